"""Writer.extend (a run of T steps per call) and the C fast path of add / add_batch.

extend must leave exactly what T calls of add leave: the same bytes, the same
episode index, the same windows; bad input raises, naming the argument, before
anything is written.  The C fast path must write the same bytes as the Python
path and leave every error to it (property tests), and readers in this process
must never see a partial step while spawned writers extend.
"""
import multiprocessing
import time

import numpy as np
import pytest
from helpers.procs import join_all, running
from helpers.workers import SPEC, episode_steps, extend_until, verify_batch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shmbuf

TIMEOUT = 60


def _stack(steps):
    return {k: np.stack([np.asarray(s[k]) for s in steps]) for k in SPEC}


def _contents(buf):
    """Everything a reader can see: the episode index and every committed row, per stream."""
    eps = buf.episodes()
    snap = buf.snapshot()
    return eps, snap


def _same_contents(a, b):
    ea, eb = a.episodes(), b.episodes()
    for f in ("length", "terminal", "stream", "ep", "chunk", "offset"):
        assert np.array_equal(getattr(ea, f), getattr(eb, f)), f
    for name in a._views:
        assert np.array_equal(a._views[name], b._views[name]), name
    assert np.array_equal(a._ring.chunk_table, b._ring.chunk_table)
    assert a.stats().steps_written == b.stats().steps_written


@pytest.mark.parametrize("chunk_size", [1, 3, 7, 64])
@pytest.mark.parametrize("runs", [[1], [5, 9, 1, 30], [64, 64], [13] * 9])
def test_extend_leaves_what_add_leaves(make_buffer, chunk_size, runs):
    steps = list(episode_steps(3, sum(runs), 6))   # a terminal every 6 steps
    if len(steps) > 11:
        steps[10]["done"] = steps[11]["done"] = True    # and two back to back
    a = make_buffer(SPEC, 200, chunk_size=chunk_size, seed=1)
    b = make_buffer(SPEC, 200, chunk_size=chunk_size, seed=1)
    with a.writer() as wa, b.writer() as wb:
        at = 0
        for n in runs:
            wa.extend(**_stack(steps[at:at + n]))
            for s in steps[at:at + n]:
                wb.add(**s)
            at += n
        wa.end_episode()
        wb.end_episode()
        assert wa.steps == wb.steps == at
    _same_contents(a, b)
    if len(a) >= 8:
        verify_batch(a.sample_sequences(32, 4, rng=np.random.default_rng(0)))
        verify_batch(a.sample_sequences(16, 3, uniform="episodes", rng=np.random.default_rng(0)))


def test_extend_then_add_then_extend_continue_one_stream(make_buffer):
    buf = make_buffer(SPEC, 300, chunk_size=10)
    steps = list(episode_steps(1, 120, 17))
    with buf.writer() as w:
        w.extend(**_stack(steps[:33]))
        for s in steps[33:40]:
            w.add(**s)
        w.extend(**_stack(steps[40:120]))
    assert len(buf) == 120
    eps = buf.episodes()
    assert eps.length.tolist() == [17] * 7 and eps.terminal.all()
    for length in (2, 9, 17):
        verify_batch(buf.sample_sequences(64, length, rng=np.random.default_rng(length)))


def _good_run(n=4):
    return _stack(list(episode_steps(0, n, 3)))


def _bad_runs():
    run = _good_run()
    yield "action", dict(run, action=run["action"][:3]), r"same run length T, got obs 4, action 3"
    yield "obs", {k: v[:0] for k, v in run.items()}, r"at least 1 step, got T = 0"
    yield "done", dict(run, done=np.array([0.0, 0.5, 1.0, 0.0])), r"extend\(done=\.\.\.\).*0\.5"
    yield "done", dict(run, done=np.array(["no", "no", "yes", "no"])), r"extend\(done=\.\.\.\)"
    yield "obs", dict(run, obs=run["obs"][:, :2]), (r"extend\(obs=\.\.\.\): "
                                                    r"expected shape \(4, 3, 8, 8\)")
    yield "reward", dict(run, reward=np.float32(1)), r"extend\(reward=\.\.\.\).*leading run axis"
    yield "obs", dict(run, obs=run["obs"].astype(np.float32) + 0.5), r"extend\(obs=\.\.\.\)"


