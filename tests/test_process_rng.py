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


def _fork_draw(r, out):
    import os

    out.put((os.getpid(), int(r.get().integers(1 << 60))))


def test_fork_is_detected_by_pid():
    # A real fork: the child's generator is its own pid's stream, not a copy of the
    # parent's (the pid is kept by a fork hook, never asked of the kernel per draw).
    import os

    r = ProcessRandom(7, owner_pid=1, name="test-fork-detection")
    first = r.get()
    assert r.get() is first
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=_fork_draw, args=(r, out))]
    with running(procs):
        pid, drawn = out.get(timeout=60)
        join_all(procs)
    assert pid != os.getpid()
    assert drawn == np.random.default_rng(stream_seed(7, (CHILD, pid))).integers(1 << 60)
    assert r.get() is first   # the parent's stream is untouched


@pytest.mark.parametrize("bad", [-1, 1.5, "3", True])
def test_bad_seeds_are_refused(bad):
    with pytest.raises((TypeError, ValueError), match="seed"):
        ProcessRandom(bad)


def test_a_pickled_buffer_keeps_its_seed(make_buffer):
    import pickle

    buf = make_buffer(COUNTER_SPEC, 100, seed=9)
    with pickle.loads(pickle.dumps(buf)) as again:
        assert again._random.seed == 9


# -- data-parallel ranks --------------------------------------------------------------------
def test_a_rank_is_mixed_into_every_seeded_place(monkeypatch):
    import os

    from shmbuf.sampling.rng import RANK, WORKER, current_place

    monkeypatch.setenv("RANK", "3")
    owner = ProcessRandom(7, owner_pid=os.getpid(), name="test-rank")
    assert owner.get().integers(1 << 60) == np.random.default_rng(
        stream_seed(7, (RANK, 3))).integers(1 << 60)
    child = ProcessRandom(7, owner_pid=1, name="test-rank")
    assert child.get().integers(1 << 60) == np.random.default_rng(
        stream_seed(7, (RANK, 3, CHILD, os.getpid()))).integers(1 << 60)
    assert current_place(1, 3)[:3] == (RANK, 3, CHILD)
    assert WORKER not in current_place(os.getpid(), 3)
    # Rank 0 keeps the stream a process without a rank draws.
    monkeypatch.setenv("RANK", "0")
    zero = ProcessRandom(7, owner_pid=os.getpid(), name="test-rank")
    assert zero.get().integers(1 << 60) == np.random.default_rng(7).integers(1 << 60)


def test_a_pickled_stream_carries_its_rank(monkeypatch):
    import os
    import pickle

    from shmbuf.sampling.rng import RANK

    monkeypatch.setenv("RANK", "2")
    sent = pickle.dumps(ProcessRandom(7, owner_pid=1, name="test-rank-pickle"))
    monkeypatch.delenv("RANK")   # a receiver without a rank of its own (a spawned worker)
    got = pickle.loads(sent).get()
    assert got.integers(1 << 60) == np.random.default_rng(
        stream_seed(7, (RANK, 2, CHILD, os.getpid()))).integers(1 << 60)


def test_rank_is_read_once_per_process_by_each_stream(monkeypatch):
    import os

    from shmbuf.sampling.rng import RANK

    # A launcher sets RANK before the process starts; a stream that drew already keeps
    # its rank (and its place in its stream) if the variable changes later, and a new
    # stream reads it anew.
    monkeypatch.setenv("RANK", "2")
    kept = ProcessRandom(7, owner_pid=os.getpid(), name="test-rank-once")
    first = kept.get().integers(1 << 60, size=2)
    assert first[0] == np.random.default_rng(stream_seed(7, (RANK, 2))).integers(1 << 60)
    monkeypatch.setenv("RANK", "5")
    assert kept.get().integers(1 << 60) == np.random.default_rng(
        stream_seed(7, (RANK, 2))).integers(1 << 60, size=3)[2]
    fresh = ProcessRandom(7, owner_pid=os.getpid(), name="test-rank-once")
    assert fresh.get().integers(1 << 60) == np.random.default_rng(
        stream_seed(7, (RANK, 5))).integers(1 << 60)


@pytest.mark.parametrize("bad", ["x", "-1", "1.5"])
def test_a_bad_rank_variable_is_named(monkeypatch, bad):
    monkeypatch.setenv("RANK", bad)
    with pytest.raises(ValueError, match=f"environment variable RANK is '{bad}'"):
        ProcessRandom(7, owner_pid=1, name="test-bad-rank").get()
    ProcessRandom(None).get()   # an unseeded stream has no use for the rank


def _job(how: str, name: str) -> dict:
    """Run the two ranks of one job (helpers.rank_workers); ``{rank: their draws}``."""
    import socket

    from helpers.rank_workers import rank_draws

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=rank_draws, args=(rank, how, port, name, results))
             for rank in range(2)]
    try:
        for p in procs:
            p.start()
        got = dict(results.get(timeout=4 * TIMEOUT) for _ in procs)
        for p in procs:
            p.join(TIMEOUT)
        assert [p.exitcode for p in procs] == [0, 0]
        return got
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(TIMEOUT)


@pytest.mark.slow
def test_data_parallel_ranks_draw_their_own_batches_and_reruns_repeat_them(make_buffer):
    pytest.importorskip("torch")
    buf = make_buffer(COUNTER_SPEC, 4000)
    fill_counter(buf, 4000)
    group = _job("group", buf.name)   # a real gloo group on 127.0.0.1, RANK unset
    env = _job("env", buf.name)       # RANK only, as a launcher sets it
    for draws in (group, env):
        for kind in ("loader_fork", "loader_spawn", "sample_sequences", "prefetch"):
            assert draws[0][kind] != draws[1][kind], kind
    # Both ways of naming the rank give each rank the same stream: a rerun repeats it.
    assert group == env


def test_the_rank_variable_is_read_without_importing_torch():
    import os
    import subprocess
    import sys

    code = ("import sys, numpy as np, shmbuf\n"
            "from shmbuf.sampling.rng import RANK, stream_seed\n"
            "with shmbuf.create({'x': ((), np.int64)}, 64, done_key=None, seed=7,\n"
            "                   handle_signals=False) as buf:\n"
            "    w = buf.writer()\n"
            "    for i in range(64): w.add(x=i)\n"
            "    w.close()\n"
            "    got = buf.sample_steps(16)['x']\n"
            "    rng = np.random.default_rng(stream_seed(7, (RANK, 5)))\n"
            "    want = buf.sample_steps(16, rng=rng)\n"
            "assert got.tolist() == want['x'].tolist(), (got, want)\n"
            "assert 'torch' not in sys.modules\n")
    run = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, RANK="5"),
                         capture_output=True, timeout=TIMEOUT, check=False)
    assert run.returncode == 0, run.stderr.decode()[-2000:]
