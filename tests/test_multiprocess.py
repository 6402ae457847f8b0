"""Writers in real processes, a trainer sampling meanwhile, every window verified.

The buffers are small so that chunks are recycled all the time while the
parent samples; each sampled window goes through ``verify_batch``, which
catches any torn, spliced, misplaced or cross-episode step.
"""
import multiprocessing
import os
import subprocess
import sys
import time

import multiprocess
import numpy as np
import pytest
from helpers.procs import join_all, reap, running
from helpers.workers import (
    SPEC,
    add_with_inherited_writer,
    episode_steps,
    verify_batch,
    write_batches_until,
    write_steps,
    write_until,
)

import shmbuf

pytestmark = pytest.mark.slow

TIMEOUT = 60
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


class Children:
    """Worker processes sharing a ``stop`` event and a ``ready`` semaphore.

    On exit every child still running is killed at once (``stop_and_join`` is the
    orderly end) and every child is reaped.  The event and semaphore are named POSIX
    semaphores under spawn and forkserver, unlinked when garbage collected; dropping
    every reference on exit keeps a failing test's traceback from holding them past
    teardown.
    """

    def __init__(self, ctx, jobs):
        self.stop, self.ready = ctx.Event(), ctx.Semaphore(0)
        self.procs = [ctx.Process(target=target, args=args,
                                  kwargs=dict(kwargs, stop=self.stop, ready=self.ready))
                      for target, args, kwargs in jobs]

    def __enter__(self):
        try:
            for p in self.procs:
                p.start()
        except BaseException:
            self.__exit__()
            raise
        return self

    def wait_ready(self) -> None:
        """Wait until every child has written its first steps; fail fast if one died."""
        deadline = time.monotonic() + TIMEOUT
        pending = len(self.procs)
        while pending:
            if self.ready.acquire(timeout=0.1):
                pending -= 1
                continue
            dead = [p.exitcode for p in self.procs if p.exitcode not in (None, 0)]
            assert not dead, f"a writer exited before it was ready: exit codes {dead}"
            assert time.monotonic() < deadline, "a writer never reported progress"

    def stop_and_join(self) -> None:
        self.stop.set()
        join_all(self.procs, TIMEOUT)

    def __exit__(self, *exc):
        try:
            reap(self.procs)
        finally:
            self.procs, self.stop, self.ready = [], None, None


def sample_and_verify(buf, rounds: int, batch_size: int, lengths, seed: int, select=None):
    """Sample ``rounds`` batches, verify every window; return (windows, stream ids seen)."""
    rng = np.random.default_rng(seed)
    verified, seen = 0, set()
    for i in range(rounds):
        length = lengths[i % len(lengths)]
        time_major = bool(i % 2)
        batch = buf.sample_sequences(batch_size, length, time_major=time_major, rng=rng,
                                     select=select)
        verified += verify_batch(batch, time_major=time_major)
        seen.update(np.unique(batch["action"][..., 0]).astype(int).tolist())
    return verified, seen


def run_writers_while_sampling(ctx, buf, n_writers=3, rounds=150, select=None):
    ids = list(range(1, n_writers + 1))
    # Episodes of 43+ steps: whichever writer the scheduler favours, the buffer
    # always holds a whole episode of someone, so a window of 20 always exists.
    jobs = [(write_until, (buf, i), dict(max_steps=200_000, episode_len=37 + 6 * i))
            for i in ids]
    with Children(ctx, jobs) as children:
        children.wait_ready()
        verified, seen = sample_and_verify(buf, rounds, 32, (8, 13, 20), seed=n_writers,
                                           select=select)
        children.stop_and_join()
    verified += sample_and_verify(buf, 10, 64, (8, 20), seed=0, select=select)[0]
    assert verified > 0
    assert seen <= set(ids)
    stats = buf.stats()
    assert stats.streams == n_writers and stats.writers == 0
    assert stats.steps_written > buf.capacity, "the buffer should have been recycled"


@pytest.mark.parametrize("method", ["spawn", "fork", "forkserver"])
def test_writers_and_sampler_concurrently(make_buffer, method):
    buf = make_buffer(SPEC, 600, chunk_size=4)
    run_writers_while_sampling(multiprocessing.get_context(method), buf)


def test_writers_and_selectors_concurrently(make_buffer):
    """Recency, AgeBuckets and a Mixture keep every window intact while writers recycle."""
    from shmbuf.select import AgeBuckets, Mixture, Recency, Uniform

    buf = make_buffer(SPEC, 3000, chunk_size=64)
    mix = Mixture([(0.4, Recency(1.0)), (0.3, AgeBuckets([1, 1, 2, 4])), (0.3, Uniform())])
    run_writers_while_sampling(multiprocessing.get_context("spawn"), buf, rounds=100,
                               select=mix)


