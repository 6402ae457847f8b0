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
    lines = got.stdout.strip().splitlines()
    last = lines[-1]
    assert last.startswith("done: 3000 steps from 2 workers") and "exit codes [0, 0]" in last
    # Progress from the first line: what is starting, then each worker as it
    # joins, then training batches whose counters only grow.
    assert lines[0].startswith("buffer ") and "starting 2 env workers" in lines[0], lines
    joins = [tuple(map(int, re.match(r"\s+(\d+)/2 workers writing,\s+(\d+) steps", line)
                       .groups())) for line in lines if "workers writing," in line]
    # Each line shows a change, and the steps only grow (the number of workers writing
    # falls again as workers finish, possibly before the last one joins).
    assert joins and all(a != b for a, b in zip(joins, joins[1:])), lines
    assert [s for _, s in joins] == sorted(s for _, s in joins), lines
    assert joins[-1][1] >= 1000 and max(j[0] for j in joins) >= 1, lines
    batches = [tuple(map(int, re.match(r"\s+batch\s+(\d+) .* written\s+(\d+)", line).groups()))
               for line in lines if line.lstrip().startswith("batch ")]
    assert batches and [b for b, _ in batches] == list(range(10, 10 * len(batches) + 1, 10))
    assert [w for _, w in batches] == sorted(w for _, w in batches), lines
    # Training stops once every step is written (after 10 batches at least), and says so:
    # no run of batch lines reports workers that have all finished as "workers writing 0".
    done = [line for line in lines if re.search(r"written\s+3000\b", line)
            and line.lstrip().startswith("batch ")]
    assert len(done) <= 1 and all("every step written" in line for line in done), lines


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
    ratio = float(re.search(r"train ratio ([\d.]+) \(target 32\)", last).group(1))
    assert abs(ratio - 32) <= 32 * 0.1   # held within a batch (512 of ~150k replayed)
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
    replayed, added = map(int, re.search(r"\(target 8, (\d+) replayed / (\d+) added\)",
                                         lines[-1]).groups())
    assert abs(replayed - 8 * added) <= 16 * 8   # within the band: one batch of 16 x 8


