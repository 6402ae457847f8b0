"""The README's claims that the code can check: they must say what the code does.

Each check reads the claim's source of truth (setup.cfg, the CLI's own
message, the writer's docstring) rather than repeating a hard-coded copy.
"""
import configparser
import inspect
import pathlib
import re

from shmbuf import cli

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _test_extra_torch() -> str:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    reqs = [r.strip() for r in cfg["options.extras_require"]["test"].splitlines() if r.strip()]
    return next(r for r in reqs if r.startswith("torch"))


def test_the_test_command_says_what_torch_it_pulls_and_how_to_keep_yours():
    torch_req = _test_extra_torch()
    i = README.index("pip install -e '.[test]'")
    note = README[i:i + 1500]
    assert f"`{torch_req}`" in note, f"the note after the test command must name {torch_req}"
    assert "GB" in note and "install it before the extra" in note
    assert re.search(r"-c constraints\.txt", note), "show the constraints-file route"


def test_gc_is_described_as_keeping_a_buffer_that_a_live_writer_uses():
    # cmd_gc keeps a dead owner's buffer while writers live; the README must not say
    # that gc marks such a buffer closed, and must quote what gc prints instead.
    assert "marks it closed (its writers stop)" not in README
    printed = re.search(r'print\(f"(kept) \{info\.name\}: ', inspect.getsource(cli.cmd_gc))
    assert printed, "cmd_gc no longer prints 'kept NAME: ...'"
    row = next(line for line in README.splitlines() if line.startswith("| the owner, SIGKILLed "
                                                                       "and not restarted"))
    assert "leaves it alone while a live writer still uses it" in row and "`kept NAME" in row


def test_extend_is_not_sold_as_whole_episodes():
    line = next(line for line in README.splitlines() if line.startswith("Writer.extend("))
    assert "whole episodes" not in line
    assert "killed inside `extend`" in README and "chunk-aligned prefix" in README
