"""``shmbuf.compat.torchrl``: TorchRL's storage, writer and slice samplers in shared memory.

TorchRL's own replay-buffer suite runs against ``LazyShmStorage`` outside
this repository (the guide says how); these tests check what that suite
cannot: the data really is shared, several processes write lock-free, bad
input leaves the storage as it was, and checkpoints round-trip.
"""
import contextlib
import functools
import multiprocessing as mp
import os
import pickle
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("tensordict", reason="the torchrl extra is not installed")
pytest.importorskip("torchrl", reason="the torchrl extra is not installed")

from helpers import torchrl_workers as workers  # noqa: E402
from helpers.procs import reap  # noqa: E402
from helpers.shm import exists as segment_exists  # noqa: E402
from tensordict import TensorDict  # noqa: E402
from torchrl.data import (  # noqa: E402
    LazyTensorStorage,
    RandomSampler,
    ReplayBuffer,
    TensorDictMaxValueWriter,
    TensorDictReplayBuffer,
)
from torchrl.data import SliceSampler as TorchRLSliceSampler  # noqa: E402

import shmbuf  # noqa: E402
from shmbuf.compat import torchrl as shmrl  # noqa: E402
from shmbuf.compat.torchrl import (  # noqa: E402
    LazyShmStorage,
    PrioritizedSliceSampler,
    ShmWriter,
    SliceSampler,
)

TIMEOUT = 60
SPAWN = mp.get_context("spawn")


@pytest.fixture
def closing():
    """Storages made in a test are closed (and their segments removed) at its end."""
    made = []

    def keep(storage):
        made.append(storage)
        return storage

    yield keep
    for storage in made:
        storage.close()


def stream_rb(storage, **kw):
    kw.setdefault("sampler", SliceSampler(slice_len=4))
    kw.setdefault("batch_size", 16)
    return TensorDictReplayBuffer(storage=storage, writer=ShmWriter(), **kw)




def assert_well_formed(obs):
    """Rows of ``workers.rows``: each one whole (its check matches)."""
    obs = obs.reshape(-1, 3)
    assert (obs[:, 2] == workers.check_of(obs[:, 0], obs[:, 1])).all(), obs


# -- the storage -------------------------------------------------------------------------
def test_data_lives_in_a_shared_segment(closing):
    storage = closing(LazyShmStorage(100))
    rb = TensorDictReplayBuffer(storage=storage, batch_size=4)
    assert storage.buffer is None and not storage.initialized
    data = workers.rows(0, 0, 10)
    rb.extend(data)
    assert segment_exists(storage.buffer.name) and segment_exists(storage.name)
    # The storage's tensors are views of the segment's columns, not copies.
    storage.buffer.arrays[next(iter(storage.buffer.spec))][3] = -1
    assert (rb[3]["obs"] == -1).all()
    assert len(rb) == 10 and rb.sample()["obs"].shape == (4, 3)


def test_nested_keys_dtypes_and_ndim(closing):
    dtypes = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
              torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64]
    data = TensorDict({f"k{i}": torch.ones(6, 2, dtype=dt) for i, dt in enumerate(dtypes)},
                      [6])
    data["next", "obs"] = torch.arange(6.0)
    storage = closing(LazyShmStorage(10))
    storage.set(range(6), data)
    got = storage[:6]
    for key in data.keys(True, True):
        assert got[key].dtype == data[key].dtype
        assert torch.equal(got[key], data[key])
    grid, plain = closing(LazyShmStorage(12, ndim=2)), LazyTensorStorage(12, ndim=2)
    for storage in (grid, plain):
        ReplayBuffer(storage=storage).extend(TensorDict({"x": torch.arange(12.0).view(4, 3)},
                                                        [4, 3]))
    assert grid.shape == plain.shape and len(grid) == len(plain) == 12
    assert torch.equal(grid[:]["x"], plain[:]["x"])


