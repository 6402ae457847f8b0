"""shmbuf.datasets: real Minari datasets (made here with Minari's DataCollector) and real
stable-worldmodel-layout HDF5 files, in and out, plus damaged and foreign files."""
import os
import signal
import subprocess
import sys
import warnings

import numpy as np
import pytest
from helpers.procs import join_all, running

import shmbuf

h5py = pytest.importorskip("h5py")
minari = pytest.importorskip("minari")
gym = pytest.importorskip("gymnasium")
# Only recording a Minari dataset (``collect``) needs jax: the HDF5, CLI and
# import-graph tests run without it.
JAX_REASON = "Minari's DataCollector needs minari[create] (jax)"

from gymnasium import spaces  # noqa: E402

from shmbuf.datasets import (  # noqa: E402
    CapacityWarning,
    DatasetFormatError,
    from_minari,
    from_swm_hdf5,
    to_minari,
    to_swm_hdf5,
)
from shmbuf.gym import UnsupportedSpaceError  # noqa: E402

FIELDS = ("observations", "actions", "rewards", "terminations", "truncations")


class DictEnv(gym.Env):
    """Dict observations (an image, a vector, a Discrete), Box actions; terminates at random."""

    observation_space = spaces.Dict({"pos": spaces.Box(-1, 1, (2,), np.float32),
                                     "img": spaces.Box(0, 255, (4, 4, 3), np.uint8),
                                     "k": spaces.Discrete(5)})
    action_space = spaces.Box(-1, 1, (3,), np.float64)

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        self.observation_space.seed(int(self.np_random.integers(1 << 30)))
        self.t = 0
        return self.observation_space.sample(), {}

    def step(self, action):
        self.t += 1
        done = self.t % 4 == 0 and self.np_random.random() < 0.5
        return self.observation_space.sample(), float(self.np_random.normal()), done, False, {}


class BothEnv(DictEnv):
    """Terminates at its third step, when a TimeLimit of 3 also truncates it."""

    observation_space = spaces.Box(-1, 1, (2,), np.float32)

    def step(self, action):
        self.t += 1
        return self.observation_space.sample(), 1.0, self.t == 3, False, {}


class ImageEnv(DictEnv):
    """A Dict observation holding a 32x32 RGB image (its space's JSON is ~35 kB, far past
    the header's old 1 kB), a Tuple and a Discrete; Tuple actions."""

    observation_space = spaces.Dict({
        "img": spaces.Box(0, 255, (32, 32, 3), np.uint8),
        "pos": spaces.Box(-1, 1, (2,), np.float32),
        "k": spaces.Discrete(5),
        "pair": spaces.Tuple((spaces.Discrete(3), spaces.Box(0, 1, (2,), np.float32)))})
    action_space = spaces.Tuple((spaces.Discrete(4), spaces.Box(-2, 2, (2,), np.float32)))


class PixelEnv(DictEnv):
    """A bare 32x32 RGB image observation (a large space) and bounded Box actions."""

    observation_space = spaces.Box(0, 255, (32, 32, 3), np.uint8)


class TextEnv(DictEnv):
    observation_space = spaces.Text(8)


def collect(env, dataset_id, steps):
    """A Minari dataset recorded by Minari's own DataCollector (ends on term or trunc)."""
    pytest.importorskip("jax", reason=JAX_REASON)
    env = minari.DataCollector(env)
    env.reset(seed=0)
    env.action_space.seed(0)
    for _ in range(steps):
        _, _, term, trunc, _ = env.step(env.action_space.sample())
        if term or trunc:
            env.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Minari's advice to add a description
        return env.create_dataset(dataset_id, description="made by shmbuf's tests")


@pytest.fixture(scope="module")
def minari_root(tmp_path_factory):
    """MINARI_DATASETS_PATH at a fresh directory, with CartPole and Dict datasets in it."""
    root = tmp_path_factory.mktemp("minari")
    old = os.environ.get("MINARI_DATASETS_PATH")
    os.environ["MINARI_DATASETS_PATH"] = str(root)
    try:
        collect(gym.make("CartPole-v1", max_episode_steps=25), "test/cartpole-v0", 300)
        collect(gym.wrappers.TimeLimit(DictEnv(), 9), "test/dict-v0", 200)
        collect(gym.wrappers.TimeLimit(BothEnv(), 3), "test/both-v0", 10)  # stops mid-episode
        collect(gym.wrappers.TimeLimit(ImageEnv(), 7), "test/image-v0", 60)
        collect(gym.wrappers.TimeLimit(PixelEnv(), 7), "test/pixel-v0", 30)
        yield root
    finally:
        if old is None:
            os.environ.pop("MINARI_DATASETS_PATH")
        else:
            os.environ["MINARI_DATASETS_PATH"] = old


