"""Bad input to Writer.add/add_batch, sampling and wait_ready: rejected, nothing changed.

Every rejection is checked three ways: the exception type, a message that names
the argument, and a buffer whose counters and contents are exactly as before.
"""
import numpy as np
import pytest

import shmbuf

SPEC = {
    "obs": ((3, 4, 4), np.uint8),
    "action": ((), np.int8),
    "reward": ((), np.float32),
    "done": ((), np.bool_),
}
CAPACITY = 64
N_ENVS = 3


def good_step(i=0):
    return {"obs": np.full((3, 4, 4), i % 250, np.uint8), "action": i % 100,
            "reward": float(i), "done": False}


def good_batch(i=0):
    return {"obs": np.full((N_ENVS, 3, 4, 4), i % 250, np.uint8),
            "action": np.arange(N_ENVS, dtype=np.int8),
            "reward": np.arange(N_ENVS, dtype=np.float32) + i,
            "done": np.zeros(N_ENVS, bool)}


def state(buf):
    """Everything a rejected call must leave alone."""
    s = buf.stats()
    counters = (s.steps_written, s.live_steps, s.episodes, s.streams, s.samples, s.writers)
    return counters, {k: v.copy() for k, v in buf.arrays.items()}


def assert_unchanged(buf, before):
    counters, arrays = state(buf)
    assert counters == before[0]
    for k, v in arrays.items():
        np.testing.assert_array_equal(v, before[1][k], err_msg=f"column {k!r} changed")


@pytest.fixture
def buf(make_buffer):
    """A buffer holding 10 steps from one writer (closed) and 2 add_batch calls."""
    b = make_buffer(SPEC, CAPACITY, chunk_size=4)
    with b.writer() as w:
        for i in range(10):
            w.add(**good_step(i))
    with b.writer() as w:
        w.add_batch(**good_batch(1))
        w.add_batch(**good_batch(2))
    return b


def _with(base, **changes):
    out = dict(base)
    for k, v in changes.items():
        if v is _DROP:
            del out[k]
        else:
            out[k] = v
    return out


_DROP = object()
G = good_step()

# (id, columns, exception, text the message must contain)
BAD_ADD = [
    ("missing column", _with(G, done=_DROP), KeyError, "missing columns ['done']"),
    ("unknown column", _with(G, bogus=1), KeyError, "unknown columns ['bogus']"),
    ("misspelt column", _with(G, done=_DROP, dones=False), KeyError, "'dones'"),
    ("no columns", {}, KeyError, "missing columns"),
    ("obs wrong shape", _with(G, obs=np.zeros((3, 4, 5), np.uint8)), ValueError,
     "add(obs=...)"),
    ("obs with batch axis", _with(G, obs=np.zeros((1, 3, 4, 4), np.uint8)), ValueError,
     "add(obs=...)"),
    ("obs scalar", _with(G, obs=0), ValueError, "add(obs=...)"),
    ("obs float", _with(G, obs=np.ones((3, 4, 4), np.float32)), TypeError, "add(obs=...)"),
    ("obs float list", _with(G, obs=np.ones((3, 4, 4)).tolist()), TypeError, "add(obs=...)"),
    ("obs int 256", _with(G, obs=np.full((3, 4, 4), 256, np.int64)), TypeError, "add(obs=...)"),
    ("obs int -1", _with(G, obs=np.full((3, 4, 4), -1, np.int16)), TypeError, "add(obs=...)"),
    ("obs ragged", _with(G, obs=[[1, 2], [3]]), TypeError, "add(obs=...)"),
    ("obs string", _with(G, obs="pixels"), ValueError, "add(obs=...)"),
    ("action float", _with(G, action=1.0), TypeError, "add(action=...)"),
    ("action numpy float", _with(G, action=np.float32(1)), TypeError, "add(action=...)"),
    ("action 128", _with(G, action=128), TypeError, "add(action=...)"),
    ("action -129", _with(G, action=-129), TypeError, "add(action=...)"),
    ("action 2**70", _with(G, action=2**70), TypeError, "add(action=...)"),
    ("action uint64", _with(G, action=np.uint64(2**63)), TypeError, "add(action=...)"),
    ("action shape", _with(G, action=[1]), ValueError, "add(action=...)"),
    ("action complex", _with(G, action=1 + 0j), TypeError, "add(action=...)"),
    ("reward string", _with(G, reward="1.0"), TypeError, "add(reward=...)"),
    ("reward bytes", _with(G, reward=b"1"), TypeError, "add(reward=...)"),
    ("reward None", _with(G, reward=None), TypeError, "add(reward=...)"),
    ("reward dict", _with(G, reward={}), TypeError, "add(reward=...)"),
    ("reward complex", _with(G, reward=1j), TypeError, "add(reward=...)"),
    ("reward overflows float32", _with(G, reward=1e39), TypeError, "add(reward=...)"),
    ("reward int not exact in float32", _with(G, reward=2**24 + 1), TypeError,
     "add(reward=...)"),
    ("reward 2**70", _with(G, reward=2**70), TypeError, "add(reward=...)"),
    ("reward vector", _with(G, reward=[1.0, 2.0]), ValueError, "add(reward=...)"),
    ("done 2", _with(G, done=2), TypeError, "add(done=...)"),
    ("done -1", _with(G, done=-1), TypeError, "add(done=...)"),
    ("done 0.5", _with(G, done=0.5), TypeError, "add(done=...)"),
    ("done nan", _with(G, done=float("nan")), TypeError, "add(done=...)"),
    ("done string", _with(G, done="yes"), TypeError, "add(done=...)"),
    ("done None", _with(G, done=None), TypeError, "add(done=...)"),
    ("done shape", _with(G, done=[True]), ValueError, "add(done=...)"),
]


