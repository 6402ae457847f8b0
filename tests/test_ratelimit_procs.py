"""The rate limiter across processes: one budget, faults, adoption and resumed runs.

Writers and trainers are real programs (``python -c``), stopped by real
SIGKILLs; every wait has a timeout and every child is killed in ``finally``.
"""
import signal

import numpy as np
import pytest
import torch
from helpers.stop_workers import Script

import shmbuf
from shmbuf import RateLimit, WaitTimeoutError
from shmbuf.posix.wait import poll

pytestmark = pytest.mark.slow
SPEC = {"x": ((), np.int64), "done": ((), np.bool_)}
TIMEOUT = 60

WRITER = """
    import numpy as np, shmbuf, sys
    buf = shmbuf.attach({name!r})
    w = buf.writer()
    print("ready", flush=True)
    i = 0
    try:
        while {steps} is None or i < {steps}:
            w.add(x=np.int64(i), done=np.False_)
            i += 1
    except shmbuf.WaitTimeoutError as exc:
        print("timeout", i, exc, flush=True)
        sys.exit(0)
    except shmbuf.BufferClosedError:
        sys.exit(0)
    print("done", i, flush=True)
"""

SAMPLER = """
    import shmbuf
    buf = shmbuf.attach({name!r})
    print("ready", flush=True)
    served = 0
    while True:
        try:
            buf.sample_sequences(4, 2, timeout={timeout})
        except shmbuf.WaitTimeoutError:
            break
        served += 1
    print(served, flush=True)
"""

OWNER = """
    import shmbuf
    from shmbuf import RateLimit
    spec = {"x": ((), "<i8"), "done": ((), "?")}
    buf = shmbuf.create(spec, 4096, rate_limit=RateLimit(4, min_steps=8, writer_timeout=None))
    print(buf.name, flush=True)
    while True:
        buf.sample_steps(8)
"""


def writer(name, steps=None):
    script = Script(WRITER.format(name=name, steps=steps))
    assert script.line() == "ready"
    return script


def stalled(buf, seconds=TIMEOUT):
    """Poll until the writers wait: the next inserted step would pass the band's lower edge."""
    def full():
        s = buf.stats().rate
        return s if s.lag - s.train_ratio < -s.tolerance else None
    return poll(full, seconds, lambda: AssertionError(f"writers never stalled: {buf.stats()}"))


def test_a_sigkilled_waiting_writer_leaves_nothing_stuck(make_buffer):
    buf = make_buffer(SPEC, 4096, rate_limit=RateLimit(4, min_steps=8, writer_timeout=None))
    victim, other = writer(buf.name), writer(buf.name)
    try:
        before = stalled(buf)
        victim.signal(signal.SIGKILL)
        assert victim.wait() == -signal.SIGKILL
        buf.sample_steps(8, timeout=TIMEOUT)         # the trainer goes on
        poll(lambda: buf.stats().rate.inserted > before.inserted or None, TIMEOUT,
             lambda: AssertionError("the surviving writer did not go on"))
        w = buf.writer()                              # and a new writer takes its turn
        buf.sample_steps(8, timeout=TIMEOUT)
        stalled(buf)
        s = buf.stats()
        assert s.rate.inserted == s.steps_written    # a writer killed while waiting took no number
        assert s.rate.lag <= s.rate.tolerance
        w.close()
    finally:
        victim.close()
        other.close()


def test_writers_go_on_once_an_adopter_samples(make_buffer):
    owner = Script(OWNER)
    name = owner.line()
    w = None
    adopted = None
    try:
        w = writer(name)
        buf = shmbuf.attach(name)
        poll(lambda: buf.stats().rate.replayed >= 80 or None, TIMEOUT,
             lambda: AssertionError("the trainer did not sample"))
        owner.signal(signal.SIGKILL)
        assert owner.wait() == -signal.SIGKILL
        before = stalled(buf)                        # the writer now waits for samples
        buf.close()
        adopted = shmbuf.attach(name, own=True)
        s = adopted.stats().rate
        assert (s.inserted, s.replayed) == (before.inserted, before.replayed)  # survived adoption
        adopted.sample_steps(8, timeout=TIMEOUT)
        poll(lambda: adopted.stats().rate.inserted > before.inserted or None, TIMEOUT,
             lambda: AssertionError("the writer did not go on after the adopter sampled"))
    finally:
        owner.close()
        if adopted is not None:
            adopted.close()                          # unlinks: the writer stops
        else:
            shmbuf.segment.segment.unlink(name)
        if w is not None:
            assert w.wait() == 0
            w.close()


def test_writers_raise_after_their_timeout_when_nobody_samples(make_buffer):
    buf = make_buffer(SPEC, 4096, rate_limit=RateLimit(4, min_steps=8, writer_timeout=0.3))
    w = writer(buf.name)
    try:
        line = w.line()
        assert line.startswith("timeout 9 ") and "waited 0.3 s for samples" in line
        assert "inserted 9 steps" in line and "replayed 0" in line
        assert w.wait() == 0
    finally:
        w.close()