def same_value(a, b, where):
    if isinstance(a, dict):
        assert sorted(a) == sorted(b), where
        for k in a:
            same_value(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (tuple, list)):
        assert isinstance(b, (tuple, list)) and len(a) == len(b), where
        for k, (x, y) in enumerate(zip(a, b)):
            same_value(x, y, f"{where}[{k}]")
    else:
        assert a.dtype == b.dtype and a.shape == b.shape, (where, a.dtype, b.dtype)
        assert np.array_equal(a, b), where


def assert_same_dataset(a, b):
    assert a.total_episodes == b.total_episodes and a.total_steps == b.total_steps
    for ea, eb in zip(a.iterate_episodes(), b.iterate_episodes()):
        for field in FIELDS:
            same_value(getattr(ea, field), getattr(eb, field), f"episode {ea.id} {field}")


def no_segment(name):
    with pytest.raises(shmbuf.SegmentNotFoundError):
        shmbuf.attach(name)


@pytest.mark.slow
def test_cartpole_rows_follow_the_step_convention_and_round_trip_bit_identically(minari_root):
    ds = minari.load_dataset("test/cartpole-v0")
    with from_minari("test/cartpole-v0", block_bytes=200) as buf:  # blocks split episodes
        assert buf.spec["obs"] == ((4,), np.dtype(np.float32))
        assert buf.capacity == len(buf) == ds.total_steps + ds.total_episodes
        held = buf.episodes()
        assert len(held.index) == ds.total_episodes
        for index, ep in zip(held.index, ds.iterate_episodes()):
            rows = buf.read_episode(int(index))
            n = len(ep.rewards)
            assert len(rows["obs"]) == n + 1
            assert np.array_equal(rows["obs"], ep.observations)
            assert rows["action"][0] == 0 and np.array_equal(rows["action"][1:], ep.actions)
            assert rows["reward"][0] == 0 and np.array_equal(rows["reward"][1:], ep.rewards)
            assert rows["is_first"].tolist() == [True] + [False] * n
            assert rows["done"].tolist() == [False] * n + [bool(ep.terminations[-1])]
        assert held.terminal.tolist() == [bool(e.terminations[-1]) for e in ds]
        assert not held.terminal.all() and held.terminal.any()  # both kinds of ends occur
        back = to_minari(buf, "test/cartpole-back-v0")
    assert_same_dataset(ds, minari.load_dataset("test/cartpole-back-v0"))
    assert back.total_episodes == ds.total_episodes


def test_an_episode_both_terminated_and_truncated_round_trips(minari_root):
    ds = minari.load_dataset("test/both-v0")
    flags = [(bool(e.terminations[-1]), bool(e.truncations[-1])) for e in ds]
    # Both flags at once, and the unfinished last episode (Minari marks it truncated).
    assert flags == [(True, True)] * 3 + [(False, True)]
    with from_minari(ds) as buf:
        held = buf.episodes()
        assert held.terminal.tolist() == [term for term, _ in flags]
        assert [bool(buf.read_episode(int(i))["truncated"][-1]) for i in held.index] == \
            [trunc for _, trunc in flags]
        to_minari(buf, "test/both-back-v0")
    assert_same_dataset(ds, minari.load_dataset("test/both-back-v0"))


@pytest.mark.slow
def test_dict_observations_become_columns_and_round_trip(minari_root):
    ds = minari.load_dataset("test/dict-v0")
    with from_minari(ds) as buf:
        assert {k for k in buf.spec if k.startswith("obs_")} == {"obs_img", "obs_k", "obs_pos"}
        assert buf.spec["obs_img"] == ((4, 4, 3), np.dtype(np.uint8))
        batch = buf.sample_sequences(4, 3)
        assert batch["obs_img"].shape == (3, 4, 4, 4, 3)
        to_minari(buf, "test/dict-back-v0")
    assert_same_dataset(ds, minari.load_dataset("test/dict-back-v0"))
    with from_minari(ds, keys=["pos"], episodes=[2, 0]) as buf:
        assert [k for k in buf.spec if k.startswith("obs")] == ["obs_pos"]
        first = buf.read_episode(int(buf.episodes().index[0]))
        assert np.array_equal(first["obs_pos"], ds[2].observations["pos"])


