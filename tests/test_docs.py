"""Every Python block of the guides (docs/*.md) and of the README runs, so a guide cannot go stale.

A block runs as the page shows it, in a fresh namespace with a temporary
directory as the working directory, after the page's ``<!-- prelude -->``
blocks.  Markers on the line before a block:

- ``<!-- no-run -->``: a deliberate fragment (it needs a cluster, a GPU, a
  network download or names it does not define); it is only compiled.
- ``<!-- prelude -->``: runs before every later block of the same page.

Every runnable block is marked slow: most make a buffer of real pixel frames,
and several start worker processes.

A block with ``if __name__ == "__main__":`` runs as a script in a child process
(spawned workers re-import the main module, which an exec'd block has not); any
other block is exec'd in this process, and its namespace is dropped afterwards,
which closes (and, for an owner, unlinks) every handle it made.  Generated
segment names carry the test session's tag, so the autouse leak check sees
them; a segment the block named itself is checked here.
"""
import gc
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
FENCE = re.compile(r"^```python\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
MARKER = re.compile(r"<!--\s*(no-run|prelude)\s*-->")
SHM = "/dev/shm"


def _blocks(page: pathlib.Path):
    """Yield (line, code, markers, preludes before it) for each python block of ``page``."""
    text = page.read_text()
    preludes: list[str] = []
    for m in FENCE.finditer(text):
        before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        markers = set(MARKER.findall(before))
        line = text.count("\n", 0, m.start()) + 1
        yield line, m.group(1), markers, list(preludes)
        if "prelude" in markers:
            preludes.append(m.group(1))


def _cases():
    for page in PAGES:
        for line, code, markers, preludes in _blocks(page):
            marks = [] if "no-run" in markers else [pytest.mark.slow]
            yield pytest.param(page, line, code, markers, preludes,
                               id=f"{page.relative_to(ROOT)}:{line}", marks=marks)


def _literal_names(code: str) -> set[str]:
    return set(re.findall(r"""["']([A-Za-z0-9_.-]+)["']""", code))


@pytest.mark.parametrize("page, line, code, markers, preludes", list(_cases()))
def test_block_runs(page, line, code, markers, preludes, tmp_path, monkeypatch):
    where = f"{page.relative_to(ROOT)}:{line}"
    if "no-run" in markers:
        compile(code, where, "exec")                # a fragment must still be Python
        return
    source = "\n".join(preludes + [code])
    monkeypatch.chdir(tmp_path)
    # A Minari dataset a block writes lands in the temporary directory, not in ~/.minari.
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(tmp_path / "minari"))
    before = set(os.listdir(SHM))
    try:
        if "__main__" in source:
            script = tmp_path / "block.py"
            script.write_text(source)
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(
                [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
            done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                                  capture_output=True, text=True, timeout=180, check=False)
            assert done.returncode == 0, f"{where} failed:\n{done.stderr[-4000:]}"
        else:
            namespace = {"__name__": "__docs__"}
            try:
                # Running the page's own code is the point of this test.
                exec(compile(source, where, "exec"), namespace)  # noqa: S102
            finally:
                namespace.clear()               # a failed block's handles go too
                gc.collect()
    finally:
        named = (set(os.listdir(SHM)) - before) & _literal_names(source)
        for name in named:
            os.unlink(os.path.join(SHM, name))
    assert not named, f"{where} left the segments it named behind: {sorted(named)}"


def test_every_page_has_runnable_blocks_and_few_fragments():
    # A marker that hides most of a page's code would let the page go stale.
    total = fragments = 0
    for page in PAGES:
        for _, _, markers, _ in _blocks(page):
            total += 1
            fragments += "no-run" in markers
    assert total >= 20, total
    assert fragments <= total // 4, f"{fragments} of {total} blocks are marked no-run"
