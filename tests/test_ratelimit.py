"""The rate limiter: a train ratio held in the segment, for every process that adds or samples.

The single-process tests compare every admission with a pure-Python model
of the rules (shmbuf.writing.ratelimit's docstring); the others use real processes
(``python -c`` scripts), real SIGKILLs and real adoption.
"""
import math

import numpy as np
import pytest
from helpers.shm import own_entries
from hypothesis import given, settings
from hypothesis import strategies as st

import shmbuf
from shmbuf import RateLimit, WaitTimeoutError

SPEC = {"x": ((), np.int64), "done": ((), np.bool_)}
SLOW = pytest.mark.slow


def step(i):
    return {"x": np.int64(i), "done": np.False_}


# -- bad input: a clear error, nothing created --------------------------------------------
BAD = [
    ({"train_ratio": 0}, ValueError, "train_ratio"),
    ({"train_ratio": -1}, ValueError, "train_ratio"),
    ({"train_ratio": float("nan")}, ValueError, "train_ratio"),
    ({"train_ratio": float("inf")}, ValueError, "train_ratio"),
    ({"train_ratio": "32"}, TypeError, "train_ratio"),
    ({"train_ratio": True}, TypeError, "train_ratio"),
    ({"train_ratio": 32, "min_steps": -1}, ValueError, "min_steps"),
    ({"train_ratio": 32, "min_steps": 1.5}, TypeError, "min_steps"),
    ({"train_ratio": 32, "tolerance": -1}, ValueError, "tolerance"),
    ({"train_ratio": 32, "tolerance": float("nan")}, ValueError, "tolerance"),
    ({"train_ratio": 32, "tolerance": 16}, ValueError, "tolerance"),
    ({"train_ratio": 32, "tolerance": "64"}, TypeError, "tolerance"),
    ({"train_ratio": 32, "block_writers": 1}, TypeError, "block_writers"),
    ({"train_ratio": 32, "writer_timeout": "5"}, TypeError, "timeout"),
    ({"train_ratio": 32, "writer_timeout": -1}, ValueError, "timeout"),
]


@pytest.mark.parametrize("kw, exc, arg", BAD, ids=[str(b[0]) for b in BAD])
def test_bad_arguments_raise_naming_them(kw, exc, arg):
    with pytest.raises(exc, match=arg):
        RateLimit(**kw)


def test_create_refuses_a_non_limit_and_creates_nothing():
    before = own_entries()
    with pytest.raises(TypeError, match="rate_limit"):
        shmbuf.create(SPEC, 100, rate_limit=32)
    assert own_entries() <= before


def test_a_sample_timeout_of_the_wrong_type_takes_no_budget(make_buffer):
    buf = make_buffer(SPEC, 100, rate_limit=RateLimit(2))
    w = buf.writer()
    w.add(**step(0))
    for bad, exc in (("1", TypeError), (-1, ValueError), (True, TypeError)):
        with pytest.raises(exc, match="timeout"):
            buf.sample_steps(1, timeout=bad)
    assert buf.stats().rate.replayed == 0


def test_a_batch_wider_than_the_band_is_refused_at_the_call(make_buffer):
    buf = make_buffer(SPEC, 1000, rate_limit=RateLimit(32, tolerance=100, min_steps=50))
    w = buf.writer()
    for i in range(50):
        w.add(**step(i))
    with pytest.raises(ValueError, match="can never be served") as err:
        buf.sample_sequences(10, 20)          # 200 + 32 > 2 x 100: it would wait forever
    assert "tolerance >= 116" in str(err.value)
    assert buf.stats().rate.replayed == 0
    w.add(**step(50))
    w.add(**step(51))                         # lag -64: a batch of 160 fits under +100
    buf.sample_sequences(8, 20, timeout=0)    # 160 + 32 fits the band


def test_without_blocked_writers_a_wide_batch_is_served(make_buffer):
    buf = make_buffer(SPEC, 1000, rate_limit=RateLimit(32, tolerance=100, block_writers=False))
    w = buf.writer()
    for i in range(50):
        w.add(**step(i))   # writers never wait: the sampler can always catch up
    buf.sample_sequences(10, 20, timeout=0)


# -- the rules, against a model ---------------------------------------------------------------
class Model:
    """The limiter's rules in plain Python (floats: the C code's doubles)."""

    def __init__(self, ratio, min_steps, tolerance, block_writers):
        self.ratio, self.m, self.block = float(ratio), min_steps, block_writers
        self.auto = tolerance is None
        self.tol = float(ratio if tolerance is None else tolerance)
        self.inserted = self.replayed = 0

    def insert(self, k) -> bool:
        first = self.inserted + 1
        if self.block and first > self.m and not (
                self.ratio * float(first - self.m) <= float(self.replayed) + self.tol):
            return False
        self.inserted += k
        return True

    def sample(self, n) -> bool:
        if self.auto:
            self.tol = max(self.tol, float(n))
        if self.inserted < self.m:
            return False
        if float(self.replayed + n) - self.ratio * float(self.inserted - self.m) > self.tol:
            return False
        self.replayed += n
        return True

    def lag(self):
        return self.replayed - self.ratio * max(self.inserted - self.m, 0)


OPS = st.lists(st.one_of(
    st.tuples(st.just("add"), st.just(1)),
    st.tuples(st.just("add_batch"), st.just(3)),
    st.tuples(st.just("extend"), st.integers(1, 6)),
    st.tuples(st.just("steps"), st.integers(1, 40)),
    st.tuples(st.just("sequences"), st.integers(1, 8))), min_size=1, max_size=60)


