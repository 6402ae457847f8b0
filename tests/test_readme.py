"""The claims of the README and the guides that the code can check: they say what it does.

Each check reads the claim's source of truth (setup.cfg, .ci/run, the CLI's own
message, the package's ``__all__``) rather than repeating a hard-coded copy, and
reads the claim from the file that now holds its text (the README keeps the
pitch and the API block; the guides under docs/ keep the rest).
"""
import configparser
import inspect
import pathlib
import re

import shmbuf
from shmbuf import cli

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
DOCS = ROOT / "docs"


def _guide(name: str) -> str:
    return (DOCS / name).read_text()


def _extra(name: str) -> list[str]:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    return [r.strip() for r in cfg["options.extras_require"][name].splitlines() if r.strip()]


def _test_extra_torch() -> str:
    return next(r for r in _extra("test") if r.startswith("torch"))


def test_the_readme_fits_on_a_few_screens():
    assert len(README.splitlines()) <= 250


def test_the_readme_setup_commands_are_the_ones_ci_runs():
    # The first screen holds exactly the two set-up commands; the second is what .ci/run does.
    first = README.split("## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", first, re.DOTALL).group(1)
    commands = [line.split("#")[0].strip() for line in block.splitlines() if line.strip()]
    assert commands == ["pip install -e . && python examples/quickstart.py",
                        "pip install -e '.[test]' && python -m pytest -q -rs"], commands
    assert (ROOT / "examples" / "quickstart.py").is_file()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "pip install -e '.[test]'" in ci and "python -m pytest -q -rs" in ci
    assert ci.index("pip install -e '.[test]'") < ci.index("python -m pytest -q -rs")
    assert "mkdocs build --strict" in ci, ".ci/run must build the docs strictly"


def test_the_torch_caveat_is_one_line_in_the_readme_with_a_link_to_the_guide():
    torch_req = _test_extra_torch()
    lines = [line for line in README.splitlines() if f"`{torch_req}`" in line]
    assert len(lines) == 1, "the caveat is one line"
    assert "(docs/installation.md#the-torch-caveat)" in lines[0]
    assert "## The torch caveat" in _guide("installation.md")


def test_the_test_command_says_what_torch_it_pulls_and_how_to_keep_yours():
    # The caveat in full lives in docs/installation.md.
    text = _guide("installation.md")
    i = text.index("## The torch caveat")
    note = text[i:i + 1500]
    assert f"`{_test_extra_torch()}`" in note, "the caveat must name the test extra's torch"
    assert "pip install -e '.[test]'" in note
    assert "GB" in note and "install it before the extra" in note
    assert re.search(r"-c constraints\.txt", note), "show the constraints-file route"


def test_the_docs_extra_is_in_the_test_extra_and_the_readme_says_how_to_build():
    # The pins themselves: tests/test_docs_toolchain.py.
    docs = _extra("docs")
    assert any(r.startswith("mkdocs-material==") for r in docs)
    assert any(r.startswith("mkdocstrings-python==") for r in docs)
    assert "shmbuf[docs]" in _extra("test"), "CI installs .[test] and builds the docs"
    for command in ("pip install -e '.[docs]'", "mkdocs build --strict", "mkdocs serve"):
        assert command in README


def test_the_dependencies_section_names_every_package_of_every_extra():
    section = README[README.index("## Dependencies"):]
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    names = ["numpy", "posix_ipc"]
    # Every extra a user installs (bench pins the peers of benchmarks/compare.py).
    extras = [e for e in cfg["options.extras_require"] if e != "bench"]
    assert {"torch", "test", "gym", "datasets", "ray", "docs", "swm"} <= set(extras)
    for extra in extras:
        names += [re.split(r"[\[<>=!~ ;]", r, maxsplit=1)[0] for r in _extra(extra)
                  if not r.startswith("shmbuf[")]     # another extra, checked on its own
    for name in names:
        assert f"`{name}" in section or f" {name}," in section or f" {name} " in section, \
            f"the README's Dependencies section does not say why shmbuf needs {name}"


def test_the_api_block_names_every_public_name():
    block = README[README.index("## API at a glance"):README.index("## Which class do I use")]
    errors_page = _guide("reference/errors.md")
    for name in shmbuf.__all__:
        if name.endswith("Error"):
            assert f"::: shmbuf.{name}" in errors_page, name
        else:
            assert re.search(rf"\b{name}\b", block), f"the README's API block lacks {name}"