@pytest.mark.parametrize("arg, columns, message", list(_bad_runs()))
def test_extend_bad_input_raises_and_writes_nothing(make_buffer, arg, columns, message):
    buf = make_buffer(SPEC, 50, chunk_size=4)
    with buf.writer() as w:
        w.extend(**_good_run(5))
        before = [v.copy() for v in buf._views.values()], buf.stats().steps_written
        with pytest.raises((ValueError, TypeError), match=message) as info:
            w.extend(**columns)
        assert arg in str(info.value)
        after = [v.copy() for v in buf._views.values()], buf.stats().steps_written
        assert all(np.array_equal(x, y) for x, y in zip(before[0], after[0]))
        assert before[1] == after[1] == 5 and w.steps == 5
        w.extend(**_good_run(2))            # the writer is still usable
    assert len(buf) == 7


def test_extend_longer_than_capacity_raises(make_buffer):
    buf = make_buffer(SPEC, 20, chunk_size=4)
    with buf.writer() as w:
        with pytest.raises(ValueError, match=r"T = 21 steps is longer than the buffer's "
                                             r"capacity of 20"):
            w.extend(**_stack(list(episode_steps(0, 21, 5))))
        with pytest.raises(KeyError, match="missing columns \\['reward'\\]"):
            w.extend(**{k: v for k, v in _good_run().items() if k != "reward"})
    assert len(buf) == 0 and buf.stats().steps_written == 0


def test_extend_of_the_whole_capacity_wraps_onto_itself_once(make_buffer):
    buf = make_buffer(SPEC, 20, chunk_size=4)
    with buf.writer() as w:
        w.extend(**_stack(list(episode_steps(0, 20, 5))))
        w.extend(**_stack(list(episode_steps(0, 40, 5))[20:]))
    assert buf.stats().steps_written == 40
    verify_batch(buf.sample_sequences(16, 4, rng=np.random.default_rng(1)))


# -- the C fast path of add / add_batch against the Python path -----------------------
SCALAR_SPEC = {"i8": ((), np.int8), "u2": ((), np.uint16), "i4": ((), np.int32),
               "u8": ((), np.uint64), "f4": ((), np.float32), "f8": ((), np.float64),
               "b": ((), np.bool_), "v": ((2,), np.float32), "done": ((), np.bool_)}

_VALUES = st.one_of(
    st.booleans(), st.integers(-2**70, 2**70), st.sampled_from([0, 1, -1, 127, 128, -129, 255,
                                                               256, 65535, 65536, 2**23,
                                                               2**23 + 1, 2**53 + 1, 2**64 - 1]),
    st.floats(allow_nan=True, allow_infinity=True, width=64),
    st.sampled_from([0.0, 1.0, -0.0, 0.5, 1e-50, 3.5e38, -3.5e38, 1e300]),
    st.builds(lambda v, t: np.array(v).astype(t) if t else np.array(v),
              st.integers(-3, 300), st.sampled_from([None, np.int8, np.uint16, np.int32,
                                                     np.float32, np.float64, np.bool_])),
    st.builds(lambda v, t: getattr(np, t)(v), st.integers(0, 1),
              st.sampled_from(["int8", "uint16", "int32", "uint64", "float32", "float64",
                               "bool_"])),
    st.just("x"), st.just(None), st.just([1, 2]),
)


def _slow(w):
    """Force the Python path on ``w`` (after its streams exist)."""
    w._fast_add = w._fast_batch = None


def _outcome(fn):
    try:
        fn()
        return None
    except Exception as exc:   # noqa: BLE001 - compared between the two paths
        return type(exc), str(exc)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(st.lists(st.fixed_dictionaries(
    {k: (_VALUES if k != "v" else st.one_of(
        st.just(np.ones(2, np.float32)), st.just(np.ones(3, np.float32)),
        st.just(np.ones(2, np.float64)), st.just(np.ones((2, 2), np.float32)[:, 0]),
        st.just([0.5, 1.0]))) for k in SCALAR_SPEC}), min_size=1, max_size=6))
def test_add_fast_path_writes_what_the_python_path_writes(steps):
    first = {k: np.zeros(s, d) for k, (s, d) in SCALAR_SPEC.items()}
    with shmbuf.create(SCALAR_SPEC, 40, chunk_size=3) as fast, \
            shmbuf.create(SCALAR_SPEC, 40, chunk_size=3) as slow, \
            fast.writer() as wf, slow.writer() as ws:
        wf.add(**first)
        ws.add(**first)
        assert wf._fast_add is not None
        _slow(ws)
        for step in steps:
            assert _outcome(lambda: wf.add(**step)) == _outcome(lambda: ws.add(**step))  # noqa: B023 - _outcome() calls it at once
        assert wf.steps == ws.steps
        _same_contents(fast, slow)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 4), st.sampled_from(["ok", "cast", "shape", "lossy",
                                                               "strided", "list", "missing"])),
                min_size=1, max_size=8))