def _ids(rows):
    return [r[0] for r in rows]


@pytest.mark.parametrize("case, columns, exc, text", BAD_ADD, ids=_ids(BAD_ADD))
@pytest.mark.parametrize("fresh", [True, False], ids=["new writer", "used writer"])
def test_add_rejects_bad_input(buf, case, columns, exc, text, fresh):
    with buf.writer() as w:
        if not fresh:
            w.add(**good_step(3))
        before = state(buf)
        with pytest.raises(exc) as info:
            w.add(**columns)
        assert text in str(info.value)
        assert_unchanged(buf, before)
        w.add(**good_step(4))  # the writer is not poisoned
        assert buf.stats().live_steps == before[0][1] + 1


B = good_batch()

BAD_BATCH = [
    ("missing column", _with(B, reward=_DROP), KeyError, "missing columns ['reward']"),
    ("unknown column", _with(B, bogus=np.zeros(N_ENVS)), KeyError, "unknown columns ['bogus']"),
    ("obs row shape", _with(B, obs=np.zeros((N_ENVS, 3, 4, 5), np.uint8)), ValueError,
     "add_batch(obs=...)"),
    ("obs without env axis", _with(B, obs=np.zeros((3, 4, 4), np.uint8)), ValueError,
     "add_batch(obs=...)"),
    ("reward fewer rows", _with(B, reward=np.zeros(N_ENVS - 1, np.float32)), ValueError,
     "add_batch(reward=...)"),
    ("done more rows", _with(B, done=np.zeros(N_ENVS + 1, bool)), ValueError,
     "add_batch(done=...)"),
    ("reward scalar", _with(B, reward=1.0), ValueError, "add_batch(reward=...)"),
    ("obs float", _with(B, obs=np.zeros((N_ENVS, 3, 4, 4), np.float64)), TypeError,
     "add_batch(obs=...)"),
    ("one obs pixel out of range",
     _with(B, obs=np.concatenate([np.zeros((N_ENVS - 1, 3, 4, 4), np.int64),
                                  np.full((1, 3, 4, 4), 300, np.int64)])),
     TypeError, "add_batch(obs=...)"),
    ("one action out of range", _with(B, action=np.array([1, 300, 3])), TypeError,
     "add_batch(action=...)"),
    ("one action fractional", _with(B, action=np.array([1.0, 2.5, 3.0])), TypeError,
     "add_batch(action=...)"),
    ("one done is 2", _with(B, done=np.array([0, 2, 1])), TypeError, "add_batch(done=...)"),
    ("one done is nan", _with(B, done=np.array([0.0, np.nan, 1.0])), TypeError,
     "add_batch(done=...)"),
    ("one reward overflows", _with(B, reward=np.array([0.0, 1e300, 1.0])), TypeError,
     "add_batch(reward=...)"),
    ("reward strings", _with(B, reward=np.array(["a", "b", "c"])), TypeError,
     "add_batch(reward=...)"),
    ("no rows", {k: v[:0] for k, v in B.items()}, ValueError, "add_batch"),
    ("no columns", {}, KeyError, "missing columns"),
    ("0-d first column", _with(B, obs=np.array(5, np.uint8)), ValueError, "add_batch(obs=...)"),
]