def test_gc_is_described_as_keeping_a_buffer_that_a_live_writer_uses():
    # cmd_gc keeps a dead owner's buffer while writers live; the crash table
    # (docs/memory-and-crashes.md) must not say that gc marks such a buffer
    # closed, and must quote what gc prints instead.
    text = _guide("memory-and-crashes.md")
    assert "marks it closed (its writers stop)" not in text
    printed = re.search(r'print\(f"(kept) \{info\.name\}: ', inspect.getsource(cli.cmd_gc))
    assert printed, "cmd_gc no longer prints 'kept NAME: ...'"
    row = next(line for line in text.splitlines() if line.startswith("| the owner, SIGKILLed "
                                                                     "and not restarted"))
    assert "leaves it alone while a live writer still uses it" in row and "`kept NAME" in row


def test_extend_is_not_sold_as_whole_episodes():
    # The API block's line in the README; the explanation in docs/training-loop.md.
    line = next(line for line in README.splitlines() if line.startswith("Writer.extend("))
    assert "whole episodes" not in line
    text = _guide("training-loop.md")
    assert "killed inside `extend`" in text and "chunk-aligned prefix" in text


def test_user_docs_carry_no_commit_hashes_issue_numbers_or_machine_notes():
    pages = [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "benchmarks" / "README.md",
             *sorted(DOCS.glob("*.md"))]
    for page in pages:
        text = page.read_text()
        for pattern in (r"\bcommits? [0-9a-f]{7,40}\b", r"\bissues? \d+", r"\bbranch \w*\d",
                        r"\bthis (2-core )?VM\b", r"(?<![-\w])load (average )?(of )?\d", r"/work/"):
            found = re.search(pattern, text, re.IGNORECASE)
            assert not found, f"{page.relative_to(ROOT)}: {found.group(0)!r}"


def test_w1_is_defined_before_its_first_use_on_every_page():
    for page in [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted(DOCS.glob("*.md"))]:
        text = page.read_text()
        if "W1" not in text:
            continue
        first = text.index("W1")
        definition = text[first:first + 400]
        defined = ("obs (3,64,64) uint8" in definition.replace(", ", ",")
                   or "obs uint8 (3, 64, 64)" in definition
                   or '"obs": ((3, 64, 64), np.uint8)' in text[:first + 400])
        assert defined, f"{page.relative_to(ROOT)}: W1 is used before it is defined"


def test_every_figure_on_the_performance_page_names_its_benchmark():
    text = _guide("performance.md")
    for section in text.split("\n## ")[1:]:
        title = section.splitlines()[0]
        if re.search(r"\d+(\.\d+)?x\b|\bMB/s\b|\bsteps/s\b|\bus\b|\bms\b", section):
            assert re.search(r"python benchmarks/\w+\.py", section), \
                f"performance.md, '{title}': a figure without its benchmark command"


def test_the_readme_names_the_command_line_and_each_of_its_commands():
    commands = set(cli.build_parser()._subparsers._group_actions[0].choices)
    lines = README.splitlines()
    at = [i for i, line in enumerate(lines) if "`shmbuf ls`" in line]
    assert at, "the README never mentions the command line"
    said = set(re.findall(r"`(?:shmbuf )?(\w+)`", " ".join(lines[at[0]:at[0] + 2])))
    assert commands <= said, sorted(commands - said)
    assert "(docs/memory-and-crashes.md#the-command-line)" in README
    assert "### The command line" in _guide("memory-and-crashes.md")


def test_the_install_guide_says_the_swm_extra_pulls_torch_and_gives_the_cpu_route():
    # The claim holds while the extra needs torchvision (which needs torch).
    assert any(r.startswith("torchvision") for r in _extra("swm"))
    guide = _guide("installation.md")
    section = guide.split("## The stable-worldmodel extra pulls a CUDA torch", 1)[1]
    section = section.split("\n## ", 1)[0]
    assert "6.5 GB" in section
    assert ("pip install torch torchvision --index-url https://download.pytorch.org/whl/cpu\n"
            "pip install -e '.[swm]'") in section
