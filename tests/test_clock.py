"""The step clock: every published step gets the next number of one buffer-wide count.

Rows record their number in the internal ``_t`` column; ``Ring.clock()`` is the
count.  Recency sampling and the rate limiter read it, so it must number every
step exactly once, in each stream's order, whichever write path made the step.
"""
import multiprocessing

import numpy as np
import pytest
from helpers.procs import join_all, running
from helpers.workers import SPEC, write_steps

import shmbuf

TIMEOUT = 60


def _numbers(buf):
    """(clock, the _t numbers of every committed row, per-stream order kept)."""
    ring = buf._ring
    rows = buf.committed_rows()
    return ring.clock(), ring.clock_rows[rows]


def _step(i, done=False):
    return {"obs": np.full((3, 8, 8), i % 251, np.uint8), "action": np.zeros(6, np.float32),
            "reward": np.float32(i), "done": done}


@pytest.mark.parametrize("path", ["add C", "add Python", "add_batch C", "add_batch Python",
                                  "extend"])
def test_every_step_gets_the_next_number_in_its_streams_order(make_buffer, path):
    buf = make_buffer(SPEC, capacity=1000, chunk_size=16)
    assert buf._ring.clock() == 0
    with buf.writer() as w:
        if path.startswith("add "):
            for i in range(100):
                step = _step(i, i % 9 == 8)
                if path.endswith("Python"):
                    step["reward"] = i          # a Python int: cast, so the Python path
                w.add(**step)
        elif path.startswith("add_batch"):
            for i in range(40):
                reward = np.full(3, i, np.float32 if path.endswith("C") else np.float64)
                w.add_batch(obs=np.full((3, 3, 8, 8), i, np.uint8),
                            action=np.zeros((3, 6), np.float32), reward=reward,
                            done=np.array([False, i % 7 == 6, False]))
        else:
            for start, n in ((0, 37), (37, 37), (74, 50)):
                w.extend(obs=np.zeros((n, 3, 8, 8), np.uint8), action=np.zeros((n, 6), np.float32),
                         reward=np.arange(start, start + n, dtype=np.float32),
                         done=np.arange(n) % 11 == 10)
    clock, numbers = _numbers(buf)
    assert clock == len(buf) == len(numbers)
    assert sorted(numbers.tolist()) == list(range(clock))     # each number exactly once
    # Within a stream the numbers follow the stream: reward encodes the position.
    rows = buf.committed_rows()
    reward = buf.arrays["reward"][rows]
    if not path.startswith("add_batch"):
        assert (numbers[np.argsort(reward, kind="stable")] == np.arange(clock)).all()


def test_numbers_are_unique_across_writer_processes(make_buffer):
    buf = make_buffer(SPEC, capacity=20_000, chunk_size=32)
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=write_steps, args=(buf, i, 3000)) for i in range(3)]
    with running(procs):
        join_all(procs, TIMEOUT)
    clock, numbers = _numbers(buf)
    assert clock == 9000 == len(numbers)
    assert len(np.unique(numbers)) == 9000 and numbers.min() == 0 and numbers.max() == 8999
    # Each writer's own steps carry increasing numbers (action[0] is the writer, [3] its position).
    action = buf.arrays["action"][buf.committed_rows()]
    for writer in range(3):
        mine = action[:, 0] == writer
        order = np.argsort(action[mine, 3])
        assert (np.diff(numbers[mine][order]) > 0).all()


def test_the_clock_counts_evicted_steps_too(make_buffer):
    buf = make_buffer(SPEC, capacity=64, chunk_size=8)
    with buf.writer() as w:
        for i in range(500):
            w.add(**_step(i))
    clock, numbers = _numbers(buf)
    assert clock == 500
    assert numbers.max() == 499 and len(numbers) == len(buf) < 500
    other = shmbuf.attach(buf.name)
    try:
        assert other._ring.clock() == 500
    finally:
        other.close()