@pytest.mark.slow
def test_image_dict_tuple_and_discrete_spaces_round_trip_with_their_spaces(minari_root,
                                                                            tmp_path):
    ds = minari.load_dataset("test/image-v0")
    with from_minari(ds) as buf:
        assert buf.meta["observation_space"]            # kept, however large
        back = to_minari(buf, "test/image-back-v0")
        assert back.observation_space == ds.observation_space
        assert back.action_space == ds.action_space
        assert_same_dataset(ds, back)
        # The CLI's export gives the same dataset, spaces included.
        got = shmbuf_cli("export", buf.name, "--to", "minari:test/image-cli-v0",
                         env=dict(os.environ, MINARI_DATASETS_PATH=str(minari_root)))
        assert got.returncode == 0, got.stderr
    cli_back = minari.load_dataset("test/image-cli-v0")
    assert cli_back.observation_space == ds.observation_space
    assert cli_back.action_space == ds.action_space
    assert_same_dataset(ds, cli_back)


@pytest.mark.slow
def test_a_space_passed_by_hand_keeps_the_other_recorded_space(minari_root):
    ds = minari.load_dataset("test/pixel-v0")
    with from_minari(ds) as buf:
        back = to_minari(buf, "test/pixel-hand-v0", observation_space=ds.observation_space)
    assert back.action_space == ds.action_space          # not a Box(-inf, inf)
    assert_same_dataset(ds, back)


@pytest.mark.slow
def test_a_small_capacity_keeps_the_newest_whole_episodes_and_warns(minari_root):
    ds = minari.load_dataset("test/cartpole-v0")
    rows = [len(e.rewards) + 1 for e in ds]
    capacity = rows[-1] + rows[-2] + rows[-3] - 1   # room for two newest, not three
    with pytest.warns(CapacityWarning, match=f"newest 2 of {len(rows)} episodes"):
        buf = from_minari(ds, capacity=capacity)
    with buf:
        assert buf.episodes().length.tolist() == rows[-2:]
        last = buf.read_episode(int(buf.episodes().index[-1]))
        assert np.array_equal(last["obs"], ds[len(rows) - 1].observations)
    with pytest.raises(ValueError, match="cannot hold even the newest episode"):
        from_minari(ds, capacity=rows[-1] - 1)


@pytest.mark.slow
def test_a_space_a_buffer_cannot_hold_is_refused_before_any_segment(minari_root):
    collect(gym.wrappers.TimeLimit(TextEnv(), 5), "test/text-v0", 12)
    name = f"shmbuf-test-{os.getpid()}-text"
    with pytest.raises(UnsupportedSpaceError, match="obs"):
        from_minari("test/text-v0", name=name)
    no_segment(name)


# -- stable-worldmodel's HDF5 layout ------------------------------------------------------

def write_swm(path, lengths, terminal_eps=(), seed=0, extra=None):
    """A file in stable-worldmodel's layout: a dataset per column, ep_len, ep_offset."""
    rng = np.random.default_rng(seed)
    lengths = np.asarray(lengths)
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    n = int(lengths.sum())
    terminated = np.zeros(n, bool)
    for e in terminal_eps:
        terminated[offsets[e] + lengths[e] - 1] = True
    cols = {"pixels": rng.integers(0, 256, (n, 3, 8, 8), dtype=np.uint8),
            "action": rng.normal(size=(n, 2)).astype(np.float32),
            "reward": rng.normal(size=n), "terminated": terminated, **(extra or {})}
    with h5py.File(path, "w") as f:
        for k, v in cols.items():
            f.create_dataset(k, data=v, chunks=(1,) + v.shape[1:])  # as swm's writer chunks
        f.create_dataset("ep_len", data=lengths.astype(np.int32))
        f.create_dataset("ep_offset", data=offsets.astype(np.int64))
    return cols, offsets