# One example per seed facade: (script, arguments, the lines its output must hold).
FACADE_EXAMPLES = {
    "dreamer_replay.py": (["--workers", "2", "--steps", "300"], [
        "sample(): obs (20, 16, 3, 64, 64) uint8, act (20, 16, 6), rew (20, 16), "
        "term (20, 16) float32",
        "done: 600 steps from 2 workers, 6 episodes, exit codes [0, 0]"]),
    "dreamerv3_replay.py": (["--actors", "4", "--steps", "100", "--updates", "5"], [
        "sample(8): vector (8, 16, 4) float32, is_first (8, 16), stepid (8, 16, 20) uint8",
        "update(): priority (8, 16) and latent (8, 16, 4) written back, 5 times",
        "done: 340 items from 4 actors, 40 samples, replay ratio 1.882, exit codes "
        "[0, 0, 0, 0]"]),
    "planet_memory.py": (["--workers", "2", "--episodes", "5"], [
        "sample(16, tracelen=20): x (16, 21, 3, 16, 16), u (16, 20, 2), r (16, 20), "
        "t (16, 20), lengths (16,)",
        "memory.episodes: maxlen 8, len 8; eps_lengths [",
        "done: 8 episodes held of 10 appended, "]),
    "iris_buffers.py": (["--workers", "2", "--episodes", "3"], [
        "sample_sequence(): obs (8, 11, 3, 32, 32), act (8, 10, 4), rew (8, 10), term (8, 10)",
        "sample_single(): obs (3, 32, 32), act (4,)",
        "done: 240 steps of 2000 from 2 workers, exit codes [0, 0]"]),
    "diamond_dataset.py": (["--steps", "200"], [
        "size 200, position 200, is_ready(200) True",
        "loader batch: action_seq (8, 5, 2), actions (8, 5, 2), burn_in_actions (8, 4, 2), "
        "burn_in_obs (8, 4, 3, 32, 32), dones (8, 5), next_obs (8, 3, 32, 32), "
        "obs_seq (8, 5, 3, 32, 32), rewards (8, 5)",
        "sample(32): obs (32, 3, 32, 32), dones torch.bool",
        "done: 200 steps, batches of 8 sequences from 1 loader workers, checkpoint restored, "
        "exit code 0"]),
    "history_planner.py": (["--steps", "6"], [
        "get(3): action (4, 2, 4) float32, pixels (4, 3, 16, 16, 3) uint8, task (4, 3) <U7",
        "env 0 frames at steps [1, 3, 5], blocks [[2.0, 3.0], [4.0, 5.0]]",
        "done: 0 min entries, num_strided [0, 3, 3, 3], re-planned 2 envs, "
        "exit codes [0, 0]"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(FACADE_EXAMPLES))
def test_facade_example_runs_and_prints_the_documented_shapes(script):
    args, expected = FACADE_EXAMPLES[script]
    got = subprocess.run([sys.executable, str(ROOT / "examples" / script), *args],
                         capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stderr
    lines = got.stdout.strip().splitlines()
    for want in expected:
        assert any(line.startswith(want) for line in lines), (want, lines)


@pytest.mark.slow
def test_offline_dataloader_loads_once_and_trains_with_workers_and_two_trainers():
    pytest.importorskip("h5py")
    got = subprocess.run([sys.executable, str(ROOT / "examples" / "offline_dataloader.py"),
                          "--episodes", "8", "--length", "30", "--batches", "6"],
                         capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stderr
    lines = got.stdout.strip().splitlines()
    assert lines[0].startswith("loaded once: 8 episodes, 240 steps into shmbuf-")
    assert lines[1].startswith("DataLoader(4 workers): 6 batches of pixels (8, 16, 3, 16, 16)")
    assert [line.split(":")[0] for line in lines[2:4]] == ["trainer 0", "trainer 1"]
    assert all(" 6 batches" in line for line in lines[2:4])
    assert lines[-1].endswith("exit codes [0, 0]")


def _swm_world_unavailable() -> str | None:
    """Why stable-worldmodel's World cannot be imported by the examples' interpreter, or None."""
    probe = subprocess.run([sys.executable, "-c", "from stable_worldmodel import World"],
                           capture_output=True, text=True, timeout=120)
    return None if probe.returncode == 0 else (probe.stderr.strip().splitlines() or ["?"])[-1]


@pytest.mark.slow
def test_swm_collectors_write_one_shared_buffer_while_the_trainer_samples():
    why = _swm_world_unavailable()
    if why is not None:
        pytest.skip(f"stable-worldmodel's World cannot be imported: {why}")
    got = subprocess.run([sys.executable, str(ROOT / "examples" / "swm_collectors.py"),
                          "--collectors", "4", "--episodes", "2", "--steps", "10",
                          "--batches", "4", "--batch-size", "8"],
                         capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stderr
    lines = got.stdout.strip().splitlines()
    assert lines[-3].startswith("sample(8): action (8, 4, 2) float32, ")
    assert "pixels (8, 4, 32, 32, 3) uint8" in lines[-3] and "reward (8, 4) float64" in lines[-3]
    assert lines[-2].startswith("trained 4 batches while collecting")
    assert lines[-1].startswith("done: 8 episodes, ")
    assert lines[-1].endswith("from 4 collectors, exit codes [0, 0, 0, 0]")


def test_every_example_has_a_test():
    tested = {"quickstart.py", "cartpole_world_model.py", "train_prefetch.py",
              "offline_dataloader.py", "swm_collectors.py", "torchrl_collectors.py",
              *FACADE_EXAMPLES}
    assert {p.name for p in (ROOT / "examples").glob("*.py")} == tested


@pytest.mark.slow
def test_torchrl_collectors_quick_run_checks_every_slice():
    pytest.importorskip("torchrl", reason="the torchrl extra is not installed")
    pytest.importorskip("gymnasium")
    got = subprocess.run([sys.executable, str(ROOT / "examples" / "torchrl_collectors.py"),
                          "--quick"], capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stderr
    last = got.stdout.strip().splitlines()[-1]
    match = re.match(r"done: (\d+) frames from 2 workers in 2 streams, (\d+) batches of 16x8 "
                     r"checked", last)
    assert match, last
    assert int(match.group(1)) >= 2000 and int(match.group(2)) > 0
