"""Keyed rings: the per-key retention protocol, its validation, and its lifecycle."""
import collections
import multiprocessing as mp
import os
import pickle

import numpy as np
import posix_ipc
import pytest
from helpers.keyed_workers import WIDE, code, keyed_writer
from helpers.procs import join_all, running
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shmbuf
from shmbuf.keyed import rings as keyed
from shmbuf.protocol import keyed as _keyed_ring
from shmbuf.protocol import layout as _layout

SHM = "/dev/shm"
SPEC = {"x": ((2,), np.int64), "tag": ((), "<U4")}


def rows_for(keys, serials) -> dict:
    keys, serials = np.asarray(keys, np.int64), np.asarray(serials, np.int64)
    return {"x": np.stack([keys, serials], axis=1),
            "tag": np.array([f"s{s % 1000}" for s in serials.tolist()], "<U4")}


def every_age(max_len):
    return lambda lengths: np.broadcast_to(np.arange(max_len), (len(lengths), max_len))


@pytest.fixture
def rings():
    r = keyed.create(SPEC, n_keys=3, max_len=4, spare=2)
    yield r
    r.close()


# -- layout -----------------------------------------------------------------------
def test_layout_is_one_chunk_per_key(rings):
    mm = rings._segment.mmap
    layout, owner = _layout.decode_header(mm, rings._segment.size, rings.name)
    assert owner["kind"] == _layout.KIND_KEYED
    assert (layout.n_chunks, layout.chunk_size, layout.capacity) == (3, 6, 18)
    assert layout.done_column == -1
    assert owner["meta"] == {"max_len": 4, "user": {}}
    assert (rings.n_keys, rings.max_len, rings.ring_len, rings.spare) == (3, 4, 6, 2)
    assert rings.views["x"].shape == (3, 6, 2) and rings.views["tag"].shape == (3, 6)
    assert rings.spec == {"x": ((2,), np.dtype(np.int64)), "tag": ((), np.dtype("<U4"))}


def test_count_and_next_live_in_the_chunk_table(rings):
    rings.append([1], rows_for([1], [0]))
    rings.append([1, 2], rows_for([1, 2], [1, 2]))
    rings.reset([1])
    table = np.frombuffer(rings._segment.mmap, "<u8", count=3 * 8,
                          offset=rings._layout.chunks_offset).reshape(3, 8)
    count, nxt = _layout.CHUNK_FIELDS["count"] // 8, _layout.CHUNK_FIELDS["next"] // 8
    assert table[:, count].tolist() == [0, 2, 1]
    assert table[:, nxt].tolist() == [0, 2, 0]
    assert rings.counts().tolist() == [0, 2, 1] and rings.lengths().tolist() == [0, 0, 1]


# -- protocol against a reference model ----------------------------------------------
OPS = st.lists(st.one_of(
    st.tuples(st.just("append"), st.sets(st.integers(0, 3), min_size=1)),
    st.tuples(st.just("reset"), st.sets(st.integers(0, 3))),
    st.tuples(st.just("read"), st.lists(st.integers(0, 3), max_size=5),
              st.lists(st.integers(-2, 7), min_size=1, max_size=6)),
), max_size=40)