@pytest.mark.parametrize("case, columns, exc, text", BAD_BATCH, ids=_ids(BAD_BATCH))
@pytest.mark.parametrize("fresh", [True, False], ids=["new writer", "used writer"])
def test_add_batch_rejects_bad_input_and_writes_nothing(buf, case, columns, exc, text, fresh):
    with buf.writer() as w:
        if not fresh:
            w.add_batch(**good_batch(5))
        before = state(buf)
        with pytest.raises(exc) as info:
            w.add_batch(**columns)
        assert text in str(info.value)
        assert_unchanged(buf, before)
        w.add_batch(**good_batch(6))  # the writer is not poisoned
        assert buf.stats().live_steps == before[0][1] + N_ENVS


def test_add_batch_with_another_env_count_is_rejected(buf):
    with buf.writer() as w:
        w.add_batch(**good_batch())
        before = state(buf)
        bigger = {k: np.concatenate([v, v[:1]]) for k, v in good_batch().items()}
        with pytest.raises(ValueError,
                           match=rf"add_batch\(obs=...\): this writer has {N_ENVS} env streams"):
            w.add_batch(**bigger)
        assert_unchanged(buf, before)


# -- lossless casts are accepted ----------------------------------------------------
def only_step(b):
    """The single live step of a buffer that holds exactly one."""
    assert b.stats().live_steps == 1
    return b.sample_steps(1, rng=0)


ACCEPTED_ADD = [
    ("python float reward", {"reward": 1.5}, "reward", np.float32(1.5)),
    ("python int reward", {"reward": 3}, "reward", np.float32(3)),
    ("int 2**24 reward", {"reward": 2**24}, "reward", np.float32(2**24)),
    ("float64 reward", {"reward": np.float64(0.25)}, "reward", np.float32(0.25)),
    ("narrowing float reward", {"reward": np.float64(0.1)}, "reward", np.float32(0.1)),
    ("inf reward", {"reward": float("inf")}, "reward", np.float32(np.inf)),
    ("done 1.0", {"done": 1.0}, "done", True),
    ("done 0.0", {"done": 0.0}, "done", False),
    ("done numpy 1.0", {"done": np.float64(1.0)}, "done", True),
    ("done int 1", {"done": 1}, "done", True),
    ("done int64 0", {"done": np.int64(0)}, "done", False),
    ("action numpy int64", {"action": np.int64(-128)}, "action", -128),
    ("action bool", {"action": True}, "action", 1),
    ("action int32 array", {"action": np.array(127, np.int32)}, "action", 127),
    ("obs int64 small", {"obs": np.full((3, 4, 4), 7, np.int64)}, "obs",
     np.full((3, 4, 4), 7, np.uint8)),
    ("obs nested list", {"obs": np.full((3, 4, 4), 255).tolist()}, "obs",
     np.full((3, 4, 4), 255, np.uint8)),
    ("obs bool", {"obs": np.ones((3, 4, 4), bool)}, "obs", np.ones((3, 4, 4), np.uint8)),
]


