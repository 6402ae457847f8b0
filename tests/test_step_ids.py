"""Step ids belong to the buffer that issued them, and survive ``save`` and ``load``.

Every step holds a ``key`` unique to it (writer * 10**6 + its position), so a test can say
which step an id names by sampling it and reading the key beside it.
"""
import numpy as np
import pytest

import shmbuf
from shmbuf import ForeignStepIdsError

SPEC = {"key": ((), np.int64), "z": ((), np.float32), "done": ((), np.bool_)}
CAPACITY, CHUNK = 512, 16


def fill(buf, steps, writers=2, start=0):
    """``steps`` steps from each of ``writers`` writers, added in turn (interleaved chunks)."""
    ws = [buf.writer() for _ in range(writers)]
    try:
        for i in range(start, start + steps):
            for w, writer in enumerate(ws):
                writer.add(key=w * 10**6 + i, z=0.0, done=i % 50 == 49)
    finally:
        for writer in ws:
            writer.close()


@pytest.fixture
def made():
    """Buffers to close at teardown (loaded ones included)."""
    bufs = []
    yield bufs
    for buf in bufs:
        buf.close()


def new(made, **kw):
    buf = shmbuf.create(SPEC, CAPACITY, chunk_size=CHUNK, priorities=True, seed=3, **kw)
    made.append(buf)
    return buf


def keys_of(buf, ids):
    """The key of the step each of ``ids`` names in ``buf`` now, -1 where it names none:
    each distinct id writes a ``z`` no step had before, found again in a snapshot."""
    uniq, back = np.unique(ids.reshape(-1), return_inverse=True)
    before = buf.snapshot()["columns"]
    mark = np.float32(before["z"].max() + 1 if len(before["z"]) else 1)
    buf.write_steps(uniq, z=mark + np.arange(len(uniq), dtype=np.float32))
    after = buf.snapshot()["columns"]
    assert np.array_equal(after["key"], before["key"])   # the same steps, in the same order
    key = np.full(len(uniq), -1, np.int64)
    hit = np.flatnonzero(after["z"] >= mark)
    key[(after["z"][hit] - mark).astype(np.int64)] = after["key"][hit]
    return key[back].reshape(ids.shape)


# -- another buffer's ids ---------------------------------------------------------------------
def test_another_buffers_ids_are_refused_and_nothing_is_written(made):
    a, b = new(made), new(made)
    fill(a, 300)
    fill(b, 300)
    ids_a = a.sample_sequences(8, 5, ids=True, rng=1)["ids"]
    ids_b = b.sample_sequences(8, 5, ids=True, rng=1)["ids"]
    assert ids_a.size == 40 and a.update_priorities(ids_a, np.full((5, 8), 2.0)) == 40
    before, pri = b.snapshot(), b.priorities_of(ids_b)
    mixed = ids_b.copy()
    mixed[3, 2] = ids_a[0, 0]   # one foreign id among b's own: nothing is written either
    for ids in (ids_a, mixed):
        for call in (lambda x: b.update_priorities(x, np.full((5, 8), 7.0)),
                     lambda x: b.write_steps(x, z=np.full((5, 8), 7.0)),
                     b.priorities_of):
            with pytest.raises(ForeignStepIdsError, match=rf"ids\[\d, \d\] is \d+, a step id of "
                               rf"another buffer .*buffer '{b.name}'.*nothing was written"):
                call(ids)
    with pytest.raises(ValueError, match=r"ids\[3, 2\]"):   # a ValueError, naming the id
        b.update_priorities(mixed, np.full((5, 8), 7.0))
    after = b.snapshot()
    assert all(np.array_equal(before["columns"][k], after["columns"][k]) for k in SPEC)
    assert np.array_equal(b.priorities_of(ids_b), pri)
    assert b._ring.priorities.largest_set() is None   # no update reached b's words
    assert b.update_priorities(ids_b, np.full((5, 8), 3.0)) == 40   # b's own still work


def test_every_step_id_argument_is_checked_alike(made):
    buf = new(made)
    fill(buf, 100)
    ids = buf.sample_sequences(2, 3, ids=True)["ids"]
    for call in (lambda x: buf.update_priorities(x, np.ones(x.shape)),
                 lambda x: buf.write_steps(x, z=np.ones(x.shape)),
                 buf.priorities_of):
        with pytest.raises(TypeError, match="ids must be int64 step ids"):
            call(ids.astype(np.int32))
        bad = ids.copy()
        bad[1, 0] = -4
        with pytest.raises(ValueError, match=r"ids\[1, 0\] is -4; step ids are >= 0"):
            call(bad)