@pytest.mark.slow
@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(max_len=st.integers(1, 5), spare=st.integers(1, 3), ops=OPS)
def test_matches_a_deque_per_key(max_len, spare, ops):
    ref = {k: collections.deque(maxlen=max_len) for k in range(4)}
    appended = [0] * 4
    serial = 0
    with keyed.create(SPEC, n_keys=4, max_len=max_len, spare=spare) as r:
        for op in ops:
            if op[0] == "append":
                keys = sorted(op[1])
                serials = list(range(serial, serial + len(keys)))
                serial += len(keys)
                r.append(keys, rows_for(keys, serials))
                for k, s in zip(keys, serials):
                    ref[k].append(s)
                    appended[k] += 1
            elif op[0] == "reset":
                r.reset(sorted(op[1]))
                for k in op[1]:
                    ref[k].clear()
            else:
                keys, ages = op[1], np.array(op[2])
                out, lengths = r.read(keys, lambda L: np.tile(ages, (len(L), 1)))  # noqa: B023 - read() calls it at once
                assert lengths.tolist() == [len(ref[k]) for k in keys]
                for row, k in enumerate(keys):
                    newest_first = list(reversed(ref[k]))
                    want = [[k, newest_first[a]] if 0 <= a < len(ref[k]) else [0, 0]
                            for a in ages.tolist()]
                    assert out["x"][row].tolist() == want
        assert r.counts().tolist() == appended
        assert r.lengths().tolist() == [len(ref[k]) for k in range(4)]
        out, lengths = r.read(None, every_age(max_len))
        for k in range(4):
            got = out["tag"][k][:lengths[k]].tolist()
            assert got == [f"s{s % 1000}" for s in reversed(ref[k])]


def test_zero_rows_for_ages_outside_the_live_window(rings):
    rings.append([0], rows_for([0], [7]))
    out, lengths = rings.read([0, 2], lambda L: np.array([[-1, 0, 1]] * len(L)),
                              {"x": slice(None)})
    assert lengths.tolist() == [1, 0]
    assert out["x"].tolist() == [[[0, 0], [0, 7], [0, 0]], [[0, 0], [0, 0], [0, 0]]]
    assert set(out) == {"x"}


def test_columns_read_their_slice_of_the_ages_and_bad_ones_are_refused(rings):
    for s in range(6):
        rings.append([1], rows_for([1], [s]))
    out, _ = rings.read([1], lambda L: np.array([[0, 1, 2, 3]] * len(L)),
                        {"x": slice(1, 3), "tag": slice(3, None)})
    assert out["x"][0, :, 1].tolist() == [4, 3] and out["tag"].tolist() == [["s2"]]
    with pytest.raises(TypeError, match=r"columns\['x'\] must be a slice .* step 1"):
        rings.read([1], lambda L: np.zeros((len(L), 4), int), {"x": slice(0, 4, 2)})
    with pytest.raises(KeyError, match="'nope', which is not one of"):
        rings.read([1], lambda L: np.zeros((len(L), 1), int), {"nope": slice(None)})


def test_the_copy_never_reads_outside_a_column():
    """keyed_take checks every row before it copies: a corrupt base is an error, not a crash."""
    from shmbuf.protocol import _atomic

    with keyed.create(SPEC, n_keys=2, max_len=4, spare=1) as r:
        fill(r, 0, 3)
        words, view = r._words, r._views["x"]
        count, lengths = words.counts(words.all), np.array([3, 0], np.int64)
        ages = np.array([[0, 1], [0, 1]], np.int64)
        out, stale = np.empty((2, 2, 2), np.int64), np.zeros(2, np.bool_)
        args = (r._segment.mmap, words._count, None, count, lengths, ages, words.ring_len,
                ((view, 0, 2, out),), stale)
        for first_row in (len(view) - 1, -3, 2**62):   # key 0's newest entries: slots 2, 1
            with pytest.raises(ValueError, match="outside the column"):
                _atomic.keyed_take(*args[:2], np.array([first_row, 0], np.int64), *args[3:])
        assert _atomic.keyed_take(*args[:2], np.array([0, 10**9], np.int64), *args[3:]) == 0
        assert out[0, :, 1].tolist() == [2, 1] and not out[1].any()
        with pytest.raises(ValueError, match="do not fit"):
            _atomic.keyed_take(*args[:2], np.zeros(2, np.int64), *args[3:7],
                               ((view, 0, 3, out),), stale)


def test_retention_is_per_key(rings):
    for s in range(50):
        rings.append([2], rows_for([2], [100 + s]))
    rings.append([0], rows_for([0], [1]))
    out, lengths = rings.read(None, every_age(4))
    assert lengths.tolist() == [1, 0, 4]
    assert out["x"][0, 0].tolist() == [0, 1]
    assert out["x"][2, :, 1].tolist() == [149, 148, 147, 146]