@settings(max_examples=40, deadline=None)
@given(ratio=st.sampled_from([0.5, 1, 3, 7.25]), min_steps=st.integers(4, 12),
       tolerance=st.sampled_from([None, 8.0, 20.0]), block=st.booleans(), ops=OPS)
def test_every_admission_follows_the_rules(ratio, min_steps, tolerance, block, ops):
    limit = RateLimit(ratio, min_steps=min_steps, tolerance=tolerance, block_writers=block,
                      writer_timeout=0)
    model = Model(ratio, min_steps, tolerance, block)
    widest = max(k if op in ("add", "add_batch", "extend") else 1 for op, k in ops)
    with shmbuf.create(SPEC, 4096, rate_limit=limit) as buf:
        w, wb = buf.writer(), buf.writer()
        for op, k in ops:
            n = {"steps": k, "sequences": 2 * k}.get(op, k)
            refuse = op in ("steps", "sequences") and block and tolerance is not None and (
                n + ratio > 2 * tolerance)
            if refuse:
                with pytest.raises(ValueError, match="never be served"):
                    buf.sample_sequences(2, k, timeout=0) if op == "sequences" else \
                        buf.sample_steps(k, timeout=0)
                continue
            want = model.insert(k) if op in ("add", "add_batch", "extend") else model.sample(n)
            try:
                if op == "add":
                    w.add(**step(0))
                elif op == "add_batch":
                    wb.add_batch(x=np.zeros(3, np.int64), done=np.zeros(3, np.bool_))
                elif op == "extend":
                    w.extend(x=np.zeros(k, np.int64), done=np.zeros(k, np.bool_))
                elif op == "steps":
                    buf.sample_steps(k, timeout=0)
                else:
                    buf.sample_sequences(2, k, timeout=0)   # min_steps >= 4 > k: windows exist
                got = True
            except WaitTimeoutError:
                got = False
            except shmbuf.NotEnoughDataError:   # admitted, then refunded: nothing delivered
                assert want
                model.replayed -= n
                got = True
            assert got == want, (op, k, model.inserted, model.replayed)
            s = buf.stats().rate
            assert (s.inserted, s.replayed) == (model.inserted, model.replayed)
            assert s.tolerance == model.tol
            assert math.isclose(s.lag, model.lag(), abs_tol=1e-9)
            if op in ("steps", "sequences") and got:   # within the band at every sample
                assert s.lag <= s.tolerance + 1e-9
                if block:   # an add_batch or extend may pass the lower edge by k - 1 steps
                    assert s.lag >= -s.tolerance - ratio * (widest - 1) - 1e-9


def test_samples_wait_for_min_steps_and_writers_do_not(make_buffer):
    buf = make_buffer(SPEC, 1000, rate_limit=RateLimit(4, min_steps=20, writer_timeout=0))
    w = buf.writer()
    for i in range(19):
        w.add(**step(i))                      # before min_steps writers never wait
    with pytest.raises(WaitTimeoutError, match="min_steps = 20"):
        buf.sample_steps(4, timeout=0)
    w.add(**step(19))
    buf.sample_steps(4, timeout=0)
    s = buf.stats().rate
    assert (s.inserted, s.replayed, s.lag) == (20, 4, 4.0)
    assert s.sample_wait_s >= 0 and buf.stats().steps_written == 20


def test_the_default_tolerance_is_one_batch(make_buffer):
    buf = make_buffer(SPEC, 1000, rate_limit=RateLimit(2, writer_timeout=0))
    assert buf.stats().rate.tolerance == 2      # one inserted step's worth until a batch
    w = buf.writer()
    w.add(**step(0))
    with pytest.raises(WaitTimeoutError, match="for samples"):
        w.add(**step(1))                        # the trainer has not sampled yet
    buf.sample_sequences(4, 1, timeout=0)       # 4 replayed: the band widens to 4
    assert buf.stats().rate.tolerance == 4
    assert buf.rate_limit == RateLimit(2, writer_timeout=0)


def test_the_c_fast_path_is_gated_like_the_python_path(make_buffer):
    buf = make_buffer(SPEC, 1000, rate_limit=RateLimit(1, tolerance=3, writer_timeout=0))
    w = buf.writer()
    w.add(**step(0))
    assert w._fast_add is not None             # the C path is in use from here on
    added = 1
    while True:
        try:
            w.add(x=np.int64(added), done=np.False_)
        except WaitTimeoutError:
            break
        added += 1
    assert added == 3 and buf.stats().rate.lag == -3
    buf.sample_steps(3, timeout=0)
    for i in range(3):
        w.add(x=np.int64(i), done=np.False_)
    assert buf.stats().rate.inserted == 6


def test_shmbuf_info_prints_the_rate_limit(make_buffer, capsys):
    from shmbuf import cli

    buf = make_buffer(SPEC, 1000, rate_limit=RateLimit(2, min_steps=4))
    w = buf.writer()
    for i in range(5):
        w.add(**step(i))
    buf.sample_steps(2, timeout=0)
    assert cli.main(["info", buf.name]) == 0
    out = capsys.readouterr().out
    assert ("rate limit   train_ratio 2, min_steps 4, tolerance 2, writers wait: inserted 5, "
            "replayed 2, ratio 2.000, lag 0") in out