@pytest.mark.parametrize("case, change, column, expect", ACCEPTED_ADD, ids=_ids(ACCEPTED_ADD))
def test_add_accepts_lossless_casts(make_buffer, case, change, column, expect):
    b = make_buffer(SPEC, CAPACITY, chunk_size=4)
    with b.writer() as w:
        w.add(**{**good_step(9), **change})
    got = only_step(b)[column][0]
    np.testing.assert_array_equal(got, expect)
    assert got.dtype == SPEC[column][1]


@pytest.mark.slow  # the first torch import takes seconds
def test_add_accepts_torch_tensors(make_buffer):
    torch = pytest.importorskip("torch")
    b = make_buffer(SPEC, CAPACITY, chunk_size=4)
    with b.writer() as w:
        w.add(obs=torch.full((3, 4, 4), 9, dtype=torch.uint8), action=torch.tensor(-3),
              reward=torch.tensor(0.5, requires_grad=True), done=torch.tensor(True))
    step = only_step(b)
    assert (step["obs"] == 9).all() and step["action"][0] == -3
    assert step["reward"][0] == 0.5 and step["done"][0]


def test_add_batch_accepts_lossless_casts(make_buffer):
    b = make_buffer(SPEC, CAPACITY, chunk_size=4)
    rewards = [10.0, 20.0, 30.0]
    with b.writer() as w:
        w.add_batch(obs=np.arange(3).reshape(3, 1, 1, 1) * np.ones((3, 3, 4, 4), np.int64),
                    action=[-1, 0, 1], reward=rewards, done=[1.0, 0.0, 0.0])
    s = b.stats()
    assert (s.live_steps, s.episodes) == (3, 1)
    arrays = b.arrays
    for i, r in enumerate(rewards):
        (row,) = np.flatnonzero(arrays["reward"] == r)
        assert (arrays["obs"][row] == i).all()
        assert arrays["action"][row] == i - 1
        assert arrays["done"][row] == (i == 0)


# -- sampling arguments ---------------------------------------------------------------
def _out(lead, time_major=True, **overrides):
    out = {k: np.full(lead + shape, 99, dtype) for k, (shape, dtype) in SPEC.items()}
    out.update(overrides)
    return out


L4B2 = (4, 2)  # (length, batch), time-major
BAD_SEQ = [
    ("batch_size 0", dict(batch_size=0, length=2), ValueError, "batch_size"),
    ("batch_size -1", dict(batch_size=-1, length=2), ValueError, "batch_size"),
    ("batch_size huge", dict(batch_size=2**24 + 1, length=2), ValueError, "batch_size"),
    ("batch_size 2**64", dict(batch_size=2**64, length=2), ValueError, "batch_size"),
    ("batch_size bool", dict(batch_size=True, length=2), TypeError, "batch_size"),
    ("batch_size float", dict(batch_size=2.0, length=2), TypeError, "batch_size"),
    ("batch_size str", dict(batch_size="2", length=2), TypeError, "batch_size"),
    ("batch_size None", dict(batch_size=None, length=2), TypeError, "batch_size"),
    ("length 0", dict(batch_size=2, length=0), ValueError, "length"),
    ("length -3", dict(batch_size=2, length=-3), ValueError, "length"),
    ("length > capacity", dict(batch_size=2, length=CAPACITY + 1), ValueError, "length"),
    ("length bool", dict(batch_size=2, length=True), TypeError, "length"),
    ("length float", dict(batch_size=2, length=1.5), TypeError, "length"),
    ("out list", dict(batch_size=2, length=4, out=[]), ValueError, "out"),
    ("out missing key", dict(batch_size=2, length=4,
                             out={k: v for k, v in _out(L4B2).items() if k != "done"}),
     ValueError, "out"),
    ("out extra key", dict(batch_size=2, length=4, out=_out(L4B2, extra=np.zeros(8))),
     ValueError, "out"),
    ("out wrong shape", dict(batch_size=2, length=4,
                             out=_out(L4B2, obs=np.zeros((4, 2, 3, 4, 5), np.uint8))),
     ValueError, "out['obs']"),
    ("out batch-major given time-major", dict(batch_size=2, length=4,
                                              out=_out((2, 4))), ValueError, "out["),
    ("out wrong dtype", dict(batch_size=2, length=4,
                             out=_out(L4B2, reward=np.zeros((4, 2), np.float64))),
     ValueError, "out['reward']"),
    ("out not contiguous", dict(batch_size=2, length=4,
                                out=_out(L4B2, reward=np.zeros((2, 4), np.float32).T)),
     ValueError, "out['reward']"),
    ("out list value", dict(batch_size=2, length=4, out=_out(L4B2, reward=[[0.0] * 2] * 4)),
     TypeError, "out['reward']"),
]