def test_reset_keeps_counts_monotonic_and_hides_old_entries(rings):
    for s in range(3):
        rings.append([0, 1], rows_for([0, 1], [s, s]))
    rings.reset([0])
    rings.reset([0])
    assert rings.counts().tolist() == [3, 3, 0] and rings.lengths().tolist() == [0, 3, 0]
    rings.append([0], rows_for([0], [9]))
    out, lengths = rings.read([0], every_age(4))
    assert lengths.tolist() == [1] and out["x"][0, 0].tolist() == [0, 9]
    start, count = rings.bounds([0])
    assert (start.tolist(), count.tolist()) == ([3], [4]) and rings.bounds_of(0) == (3, 4)
    with pytest.raises(IndexError):
        rings.bounds_of(3)


@pytest.mark.parametrize("keys, rows, error", [
    ([0, 0], rows_for([0, 0], [1, 2]), ValueError),             # keys not distinct
    ([0, 3], rows_for([0, 3], [1, 2]), IndexError),             # key out of range
    ([0, -1], rows_for([0, 1], [1, 2]), IndexError),
    ([0.5], rows_for([0], [1]), TypeError),
    ([0, 1], rows_for([0], [1]), ValueError),                   # rows for one key only
    ([0], {"x": np.zeros((1, 2), np.float64), "tag": np.array(["a"])}, TypeError),  # lossy
    ([0], {"x": np.zeros((1, 2), np.int64)}, KeyError),         # missing column
    ([0], {**rows_for([0], [1]), "y": np.zeros(1)}, KeyError),  # unknown column
    ([0], {"x": np.zeros((1, 2), np.int64), "tag": np.array(["toolong"])}, TypeError),
])
def test_bad_appends_write_nothing(rings, keys, rows, error):
    rings.append([0, 1], rows_for([0, 1], [5, 6]))
    before = {k: v.copy() for k, v in rings.views.items()}
    with pytest.raises(error):
        rings.append(keys, rows)
    assert rings.counts().tolist() == [1, 1, 0]
    for k, v in rings.views.items():
        assert np.array_equal(v, before[k])


def test_empty_append_is_a_no_op(rings):
    rings.append([], rows_for([], []))
    assert rings.counts().tolist() == [0, 0, 0]


def test_create_rejects_bad_arguments():
    for kwargs, error in [({"n_keys": 0}, ValueError), ({"max_len": -1}, ValueError),
                          ({"spare": 0}, ValueError), ({"n_keys": 2.0}, TypeError)]:
        args = {"n_keys": 2, "max_len": 3, **kwargs}
        with pytest.raises(error, match=next(iter(kwargs))):
            keyed.create(SPEC, **args)


# -- the seqlock: appends that land while a read copies ---------------------------------
def lapping_select(r, key, appends, times):
    """A select that appends ``appends`` entries to ``key`` (between snapshot and copy)."""
    calls = []

    def select(lengths):
        if len(calls) < times:
            counts = r.counts([key])
            for i in range(appends):
                r.append([key], rows_for([key], counts + i))
        calls.append(lengths.copy())
        return np.broadcast_to(np.arange(r.max_len), (len(lengths), r.max_len))
    return select, calls


def fill(r, key, n):
    for s in range(n):
        r.append([key], rows_for([key], [s]))


def test_appends_within_the_spare_slots_keep_a_read_intact():
    with keyed.create(SPEC, n_keys=2, max_len=4, spare=3) as r:
        fill(r, 0, 10)
        select, calls = lapping_select(r, 0, appends=2, times=1)
        out, lengths = r.read([0, 1], select)
        assert len(calls) == 1
        assert out["x"][0, :, 1].tolist() == [9, 8, 7, 6]   # the snapshot's entries


