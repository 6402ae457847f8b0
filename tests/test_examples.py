"""Every script in examples/ runs to completion (with small sizes)."""
import pathlib
import re
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


@pytest.mark.slow
def test_cartpole_world_model_quick_run_learns_and_exits_cleanly():
    pytest.importorskip("gymnasium")
    got = subprocess.run([sys.executable, str(ROOT / "examples" / "cartpole_world_model.py"),
                          "--quick"], capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stderr
    lines = got.stdout.strip().splitlines()
    assert len(lines) == 11 and lines[0].startswith("update    30  world-model loss")
    last = lines[-1]
    assert last.startswith("done: 300 updates") and "policy v31," in last
    assert last.endswith("exit codes [0, 0, 0, 0]")
    first_loss, last_loss = map(float, re.search(r"world-model loss ([\d.]+) -> ([\d.]+)",
                                                 last).groups())
    assert last_loss < first_loss / 2  # the world model learns from the sampled sequences


@pytest.mark.slow
def test_train_prefetch_trains_on_spawned_workers():
    got = subprocess.run([sys.executable, str(ROOT / "examples" / "train_prefetch.py"),
                          "--workers", "2", "--env-steps", "800", "--train-steps", "25",
                          "--capacity", "4000"],
                         capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stderr
    lines = got.stdout.strip().splitlines()
    assert any(line.startswith("step   25/25  loss") for line in lines)
    assert lines[-1].startswith("done: 25 training steps") and "exit codes [0, 0]" in lines[-1]


def test_every_example_has_a_test():
    tested = {"quickstart.py", "cartpole_world_model.py", "train_prefetch.py"}
    assert {p.name for p in (ROOT / "examples").glob("*.py")} == tested