def test_swm_file_round_trips_with_its_episode_ends(tmp_path):
    lengths = [5, 1, 7, 4, 9]
    cols, offsets = write_swm(tmp_path / "a.h5", lengths, terminal_eps=(1, 3))
    with from_swm_hdf5(tmp_path / "a.h5", block_bytes=700) as buf:  # ~3 rows a block
        assert buf.done_key == "terminated" and buf.spec["pixels"][0] == (3, 8, 8)
        held = buf.episodes()
        assert held.length.tolist() == lengths
        assert held.terminal.tolist() == [False, True, False, True, False]
        ep = buf.read_episode(int(held.index[2]))
        assert np.array_equal(ep["pixels"], cols["pixels"][offsets[2]:offsets[2] + 7])
        assert to_swm_hdf5(buf, tmp_path / "b.h5") == 5
        with pytest.raises(FileExistsError):
            to_swm_hdf5(buf, tmp_path / "b.h5")
    with h5py.File(tmp_path / "a.h5") as a, h5py.File(tmp_path / "b.h5") as b:
        assert sorted(a) == sorted(b)
        for k in a:
            assert a[k].dtype == b[k].dtype and np.array_equal(a[k][:], b[k][:]), k
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".shmbuf-")]


def test_swm_episodes_keys_capacity_and_progress(tmp_path, capsys):
    write_swm(tmp_path / "a.h5", [3, 4, 5])
    with pytest.warns(CapacityWarning, match="newest 1 of 2"):
        buf = from_swm_hdf5(tmp_path / "a.h5", episodes=[0, 2], keys=["action", "reward"],
                            capacity=6, progress=True)
    with buf:
        assert sorted(buf.spec) == ["action", "reward"] and buf.done_key is None
        assert buf.episodes().length.tolist() == [5]
    assert "from_swm_hdf5" in capsys.readouterr().err  # tqdm's bar, forced on


def test_swm_episodes_out_of_file_order_keep_their_rows_and_ends(tmp_path):
    # 2 then 3 and 0 then 1 lie back to back in the file: each pair is read as one run
    # of rows, cut at the episode end inside it; the runs come in the order asked for.
    lengths = [3, 4, 5, 2]
    cols, offsets = write_swm(tmp_path / "a.h5", lengths, terminal_eps=(0, 2))
    order = [2, 3, 0, 1]
    with from_swm_hdf5(tmp_path / "a.h5", episodes=order, block_bytes=700) as buf:
        held = buf.episodes()
        assert held.length.tolist() == [lengths[e] for e in order]
        assert held.terminal.tolist() == [True, False, True, False]
        for i, e in enumerate(order):
            ep = buf.read_episode(int(held.index[i]))
            rows = slice(offsets[e], offsets[e] + lengths[e])
            assert np.array_equal(ep["pixels"], cols["pixels"][rows]), e
            assert np.array_equal(ep["action"], cols["action"][rows]), e


@pytest.mark.parametrize("damage, match", [
    ("truncate", "truncated"),
    ("ep_len", "do not match its rows"),
    ("no_index", "no 1-D integer dataset 'ep_len'"),
    ("mid_terminal", "inside an episode"),
    ("strings", "cannot hold"),
    ("rows", "different numbers of rows"),
])
def test_damaged_or_foreign_files_raise_and_leave_no_segment(tmp_path, damage, match):
    path = tmp_path / "bad.h5"
    write_swm(path, [40, 30, 50])
    if damage == "truncate":
        data = path.read_bytes()
        path.write_bytes(data[:len(data) // 2])
    else:
        with h5py.File(path, "a") as f:
            if damage == "ep_len":
                f["ep_len"][1] = 31
            elif damage == "no_index":
                del f["ep_len"]
            elif damage == "mid_terminal":
                f["terminated"][10] = True
            elif damage == "strings":
                f.create_dataset("text", data=np.array([b"x"] * 120, dtype=h5py.string_dtype()))
            else:
                f.create_dataset("short", data=np.zeros(119))
    name = f"shmbuf-test-{os.getpid()}-bad"
    with pytest.raises(DatasetFormatError, match=match):
        from_swm_hdf5(path, name=name, block_bytes=4096)
    no_segment(name)


def test_a_file_that_is_not_hdf5_and_a_missing_file(tmp_path):
    (tmp_path / "x.h5").write_bytes(b"not an hdf5 file at all")
    with pytest.raises(DatasetFormatError, match="not a readable HDF5 file"):
        from_swm_hdf5(tmp_path / "x.h5")
    with pytest.raises(FileNotFoundError):
        from_swm_hdf5(tmp_path / "nope.h5")


# -- the CLI --------------------------------------------------------------------------------

def shmbuf_cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "shmbuf", *args], capture_output=True,
                          text=True, timeout=120, env=env)