def test_add_batch_fast_path_writes_what_the_python_path_writes(calls):
    n = 4
    rng = np.random.default_rng(len(calls))

    def batch(done_row, kind):
        cols = {"obs": rng.integers(0, 255, (n, 3, 8, 8), dtype=np.uint8),
                "action": rng.standard_normal((n, 6)).astype(np.float32),
                "reward": rng.standard_normal(n).astype(np.float32),
                "done": np.arange(n) == done_row}
        if kind == "cast":
            cols["reward"] = cols["reward"].astype(np.float64)
        elif kind == "shape":
            cols["action"] = cols["action"][:, :5]
        elif kind == "lossy":
            cols["obs"] = cols["obs"].astype(np.int64) + 200
        elif kind == "strided":
            cols["action"] = np.repeat(cols["action"], 2, axis=1)[:, ::2]
        elif kind == "list":
            cols["done"] = cols["done"].tolist()
        elif kind == "missing":
            del cols["reward"]
        return cols

    with shmbuf.create(SPEC, 60, chunk_size=5) as fast, \
            shmbuf.create(SPEC, 60, chunk_size=5) as slow, \
            fast.writer() as wf, slow.writer() as ws:
        first = batch(9, "ok")
        wf.add_batch(**first)
        ws.add_batch(**first)
        assert wf._fast_batch is not None
        _slow(ws)
        for done_row, kind in calls:
            cols = batch(done_row, kind)
            assert _outcome(lambda: wf.add_batch(**cols)) == _outcome(lambda: ws.add_batch(**cols))  # noqa: B023 - _outcome() calls it at once
            if done_row == 2:
                wf.end_episode(1)
                ws.end_episode(1)
        _same_contents(fast, slow)


def test_fast_path_is_taken_after_extend_opened_the_stream(make_buffer):
    # extend may open the writer's stream first; the adds after it still go in C.
    buf = make_buffer(SPEC, 100, chunk_size=8)
    steps = list(episode_steps(0, 30, 7))
    with buf.writer() as w:
        w.extend(**_stack(steps[:5]))
        assert w._fast_add is not None
        calls = []
        real = w._fast_add
        w._fast_add = lambda cols: calls.append(real(cols)) or calls[-1]
        for s in steps[5:]:
            w.add(**s)
    assert len(calls) == 25 and calls.count(-1) <= 4   # -1 only where a chunk is claimed
    verify_batch(buf.sample_sequences(20, 5, rng=np.random.default_rng(0)))
    assert buf.episodes().length.tolist() == [7, 7, 7, 7]


def test_fast_path_is_taken_for_exact_values(make_buffer, monkeypatch):
    buf = make_buffer(SPEC, 100, chunk_size=8)
    steps = list(episode_steps(0, 30, 7))
    with buf.writer() as w:
        w.add(**steps[0])
        calls = []
        real = w._fast_add
        w._fast_add = lambda cols: calls.append(real(cols)) or calls[-1]
        for s in steps[1:]:
            w.add(**s)
    # one -1 per chunk claim (every 8 steps), 0 or 1 otherwise
    assert calls.count(-1) == 3 and calls.count(1) == 4 and len(calls) == 29
    verify_batch(buf.sample_sequences(20, 5, rng=np.random.default_rng(0)))
    assert buf.episodes().length.tolist() == [7, 7, 7, 7]


# -- readers never see a partial step while spawned writers extend ---------------------
@pytest.mark.slow
def test_readers_see_whole_steps_while_spawned_writers_extend(make_buffer):
    buf = make_buffer(SPEC, 1500, chunk_size=16)
    ctx = multiprocessing.get_context("spawn")
    stop, ready = ctx.Event(), ctx.Semaphore(0)
    procs = [ctx.Process(target=extend_until, args=(buf, i, stop, ready, 200_000),
                         kwargs=dict(episode_len=31 + 10 * i, run=7 + 20 * i))
             for i in (1, 2)]
    with running(procs):
        deadline = time.monotonic() + TIMEOUT
        for _ in procs:
            while not ready.acquire(timeout=0.1):
                assert all(p.exitcode in (None, 0) for p in procs), "a writer died"
                assert time.monotonic() < deadline, "a writer never wrote"
        buf.wait_ready(min_steps=200, timeout=TIMEOUT)
        rng = np.random.default_rng(5)
        verified = 0
        for i in range(150):
            length = (3, 11, 25)[i % 3]
            uniform = "episodes" if i % 5 == 4 else "steps"
            try:
                batch = buf.sample_sequences(16, length, rng=rng, uniform=uniform)
            except shmbuf.NotEnoughDataError:
                continue
            verified += verify_batch(batch)
        stop.set()
        join_all(procs, TIMEOUT)
        assert verified > 1000
        assert buf.stats().steps_written > buf.capacity


