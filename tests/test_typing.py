"""mypy passes on the package, with the configuration checked in (setup.cfg's [mypy])."""
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_mypy_passes_on_the_package():
    # No arguments: setup.cfg names the files (files = shmbuf) and the options.
    proc = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, f"mypy failed:\n{proc.stdout}{proc.stderr}"