@pytest.mark.parametrize("case, kwargs, exc, text", BAD_SEQ, ids=_ids(BAD_SEQ))
def test_sample_sequences_rejects_bad_arguments(buf, case, kwargs, exc, text):
    before = state(buf)
    out = kwargs.get("out")
    targets = {k: (v, v.copy()) for k, v in out.items()
               if isinstance(v, np.ndarray)} if isinstance(out, dict) else {}
    with pytest.raises(exc) as info:
        buf.sample_sequences(**kwargs)
    assert text in str(info.value)
    assert_unchanged(buf, before)
    for k, (v, copy) in targets.items():
        np.testing.assert_array_equal(v, copy, err_msg=f"out[{k!r}] written by a failed call")


@pytest.mark.parametrize("rng, exc", [("x", TypeError), (-1, ValueError), (1.5, TypeError),
                                      (True, TypeError), ([1, "a"], ValueError)])
@pytest.mark.parametrize("call", ["sample_sequences", "sample_steps", "count_valid_starts",
                                  "count_episodes", "prefetch"])
def test_a_bad_rng_is_named(buf, call, rng, exc):
    before = state(buf)
    calls = {"sample_sequences": lambda: buf.sample_sequences(2, 4, rng=rng),
             "sample_steps": lambda: buf.sample_steps(2, rng=rng),
             "count_valid_starts": lambda: buf.count_valid_starts(4, rng=rng),
             "count_episodes": lambda: buf.count_episodes(4, rng=rng),
             "prefetch": lambda: buf.prefetch(2, 4, rng=rng, device="cpu")}
    with pytest.raises(exc) as info:
        calls[call]()
    assert str(info.value).startswith(f"rng must be None, a seed (an int >= 0 or a sequence "
                                      f"of them), a numpy SeedSequence, BitGenerator or "
                                      f"Generator; got {rng!r}")
    assert_unchanged(buf, before)


def test_sample_sequences_accepts_good_out(buf):
    out = _out(L4B2)
    got = buf.sample_sequences(2, 4, out=out, rng=0)
    assert all(got[k] is out[k] for k in SPEC)
    assert buf.stats().samples == 1


B5 = (5,)
BAD_STEPS = [
    ("batch_size 0", dict(batch_size=0), ValueError, "batch_size"),
    ("batch_size -2", dict(batch_size=-2), ValueError, "batch_size"),
    ("batch_size huge", dict(batch_size=2**24 + 1), ValueError, "batch_size"),
    ("batch_size bool", dict(batch_size=False), TypeError, "batch_size"),
    ("batch_size float", dict(batch_size=5.0), TypeError, "batch_size"),
    ("out list", dict(batch_size=5, out=[]), ValueError, "out"),
    ("out missing key", dict(batch_size=5, out={k: v for k, v in _out(B5).items()
                                                if k != "obs"}), ValueError, "out"),
    ("out wrong shape", dict(batch_size=5, out=_out(B5, reward=np.zeros(6, np.float32))),
     ValueError, "out['reward']"),
    ("out sequence shape", dict(batch_size=5, out=_out((1, 5))), ValueError, "out["),
    ("out wrong dtype", dict(batch_size=5, out=_out(B5, action=np.zeros(5, np.int64))),
     ValueError, "out['action']"),
    ("out not contiguous", dict(batch_size=5,
                                out=_out(B5, obs=np.zeros((5, 3, 4, 8), np.uint8)[..., ::2])),
     ValueError, "out['obs']"),
]


