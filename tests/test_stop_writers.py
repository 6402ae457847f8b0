"""Buffer.stop_writers: every writer, in every process and whatever it is waiting for, ends
with WritersStoppedError, and so does every later write, until resume_writers."""
import multiprocessing as mp

import numpy as np
import pytest
from helpers.procs import bounded_pool, reap
from helpers.stopped_writers import SPEC, write_one, write_until_stopped

import shmbuf
from shmbuf.posix.wait import poll

TIMEOUT = 60


@pytest.mark.slow
def test_writers_waiting_on_the_rate_limit_in_other_processes_stop():
    # Nobody samples, so after min_steps every writer waits for budget (300 s timeout).
    limit = shmbuf.RateLimit(1.0, min_steps=64, writer_timeout=300.0)
    ctx = mp.get_context("spawn")
    with shmbuf.create(SPEC, 4096, rate_limit=limit) as buf:
        reports = ctx.Queue()
        procs = [ctx.Process(target=write_until_stopped, args=(buf, how, reports))
                 for how in ("add", "add_batch", "extend")]
        try:
            for p in procs:
                p.start()
            buf.wait_ready(64, timeout=TIMEOUT)
            # Each writer is waiting (or about to): its slot is held and no insert fits.
            def full():
                s = buf.stats()
                r = s.rate
                return True if s.writers == 3 and r.lag - r.train_ratio < -r.tolerance else None

            poll(full, TIMEOUT, lambda: AssertionError("the writers never had to wait"))
            buf.stop_writers()
            got = sorted(reports.get(timeout=TIMEOUT) for _ in procs)
        finally:
            buf.stop_writers()   # on a failure too: nothing is left waiting 300 s
            reap(procs, TIMEOUT)
        assert [(how, err) for how, err, _, _ in got] == [
            ("add", "WritersStoppedError"), ("add_batch", "WritersStoppedError"),
            ("extend", "WritersStoppedError")], got
        assert all(p.exitcode == 0 for p in procs)
        assert buf.stats().writers_stopped


def test_every_later_write_raises_until_resume(make_buffer):
    buf = make_buffer(SPEC, 256)
    w = buf.writer()
    w.add(x=0, done=False)
    buf.stop_writers()
    buf.stop_writers()          # idempotent
    for write in (lambda: w.add(x=1, done=False),
                  lambda: w.add_batch(x=np.arange(2), done=np.zeros(2, bool)),
                  lambda: w.extend(x=np.arange(3), done=np.zeros(3, bool)),
                  lambda: w.end_episode(),
                  lambda: buf.writer().add(x=1, done=False)):
        with pytest.raises(shmbuf.WritersStoppedError, match="stop_writers") as info:
            write()
        assert isinstance(info.value, RuntimeError) and buf.name in str(info.value)
    assert len(buf) == 1                                   # nothing was written
    assert buf.sample_steps(4)["x"].tolist() == [0] * 4    # samplers go on
    buf.resume_writers()
    assert not buf.stats().writers_stopped
    w.add(x=2, done=True)
    assert len(buf) == 2
    w.close()


@pytest.mark.slow
def test_a_stop_holds_for_processes_that_attach_later(make_buffer):
    buf = make_buffer(SPEC, 256)
    ctx = mp.get_context("spawn")
    buf.stop_writers()
    with bounded_pool(ctx, 1, TIMEOUT) as pool:
        assert pool.apply_async(write_one, (buf,)).get(TIMEOUT) == "WritersStoppedError"
        buf.resume_writers()
        assert pool.apply_async(write_one, (buf,)).get(TIMEOUT) == "ok"
    assert len(buf) == 1


def test_stop_writers_on_a_closed_buffer_says_closed(make_buffer):
    buf = make_buffer(SPEC, 64)
    other = shmbuf.attach(buf.name)
    other.close()
    with pytest.raises(shmbuf.BufferClosedError):
        other.stop_writers()
    with pytest.raises(shmbuf.BufferClosedError):
        other.resume_writers()


def test_a_facades_add_raises_the_same_error():
    from shmbuf.compat.dreamer import ReplayBuffer

    rb = ReplayBuffer(size=64, obs_shape=(3, 4, 4), action_size=2, seq_len=4, batch_size=2)
    try:
        rb.add({"image": np.zeros((3, 4, 4), np.uint8)}, np.zeros(2), 0.0, 0.0)
        rb.buffer.stop_writers()
        with pytest.raises(shmbuf.WritersStoppedError):
            rb.add({"image": np.zeros((3, 4, 4), np.uint8)}, np.zeros(2), 0.0, 0.0)
    finally:
        rb.close()
