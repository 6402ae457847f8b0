"""Every script in examples/ runs to completion (with small sizes)."""
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_quickstart_runs_and_summarises():
    got = subprocess.run([sys.executable, str(ROOT / "examples" / "quickstart.py"),
                          "--workers", "2", "--steps", "1500", "--capacity", "4000"],
                         capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stderr
    last = got.stdout.strip().splitlines()[-1]
    assert last.startswith("done: 3000 steps from 2 workers") and "exit codes [0, 0]" in last


def test_every_example_has_a_test():
    tested = {"quickstart.py"}
    assert {p.name for p in (ROOT / "examples").glob("*.py")} == tested