def test_pickle_sends_the_name_and_attach_opens_it(closing):
    storage = closing(LazyShmStorage(50))
    storage.set(range(5), workers.rows(1, 0, 5))
    blob = pickle.dumps(storage)
    assert len(blob) < 1024                       # the name, not the data
    other = pickle.loads(blob)
    for opened in (other, shmrl.attach(storage.name), shmbuf.attach(storage.name)):
        assert isinstance(opened, LazyShmStorage) and not opened.owner
        assert torch.equal(opened[:5]["obs"], storage[:5]["obs"])
    storage.set(range(5, 8), workers.rows(1, 5, 3))
    assert len(other) == 8                        # the length is shared too
    assert torch.equal(other[7]["obs"], workers.rows(1, 7, 1)["obs"][0])


def test_a_spawned_child_may_write_first(closing):
    storage = closing(LazyShmStorage(100))
    rb = stream_rb(storage)
    out = SPAWN.Queue()
    child = SPAWN.Process(target=workers.write_first, args=(rb, out))
    child.start()
    try:
        index = out.get(timeout=TIMEOUT)
        child.join(TIMEOUT)
        assert child.exitcode == 0
    finally:
        reap([child], TIMEOUT)
    data_name = storage.buffer.name
    assert torch.equal(rb[torch.tensor(index)]["obs"], workers.rows(7, 0, 5)["obs"])
    storage.close()                               # the child made it; the constructor removes it
    assert not segment_exists(data_name) and not segment_exists(storage.name)


def test_a_forked_child_may_write_first_and_removes_nothing(closing):
    storage = closing(LazyShmStorage(100))
    rb = stream_rb(storage)
    out = mp.get_context("fork").Queue()
    child = mp.get_context("fork").Process(target=workers.write_first_forked, args=(rb, out))
    child.start()
    try:
        owner, index = out.get(timeout=TIMEOUT)
        child.join(TIMEOUT)
        assert child.exitcode == 0
    finally:
        reap([child], TIMEOUT)
    assert owner is False and storage.owner
    assert torch.equal(rb[torch.tensor(index)]["obs"], workers.rows(8, 0, 4)["obs"])


def test_indices_from_extend_read_the_same_steps_in_another_process(closing):
    storage = closing(LazyShmStorage(100))
    rb = stream_rb(storage)
    rb.extend(workers.rows(0, 0, 30))
    index = rb.extend(workers.rows(2, 0, 7))
    out = SPAWN.Queue()
    child = SPAWN.Process(target=workers.read_rows, args=(storage, index.tolist(), out))
    child.start()
    try:
        assert out.get(timeout=TIMEOUT) == workers.rows(2, 0, 7)["obs"].tolist()
    finally:
        reap([child], TIMEOUT)
    assert torch.equal(rb[index]["obs"], workers.rows(2, 0, 7)["obs"])


# -- bad input ------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, arg", [({"max_size": 0}, "max_size"),
                                         ({"max_size": 10, "device": "nodevice"}, "device"),
                                         ({"max_size": 10, "ndim": 0}, "ndim"),
                                         ({"max_size": 10, "compress": "obs"}, "compress")])
def test_bad_constructor_arguments_name_the_argument(kwargs, arg):
    before = set(os.listdir("/dev/shm"))
    with pytest.raises((ValueError, TypeError), match=arg):
        LazyShmStorage(**kwargs)
    assert set(os.listdir("/dev/shm")) - before == set()


def test_shmwriter_refuses_drifting_keys_and_shapes_and_writes_nothing(closing):
    storage = closing(LazyShmStorage(100))
    rb = stream_rb(storage)
    rb.extend(workers.rows(0, 0, 10))
    held = rb[:]["obs"].clone()
    bad = [workers.rows(0, 10, 5).exclude("pixels"),
           workers.rows(0, 10, 5).set("extra", torch.zeros(5)),
           workers.rows(0, 10, 5).set("pixels", torch.zeros(5, 4, 5, dtype=torch.uint8)),
           workers.rows(0, 10, 5).set("obs", torch.zeros(5, 3))]      # float into int64
    for data in bad:
        with pytest.raises(ValueError, match="data"):
            rb.extend(data)
    assert len(rb) == 10 and rb.write_count == 10
    assert torch.equal(rb[:]["obs"], held)


def test_indexed_writes_refuse_a_new_shape_and_write_nothing(closing):
    storage = closing(LazyShmStorage(20))
    rb = TensorDictReplayBuffer(storage=storage)
    rb.extend(workers.rows(0, 0, 10))
    held = rb[:].clone()
    with pytest.raises(ValueError, match="data"):
        rb.extend(workers.rows(0, 0, 4).set("pixels", torch.zeros(4, 2, 2, dtype=torch.uint8)))
    assert len(rb) == 10 and (rb[:] == held).all()