# -- save and load ----------------------------------------------------------------------------
def test_ids_sampled_before_a_save_name_the_same_steps_after_load(made, tmp_path):
    src = new(made)
    fill(src, 2000)   # wrapped many times: its claim numbers are far from 0
    batch = src.sample_sequences(16, 4, ids=True, time_major=False, rng=5)
    ids = batch["ids"]
    src.update_priorities(ids, np.arange(64, dtype=np.float32).reshape(16, 4) / 8)
    src.save(tmp_path / "s")
    loaded = shmbuf.load(tmp_path / "s")
    made.append(loaded)
    assert np.array_equal(loaded.priorities_of(ids), src.priorities_of(ids))
    assert np.array_equal(keys_of(loaded, ids), batch["key"])
    assert loaded.update_priorities(ids, np.full((16, 4), 5.0)) == 64
    assert (loaded.priorities_of(ids) == 5.0).all()
    # Its own ids carry a tag of its own, and name the same steps as the saved ones.
    own = loaded.sample_sequences(16, 4, ids=True, time_major=False, rng=6)
    assert np.array_equal(keys_of(loaded, own["ids"]), own["key"])
    assert not (own["ids"] >> 47 == ids[0, 0] >> 47).any()
    # The saved buffer runs on: its new ids name no step of the loaded one (stale, not
    # another step), even once the loaded buffer has claimed chunks past the save too.
    fill(src, 400, start=2000)
    fill(loaded, 400, start=5000)
    later = src.sample_sequences(16, 4, ids=True, rng=7)["ids"]
    assert np.isnan(loaded.priorities_of(later)).all()
    assert loaded.update_priorities(later, np.ones(later.shape)) == 0
    # A save of the loaded buffer, loaded again, still takes the first buffer's ids.
    again_batch = loaded.sample_sequences(8, 2, ids=True, rng=8)
    loaded.save(tmp_path / "t")
    again = shmbuf.load(tmp_path / "t")
    made.append(again)
    assert np.array_equal(keys_of(again, again_batch["ids"]), again_batch["key"])
    other = new(made)
    fill(other, 100)
    with pytest.raises(ForeignStepIdsError):
        again.priorities_of(other.sample_sequences(1, 1, ids=True)["ids"])


def test_ids_are_stale_after_a_load_that_cannot_keep_them(made, tmp_path):
    src = new(made)
    fill(src, 2000)
    ids = src.sample_sequences(8, 4, ids=True, rng=5)["ids"]
    src.save(tmp_path / "s")
    bigger = shmbuf.load(tmp_path / "s", capacity=2 * CAPACITY)   # another geometry
    made.append(bigger)
    assert np.isnan(bigger.priorities_of(ids)).all()          # taken, but name no step
    assert bigger.update_priorities(ids, np.ones(ids.shape)) == 0
    assert bigger.write_steps(ids, z=np.ones(ids.shape)) == 0


def test_a_save_whose_chunks_cannot_go_back_in_place_loads_with_its_ids_stale(made, tmp_path):
    """The load checks that every saved chunk got its ticket back; where one did not (here
    the tickets were moved by one, so a full chunk meets the short last chunk of a capacity
    that is not a multiple of the chunk size), the saved ids name no step, never a wrong one."""
    src = shmbuf.create(SPEC, 500, chunk_size=CHUNK, priorities=True, seed=3)
    made.append(src)
    fill(src, 2000)
    batch = src.sample_sequences(16, 4, ids=True, time_major=False, rng=5)
    src.save(tmp_path / "s")
    tickets = np.load(tmp_path / "s" / "_tickets.npy")
    np.save(tmp_path / "s" / "_tickets.npy", tickets + 1)
    loaded = shmbuf.load(tmp_path / "s")
    made.append(loaded)
    assert len(loaded) == len(src)
    assert (keys_of(loaded, batch["ids"]) == -1).all()
    assert np.isnan(loaded.priorities_of(batch["ids"])).all()


