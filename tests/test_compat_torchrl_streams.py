"""``LazyShmStorage`` written by ``ShmWriter``: reading rows of a compressing storage, and
``empty()``.

A compressing storage keeps its cold chunks packed, their raw pages given
back, so ``storage[index]`` reads every row through the store and decodes it;
each test compares it with an uncompressed twin fed the same batches, after
checking that the raw columns really differ (packed chunks read as zeros
there).  ``empty()`` moves the data to a new segment that every process
follows.
"""
import multiprocessing as mp
import os
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("tensordict", reason="the torchrl extra is not installed")
pytest.importorskip("torchrl", reason="the torchrl extra is not installed")

from helpers import torchrl_workers as workers  # noqa: E402
from helpers.preempt import At, atomic_loads, calls_in  # noqa: E402
from helpers.procs import reap  # noqa: E402
from helpers.shm import exists as segment_exists  # noqa: E402
from tensordict import is_tensor_collection  # noqa: E402
from torchrl.data import (  # noqa: E402
    LazyTensorStorage,
    RandomSampler,
    ReplayBuffer,
    TensorDictReplayBuffer,
)

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
PACKED = ["pixels", "next.pixels"]


def packing(hot_steps: int):
    """The storages' compression (skips the test without the compress extra)."""
    pytest.importorskip("zstandard")
    return shmbuf.Compress(PACKED, hot_steps=hot_steps)


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




def assert_same(got, want, what=""):
    """The same type, shape, keys, dtypes and values."""
    assert type(got) is type(want), what
    if is_tensor_collection(want):
        assert got.batch_size == want.batch_size, what
        assert set(got.keys(True, True)) == set(want.keys(True, True)), what
        for key in want.keys(True, True):
            assert_same(got[key], want[key], f"{what} {key}")
    elif isinstance(want, torch.Tensor):
        assert got.shape == want.shape and got.dtype == want.dtype, what
        assert torch.equal(got, want), what
    elif isinstance(want, dict):
        assert got.keys() == want.keys(), what
        for key in want:
            assert_same(got[key], want[key], f"{what} {key}")
    else:
        assert len(got) == len(want), what
        for a, b in zip(got, want):
            assert_same(a, b, what)


def assert_whole(data, writer=None):
    """Every step of ``data`` is one step of ``workers.picture_rows``, all of it."""
    obs = data["obs"].reshape(-1, 3)
    if not len(obs):
        return
    step = obs[:, 1]
    assert (obs[:, 2] == workers.check_of(obs[:, 0], step)).all(), obs
    if writer is not None:
        assert (obs[:, 0] == writer).all(), obs
    assert (data["pixels"].reshape(len(obs), -1) == (step % 251)[:, None]).all()
    assert (data["next", "pixels"].reshape(len(obs), -1) == (step % 239)[:, None]).all()


def twins(closing, max_size, *, ndim=1, width=1, hot_steps=64):
    """A compressing storage of 1024 rows and an uncompressed one, fed the same batches by
    ShmWriter; the first holds packed chunks (checked), whose raw rows differ from the
    twin's.  The ring is filled, compacted, then written on (which recycles packed
    chunks) and compacted again: a writer skips a chunk that the compressor holds, so
    the twins lay their rows out alike only if no chunk is recycled while it works."""
    packed = closing(LazyShmStorage(max_size, ndim=ndim, compress=packing(hot_steps)))
    plain = closing(LazyShmStorage(max_size, ndim=ndim))
    writers = []
    for storage in (packed, plain):
        writers.append(ShmWriter())
        writers[-1].register_storage(storage)
    for first, n in ((0, 1024), (1024, 200)):
        for writer in writers:
            for at in range(first, first + n, 32):
                data = workers.picture_rows(1, at * width, min(32, first + n - at) * width)
                writer.extend(data.reshape(-1, width) if ndim > 1 else data)
        packed.buffer.compact()
    assert packed.buffer.capacity == 1024
    assert packed.buffer.stats().compression.compressed_chunks > 0
    raw, twin = packed.buffer.arrays, plain.buffer.arrays
    assert any(not np.array_equal(raw[c], twin[c]) for c in raw)   # raw reads would be wrong
    assert np.array_equal(packed.buffer.committed_rows(), plain.buffer.committed_rows())
    return packed, plain


