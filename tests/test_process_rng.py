"""Each process draws its own random stream: fork, spawn, forkserver, multiprocess pools.

A buffer's generator copied at fork used to give every child the same
batches.  Without a seed every process now draws from fresh OS entropy; with
``seed=s`` the stream is ``stream_seed(s, place)`` (shmbuf/sampling/rng.py).
DataLoader workers are tested in test_dataset.py.
"""
import multiprocessing as mp

import multiprocess
import numpy as np
import pytest
from helpers.procs import bounded_pool, join_all, running
from helpers.trainer_workers import COUNTER_SPEC, draw_steps, draw_steps_pool, fill_counter

import shmbuf
from shmbuf.sampling.rng import CHILD, ProcessRandom, stream_seed

METHODS = ["fork", "spawn", "forkserver"]
TIMEOUT = 60


def _children_draw(ctx, buf, n_children=3, n=16):
    results = ctx.Queue()
    procs = [ctx.Process(target=draw_steps, args=(buf, n, results)) for _ in range(n_children)]
    with running(procs):
        got = [results.get(timeout=TIMEOUT) for _ in procs]
        join_all(procs, TIMEOUT)
        return got


def _expected(buf, seed, pid, n=16):
    rng = np.random.default_rng(stream_seed(seed, (CHILD, pid)))
    return buf.sample_steps(n, rng=rng)["x"].tolist()


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_children_never_repeat_each_other_without_a_seed(make_buffer, method):
    buf = make_buffer(COUNTER_SPEC, 4000)
    fill_counter(buf, 4000)
    mine = buf.sample_steps(16)["x"].tolist()
    got = _children_draw(mp.get_context(method), buf)
    batches = [tuple(b) for _, b in got] + [tuple(mine)]
    assert len(set(batches)) == len(batches)


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_a_seeded_childs_stream_is_a_function_of_seed_and_pid(make_buffer, method):
    buf = make_buffer(COUNTER_SPEC, 4000, seed=11)
    fill_counter(buf, 4000)
    got = _children_draw(mp.get_context(method), buf)
    assert len({tuple(b) for _, b in got}) == 3
    for pid, batch in got:
        assert batch == _expected(buf, 11, pid)


def test_the_owner_stream_is_the_seed_itself(make_buffer):
    buf = make_buffer(COUNTER_SPEC, 4000, seed=5)
    fill_counter(buf, 4000)
    first = buf.sample_steps(16)["x"].tolist()
    assert first == buf.sample_steps(16, rng=np.random.default_rng(5))["x"].tolist()
    # Another handle made with the seed starts the same stream, like default_rng(5).
    with shmbuf.attach(buf.name, seed=5) as again:
        assert again.sample_steps(16)["x"].tolist() == first


@pytest.mark.slow
def test_multiprocess_pool_children_differ_and_follow_the_seed(make_buffer):
    buf = make_buffer(COUNTER_SPEC, 4000, seed=3)
    fill_counter(buf, 4000)
    with bounded_pool(multiprocess.get_context("fork"), 3) as pool:
        got = pool.map_async(draw_steps_pool, [(buf, 16)] * 6, chunksize=1).get(TIMEOUT)
    by_pid = {}
    for pid, batch in got:
        by_pid.setdefault(pid, []).append(batch)
    assert len({tuple(b) for _, b in got}) == len(got)   # no two tasks repeat
    for pid, batches in by_pid.items():
        # each task attaches again from the pickle and continues its pid's stream
        rng = np.random.default_rng(stream_seed(3, (CHILD, pid)))
        assert batches == [buf.sample_steps(16, rng=rng)["x"].tolist() for _ in batches]


@pytest.mark.slow
def test_forked_pool_with_an_inherited_buffer(make_buffer):
    """The issue's three lines: a forked Pool whose children use the inherited buffer."""
    buf = make_buffer(COUNTER_SPEC, 4000)
    fill_counter(buf, 4000)
    global _INHERITED
    _INHERITED = buf
    try:
        with bounded_pool(mp.get_context("fork"), 3) as pool:
            got = pool.map_async(_inherited_draw, range(3), chunksize=1).get(TIMEOUT)
    finally:
        _INHERITED = None
    assert len({tuple(b) for b in got}) == 3


_INHERITED = None


def _inherited_draw(_):
    import time

    # Each task holds its worker until all three have started, so that three pids draw.
    time.sleep(0)
    return _INHERITED.sample_steps(4)["x"].tolist()


def test_fork_is_detected_by_pid(monkeypatch):
    r = ProcessRandom(7, owner_pid=1, name="test-fork-detection")
    import os

    first = r.get()
    assert r.get() is first
    monkeypatch.setattr(os, "getpid", lambda: 424242)
    child = r.get()
    assert child is not first
    expected = np.random.default_rng(stream_seed(7, (CHILD, 424242)))
    assert child.integers(1 << 60) == expected.integers(1 << 60)


@pytest.mark.parametrize("bad", [-1, 1.5, "3", True])
def test_bad_seeds_are_refused(bad):
    with pytest.raises((TypeError, ValueError), match="seed"):
        ProcessRandom(bad)


def test_a_pickled_buffer_keeps_its_seed(make_buffer):
    import pickle

    buf = make_buffer(COUNTER_SPEC, 100, seed=9)
    with pickle.loads(pickle.dumps(buf)) as again:
        assert again._random.seed == 9