def test_a_load_reserves_every_chunks_rows_before_its_first_step(made, tmp_path, monkeypatch):
    """A placed load takes some tickets unclaimed (before the first saved chunk, and where a
    claim held no step at the save); a chunk claimed first in a later lap must still have its
    rows reserved before anything is written there, or a full /dev/shm is SIGBUS."""
    from shmbuf.posix.space import Space

    src = new(made)
    fill(src, 2000)
    idle = src.writer()
    idle._claim_next(frozenset())   # a claimed chunk with no step: not saved, a gap
    fill(src, 40, start=2000)
    idle.close()
    src.save(tmp_path / "s")
    reserved = []
    reserve = Space.reserve

    def spy_reserve(self, offset, length, what):
        reserved.append((offset, offset + length))
        return reserve(self, offset, length, what)

    monkeypatch.setattr(Space, "reserve", spy_reserve)
    loaded = shmbuf.load(tmp_path / "s")
    made.append(loaded)
    assert loaded._ring.counter("ticket") >= loaded._layout.n_chunks   # a later lap
    loaded.restore(loaded.snapshot())   # empties every claimed chunk, not the unclaimed
    fill(loaded, 3 * CAPACITY)           # every chunk is claimed again
    key = loaded._layout.column("key")
    for chunk in range(loaded._layout.n_chunks):
        lo = key.offset + chunk * CHUNK * key.row_bytes
        hi = lo + CHUNK * key.row_bytes
        assert any(a <= lo and b >= hi for a, b in reserved), chunk


def test_an_embodied_replay_refuses_another_replays_stepid():
    from shmbuf.compat.embodied import Prioritized, Replay

    reps = [Replay(4, 100, selector=Prioritized(seed=i)) for i in range(2)]
    try:
        for r in reps:
            for t in range(12):
                r.add({"step": np.int64(t), "is_first": t == 0})
        theirs, mine = reps[0].sample(2), reps[1].sample(2)
        with pytest.raises(ForeignStepIdsError, match=r"stepid\[0, 0\] was not sampled from "
                                                      "replay"):
            reps[1].update({"stepid": theirs["stepid"], "priority": np.ones((2, 4))})
        reps[1].update({"stepid": mine["stepid"], "priority": np.ones((2, 4))})
    finally:
        for r in reps:
            r.close()


def test_ids_written_into_records_carry_the_tag_and_leave_the_rest_alone(made):
    # The embodied facade has the store write each id into the first 8 bytes of a
    # 20-byte record: the same ids sample_sequences returns, the other bytes untouched.
    buf = new(made)
    fill(buf, 40)
    w = buf.port.locate(np.arange(0, 60, 7), 4)
    ids = buf.port.step_ids(w.rows)
    assert (ids >> 47 == buf.port.id_tag).all()
    records = np.full(w.rows.shape + (20,), 0xAB, np.uint8)
    assert buf.port.step_ids(w.rows, out=records) is records
    assert (records[..., :8].copy().view(np.int64)[..., 0] == ids).all()
    assert (records[..., 8:] == 0xAB).all()
    # An out whose size is no whole number of >= 8-byte records per row is refused, and
    # nothing is written; so is a bad row.
    for bad in (np.zeros(w.rows.size * 8 - 1, np.uint8), np.zeros(w.rows.size * 4, np.uint8)):
        with pytest.raises(ValueError, match="8 or more bytes per row"):
            buf.port.step_ids(w.rows, out=bad)
        assert not bad.any()
    rows = w.rows.copy()
    rows[-1, -1] = CAPACITY
    records[...] = 0
    with pytest.raises(ValueError, match="row out of range"):
        buf.port.step_ids(rows, out=records)
    assert not records.any()   # every row is checked before any id is written


def test_ids_that_outgrow_their_bits_raise_instead_of_wrapping(made):
    # A loaded buffer's ids continue the saved one's (base); once ticket * chunk_size
    # passes 47 bits, an id would run into the tag: sampling ids says so instead.
    base = (1 << 47) // CHUNK - 2   # two chunks of room
    buf = new(made, _step_ids={"tag": 77, "base": base, "accept": []})
    fill(buf, 8, writers=1)
    assert (buf.sample_sequences(4, 2, ids=True)["ids"] >> 47 == 77).all()
    fill(buf, 3 * CHUNK, writers=1, start=8)   # claims its third chunk
    with pytest.raises(OverflowError, match="outgrown 47 bits"):
        for _ in range(200):   # until a window in the third chunk is drawn
            buf.sample_sequences(8, 2, ids=True)