def test_a_lapped_read_is_redone_for_that_key_only():
    with keyed.create(SPEC, n_keys=2, max_len=4, spare=1) as r:
        fill(r, 0, 10)
        fill(r, 1, 3)
        select, calls = lapping_select(r, 0, appends=1, times=1)
        out, lengths = r.read([1, 0, 1], select)
        assert [len(c) for c in calls] == [3, 1]            # then only the lapped row
        assert lengths.tolist() == [3, 4, 3]
        assert out["x"][1, :, 1].tolist() == [10, 9, 8, 7]  # re-read after the append
        assert out["x"][0, :3, 1].tolist() == [2, 1, 0] == out["x"][2, :3, 1].tolist()


def test_reads_that_are_always_lapped_raise():
    with keyed.create(SPEC, n_keys=1, max_len=2, spare=1) as r:
        fill(r, 0, 5)
        select, calls = lapping_select(r, 0, appends=1, times=10**9)
        with pytest.raises(shmbuf.SampleRetryError, match="spare"):
            r.read(None, select)
        assert len(calls) == _keyed_ring.MAX_ATTEMPTS


def test_reading_only_recent_entries_tolerates_more_appends():
    with keyed.create(SPEC, n_keys=1, max_len=4, spare=1) as r:
        fill(r, 0, 10)
        calls = []

        def select(lengths):
            if not calls:
                fill(r, 0, 1)  # position 10 clobbers 5 (age 4); the next would clobber 6
            calls.append(1)
            return np.array([[0, 1, 2]])
        out, _ = r.read(None, select)
        assert len(calls) == 1 and out["x"][0, :, 1].tolist() == [9, 8, 7]


# -- lifecycle --------------------------------------------------------------------
def test_attach_sees_the_same_memory_and_never_unlinks(rings):
    rings.append([2], rows_for([2], [42]))
    other = keyed.attach(rings.name)
    assert not other.owner and other.meta == {} and other.max_len == 4
    out, _ = other.read([2], every_age(4))
    assert out["x"][0, 0].tolist() == [2, 42]
    other.append([1], rows_for([1], [43]))
    assert rings.lengths().tolist() == [0, 1, 1]
    with pytest.raises(PermissionError):
        other.unlink()
    other.close()
    other.close()
    assert os.path.exists(os.path.join(SHM, rings.name))
    with pytest.raises(shmbuf.BufferClosedError):
        other.read(None, every_age(1))
    with pytest.raises(shmbuf.BufferClosedError):
        other.append([0], rows_for([0], [1]))


def test_owner_close_unlinks_and_is_idempotent():
    r = keyed.create(SPEC, n_keys=1, max_len=1, meta={"who": "me"})
    name = r.name
    assert r.meta == {"who": "me"} and repr(r).endswith("owner>")
    r.close()
    r.close()
    assert not os.path.exists(os.path.join(SHM, name))
    with pytest.raises(shmbuf.BufferClosedError):
        r.lengths()
    with pytest.raises(shmbuf.SegmentNotFoundError):
        keyed.attach(name)


def test_dropping_the_owner_unlinks():
    r = keyed.create(SPEC, n_keys=1, max_len=1)
    name = r.name
    del r   # no reference cycles: the finalizer runs at once
    assert not os.path.exists(os.path.join(SHM, name))


def test_unlink_keeps_existing_mappings(rings):
    rings.append([0], rows_for([0], [3]))
    rings.unlink()
    rings.unlink()
    assert not os.path.exists(os.path.join(SHM, rings.name))
    assert rings.lengths().tolist() == [1, 0, 0]


def test_pickle_sends_the_name(rings):
    rings.append([0], rows_for([0], [5]))
    copy = pickle.loads(pickle.dumps(rings))
    try:
        assert copy.name == rings.name and not copy.owner
        assert copy.lengths().tolist() == [1, 0, 0]
    finally:
        copy.close()
    assert os.path.exists(os.path.join(SHM, rings.name))