@pytest.mark.parametrize("case, kwargs, exc, text", BAD_STEPS, ids=_ids(BAD_STEPS))
def test_sample_steps_rejects_bad_arguments(buf, case, kwargs, exc, text):
    before = state(buf)
    with pytest.raises(exc) as info:
        buf.sample_steps(**kwargs)
    assert text in str(info.value)
    assert_unchanged(buf, before)


def test_sample_steps_rejects_list_out_like_sample_sequences(make_buffer):
    """A list in out= must be refused, not filled through a temporary copy and dropped."""
    spec = {"x": ((2,), np.float64), "reward": ((), np.float64)}
    b = make_buffer(spec, CAPACITY, chunk_size=4, done_key=None)
    with b.writer() as w:
        for i in range(5):
            w.add(x=[i, i], reward=float(i))
    out = {"x": [[-1.0, -1.0]] * 4, "reward": [-1.0] * 4}
    with pytest.raises(TypeError, match=r"out\['x'\]"):
        b.sample_steps(4, out=out, rng=0)
    assert out["reward"] == [-1.0] * 4


def test_sample_steps_accepts_good_out(buf):
    out = _out(B5)
    got = buf.sample_steps(5, out=out, rng=0)
    assert got is out and (out["reward"] != 99).all()


def test_sampling_an_empty_buffer_raises_not_enough_data(make_buffer):
    b = make_buffer(SPEC, CAPACITY, chunk_size=4)
    with pytest.raises(shmbuf.NotEnoughDataError, match="wait_ready"):
        b.sample_sequences(2, 4)
    with pytest.raises(shmbuf.NotEnoughDataError):
        b.sample_steps(2)
    assert b.stats().samples == 0


# -- wait_ready ------------------------------------------------------------------
def test_wait_ready_times_out_on_an_empty_buffer(make_buffer):
    b = make_buffer(SPEC, CAPACITY, chunk_size=4)
    with pytest.raises(shmbuf.WaitTimeoutError) as info:
        b.wait_ready(1, timeout=0.01)
    assert isinstance(info.value, TimeoutError)
    assert b.name in str(info.value) and "0 live steps" in str(info.value)
    with pytest.raises(shmbuf.WaitTimeoutError):
        b.wait_ready(1, timeout=0)


def test_wait_ready_returns_at_once_when_enough(buf):
    live = buf.stats().live_steps
    assert buf.wait_ready(live, timeout=0) == live
    assert buf.wait_ready(timeout=None) == live


BAD_WAIT = [
    ("min_steps > capacity", dict(min_steps=CAPACITY + 1), ValueError, "min_steps"),
    ("min_steps 0", dict(min_steps=0), ValueError, "min_steps"),
    ("min_steps -1", dict(min_steps=-1), ValueError, "min_steps"),
    ("min_steps bool", dict(min_steps=True), TypeError, "min_steps"),
    ("min_steps float", dict(min_steps=1.0), TypeError, "min_steps"),
    ("timeout negative", dict(min_steps=1, timeout=-1), ValueError, "timeout"),
    ("timeout nan", dict(min_steps=1, timeout=float("nan")), ValueError, "timeout"),
    ("timeout str", dict(min_steps=1, timeout="1"), TypeError, "timeout"),
]


@pytest.mark.parametrize("case, kwargs, exc, text", BAD_WAIT, ids=_ids(BAD_WAIT))
def test_wait_ready_rejects_bad_arguments(buf, case, kwargs, exc, text):
    before = state(buf)
    with pytest.raises(exc) as info:
        buf.wait_ready(**kwargs)
    assert text in str(info.value)
    assert_unchanged(buf, before)