def test_writers_and_sampler_with_multiprocess_package(make_buffer):
    buf = make_buffer(SPEC, 600, chunk_size=4)
    run_writers_while_sampling(multiprocess.get_context("spawn"), buf)


def test_add_batch_from_two_spawned_processes(make_buffer):
    buf = make_buffer(SPEC, 1200, chunk_size=4)
    # Each env row is its own stream, encoded with its own writer id.
    jobs = [(write_batches_until, (buf, first, 8), dict(max_calls=20_000)) for first in (1, 101)]
    with Children(multiprocessing.get_context("spawn"), jobs) as children:
        children.wait_ready()
        verified, seen = sample_and_verify(buf, 120, 32, (6, 12), seed=1)
        children.stop_and_join()
    assert verified > 0
    assert seen <= set(range(1, 9)) | set(range(101, 109))
    assert buf.stats().streams == 16


def test_forked_child_gets_new_streams_from_inherited_writer(make_buffer):
    ctx = multiprocessing.get_context("fork")
    buf = make_buffer(SPEC, 512, chunk_size=8)
    parent_steps = list(episode_steps(1, 150, 10))
    with buf.writer() as w:
        for step in parent_steps[:13]:          # stop in the middle of a chunk
            w.add(**step)
        assert buf.stats().streams == 1
        child = ctx.Process(target=add_with_inherited_writer, args=(w, 2, 150, 9))
        with running([child]):
            join_all([child], TIMEOUT)
        assert buf.stats().streams == 2, "the child must have opened a stream of its own"
        for step in parent_steps[13:]:
            w.add(**step)
    stats = buf.stats()
    assert stats.streams == 2 and stats.live_steps == 300 and stats.steps_written == 300
    verified, seen = sample_and_verify(buf, 40, 64, (5, 9), seed=2)
    assert verified > 0 and seen == {1, 2}


def test_python_c_subprocess_attaches_and_writes(make_buffer):
    buf = make_buffer(SPEC, 2000, chunk_size=16)
    code = ("import sys, shmbuf; from helpers.workers import write_steps; "
            "buf = shmbuf.attach(sys.argv[1]); write_steps(buf, 7, 500, 23); buf.close()")
    path = [TESTS_DIR] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    done = subprocess.run([sys.executable, "-c", code, buf.name], env=env,
                          capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr
    stats = buf.stats()
    assert stats.steps_written == 500 and stats.live_steps == 500 and stats.writers == 0
    verified, seen = sample_and_verify(buf, 20, 64, (1, 10, 23), seed=3)
    assert verified > 0 and seen == {7}


def test_wait_ready_returns_once_spawned_writers_wrote_enough(make_buffer):
    ctx = multiprocessing.get_context("spawn")
    buf = make_buffer(SPEC, 1000, chunk_size=8)
    with pytest.raises(shmbuf.WaitTimeoutError):
        buf.wait_ready(min_steps=1, timeout=0.01)
    procs = [ctx.Process(target=write_steps, args=(buf, i, 400)) for i in (1, 2)]
    with running(procs):
        assert buf.wait_ready(min_steps=300, timeout=TIMEOUT) >= 300
        join_all(procs, TIMEOUT)
    assert buf.wait_ready(min_steps=800, timeout=0) == 800
    verified, _ = sample_and_verify(buf, 10, 32, (10,), seed=4)
    assert verified == 320


def test_stats_stay_consistent_while_writers_recycle(make_buffer):
    # A tiny buffer recycles a chunk every couple of steps, so any read order
    # of the counters that lets ``evicted`` overtake ``written`` shows up here.
    buf = make_buffer(SPEC, 64, chunk_size=2)
    jobs = [(write_until, (buf, i), dict(max_steps=2_000_000, episode_len=9)) for i in (1, 2)]
    with Children(multiprocessing.get_context("spawn"), jobs) as children:
        children.wait_ready()
        bad = []
        for _ in range(20_000):
            s = buf.stats()
            if not (0 < s.live_steps <= s.capacity and s.oldest_step <= s.newest_step + 1
                    and s.steps_written >= s.live_steps):
                bad.append(s)
        children.stop_and_join()
    assert not bad, f"{len(bad)} inconsistent snapshots, first {bad[0]}"