def index_forms(held: np.ndarray, capacity: int) -> dict:
    """Every index form ``get`` takes along dim 0, on rows that hold a step."""
    rows = torch.from_numpy(held)
    mask = torch.zeros(capacity, dtype=torch.bool)
    mask[rows[::7]] = True
    return {"int": int(held[5]), "negative int": int(held[-1]) - capacity,
            "0-d tensor": rows[9], "tensor with repeats": rows[[3, 1, 3, 40]],
            "2-d tensor": rows[:12].view(3, 4), "numpy array": held[100:110],
            "list": held[::50].tolist(), "empty tensor": rows[:0], "slice": slice(None),
            "bounded slice": slice(int(held[10]), int(held[-10])),
            "stepped slice": slice(10, capacity - 100, 3), "boolean mask": mask}


# -- reading rows of a compressing storage --------------------------------------------------
def test_compressed_rows_read_decoded_for_every_index_form(closing):
    packed, plain = twins(closing, 1024)
    held = np.sort(plain.buffer.committed_rows())
    assert len(packed) == len(plain) == len(held)
    for name, index in index_forms(held, 1024).items():
        assert_same(packed[index], plain[index], name)
        assert_whole(packed[index], writer=1)
    assert len(packed[:]) == len(held)
    rb, twin = (TensorDictReplayBuffer(storage=s, writer=ShmWriter()) for s in (packed, plain))
    for index in (int(held[3]), torch.from_numpy(held[:20]), slice(None)):
        assert_same(rb[index], twin[index])


def test_compressed_rows_with_ndim_2_take_tuple_indices(closing):
    packed, plain = twins(closing, 3 * 1024, ndim=2, width=3)
    held = torch.from_numpy(np.sort(plain.buffer.committed_rows()))
    forms = {"rows and columns": (held[:10], torch.tensor([0, 2] * 5)),
             "2-d rows and columns": (held[:6].view(2, 3), torch.tensor([[1, 1, 0]])),
             "ints": (int(held[4]), 2), "slice then columns": (slice(None), torch.tensor([2, 0])),
             "slice then int": (slice(None), 1), "rows then slice": (held[5:9], slice(1, 3)),
             "one-tuple": (held[:4],), "boolean grid": torch.zeros(1024, 3, dtype=torch.bool)
             .index_fill_(0, held[::9], True)}
    for name, index in forms.items():
        got = packed[index]
        assert_whole(got, writer=1)
        assert_whole(plain[index], writer=1)
        assert_same(got, plain[index], name)
    # TorchRL's ReplayBuffer on ndim=2 extends and reads along dim 1 (dim_extend): rb[:]
    # asks the storage for (slice(None), slice(None)).
    rb, twin = (ReplayBuffer(storage=s, writer=ShmWriter()) for s in (packed, plain))
    assert rb.dim_extend == 1
    assert_same(rb[:], twin[:])


def test_torchrls_random_sampler_reads_a_compressing_storage(closing):
    packed, plain = twins(closing, 1024)
    rbs = [TensorDictReplayBuffer(storage=s, writer=ShmWriter(), sampler=RandomSampler(),
                                  batch_size=64, generator=torch.Generator().manual_seed(3))
           for s in (packed, plain)]
    for _ in range(5):
        got, want = (rb.sample(return_info=True) for rb in rbs)
        assert torch.equal(got[1]["index"], want[1]["index"])
        assert_same(got[0], want[0])
        assert_whole(got[0], writer=1)
    rb = TensorDictReplayBuffer(storage=packed, writer=ShmWriter(), sampler=RandomSampler(),
                                batch_size=64)   # as a user makes it: one more extend
    rb.extend(workers.picture_rows(1, 3000, 50))
    assert_whole(rb.sample(), writer=1)


def test_compressed_rows_read_in_a_spawned_child(closing):
    packed, plain = twins(closing, 1024)
    index = torch.from_numpy(np.sort(plain.buffer.committed_rows())[::11].copy())
    out = SPAWN.Queue()
    child = SPAWN.Process(target=workers.read_index, args=(packed, index, out))
    child.start()
    try:
        got = out.get(timeout=TIMEOUT)
        child.join(TIMEOUT)
        assert child.exitcode == 0
    finally:
        reap([child], TIMEOUT)
    for part, want in zip(got, (plain[index], plain[:])):
        assert part == [want[key].tolist() for key in ("obs", "pixels", ("next", "pixels"))]