def test_one_storage_is_written_one_way(closing):
    storage = closing(LazyShmStorage(20))
    TensorDictReplayBuffer(storage=storage).extend(workers.rows(0, 0, 4))
    with pytest.raises(RuntimeError, match="ShmWriter"):
        stream_rb(storage).extend(workers.rows(0, 4, 4))
    assert len(storage) == 4


# -- TorchRL's writers and samplers behave as on LazyTensorStorage ----------------------------
def _same_run(make_storage, seed=0):
    """A fixed sequence of TorchRL operations; returns everything they produced."""
    gen = torch.Generator().manual_seed(seed)
    rb = TensorDictReplayBuffer(storage=make_storage(), batch_size=8,
                                sampler=RandomSampler(), generator=gen)
    out = [rb.extend(workers.rows(0, 0, 13)), rb.extend(workers.rows(1, 0, 13))]
    out += [rb.sample()["obs"], rb[:]["obs"], torch.tensor(len(rb))]
    rb[2:4] = workers.rows(3, 0, 2)
    out += [rb[:]["obs"]]
    top = TensorDictReplayBuffer(storage=make_storage(), batch_size=4,
                                 writer=TensorDictMaxValueWriter(rank_key="r"))
    for i in (5, 1, 7, 3, 9, 2):
        top.add(TensorDict({"r": torch.tensor(float(i)), "obs": torch.tensor([i])}, []))
    out += [top[:]["r"].sort().values]
    sl = TensorDictReplayBuffer(storage=make_storage(), batch_size=6,
                                sampler=TorchRLSliceSampler(slice_len=3, traj_key="t"),
                                generator=torch.Generator().manual_seed(seed))
    sl.extend(TensorDict({"t": torch.arange(20) // 5, "x": torch.arange(20)}, [20]))
    out += [sl.sample()["x"]]
    return out


def test_torchrl_writers_and_samplers_match_lazy_tensor_storage(closing):
    ours = _same_run(lambda: closing(LazyShmStorage(20)))
    theirs = _same_run(lambda: LazyTensorStorage(20))
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)


# -- ShmWriter and the slice samplers ------------------------------------------------------
def test_extend_returns_rows_and_eviction_is_fifo(closing):
    storage = closing(LazyShmStorage(64))
    rb = stream_rb(storage)
    for b in range(20):
        index = rb.extend(workers.rows(0, 8 * b, 8))
        assert torch.equal(rb[index]["obs"], workers.rows(0, 8 * b, 8)["obs"])
    steps = sorted(rb[:]["obs"][:, 1].tolist())
    assert steps == list(range(160 - len(steps), 160))   # the newest, whole chunks
    assert len(rb) == len(steps) <= 64 and rb.write_count == 160


def test_slices_are_contiguous_and_never_cross_a_trajectory(closing):
    storage = closing(LazyShmStorage(2000))
    rb = stream_rb(storage, sampler=SliceSampler(num_slices=8), batch_size=40)
    for b in range(10):
        rb.extend(workers.rows(b % 3, 30 * b, 30, traj_len=7))
    for _ in range(20):
        data = rb.sample()
        obs = data["obs"].view(8, 5, 3)
        assert_well_formed(obs)
        assert (obs[:, :, 0] == obs[:, :1, 0]).all()               # one writer per slice
        assert (obs[:, 1:, 1] - obs[:, :-1, 1] == 1).all()         # consecutive steps
        traj = data["collector", "traj_ids"].view(8, 5)
        assert (traj == traj[:, :1]).all()
        truncated = data["next", "truncated"].view(8, 5)
        assert truncated[:, -1].all() and not truncated[:, :-1].any()


def test_prioritized_slices_follow_priorities_set_in_another_process(closing):
    storage = closing(LazyShmStorage(1000))
    rb = stream_rb(storage, batch_size=20,
                   sampler=PrioritizedSliceSampler(1000, alpha=1.0, beta=0.5, slice_len=5))
    index = torch.cat([rb.extend(workers.rows(w, 0, 100, traj_len=10)) for w in range(4)])
    rb.update_priority(index, torch.ones(len(index)))
    hot = index[200:210]                          # writer 2's trajectory 0
    out = SPAWN.Queue()
    child = SPAWN.Process(target=workers.bump_priority, args=(rb, hot.tolist(), out))
    child.start()
    try:
        assert out.get(timeout=TIMEOUT) == "done"
    finally:
        reap([child], TIMEOUT)
    drawn = torch.cat([rb.sample(return_info=True)[0]["obs"] for _ in range(20)])
    share = ((drawn[:, 0] == 2) & (drawn[:, 1] < 10)).float().mean()
    assert share > 0.5                            # 1000x the others' priority; 6 of 360 starts
    data, info = rb.sample(return_info=True)
    assert info["priority_weight"].shape == (20,)


def test_several_writer_processes_without_a_lock(closing):
    storage = closing(LazyShmStorage(4000))
    rb = stream_rb(storage, sampler=SliceSampler(slice_len=6), batch_size=48)
    rb.share()                                    # as TorchRL's collectors do
    assert isinstance(rb._write_lock, contextlib.nullcontext)   # no process lock
    ready, go = SPAWN.Queue(), SPAWN.Event()
    procs = [SPAWN.Process(target=workers.extend_loop, args=(rb, w, 40, 25, 9, ready, go))
             for w in range(2)]
    for p in procs:
        p.start()
    try:
        for _ in procs:
            ready.get(timeout=TIMEOUT)
        go.set()
        while any(p.is_alive() for p in procs):
            if len(rb) >= 48:
                obs = rb.sample()["obs"].view(8, 6, 3)
                assert_well_formed(obs)
                assert (obs[:, :, 0] == obs[:, :1, 0]).all()
                assert (obs[:, 1:, 1] - obs[:, :-1, 1] == 1).all()
            procs[0].join(0.05)
        for p in procs:
            p.join(TIMEOUT)
            assert p.exitcode == 0
    finally:
        reap(procs, TIMEOUT)
    assert len(rb) == 2000 and storage.buffer.stats().streams == 2
    assert_well_formed(rb[:]["obs"])


@pytest.mark.slow
def test_a_writer_killed_mid_extend_leaves_no_torn_step(closing):
    storage = closing(LazyShmStorage(3000))
    rb = stream_rb(storage, sampler=SliceSampler(slice_len=5), batch_size=40)
    ready = SPAWN.Queue()
    procs = [SPAWN.Process(target=workers.extend_forever, args=(rb, w, 50, ready))
             for w in range(2)]
    for p in procs:
        p.start()
    try:
        for _ in procs:
            ready.get(timeout=TIMEOUT)
        procs[0].kill()
        procs[0].join(TIMEOUT)
        written = rb.write_count
        for _ in range(20):
            obs = rb.sample()["obs"].view(8, 5, 3)
            assert_well_formed(obs)
            assert (obs[:, 1:, 1] - obs[:, :-1, 1] == 1).all()
        assert procs[1].is_alive()
        assert rb.write_count > written               # the other writer goes on
        assert_well_formed(rb[:]["obs"])
    finally:
        for p in procs:
            p.kill()
        reap(procs, TIMEOUT)


# -- collectors ------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("collector", ["MultiSyncCollector", "MultiAsyncCollector"])
def test_collectors_write_from_their_workers(closing, collector):
    import torchrl.collectors as collectors
    from helpers.torchrl_envs import check_of, make_env

    storage = closing(LazyShmStorage(5000))
    rb = stream_rb(storage, sampler=SliceSampler(slice_len=4), batch_size=32)
    coll = getattr(collectors, collector)(
        [functools.partial(make_env, 1), functools.partial(make_env, 2)], policy=None,
        frames_per_batch=64, total_frames=768, replay_buffer=rb)
    try:
        for _ in coll:
            if len(rb) >= 64:
                data = rb.sample()
                obs = data["obs"].view(8, 4, 4)
                assert (obs[..., 3] == check_of(obs[..., 0], obs[..., 1], obs[..., 2])).all()
                assert (obs[..., :2] == obs[:, :1, :2]).all()          # one episode per slice
                assert (obs[:, 1:, 2] - obs[:, :-1, 2] == 1).all()
                traj = data["collector", "traj_ids"].view(8, 4)
                assert (traj == traj[:, :1]).all()
    finally:
        coll.shutdown()
    stats = storage.buffer.stats()
    assert stats.streams == 2 and stats.steps_written >= 768     # one stream per worker
    assert rb._writer._here is None               # the main process wrote nothing
    held = rb[:]
    # A trajectory id names one (worker env, episode) everywhere.
    pairs = {(t, tuple(o[:2])) for t, o in zip(held["collector", "traj_ids"].tolist(),
                                               held["obs"].tolist())}
    assert len({t for t, _ in pairs}) == len(pairs)


# -- checkpoints ------------------------------------------------------------------------
def test_stream_checkpoints_round_trip(closing, tmp_path):
    rb = stream_rb(closing(LazyShmStorage(200)))
    for w in range(3):
        rb.extend(workers.rows(w, 0, 20, traj_len=5))
    want = sorted(map(tuple, rb[:]["obs"].tolist()))
    torch.save(rb.state_dict(), tmp_path / "rb.pt")
    again = stream_rb(closing(LazyShmStorage(200)))
    again.load_state_dict(torch.load(tmp_path / "rb.pt", weights_only=True))
    assert sorted(map(tuple, again[:]["obs"].tolist())) == want
    rb.dumps(tmp_path / "dump")
    third = stream_rb(closing(LazyShmStorage(200)))
    third.extend(workers.rows(9, 0, 3))
    other = closing(shmrl.attach(third.storage.name))
    before = third.storage.buffer.name
    assert len(other) == 3
    third.loads(tmp_path / "dump")
    assert sorted(map(tuple, third[:]["obs"].tolist())) == want
    assert not segment_exists(before)             # a new generation, which others follow
    assert sorted(map(tuple, other[:]["obs"].tolist())) == want
    obs = third.sample()["obs"].view(4, 4, 3)
    assert (obs[:, 1:, 1] - obs[:, :-1, 1] == 1).all()            # trajectories kept


def test_indexed_checkpoints_round_trip(closing, tmp_path):
    rb = TensorDictReplayBuffer(storage=closing(LazyShmStorage(30)))
    rb.extend(workers.rows(0, 0, 40))               # wraps around
    rb.dumps(tmp_path / "dump")
    again = TensorDictReplayBuffer(storage=closing(LazyShmStorage(30)))
    again.loads(tmp_path / "dump")
    assert (again[:] == rb[:]).all() and len(again) == 30
    state = rb.state_dict()
    third = TensorDictReplayBuffer(storage=closing(LazyShmStorage(30)))
    third.load_state_dict(state)
    assert (third[:] == rb[:]).all()


# -- packaging ------------------------------------------------------------------------
def test_missing_extra_names_it():
    code = ("import sys; sys.modules['torchrl'] = None\n"
            "try:\n    import shmbuf.compat.torchrl\n"
            "except ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=TIMEOUT)
    assert "shmbuf[torchrl]" in out.stdout, out.stderr


def test_the_core_does_not_import_torchrl():
    code = "import shmbuf, sys; print('torchrl' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=TIMEOUT)
    assert out.stdout.split() == ["False", "False"], out.stderr


def test_compressed_keys_are_sampled_decoded(closing):
    pytest.importorskip("zstandard")
    storage = closing(LazyShmStorage(2048, compress=shmbuf.Compress("pixels", hot_steps=64)))
    rb = stream_rb(storage, sampler=SliceSampler(slice_len=4), batch_size=32)
    for b in range(30):
        rb.extend(workers.rows(0, 50 * b, 50))
    storage.buffer.compact()
    assert storage.buffer.stats().compression.compressed_chunks > 0
    for _ in range(5):
        data = rb.sample()
        assert_well_formed(data["obs"])
        want = (data["obs"][:, 1] % 251).to(torch.uint8)
        assert (data["pixels"] == want[:, None, None]).all()
    held = rb[:]                                  # read through the store, decoded
    assert len(held) == len(rb)
    assert_well_formed(held["obs"])
    assert (held["pixels"] == (held["obs"][:, 1] % 251).to(torch.uint8)[:, None, None]).all()
