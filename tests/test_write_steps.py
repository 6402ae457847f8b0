"""``Buffer.write_steps``: values written back into sampled steps by id; serial blocks."""
import numpy as np
import pytest
from helpers.procs import join_all, running

import shmbuf

SPEC = {"step": ((), np.int64), "ctx": ((3,), np.float32)}


def fill(buf, n: int, start: int = 0) -> None:
    with buf.writer() as w:
        for t in range(start, start + n):
            w.add(step=t, ctx=np.zeros(3, np.float32))


def ctx_of(buf) -> dict:
    """{step: ctx row} of every held step."""
    rows = buf.committed_rows()
    arrays = buf.arrays
    return {int(s): arrays["ctx"][r].copy() for s, r in zip(arrays["step"][rows], rows)}


def test_writes_the_named_steps_only(make_buffer):
    buf = make_buffer(SPEC, 64, chunk_size=8, done_key=None, priorities=True)
    fill(buf, 40)
    batch = buf.sample_sequences(4, 5, ids=True, time_major=False, rng=0)
    values = np.arange(4 * 5 * 3, dtype=np.float32).reshape(4, 5, 3) + 1
    assert buf.write_steps(batch["ids"], ctx=values) == 20
    held = ctx_of(buf)
    named = {}
    for b in range(4):
        for t in range(5):
            named[int(batch["step"][b, t])] = values[b, t]
    for step, row in held.items():
        want = named.get(step, np.zeros(3, np.float32))
        assert (row == want).all(), step


def test_evicted_ids_are_skipped(make_buffer):
    buf = make_buffer(SPEC, 32, chunk_size=8, done_key=None, priorities=True)
    fill(buf, 16)
    old = buf.sample_sequences(8, 4, ids=True, time_major=False, rng=1)
    fill(buf, 64, start=16)   # every chunk recycled: the old ids name nothing now
    assert buf.write_steps(old["ids"], ctx=np.ones((8, 4, 3), np.float32)) == 0
    assert all((row == 0).all() for row in ctx_of(buf).values())


@pytest.mark.parametrize("kwargs,exc,match", [
    ({"ctx": np.ones((2, 3, 3))}, ValueError, "shape"),
    ({"nope": np.ones((2, 2))}, KeyError, "'nope'"),
    ({"ctx": np.full((2, 2, 3), 0.5), "step": np.full((2, 2), 0.5)}, TypeError, "step"),
    ({}, ValueError, "at least one"),
])
def test_bad_values_write_nothing(make_buffer, kwargs, exc, match):
    buf = make_buffer(SPEC, 64, chunk_size=8, done_key=None, priorities=True)
    fill(buf, 20)
    ids = buf.sample_sequences(2, 2, ids=True, time_major=False, rng=2)["ids"]
    with pytest.raises(exc, match=match):
        buf.write_steps(ids, **kwargs)
    assert all((row == 0).all() for row in ctx_of(buf).values())
    assert sorted(ctx_of(buf)) == list(range(20))


def test_bad_ids(make_buffer):
    buf = make_buffer(SPEC, 64, chunk_size=8, done_key=None, priorities=True)
    fill(buf, 20)
    with pytest.raises(TypeError, match="int64"):
        buf.write_steps(np.zeros((2,), np.int32), ctx=np.ones((2, 3)))
    with pytest.raises(ValueError, match=r"ids\[1\] is -3"):
        buf.write_steps(np.array([0, -3]), ctx=np.ones((2, 3)))
    plain = make_buffer(SPEC, 64, chunk_size=8, done_key=None)
    with pytest.raises(ValueError, match="priorities=True"):
        plain.write_steps(np.zeros(1, np.int64), ctx=np.ones((1, 3)))


def test_serial_blocks(make_buffer):
    buf = make_buffer(SPEC, 64, done_key=None)
    assert buf.serial_count() == 0
    assert buf.next_serial() == 0
    assert buf.next_serial(5) == 1
    assert buf.next_serial() == 6
    assert buf.serial_count() == 7
    with pytest.raises(ValueError, match="count"):
        buf.next_serial(0)


# -- pins: a written value never lands in a later step ----------------------------------
def test_a_pinned_chunk_is_left_to_its_pinner(make_buffer):
    """A writer that reaches a chunk write_steps has pinned takes the next one instead."""
    buf = make_buffer(SPEC, 32, chunk_size=8, done_key=None, priorities=True)
    fill(buf, 32)
    with buf._ring.pins.pinned(np.array([0])):
        fill(buf, 8, start=32)
        held = set(ctx_of(buf))
        assert set(range(8)) <= held and not held & set(range(8, 16))
    fill(buf, 24, start=40)     # unpinned: chunk 0 goes when its ticket comes round
    assert not set(ctx_of(buf)) & set(range(8))


@pytest.mark.slow
def test_a_dead_pinners_pin_holds_nothing(make_buffer):
    import multiprocessing as mp

    from helpers import pin_workers
    buf = make_buffer(SPEC, 32, chunk_size=8, done_key=None, priorities=True)
    fill(buf, 32)
    ctx = mp.get_context("spawn")
    pinned = ctx.Event()
    p = ctx.Process(target=pin_workers.die_pinning, args=(buf.name, 0, pinned))
    with running([p]):
        assert pinned.wait(60)
        join_all([p], 60, expect=-9)
    ids = buf.sample_sequences(4, 4, ids=True, time_major=False, rng=3)
    assert buf.write_steps(ids["ids"], ctx=np.ones((4, 4, 3), np.float32)) == 16  # no wait
    fill(buf, 8, start=32)      # the dead pin does not keep chunk 0
    assert not set(ctx_of(buf)) & set(range(8))


@pytest.mark.slow
def test_values_written_back_never_land_in_later_steps(make_buffer):
    """A writer wraps a 4-chunk ring flat out while the learner writes back the sampled
    steps' own numbers: every row must hold -1 (its writer's) or its own step number, and
    the writer must never fail to find a chunk while pins come and go.  (A soak: the race
    the pins close is too narrow to hit on demand; the test above is what fails when a
    recycler ignores a pin.)"""
    import multiprocessing as mp

    from helpers import pin_workers
    buf = make_buffer(SPEC, 64, chunk_size=16, done_key=None, priorities=True)
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    p = ctx.Process(target=pin_workers.wrap_until_stopped, args=(buf.name, ready))
    written = 0
    with running([p]):
        assert ready.wait(60)
        for r in range(3000):
            try:
                batch = buf.sample_sequences(4, 4, ids=True, time_major=False, rng=r)
            except shmbuf.SampleRetryError:
                continue
            steps = batch["step"].astype(np.float32)
            written += buf.write_steps(batch["ids"], ctx=np.repeat(steps[..., None], 3, -1))
        buf.stop_writers()
        join_all([p], 60)
    assert written > 0
    for step, row in ctx_of(buf).items():
        assert (row == -1).all() or (row == step).all(), (step, row)