def _read_preempted(storage, index, k: int, action):
    hook = At(k, action, atomic_loads)
    finder = storage.buffer.port.finder
    finder.preempt = hook
    sys.setprofile(hook)
    try:
        got = storage[index]
    finally:
        sys.setprofile(None)
        finder.preempt = None
    return got, hook.fired


def test_a_row_recycled_during_the_read_comes_back_whole(closing):
    """A writer recycles the chunks of the rows being read, at each point of one read."""
    k, seen = 0, set()
    while True:
        storage = LazyShmStorage(256, compress=packing(16))
        rb = TensorDictReplayBuffer(storage=storage, writer=ShmWriter())
        try:
            index = rb.extend(workers.picture_rows(5, 0, 256))[:8]   # the oldest two chunks
            storage.buffer.compact()
            assert storage.buffer.stats().compression.compressed_chunks > 0
            got, fired = _read_preempted(storage, index, k, lambda: rb.extend(  # noqa: B023
                workers.picture_rows(5, 256, 12)))                     # recycles three chunks
            assert_whole(got, writer=5)   # never zeros, never a mix
            step = got["obs"][:, 1]
            assert ((step == torch.arange(8)) | (step == 256 + torch.arange(8))).all()
            seen.add(tuple((step >= 256).tolist()))
            now = storage[index]["obs"][:, 1]
            assert (now == (256 if fired else 0) + torch.arange(8)).all()
        finally:
            storage.close()
        if not fired:
            break
        k += 1
    assert k > 10 and len(seen) > 1   # both the old steps and the new ones were read


def test_pytrees_and_tensors_in_streams_mode_read_as_torchrl_does(closing):
    tree = {"a": torch.arange(12.0), "b": (torch.arange(24).view(12, 2),)}
    for data in (tree, torch.arange(36.0).view(12, 3)):
        ours = ReplayBuffer(storage=closing(LazyShmStorage(50)), writer=ShmWriter())
        theirs = ReplayBuffer(storage=LazyTensorStorage(50))
        assert torch.equal(ours.extend(data), theirs.extend(data))
        for index in (3, torch.tensor([1, 5, 5]), slice(None)):
            assert_same(ours[index], theirs[index])
            assert_same(ours.storage.get(index), theirs.storage.get(index))


def test_bad_indices_name_the_index(closing):
    packed, _ = twins(closing, 1024)
    for index, error in ((1024, IndexError), (torch.tensor([0, -1025]), IndexError),
                         (torch.zeros(5, dtype=torch.bool), IndexError),
                         (torch.tensor([0.5]), TypeError), (..., TypeError), (True, TypeError)):
        with pytest.raises(error, match="index"):
            packed[index]


# -- empty() --------------------------------------------------------------------------------
def test_empty_renews_the_data_for_every_handle(closing):
    storage = closing(LazyShmStorage(1000))
    rb = TensorDictReplayBuffer(storage=storage, writer=ShmWriter(), batch_size=8,
                                sampler=SliceSampler(slice_len=4))
    other = closing(shmrl.attach(storage.name))       # a second handle, written before too
    orb = TensorDictReplayBuffer(storage=other, writer=ShmWriter(), batch_size=8,
                                 sampler=SliceSampler(slice_len=4))
    rb.extend(workers.rows(0, 0, 100))
    orb.extend(workers.rows(1, 0, 50))
    old, revision = storage.buffer.name, storage._mutation_revision
    assert len(orb) == 150 and rb.write_count == 150
    rb.empty()
    assert not segment_exists(old) and segment_exists(storage.buffer.name)
    assert storage._mutation_revision > revision
    for buffer in (rb, orb):
        assert len(buffer) == 0 and buffer.write_count == 0 and len(buffer[:]) == 0
        with pytest.raises(shmbuf.NotEnoughDataError):
            buffer.sample()
    assert other.buffer.name == storage.buffer.name
    index = orb.extend(workers.rows(2, 0, 30))        # the other handle's writer moves over
    index = torch.cat([index, rb.extend(workers.rows(3, 0, 20))])
    assert len(rb) == 50 and rb.write_count == 50
    assert sorted(rb[:]["obs"][:, 0].tolist()) == [2] * 30 + [3] * 20
    assert torch.equal(rb[index]["obs"], torch.cat([workers.rows(2, 0, 30)["obs"],
                                                    workers.rows(3, 0, 20)["obs"]]))
    assert set(orb.sample()["obs"][:, 0].tolist()) <= {2, 3}
    orb.empty(empty_write_count=False)                # the count goes on
    assert len(rb) == 0 and rb.write_count == 50
    rb.extend(workers.rows(4, 0, 5))
    assert rb.write_count == 55