def test_attach_refuses_a_step_store_and_the_store_refuses_rings(rings):
    with shmbuf.create({"x": ((), np.float32)}, 16, done_key=None) as store:
        with pytest.raises(shmbuf.CorruptSegmentError, match="step store"):
            keyed.attach(store.name)
    with pytest.raises(shmbuf.CorruptSegmentError, match="keyed rings"):
        shmbuf.attach(rings.name)


def test_attach_waits_for_a_header_then_gives_up():
    name = f"shmbuf-test-keyed-blank-{os.getpid()}"
    shm = posix_ipc.SharedMemory("/" + name, posix_ipc.O_CREX, size=8192)
    shm.close_fd()
    try:
        with pytest.raises(shmbuf.CorruptSegmentError, match="no complete shmbuf header"):
            keyed.attach(name, timeout=0.01)
    finally:
        posix_ipc.unlink_shared_memory("/" + name)


def _close_inherited(r):
    r.close()


@pytest.mark.slow
def test_a_forked_child_never_unlinks(rings):
    ctx = mp.get_context("fork")
    with running([ctx.Process(target=_close_inherited, args=(rings,))]) as procs:
        join_all(procs, 30)
    assert os.path.exists(os.path.join(SHM, rings.name))
    rings.append([0], rows_for([0], [1]))


# -- several processes ------------------------------------------------------------------
def check_untorn(out, lengths, keys, newest_seen) -> None:
    """Every row is one whole entry of its key; ages are consecutive positions."""
    x, before = out["x"], dict(newest_seen)
    for row, key in enumerate(keys):
        n = int(lengths[row])
        entries = x[row, :n]
        assert (entries == entries[:, :1]).all(), f"torn entry in key {key}"
        pos = entries[:, 0] - code(key, 0)
        assert (0 <= pos).all() and (pos < 1_000_000_000).all(), f"key {key} holds {pos}"
        assert (np.diff(pos) == -1).all(), f"key {key}: positions {pos.tolist()}"
        assert (x[row, n:] == 0).all()
        if n:
            assert pos[0] >= before.get(key, -1), "a read went back in time"
            newest_seen[key] = max(newest_seen.get(key, -1), int(pos[0]))


@pytest.mark.slow
def test_spawned_writers_on_disjoint_keys_are_never_torn():
    ctx = mp.get_context("spawn")
    max_len = 6
    owned = [[0, 2], [1, 3]]
    with keyed.create({"x": ((WIDE,), np.int64)}, n_keys=4, max_len=max_len, spare=1) as r:
        stop_r, stop_w = ctx.Pipe(duplex=False)
        ready_r, ready_w = ctx.Pipe(duplex=False)
        procs = [ctx.Process(target=keyed_writer, args=(r, keys, stop_r, ready_w, 200_000))
                 for keys in owned]
        newest, ok, lapped = {}, 0, 0
        with running(procs):
            for _ in procs:
                assert ready_r.poll(60), "a writer never started"
                ready_r.recv()
            keys = [3, 0, 1, 2, 0]
            for i in range(400):
                m = max_len if i % 2 else 3
                try:
                    out, lengths = r.read(keys, lambda L: np.broadcast_to(np.arange(m),  # noqa: B023 - read() calls it at once
                                                                          (len(L), m)))  # noqa: B023 - read() calls it at once
                except shmbuf.SampleRetryError:
                    lapped += 1
                    continue
                check_untorn(out, np.minimum(lengths, m), keys, newest)
                ok += 1
            stop_w.send(True)
            join_all(procs, 60)
        out, lengths = r.read(None, lambda L: np.tile(np.arange(max_len), (4, 1)))
        check_untorn(out, lengths, [0, 1, 2, 3], newest)
        counts = r.counts()
        assert counts[0] == counts[2] and counts[1] == counts[3]
        assert lengths.tolist() == [max_len] * 4
        assert out["x"][:, 0, 0].tolist() == code([0, 1, 2, 3], counts - 1).tolist()
        print(f"concurrent reads: {ok} intact, {lapped} lapped every retry")