# -- the chunk entry's episode starts decide windows exactly as the _ep column does ----
def _valid_starts(buf, length, tail):
    rows = buf._ring.committed_rows()
    return buf._finder.valid(rows, length, tail)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chunk_size=st.integers(1, 9),
       steps=st.lists(st.tuples(st.sampled_from(["add", "extend", "cut"]), st.integers(1, 12),
                                st.integers(1, 6)), min_size=1, max_size=25))
def test_starts_word_decides_windows_like_the_ep_column(chunk_size, steps):
    """Every committed start row, every length and tail: the same verdict with the
    starts words as with all of them marked untracked (which makes C read _ep)."""
    from shmbuf.protocol import layout as _layout

    with shmbuf.create(SPEC, 120, chunk_size=chunk_size) as buf:
        pos = 0
        with buf.writer() as w:
            for kind, n, every in steps:
                run = list(episode_steps(1, pos + n, every))[pos:]
                if kind == "add":
                    for s in run:
                        w.add(**s)
                elif kind == "extend":
                    w.extend(**_stack(run))
                else:
                    w.end_episode()
                    continue
                pos += n
        starts_col = _layout.CHUNK_FIELDS["starts"] // 8
        table = buf._ring.chunk_table
        for length in range(1, 8):
            for tail in range(length):
                exact = _valid_starts(buf, length, tail)
                saved = table[:, starts_col].copy()
                table[:, starts_col] = np.uint64(_layout.STARTS_UNTRACKED)
                try:
                    by_ep = _valid_starts(buf, length, tail)
                finally:
                    table[:, starts_col] = saved
                assert exact.tolist() == by_ep.tolist(), (length, tail)


# -- a writer SIGKILLed inside extend leaves a chunk-aligned prefix ----------------------
KILLED_INSIDE_EXTEND = """
    import os, signal, sys
    import numpy as np
    import shmbuf
    from shmbuf.protocol import streams as _ring
    buf = shmbuf.attach(sys.argv[1])
    real, published = _ring.Streams.publish_run, []

    def publish_run(self, i, n, ends):   # the kill lands between two chunk publishes
        real(self, i, n, ends)
        published.append(n)
        if len(published) == 2:
            print("killed", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    _ring.Streams.publish_run = publish_run
    w = buf.writer()
    done = np.zeros(40, bool)
    done[5] = True                      # episode A: steps 0..5; B begins at step 6
    w.extend(x=np.arange(40), done=done)
"""


@pytest.mark.slow
def test_a_run_killed_mid_extend_leaves_its_episode_unfinished_and_unindexed(make_buffer):
    from helpers.stop_workers import Script

    buf = make_buffer({"x": ((), np.int64), "done": ((), np.bool_)}, 256, chunk_size=8)
    child = Script(KILLED_INSIDE_EXTEND.replace("sys.argv[1]", repr(buf.name)))
    try:
        assert child.line() == "killed" and child.wait() == -9
    finally:
        child.close()
    assert len(buf) == 16                                  # two whole chunks of the run
    assert buf.episodes().length.tolist() == [6]           # A; B never finishes
    assert buf.count_episodes(1) == 1
    drawn = buf.sample_sequences(100, 3, uniform="episodes", rng=0)["x"]
    assert drawn.max() <= 5                                # episodes mode: A only
    assert [ep["x"].tolist() for ep in buf.iter_episodes()] == [list(range(6))]
    assert [ep["x"].tolist() for ep in buf.iter_episodes(include_open=True)] == [
        list(range(6)), list(range(6, 16))]                # the prefix, asked for
    steps = buf.sample_sequences(200, 3, rng=0)["x"]       # steps mode: B's prefix too
    assert steps.max() == 15 and (np.diff(steps, axis=0) == 1).all()


def test_extend_returns_the_rows_its_run_went_to(make_buffer):
    """Across chunk ends, and after another writer took the chunks between: the rows
    ``extend`` returns hold the run's steps, in order."""
    buf = make_buffer({"x": ((), np.int64), "done": ((), np.bool_)}, 64, chunk_size=4)
    a, b = buf.writer(), buf.writer()
    got = []
    for start in (0, 100, 200):
        x = np.arange(start, start + 7)
        rows = a.extend(x=x, done=np.zeros(7, bool))
        b.extend(x=np.full(5, -1), done=np.zeros(5, bool))   # interleaves its own chunks
        assert rows.dtype == np.int64 and rows.shape == (7,)
        got.append((rows, x))
    for rows, x in got:
        assert (buf.arrays["x"][rows] == x).all()
        assert np.isin(rows, buf.committed_rows()).all()