def test_empty_resets_shared_priorities_and_compressed_data(closing):
    storage = closing(LazyShmStorage(2048, compress=packing(64)))
    sampler = PrioritizedSliceSampler(2048, alpha=1.0, beta=0.5, slice_len=5)
    rb = TensorDictReplayBuffer(storage=storage, writer=ShmWriter(), sampler=sampler,
                                batch_size=20)
    for b in range(30):
        rb.extend(workers.picture_rows(1, 50 * b, 50))
    storage.buffer.compact()
    assert storage.buffer.stats().compression.compressed_chunks > 0
    rb.empty()
    assert len(rb) == 0 and storage.buffer.stats().compression.compressed_chunks == 0
    index = torch.cat([rb.extend(workers.picture_rows(w, 0, 100)) for w in (2, 3)])
    rb.update_priority(index, torch.cat([torch.full((100,), 1e-6), torch.ones(100)]))
    drawn = rb.sample()
    assert_whole(drawn, writer=3)
    assert_whole(rb[:])


def test_new_keys_move_indexed_data_to_a_new_segment(closing):
    storage = closing(LazyShmStorage(40))
    rb = TensorDictReplayBuffer(storage=storage)
    rb.extend(workers.rows(0, 0, 10))
    first = storage.buffer.name
    rb.extend(workers.rows(0, 10, 5).set("extra", torch.ones(5)))   # new keys: a new segment
    assert not segment_exists(first) and storage.buffer.name != first
    assert torch.equal(rb[:15]["obs"], workers.rows(0, 0, 15)["obs"])
    other = closing(shmrl.attach(storage.name))
    assert (rb[10:15]["extra"] == 1).all() and other[:15]["extra"].sum() == 5
    rb.empty()
    assert len(rb) == 0


SHMBUF_DIR = os.path.dirname(shmbuf.__file__)
FACADE_DIR = os.path.dirname(shmrl.__file__)


def _emptied_during(call, k: int, action, where: str = SHMBUF_DIR):
    """``(call's result, or the NotEnoughDataError it raised; whether action ran)``."""
    hook = At(k, action, calls_in(where))
    sys.setprofile(hook)
    try:
        return call(), hook.fired
    except shmbuf.NotEnoughDataError as exc:
        return exc, hook.fired
    finally:
        sys.setprofile(None)


def test_an_empty_at_any_point_of_an_extend_or_a_sample_in_another_handle(closing):
    """Another handle (as another process would) empties the storage at each point of one
    extend, then of one sample: the batch goes whole to the new data or with the old,
    and a sample draws from the old data or finds the new one empty; nothing raises."""
    storage = closing(LazyShmStorage(1000))
    ours = TensorDictReplayBuffer(storage=storage, writer=ShmWriter(), batch_size=8,
                                  sampler=SliceSampler(slice_len=4))
    theirs = TensorDictReplayBuffer(storage=closing(shmrl.attach(storage.name)),
                                    writer=ShmWriter())
    ours.extend(workers.rows(1, 0, 10))
    batch = workers.rows(2, 0, 30)
    k = 0
    while True:
        index, fired = _emptied_during(lambda: ours.extend(batch), k, theirs.empty)
        assert len(ours) in (10, 30, 40) if not fired else len(ours) in (0, 30)
        if len(ours) == 30:
            assert torch.equal(ours[index]["obs"], batch["obs"])
            assert torch.equal(ours[:]["obs"], batch["obs"])
        if not fired:
            break
        k += 1
    extends = k
    k = 0
    while True:
        theirs.extend(workers.rows(3, 0, 12))
        drawn, fired = _emptied_during(ours.sample, k, theirs.empty)
        if isinstance(drawn, Exception):
            assert fired and len(ours) == 0
        else:
            assert (drawn["obs"][:, 0] == 3).all() and drawn["obs"].shape == (8, 3)
        if not fired:
            break
        k += 1
    assert extends > 10 and k > 10