@pytest.mark.slow
def test_cli_import_holds_the_buffer_until_sigterm_and_export_writes_it(tmp_path):
    cols, _ = write_swm(tmp_path / "a.h5", [6, 3, 8], terminal_eps=(0,))
    name = f"shmbuf-test-{os.getpid()}-imp"
    holder = subprocess.Popen([sys.executable, "-m", "shmbuf", "import",
                               f"swm:{tmp_path / 'a.h5'}", "--name", name],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with running([holder]):
        line = holder.stdout.readline()        # printed once the import is complete
        assert line.split("\t") == [name, "17", "3\n"], holder.stderr.read()
        with shmbuf.attach(name) as buf:
            assert not buf.owner and buf.stats().owner_pid == holder.pid
            assert np.array_equal(buf.read_episode(int(buf.episodes().index[2]))["action"],
                                  cols["action"][9:])
        got = shmbuf_cli("export", name, "--to", f"swm:{tmp_path / 'b.h5'}")
        assert got.returncode == 0 and "wrote 3 episodes" in got.stdout, got.stderr
        with h5py.File(tmp_path / "b.h5") as b:
            assert np.array_equal(b["pixels"][:], cols["pixels"])
        got = shmbuf_cli("rm", name)
        assert got.returncode == 1 and "live process" in got.stderr  # the holder owns it
        holder.send_signal(signal.SIGTERM)
        join_all([holder], 60, expect=-signal.SIGTERM)
    no_segment(name)
    got = shmbuf_cli("import", f"swm:{tmp_path / 'missing.h5'}", "--name", name)
    assert got.returncode == 1 and "no file at" in got.stderr
    got = shmbuf_cli("import", "tar:x.tgz")
    assert got.returncode == 1 and "minari:<dataset id> or swm:<file.h5>" in got.stderr


@pytest.mark.slow
def test_cli_import_of_a_missing_dataset_says_what_the_cli_can_do(tmp_path):
    env = dict(os.environ, MINARI_DATASETS_PATH=str(tmp_path))
    got = shmbuf_cli("import", "minari:test/absent-v0", env=env)
    assert got.returncode == 1 and "--download" in got.stderr, got.stderr
    assert "download=True" not in got.stderr and "test/absent-v0" in got.stderr
    got = shmbuf_cli("import", f"swm:{tmp_path / 'a.h5'}", "--download", env=env)
    assert got.returncode == 1 and "--download fetches Minari datasets" in got.stderr


def test_from_minari_checks_download():
    with pytest.raises(TypeError, match="download must be True or False, got 'yes'"):
        from_minari("test/absent-v0", download="yes")


@pytest.mark.slow
def test_cli_import_minari_stops_when_the_buffer_is_removed(minari_root):
    name = f"shmbuf-test-{os.getpid()}-mimp"
    holder = subprocess.Popen([sys.executable, "-m", "shmbuf", "import",
                               "minari:test/cartpole-v0", "--name", name],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with running([holder]):
        assert holder.stdout.readline().startswith(name + "\t"), holder.stderr.read()
        got = shmbuf_cli("export", name, "--to", "minari:test/cartpole-cli-v0")
        assert got.returncode == 0, got.stderr
        assert_same_dataset(minari.load_dataset("test/cartpole-v0"),
                            minari.load_dataset("test/cartpole-cli-v0"))
        assert shmbuf_cli("rm", "--force", name).returncode == 0
        join_all([holder], 60)
        assert "removed by another process" in holder.stderr.read()


@pytest.mark.slow
def test_the_core_never_imports_the_datasets_module():
    code = ("import sys, shmbuf, shmbuf.cli; "
            "print(sorted(m for m in ('shmbuf.datasets', 'h5py', 'minari', 'tqdm') "
            "if m in sys.modules))")
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert got.returncode == 0 and got.stdout.strip() == "[]", got.stderr