@pytest.mark.parametrize("value, dtype, shape, says", [
    (300, np.uint8, (), "300 does not fit in uint8 (integers 0..255)"),
    (np.array([1, 2, 300]), np.uint8, (3,), "300 (at index (2,)) does not fit in uint8"),
    (0.5, np.uint8, (), "0.5 does not fit in uint8"),
    (2, np.bool_, (), "2 does not fit in bool (False/True or 0/1)"),
    (2.0, np.bool_, (), "2.0 does not fit in bool"),
    (1e6, np.float16, (), "1000000.0 does not fit in float16 (real numbers within +-65504)"),
    (2 ** 24 + 1, np.float32, (), "16777217 does not fit in float32 (integers are exact up to"),
    (1 + 2j, np.float32, (), "(1+2j) has an imaginary part"),
    (np.array(["hello world"]), "<U5", (1,), "'hello world' does not fit in <U5"),
])
def test_a_lossy_cast_names_the_value_that_does_not_fit(make_buffer, value, dtype, shape, says):
    buf = make_buffer({"x": (shape, dtype)}, 10, done_key=None)
    with buf.writer() as w:
        with pytest.raises(TypeError) as err:
            w.add(x=value)
        assert "add(x=...): " + says in str(err.value)
        assert "nothing was written" in str(err.value)
        assert len(buf) == 0


def test_values_that_fit_are_accepted_whatever_their_dtype(make_buffer):
    buf = make_buffer({"x": ((3,), np.uint8), "f": ((), np.float32)}, 10, done_key=None)
    with buf.writer() as w:
        w.add(x=np.array([0, 7, 255], np.int64), f=np.float64(0.25))
    assert buf.arrays["x"][0].tolist() == [0, 7, 255]


FLOAT_DONE = {"x": ((), np.float32), "done": ((), np.float32)}


@pytest.mark.parametrize("value", [0.5, -3.0, np.float32(0.5), np.float32(-3.0), float("nan"),
                                   2], ids=["half", "minus3", "f32-half", "f32-minus3", "nan",
                                            "int-2"])
def test_a_float_done_column_takes_exactly_0_or_1(make_buffer, value):
    buf = make_buffer(FLOAT_DONE, CAPACITY)
    w = buf.writer()
    for t in range(3):   # exact dtypes: later adds go through the C fast path
        w.add(x=np.float32(t), done=np.float32(0.0))
    assert w._fast_add is not None
    before = state(buf)
    shown = "nan" if value != value else repr(float(value))
    with pytest.raises(ValueError, match=rf"add\(done=...\).* exactly 0 or 1.*got {shown} "
                                         r"at this writer's step 3"):
        w.add(x=np.float32(3), done=value)
    assert_unchanged(buf, before)
    w.add(x=np.float32(3), done=np.float32(1.0))   # a true flag still ends the episode
    w.add(x=np.float32(4), done=1.0)
    assert buf.stats().episodes == 2
    w.close()


def test_add_batch_and_extend_refuse_float_done_values_but_0_and_1(make_buffer):
    buf = make_buffer(FLOAT_DONE, CAPACITY)
    batch, run = buf.writer(), buf.writer()
    ok = {"x": np.zeros(N_ENVS, np.float32), "done": np.zeros(N_ENVS, np.float32)}
    batch.add_batch(**ok)
    assert batch._fast_batch is not None
    before = state(buf)
    with pytest.raises(ValueError, match=r"add_batch\(done=...\).*got 0.25 at env row 2"):
        batch.add_batch(x=ok["x"], done=np.array([0, 1, 0.25], np.float32))
    with pytest.raises(ValueError, match=r"extend\(done=...\).*got -1.0 at step 4 of the run"):
        run.extend(x=np.zeros(6, np.float32), done=np.array([0, 0, 1, 0, -1, 0], np.float32))
    assert_unchanged(buf, before)
    run.extend(x=np.zeros(6, np.float32), done=np.array([0, 0, 1, 0, 0, 1], np.float64))
    batch.add_batch(x=ok["x"], done=np.array([0, 1, 0], np.float32))
    assert buf.stats().episodes == 3
    batch.close()
    run.close()