@pytest.mark.parametrize("first", ["owner", "attached"])
def test_a_first_write_racing_a_write_and_an_empty_elsewhere(first):
    """While one handle (the constructing one, or one attached by name) makes the data
    segment at its first write, another writes and empties, at each point: no segment
    is left behind, and the batch is held whole in the current data or not at all."""
    batch, k = workers.rows(2, 0, 30), 0
    while True:
        with LazyShmStorage(1000) as storage, shmrl.attach(storage.name) as other:
            handles = (storage, other) if first == "owner" else (other, storage)
            ours, theirs = (TensorDictReplayBuffer(storage=h, writer=ShmWriter())
                            for h in handles)

            def elsewhere():
                theirs.extend(workers.rows(3, 0, 5))  # noqa: B023 - runs inside this loop
                theirs.empty()                        # noqa: B023

            # Points in the facade only: inside store.create the other handle would wait
            # for a header this one, frozen here, never writes (another process would).
            _, fired = _emptied_during(lambda: ours.extend(batch), k,  # noqa: B023
                                       elsewhere, FACADE_DIR)
            assert len(ours) in (0, 30) if fired else len(ours) == 30
            if len(ours):
                assert torch.equal(ours[:]["obs"], batch["obs"])
            held = [n for n in os.listdir("/dev/shm") if n.startswith(storage.name + ".")]
            assert held == [storage.buffer.name]
        if not fired:
            break
        k += 1
    assert k > 10


def test_a_spawned_process_follows_empty(closing):
    storage = closing(LazyShmStorage(1000))
    rb = TensorDictReplayBuffer(storage=storage, writer=ShmWriter(), batch_size=8,
                                sampler=SliceSampler(slice_len=4))
    commands, replies = SPAWN.Queue(), SPAWN.Queue()
    child = SPAWN.Process(target=workers.serve, args=(rb, commands, replies))
    child.start()

    def ask(*command):
        commands.put(command)
        return replies.get(timeout=TIMEOUT)

    try:
        ask("extend", 7, 0, 100)                      # its writer and sampler bind the data
        assert len(ask("sample")) == 8 and ask("len") == 100 and len(rb) == 100
        old = storage.buffer.name
        rb.empty()
        assert not segment_exists(old)
        assert ask("len") == 0 and ask("read") == [] and ask("sample") == "NotEnoughDataError"
        index = ask("extend", 8, 0, 60)               # lands in the new generation
        assert len(rb) == 60 and rb[torch.tensor(index)]["obs"].tolist() == \
            workers.rows(8, 0, 60)["obs"].tolist()
        assert {row[0] for row in ask("sample")} == {8}
        assert {row[0] for row in rb.sample()["obs"].tolist()} == {8}
        commands.put(("stop",))
        child.join(TIMEOUT)
        assert child.exitcode == 0
    finally:
        reap([child], TIMEOUT)


def test_an_extend_racing_empty_is_kept_whole_or_dropped(closing):
    """A spawned writer extends batch after batch while this process empties the storage
    again and again: the batches held at the end are each whole, none split."""
    batch = 40
    storage = closing(LazyShmStorage(20_000))
    rb = TensorDictReplayBuffer(storage=storage, writer=ShmWriter(), batch_size=16,
                                sampler=SliceSampler(slice_len=4))
    done, stop = SPAWN.Queue(), SPAWN.Event()
    child = SPAWN.Process(target=workers.extend_until, args=(rb, 9, batch, done, stop))
    child.start()
    try:
        names = set()
        for _ in range(8):
            for _ in range(3):
                done.get(timeout=TIMEOUT)             # a few batches into this generation
            names.add(storage.buffer.name)
            rb.empty()
            try:
                drawn = rb.sample()["obs"]
                assert (drawn[:, 2] == workers.check_of(drawn[:, 0], drawn[:, 1])).all()
            except shmbuf.NotEnoughDataError:
                pass                                  # nothing written since: fine
        stop.set()
        while True:
            last = done.get(timeout=TIMEOUT)
            if isinstance(last, tuple):
                break
        child.join(TIMEOUT)
        assert child.exitcode == 0
    finally:
        reap([child], TIMEOUT)
    assert not any(segment_exists(name) for name in names)
    obs = rb[:]["obs"]
    assert (obs[:, 0] == 9).all() and (obs[:, 2] == workers.check_of(9, obs[:, 1])).all()
    counts = torch.bincount(obs[:, 1] // batch)
    assert ((counts == 0) | (counts == batch)).all()   # every batch whole, or gone
    assert counts[last[1]] == batch                    # the one after stop: here
    assert len(rb) == len(obs) == int(counts.sum())
