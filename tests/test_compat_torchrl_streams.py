"""``LazyShmStorage`` written by ``ShmWriter``: reading rows of a compressing storage.

A compressing storage keeps its cold chunks packed, their raw pages given
back, so ``storage[index]`` reads every row through the store and decodes it;
each test compares it with an uncompressed twin fed the same batches, after
checking that the raw columns really differ (packed chunks read as zeros
there).
"""
import multiprocessing as mp
import os
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("tensordict", reason="the torchrl extra is not installed")
pytest.importorskip("torchrl", reason="the torchrl extra is not installed")
pytest.importorskip("zstandard")

from helpers import torchrl_workers as workers  # noqa: E402
from tensordict import is_tensor_collection  # noqa: E402
from torchrl.data import (  # noqa: E402
    LazyTensorStorage,
    RandomSampler,
    ReplayBuffer,
    TensorDictReplayBuffer,
)

import shmbuf  # noqa: E402
from shmbuf.compat.torchrl import LazyShmStorage, ShmWriter  # noqa: E402

TIMEOUT = 60
SPAWN = mp.get_context("spawn")
PACKED = ["pixels", "next.pixels"]


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


def join_all(procs):
    for p in procs:
        p.join(TIMEOUT)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(10)


def segment_exists(name: str) -> bool:
    return os.path.exists(os.path.join("/dev/shm", name))


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
    packed = closing(LazyShmStorage(max_size, ndim=ndim, compress=shmbuf.Compress(
        PACKED, hot_steps=hot_steps)))
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
        join_all([child])
    for part, want in zip(got, (plain[index], plain[:])):
        assert part == [want[key].tolist() for key in ("obs", "pixels", ("next", "pixels"))]


class _Preempt:
    """Counts a read's loads from shared memory (calls into ``shmbuf.protocol._atomic``,
    and the C window check's loads through its ``preempt`` hook) and runs ``action``
    right before the ``k``-th, as if the reader had been preempted there."""

    def __init__(self, k: int, action):
        self.k, self.action, self.calls, self.fired = k, action, 0, False

    def __call__(self, frame=None, event="c_call", arg=None):
        if event != "c_call" or (arg is not None and getattr(
                arg, "__module__", None) != "shmbuf.protocol._atomic"):
            return
        if self.calls == self.k:
            self.fired = True
            sys.setprofile(None)   # the action's own loads are not read points
            try:
                self.action()
            finally:
                sys.setprofile(self)
        self.calls += 1


def _read_preempted(storage, index, k: int, action):
    hook = _Preempt(k, action)
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
        storage = LazyShmStorage(256, compress=shmbuf.Compress(PACKED, hot_steps=16))
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