def test_every_sampler_draws_from_one_budget(make_buffer):
    ratio, n, steps, m = 2, 8, 600, 16
    buf = make_buffer(SPEC, 4096, rate_limit=RateLimit(ratio, min_steps=m, writer_timeout=None))
    samplers = [Script(SAMPLER.format(name=buf.name, timeout=1.0)) for _ in range(2)]
    w = None
    try:
        for s in samplers:
            assert s.line() == "ready"
        w = writer(buf.name, steps)
        mine = 0
        with buf.prefetch(4, 2, depth=2, device="cpu") as batches:   # a thread samples too
            for _ in range(5):
                next(batches)
                mine += 1
        while True:
            try:
                buf.sample_sequences(4, 2, timeout=1.0)
            except WaitTimeoutError:
                break
            mine += 1
        assert w.line() == f"done {steps}"
        served = [int(s.line()) for s in samplers]
        assert all(k > 0 for k in served)
        r = buf.stats().rate
        counted = ratio * (steps - m)
        # Every sampler stopped because no batch fitted the shared budget any more, and
        # every batch drawn counts (the prefetcher's unconsumed ones too): the sum of all
        # their draws fills the band to within one batch.
        assert counted + r.tolerance - n < r.replayed <= counted + r.tolerance
        assert r.replayed >= n * (sum(served) + mine)
        assert (r.replayed - n * (sum(served) + mine)) % n == 0   # the rest: prefetched
    finally:
        for s in samplers:
            s.close()
        if w is not None:
            w.close()


def _fill(buf, rounds):
    """Alternate adds and samples; return the writer."""
    w = buf.writer()
    for i in range(16):
        w.add(x=np.int64(i), done=np.False_)
    for r in range(rounds):
        for _ in range(2):   # 2 steps x train_ratio 8 = one sample of 16
            w.add(x=np.int64(r), done=np.False_)
        buf.sample_steps(16, timeout=0)
    return w


def _served_at_once(buf, n, check=True):
    """Samples served without any insert; each must leave the lag within the band."""
    served = 0
    while True:
        try:
            buf.sample_steps(n, timeout=0)
        except WaitTimeoutError:
            return served
        s = buf.stats().rate
        assert not check or -s.tolerance <= s.lag <= s.tolerance
        served += 1


@pytest.mark.parametrize("route", ["state_dict", "save"])
def test_a_resumed_run_holds_the_ratio_without_a_catch_up_burst(make_buffer, tmp_path, route):
    limit = RateLimit(8, min_steps=16, tolerance=64, writer_timeout=None)
    a = make_buffer(SPEC, 4096, rate_limit=limit)
    _fill(a, 30).close()
    before = a.stats().rate
    if route == "state_dict":
        torch.save(a.state_dict(), tmp_path / "replay.pt")
        state = torch.load(tmp_path / "replay.pt", weights_only=True)
        b = make_buffer(SPEC, 4096, rate_limit=limit)
        b.load_state_dict(state)
    else:
        a.save(tmp_path / "replay")
        b = shmbuf.load(tmp_path / "replay")
        assert b.rate_limit == limit
    try:
        s = b.stats().rate
        assert (s.inserted, s.replayed, s.lag) == (before.inserted, before.replayed, before.lag)
        want = int((s.tolerance - s.lag) // 16)          # what the band allows, no more
        assert _served_at_once(b, 16) == want
        # The first seconds after the resume, with a writer: every sample within the band.
        w = writer(b.name, 200)
        try:
            for _ in range(80):
                b.sample_steps(16, timeout=TIMEOUT)
                s = b.stats().rate
                assert -s.tolerance <= s.lag <= s.tolerance
        finally:
            w.close()
    finally:
        if route == "save":
            b.close()
    # Without the counters the resumed trainer would catch up in one burst:
    state = a.state_dict()
    del state["rate"]
    c = make_buffer(SPEC, 4096, rate_limit=limit)
    c.load_state_dict(state)
    assert _served_at_once(c, 16, check=False) > 3 * max(want, 1)


def test_the_dreamer_facade_takes_train_ratio(make_buffer):
    with pytest.raises(ValueError, match="train_ratio"):
        shmbuf.ReplayBuffer(100, (3, 8, 8), 2, seq_len=4, batch_size=2, train_ratio=-1)
    rb = shmbuf.ReplayBuffer(1000, (3, 8, 8), 2, seq_len=4, batch_size=2, train_ratio=2)
    try:
        assert rb.buffer.rate_limit == RateLimit(2, min_steps=8)
        frame = np.zeros((3, 8, 8), np.uint8)
        for _ in range(8 + 1):   # min_steps, then one step's worth of the band
            rb.add({"image": frame}, np.zeros(2, np.float32), 0.0, 0.0)
        obs, act, rew, term = rb.sample()
        assert obs.shape == (4, 2, 3, 8, 8)
        s = rb.buffer.stats().rate
        assert (s.inserted, s.replayed, s.lag) == (9, 8, 6)
        again = shmbuf.ReplayBuffer.attach(rb.name)
        assert again.buffer.rate_limit == rb.buffer.rate_limit
        again.close()
    finally:
        rb.close()


def test_kill_loop_writers_and_trainers_no_hang_no_lost_step():
    from helpers import rate_kill_loop

    report = rate_kill_loop.run(rounds=8, seed=3)
    assert report.rounds == 8 and report.steps_checked > 0, report.line()
    assert (report.hangs, report.lost, report.outside_band) == (0, 0, 0), report.line()


def test_dataloader_workers_draw_from_the_same_budget(make_buffer):
    ratio, m = 2, 16
    buf = make_buffer(SPEC, 4096, rate_limit=RateLimit(ratio, min_steps=m, writer_timeout=None))
    w = writer(buf.name, 400)
    try:
        loader = torch.utils.data.DataLoader(buf.dataset(4, 2), batch_size=None, num_workers=2)
        it = iter(loader)
        for _ in range(20):
            batch = next(it)
            assert batch["x"].shape == (2, 4)
        r = buf.stats().rate
        # The workers' batches in flight (prefetched by the loader) count too.
        assert r.replayed >= 20 * 8 and r.lag <= r.tolerance
        del it, loader
    finally:
        w.close()
