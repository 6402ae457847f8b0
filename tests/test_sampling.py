"""Window sampling in one process, checked against a reference model.

The reference knows every step the test wrote (stream, position, terminal,
cut) and finds the row each step landed in right after writing it.  Recycling
is per chunk, and a recycled chunk's new owner writes the chunk's first row
before any other, so a step is live exactly while no later step has landed on
the first row of its chunk.  From that the reference derives every valid
window, without looking at shmbuf's index.
"""
import contextlib
import dataclasses
import sys

import numpy as np
import pytest
import torch
from helpers.preempt import At, atomic_loads
from helpers.workers import SPEC, EnvCursor, batch_step, step_for, verify_batch, write_batches
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shmbuf

TORCH_DTYPES = {np.dtype(np.uint8): torch.uint8, np.dtype(np.float32): torch.float32,
                np.dtype(np.bool_): torch.bool}


@dataclasses.dataclass
class Step:
    episode: int
    t: int
    done: bool
    cut: bool = False       # end_episode was called right after this step
    row: int = -1
    tick: int = -1          # write call that added it


class Reference:
    """Every step written to ``buf``, where it landed, and which are still live."""

    def __init__(self, buf):
        self.buf = buf
        self.k = buf.chunk_size
        self.action = buf.arrays["action"]
        self.streams: dict[int, list[Step]] = {}
        self.cursor: dict[int, tuple[int, int]] = {}
        self.tick = 0
        self.first_row_tick: dict[int, int] = {}

    def step(self, stream: int, done: bool) -> dict:
        """The encoded step to write next to ``stream`` (ids start at 1)."""
        episode, t = self.cursor.get(stream, (0, 0))
        steps = self.streams.setdefault(stream, [])
        steps.append(Step(episode, t, bool(done)))
        self.cursor[stream] = (episode + 1, 0) if done else (episode, t + 1)
        return step_for(stream, len(steps) - 1, episode, t, bool(done))

    def cut(self, stream: int) -> None:
        episode, t = self.cursor.get(stream, (0, 0))
        if t:
            self.streams[stream][-1].cut = True
            self.cursor[stream] = (episode + 1, 0)

    def landed(self, streams) -> None:
        """Find the rows of the newest step of each of ``streams`` (one write call)."""
        for stream in streams:
            pos = len(self.streams[stream]) - 1
            rows = np.flatnonzero((self.action[:, 0] == stream) & (self.action[:, 3] == pos))
            assert len(rows) == 1, f"step {pos} of stream {stream} is in rows {rows}"
            rec = self.streams[stream][pos]
            rec.row, rec.tick = int(rows[0]), self.tick
            if rec.row % self.k == 0:
                self.first_row_tick[rec.row // self.k] = self.tick
        self.tick += 1

    def live(self, rec: Step) -> bool:
        return self.first_row_tick[rec.row // self.k] <= rec.tick

    def live_steps(self) -> set:
        return {(s, p) for s, steps in self.streams.items()
                for p, rec in enumerate(steps) if self.live(rec)}

    def valid_starts(self, length: int) -> set:
        """(stream, first position) of every window of ``length`` that may be sampled."""
        out = set()
        for stream, steps in self.streams.items():
            if len(steps) < length:
                continue
            live = np.array([self.live(r) for r in steps])
            stop = np.array([r.done or r.cut for r in steps])
            all_live = np.lib.stride_tricks.sliding_window_view(live, length).all(axis=1)
            crosses = np.lib.stride_tricks.sliding_window_view(stop[:-1], length - 1).any(axis=1) \
                if length > 1 else np.zeros(len(steps), bool)
            out.update((stream, int(p)) for p in np.flatnonzero(all_live & ~crosses))
        return out

    def check_consistent(self) -> None:
        """The buffer still holds every live step where it landed, and nothing else is live."""
        live = self.live_steps()
        for stream, pos in live:
            row = self.streams[stream][pos].row
            assert (self.action[row, 0], self.action[row, 3]) == (stream, pos)
        assert self.buf.stats().live_steps == len(live)

    def window_starts(self, batch: dict) -> list:
        """(stream, first position) of each window of a batch-major batch."""
        first = batch["action"][:, 0]
        return list(zip(first[:, 0].astype(int).tolist(), first[:, 3].astype(int).tolist()))

    def check_done_flags(self, batch: dict) -> None:
        for b, (stream, pos) in enumerate(self.window_starts(batch)):
            want = [r.done for r in self.streams[stream][pos:pos + batch["done"].shape[1]]]
            assert batch["done"][b].tolist() == want


def check_sampling(buf, ref: Reference, length: int, seed: int) -> None:
    """Sampled windows are valid ones; sampling fails only when none exists."""
    valid = ref.valid_starts(length)
    if not valid:
        with pytest.raises(shmbuf.NotEnoughDataError):
            buf.sample_sequences(8, length, rng=seed)
        return
    batch = buf.sample_sequences(32, length, time_major=False, rng=seed)
    assert batch["reward"].shape == (32, length)
    verify_batch(batch, time_major=False)
    starts = ref.window_starts(batch)
    assert set(starts) <= valid, f"invalid windows sampled: {set(starts) - valid}"
    ref.check_done_flags(batch)


class Writers:
    """Solo and batch writers of one buffer, with their stream ids."""

    def __init__(self, buf, envs, stack: contextlib.ExitStack):
        self.writers, self.streams, next_id = [], [], 1
        for n in envs:
            self.writers.append(stack.enter_context(buf.writer()))
            self.streams.append(list(range(next_id, next_id + (n or 1))))
            next_id += n or 1
        self.envs = envs
        self.started = [False] * len(envs)

    def add(self, ref: Reference, i: int, dones) -> None:
        """One add (solo) or add_batch call by writer ``i``; ``dones`` per stream."""
        w, streams = self.writers[i], self.streams[i]
        steps = [ref.step(s, d) for s, d in zip(streams, dones)]
        if self.envs[i] is None:
            w.add(**steps[0])
        else:
            w.add_batch(**{k: np.stack([np.asarray(s[k]) for s in steps]) for k in SPEC})
        self.started[i] = True
        ref.landed(streams)

    def cut(self, ref: Reference, i: int, env: int) -> None:
        if self.envs[i] is None:
            self.writers[i].end_episode()
            ref.cut(self.streams[i][0])
        elif self.started[i]:
            env %= self.envs[i]
            self.writers[i].end_episode(env)
            ref.cut(self.streams[i][env])


OPS = st.one_of(
    st.tuples(st.just("add"), st.integers(0, 2), st.integers(1, 60), st.sampled_from(
        [0.0, 0.05, 0.2, 0.6]), st.integers(0, 2 ** 16)),
    st.tuples(st.just("cut"), st.integers(0, 2), st.integers(0, 2)),
    st.tuples(st.just("sample"), st.integers(1, 14)),
)


@st.composite
def scenarios(draw):
    envs = draw(st.lists(st.sampled_from([None, None, 1, 2, 3]), min_size=1, max_size=3))
    n_streams = sum(n or 1 for n in envs)
    # Mostly small buffers, so that most examples wrap around and recycle.
    low = max(8, n_streams + 1)
    capacity = draw(st.one_of(st.integers(low, 48), st.integers(low, 300)))
    # Every stream holds one chunk it is filling; a claim needs one more.
    max_chunk = (capacity - 1) // n_streams
    chunk_size = draw(st.one_of(st.integers(1, min(4, max_chunk)), st.integers(1, max_chunk)))
    ops = draw(st.lists(OPS, min_size=2, max_size=25))
    return envs, capacity, chunk_size, ops


@pytest.mark.slow
@settings(max_examples=80, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(scenarios())
def test_sampled_windows_match_reference_model(scenario):
    envs, capacity, chunk_size, ops = scenario
    with contextlib.ExitStack() as stack:
        buf = stack.enter_context(shmbuf.create(SPEC, capacity, chunk_size=chunk_size))
        writers = Writers(buf, envs, stack)
        ref = Reference(buf)
        for n_op, op in enumerate(ops):
            if op[0] == "add":
                _, i, n, p_done, seed = op
                i %= len(envs)
                rng = np.random.default_rng(seed)
                for _ in range(n):
                    writers.add(ref, i, rng.random(len(writers.streams[i])) < p_done)
            elif op[0] == "cut":
                writers.cut(ref, op[1] % len(envs), op[2])
            else:
                ref.check_consistent()
                check_sampling(buf, ref, min(op[1], capacity), seed=n_op)
        ref.check_consistent()
        k = chunk_size
        for length in sorted({1, 2, 3, k, k + 1, 2 * k + 1, capacity // 2}):
            if length <= capacity:
                check_sampling(buf, ref, length, seed=length)
        steps = ref.live_steps()
        if steps:
            batch = buf.sample_steps(64, rng=1)
            got = zip(batch["action"][:, 0].astype(int).tolist(),
                      batch["action"][:, 3].astype(int).tolist())
            assert set(got) <= steps
        else:
            with pytest.raises(shmbuf.NotEnoughDataError):
                buf.sample_steps(4, rng=1)


def test_empty_buffer_raises_not_enough_data(make_buffer):
    buf = make_buffer(SPEC, 64, chunk_size=4)
    with pytest.raises(shmbuf.NotEnoughDataError):
        buf.sample_sequences(4, 1)
    with pytest.raises(shmbuf.NotEnoughDataError):
        buf.sample_steps(4)


# -- uniformity ------------------------------------------------------------------

def _fill_uniformity_buffer(buf, ref, writers):
    """Two streams interleaved, with terminals and a cut: a known set of valid starts."""
    rng = np.random.default_rng(3)
    for i in range(90):
        w = i % 2
        writers.add(ref, w, [rng.random() < 0.08])
        if i == 41:
            writers.cut(ref, 1, 0)


def _chi_square(counts: np.ndarray) -> float:
    expected = counts.sum() / len(counts)
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.slow
@pytest.mark.parametrize("length, batch_size, calls", [(4, 4000, 5), (9, 1, 1500)],
                         ids=["dense-big-batches", "sparse-batch-of-one"])
def test_starts_are_uniform_over_valid_windows(make_buffer, length, batch_size, calls):
    buf = make_buffer(SPEC, 64, chunk_size=4)
    with contextlib.ExitStack() as stack:
        writers = Writers(buf, [None, None], stack)
        ref = Reference(buf)
        _fill_uniformity_buffer(buf, ref, writers)
        valid = sorted(ref.valid_starts(length))
        assert len(valid) >= 5, "the scenario should leave several valid starts"
        rng = np.random.default_rng(2024)
        counts = dict.fromkeys(valid, 0)
        for _ in range(calls):
            batch = buf.sample_sequences(batch_size, length, time_major=False, rng=rng)
            for start in ref.window_starts(batch):
                assert start in counts, f"invalid window {start} sampled"
                counts[start] += 1
        observed = np.array(list(counts.values()), float)
        assert observed.min() > 0, "some valid start was never drawn"
        df = len(observed) - 1
        stat = _chi_square(observed)
        # Deterministic given the seed; the bound is mean + 6 standard deviations.
        assert stat < df + 6 * np.sqrt(2 * df), f"chi-square {stat:.1f} with {df} dof"


# -- focused behaviours --------------------------------------------------------------

def _solo(buf, stack, n_writers=1):
    return Writers(buf, [None] * n_writers, stack)


def test_newest_step_is_sampled(make_buffer):
    buf = make_buffer(SPEC, 64, chunk_size=4)
    with contextlib.ExitStack() as stack:
        ref = Reference(buf)
        writers = _solo(buf, stack, 2)
        for i in range(41):
            writers.add(ref, i % 2, [False])
        newest = (1, len(ref.streams[1]) - 1)        # stream 1 wrote the last step
        steps = buf.sample_steps(2000, rng=0)
        got = set(zip(steps["action"][:, 0].astype(int).tolist(),
                      steps["action"][:, 3].astype(int).tolist()))
        assert newest in got
        assert got == ref.live_steps()
        batch = buf.sample_sequences(2000, 5, time_major=False, rng=1)
        verify_batch(batch, time_major=False)
        ends = {(s, p + 4) for s, p in ref.window_starts(batch)}
        assert newest in ends


def test_windows_end_on_terminals_but_never_cross_them(make_buffer):
    buf = make_buffer(SPEC, 256, chunk_size=4)
    with buf.writer() as w:
        for pos in range(120):
            episode, t = divmod(pos, 6)
            w.add(**step_for(1, pos, episode, t, t == 5))
    batch = buf.sample_sequences(1000, 6, time_major=False, rng=0)
    verify_batch(batch, time_major=False)
    # Episodes are 6 long: a window of 6 is a whole episode, ending on its terminal.
    assert batch["done"][:, -1].all() and not batch["done"][:, :-1].any()
    batch = buf.sample_sequences(1000, 3, time_major=False, rng=1)
    verify_batch(batch, time_major=False)
    assert batch["done"][:, -1].any(), "windows that end on a terminal should be drawn"
    with pytest.raises(shmbuf.NotEnoughDataError):
        buf.sample_sequences(4, 7)


def test_windows_span_chunk_boundaries(make_buffer):
    buf = make_buffer(SPEC, 200, chunk_size=2)
    with contextlib.ExitStack() as stack:
        ref = Reference(buf)
        writers = _solo(buf, stack, 3)
        for i in range(150):
            writers.add(ref, i % 3, [False])
        ref.check_consistent()
        batch = buf.sample_sequences(500, 7, time_major=False, rng=0)
        verify_batch(batch, time_major=False)
        assert set(ref.window_starts(batch)) <= ref.valid_starts(7)
        # Streams interleave chunk by chunk: no window's rows are contiguous.
        for s, p in ref.window_starts(batch):
            assert ref.streams[s][p + 6].row - ref.streams[s][p].row != 6


def test_wrap_around_never_splices_newest_onto_oldest(make_buffer):
    buf = make_buffer(SPEC, 32, chunk_size=4)
    with contextlib.ExitStack() as stack:
        ref = Reference(buf)
        writers = _solo(buf, stack, 2)
        for i in range(403):
            writers.add(ref, 0 if i % 5 else 1, [False])
        ref.check_consistent()
        stats = buf.stats()
        assert stats.steps_written == 403 and stats.live_steps <= 32
        for length in (2, 5, 9, 14):
            valid = ref.valid_starts(length)
            batch = buf.sample_sequences(400, length, time_major=False, rng=length)
            verify_batch(batch, time_major=False)
            assert set(ref.window_starts(batch)) <= valid


def test_capacity_50_three_writers_one_process(make_buffer):
    buf = make_buffer(SPEC, 50)
    with contextlib.ExitStack() as stack:
        ref = Reference(buf)
        writers = _solo(buf, stack, 3)
        rng = np.random.default_rng(0)
        for i in range(600):
            writers.add(ref, int(rng.integers(3)), [rng.random() < 0.05])
            if i % 97 == 0:
                ref.check_consistent()
                check_sampling(buf, ref, 4, seed=i)
        for length in (1, 3, 6):
            check_sampling(buf, ref, length, seed=length)


@pytest.fixture
def filled(make_buffer):
    buf = make_buffer(SPEC, 128, chunk_size=8)
    with buf.writer() as w:
        for pos in range(100):
            episode, t = divmod(pos, 25)
            w.add(**step_for(1, pos, episode, t, t == 24))
    return buf


@pytest.mark.parametrize("time_major", [True, False])
def test_sample_sequences_shapes(filled, time_major):
    batch = filled.sample_sequences(6, 5, time_major=time_major, rng=0)
    lead = (5, 6) if time_major else (6, 5)
    assert {k: v.shape for k, v in batch.items()} == {
        k: lead + shape for k, (shape, _) in SPEC.items()}
    assert {k: v.dtype for k, v in batch.items()} == {k: np.dtype(d) for k, (_, d) in SPEC.items()}
    assert verify_batch(batch, time_major=time_major) == 6


def test_time_major_is_a_transpose_of_batch_major(filled):
    a = filled.sample_sequences(6, 5, time_major=True, rng=3)
    b = filled.sample_sequences(6, 5, time_major=False, rng=3)
    for k in SPEC:
        np.testing.assert_array_equal(np.swapaxes(a[k], 0, 1), b[k])


def _numpy_out(lead):
    return {k: np.full(lead + shape, 7, dtype) for k, (shape, dtype) in SPEC.items()}


def _torch_out(lead):
    return {k: torch.full(lead + shape, 7, dtype=TORCH_DTYPES[np.dtype(dtype)])
            for k, (shape, dtype) in SPEC.items()}


@pytest.mark.parametrize("time_major", [True, False])
def test_out_numpy_filled_in_place(filled, time_major):
    lead = (5, 6) if time_major else (6, 5)
    out = _numpy_out(lead)
    got = filled.sample_sequences(6, 5, time_major=time_major, out=out, rng=4)
    fresh = filled.sample_sequences(6, 5, time_major=time_major, rng=4)
    for k in SPEC:
        assert got[k] is out[k]
        np.testing.assert_array_equal(out[k], fresh[k])
    verify_batch(out, time_major=time_major)


@pytest.mark.parametrize("time_major", [True, False])
def test_out_torch_filled_in_place(filled, time_major):
    lead = (5, 6) if time_major else (6, 5)
    out = _torch_out(lead)
    got = filled.sample_sequences(6, 5, time_major=time_major, out=out, rng=4)
    fresh = filled.sample_sequences(6, 5, time_major=time_major, rng=4)
    for k in SPEC:
        assert got[k] is out[k]
        np.testing.assert_array_equal(out[k].numpy(), fresh[k])
    verify_batch({k: v.numpy() for k, v in out.items()}, time_major=time_major)


@pytest.mark.parametrize("time_major", [True, False])
@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_windows_in_one_chunk_and_across_chunks_gather_their_rows(make_buffer, time_major,
                                                                  kind):
    # Two writers in turn: a window that leaves its chunk continues in a chunk that is
    # not the next one physically.  Windows inside one chunk are copied as one slice per
    # column, the others row by row: both must land exactly where a fancy index puts
    # them, for the whole batch and for a redraw of some of its places.
    from shmbuf.sampling import gather
    from shmbuf.sampling.out import prepare_out

    buf = make_buffer(SPEC, 128, chunk_size=8)
    with buf.writer() as w0, buf.writer() as w1:
        for pos in range(60):
            for i, w in enumerate((w0, w1)):
                w.add(**step_for(i, pos, 0, pos, False))
    port, length = buf.port, 5
    win = port.locate(np.arange(0, 120, 3), length)
    rows = win.rows
    one_chunk = rows[:, 0] // 8 == rows[:, -1] // 8
    assert one_chunk.any() and (~one_chunk).any() and len(rows) >= 12
    batch = len(rows)
    lead = (length, batch) if time_major else (batch, length)
    spec = {k: (shape, np.dtype(d)) for k, (shape, d) in SPEC.items()}
    for pending in (np.arange(batch), np.array([1, 4, 5, 9])):
        out = (_numpy_out(lead) if kind == "numpy" else _torch_out(lead))
        targets = prepare_out(out, spec, lead)
        picked = win.take(np.arange(len(pending)))
        gather.gather(port, picked, pending, targets, time_major, batch)
        for k in SPEC:
            want = np.full(lead + spec[k][0], 7, spec[k][1])
            got = out[k] if kind == "numpy" else out[k].numpy()
            taken = buf.arrays[k][picked.rows]              # (n, L, ...)
            if time_major:
                want[:, pending] = np.swapaxes(taken, 0, 1)
            else:
                want[pending] = taken
            np.testing.assert_array_equal(got, want, err_msg=f"{k} pending={pending}")


def test_copy_rows_refuses_rows_or_places_outside_its_buffers():
    from shmbuf.protocol import _rows

    src, dst = np.arange(40, dtype=np.uint8), np.zeros(8, np.uint8)
    wide, wide_dst = np.arange(80, dtype=np.uint16), np.zeros(8, np.uint16)
    at = np.zeros(1, np.int64)
    _rows.copy_rows([(src, dst, 1, 4, 1), (wide, wide_dst, 2, 8, 2)],
                    np.array([[36, 37, 38, 39]]), at)
    assert dst[:4].tolist() == [36, 37, 38, 39] and wide_dst[:4].tolist() == [36, 37, 38, 39]
    dst[:], wide_dst[:] = 0, 0
    for rows, place in (([[37, 38, 39, 40]], 0), ([[-1, 0, 1, 2]], 0), ([[0, 1, 2, 3]], 2),
                        ([[0, 1, 2, 3]], -1)):
        with pytest.raises(ValueError, match="copy_rows: a (row|window) lies outside"):
            _rows.copy_rows([(src, dst, 1, 4, 1)], np.array(rows), np.array([place]))
    # A bad second column: the first is not copied either (all checked before any copy).
    with pytest.raises(ValueError, match="copy_rows: a row lies outside"):
        _rows.copy_rows([(wide, wide_dst, 2, 8, 2), (src, dst, 1, 4, 1)],
                        np.array([[37, 38, 39, 40]]), at)
    with pytest.raises(TypeError, match="each column is"):
        _rows.copy_rows([(src, dst, 1, 4)], np.array([[0, 1, 2, 3]]), at)
    assert dst.tolist() == [0] * 8 and wide_dst.tolist() == [0] * 8   # nothing was copied


def test_step_ids_refuse_rows_outside_the_buffer(filled):
    rows = np.array([[0, 7], [8, 127]])
    ids = filled.port.step_ids(rows)
    assert ids.shape == (2, 2) and ids[0, 1] - ids[0, 0] == 7 and ids[1, 0] % 8 == 0
    for bad in (128, -1, 1 << 50):
        with pytest.raises(ValueError, match="step_ids: row out of range"):
            filled.port.step_ids(np.array([3, bad]))


def test_out_with_wrong_shape_is_rejected(filled):
    out = _numpy_out((5, 7))
    with pytest.raises(ValueError):
        filled.sample_sequences(6, 5, out=out)


def test_sample_steps_shapes_and_out(filled):
    steps = filled.sample_steps(9, rng=5)
    assert {k: v.shape for k, v in steps.items()} == {
        k: (9,) + shape for k, (shape, _) in SPEC.items()}
    assert set(steps["reward"].tolist()) <= set(range(100))
    out = {k: np.zeros((9,) + shape, dtype) for k, (shape, dtype) in SPEC.items()}
    got = filled.sample_steps(9, out=out, rng=5)
    for k in SPEC:
        assert got[k] is out[k]
        np.testing.assert_array_equal(out[k], steps[k])


def test_sample_steps_out_torch(filled):
    steps = filled.sample_steps(9, rng=5)
    out = _torch_out((9,))
    got = filled.sample_steps(9, out=out, rng=5)
    for k in SPEC:
        assert got[k] is out[k]
        np.testing.assert_array_equal(out[k].numpy(), steps[k])


def test_same_seed_same_batch(filled, make_buffer):
    a = filled.sample_sequences(16, 4, rng=11)
    b = filled.sample_sequences(16, 4, rng=np.random.default_rng(11))
    c = filled.sample_sequences(16, 4, rng=12)
    for k in SPEC:
        np.testing.assert_array_equal(a[k], b[k])
    assert not np.array_equal(a["reward"], c["reward"])
    # The buffer's own generator (create(seed=...)) is reproducible too.
    twins = [make_buffer(SPEC, 128, chunk_size=8, seed=5) for _ in range(2)]
    for buf in twins:
        with buf.writer() as w:
            for pos in range(60):
                w.add(**step_for(1, pos, pos // 20, pos % 20, pos % 20 == 19))
    first, second = (buf.sample_sequences(16, 4) for buf in twins)
    for k in SPEC:
        np.testing.assert_array_equal(first[k], second[k])


# -- add_batch ---------------------------------------------------------------------

def test_add_batch_envs_are_separate_streams(make_buffer):
    buf = make_buffer(SPEC, 2048, chunk_size=8)
    cursor = EnvCursor(first_id=1, n_envs=16)
    with buf.writer() as w:
        write_batches(w, cursor, 100)
    assert buf.stats().streams == 16
    assert buf.stats().live_steps == 1600
    for length in (3, 6, 12):
        batch = buf.sample_sequences(500, length, time_major=False, rng=length)
        verify_batch(batch, time_major=False)
    # Short episodes: env 0 (5 steps) has no window of 6; env 15 (50 steps) has many.
    seen = set(batch["action"][:, 0, 0].astype(int).tolist())
    assert 1 not in seen and 16 in seen


def test_sixteen_env_streams_keep_most_of_the_default_capacity(make_buffer):
    # Each stream holds one partly filled chunk; the default chunk size keeps
    # that below a quarter of the capacity, whatever the phase of the fill.
    buf = make_buffer(SPEC, 10_000)
    cursor = EnvCursor(first_id=1, n_envs=16)
    with buf.writer() as w:
        write_batches(w, cursor, 700)           # 11,200 rows: wrapped around
        lowest = buf.capacity
        for _ in range(buf.chunk_size):         # one full cycle of the open chunks
            write_batches(w, cursor, 1)
            lowest = min(lowest, len(buf))
    assert lowest >= 0.75 * buf.capacity, (lowest, buf.chunk_size)


def test_add_batch_done_ends_only_that_env(make_buffer):
    buf = make_buffer(SPEC, 512, chunk_size=4)
    ids = np.arange(1, 17)
    done_env = 3
    with buf.writer() as w:
        for pos in range(20):
            episode = np.where((ids == done_env + 1) & (pos > 9), 1, 0)
            t = np.where(episode == 1, pos - 10, pos)
            done = (ids == done_env + 1) & (pos == 9)
            w.add_batch(**batch_step(ids, np.full(16, pos), episode, t, done))
    # Every other env holds one window of 20; the terminal splits env done_env's.
    batch = buf.sample_sequences(600, 20, time_major=False, rng=0)
    verify_batch(batch, time_major=False)
    seen = set(batch["action"][:, 0, 0].astype(int).tolist())
    assert seen == set(ids.tolist()) - {done_env + 1}
    batch = buf.sample_sequences(1000, 10, time_major=False, rng=1)
    verify_batch(batch, time_major=False)
    starts = {(s, p) for s, p in zip(batch["action"][:, 0, 0].astype(int).tolist(),
                                     batch["action"][:, 0, 3].astype(int).tolist())}
    # Env done_env: a window ends on the terminal (start 0) or starts after it (10).
    assert {p for s, p in starts if s == done_env + 1} <= {0, 10}


@pytest.mark.slow
def test_end_episode_env_cuts_one_stream(make_buffer):
    buf = make_buffer(SPEC, 512, chunk_size=4)
    ids = np.arange(1, 17)
    cut_env = 5
    with buf.writer() as w:
        for pos in range(20):
            episode = np.where((ids == cut_env + 1) & (pos > 9), 1, 0)
            t = np.where(episode == 1, pos - 10, pos)
            w.add_batch(**batch_step(ids, np.full(16, pos), episode, t, np.zeros(16, bool)))
            if pos == 9:
                w.end_episode(cut_env)
        with pytest.raises(IndexError):
            w.end_episode(16)
    batch = buf.sample_sequences(600, 20, time_major=False, rng=0)
    verify_batch(batch, time_major=False)
    seen = set(batch["action"][:, 0, 0].astype(int).tolist())
    assert seen == set(ids.tolist()) - {cut_env + 1}
    batch = buf.sample_sequences(1000, 11, time_major=False, rng=1)
    verify_batch(batch, time_major=False)
    assert not (batch["action"][:, 0, 0] == cut_env + 1).any()


# -- a writer acting at every point of one sample call -------------------------------
#
# A hook counts the sampler's loads from shared memory and runs a writer action
# right before the k-th one, as if the trainer had been preempted there.  It sees
# the calls into shmbuf.protocol._atomic through a profile hook, and the loads inside the
# C window check (shmbuf.protocol._window_check) through that module's preempt argument.
# Running k = 0, 1, 2, ... until the hook no longer fires explores every such
# point of one sample_sequences call, deterministically and in one process.


def _sample_preempted(buf, k: int, action, batch_size: int, length: int):
    hook = At(k, action, atomic_loads)
    buf._finder.preempt = hook
    sys.setprofile(hook)
    try:
        batch = buf.sample_sequences(batch_size, length, time_major=False, rng=k)
    finally:
        sys.setprofile(None)
        buf._finder.preempt = None
    return batch, hook.fired


def _explore(make_buffer, capacity, chunk_size, before, during, batch_size, length):
    """Write ``before`` steps, then sample with ``during`` more written at point k, for all k."""
    points = 0
    while True:
        buf = make_buffer(SPEC, capacity, chunk_size=chunk_size)
        with buf.writer() as w:
            steps = (step_for(1, pos, pos // 50, pos % 50, False) for pos in range(before + during))
            for _ in range(before):
                w.add(**next(steps))

            def action():
                for _ in range(during):
                    w.add(**next(steps))  # noqa: B023 - _sample_preempted() calls it at once

            batch, fired = _sample_preempted(buf, points, action, batch_size, length)
            verify_batch(batch, time_major=False)
        buf.close()
        if not fired:
            return points
        points += 1


def test_writer_linking_a_chunk_at_any_point_of_a_sample(make_buffer):
    # The stream's chunk holds 2 of 4 rows; meanwhile the writer fills it and
    # links the next chunk.  No window may skip the two rows it missed.
    points = _explore(make_buffer, 64, 4, before=2, during=3, batch_size=64, length=2)
    assert points > 5


@pytest.mark.slow
def test_writer_linking_chunks_at_any_point_of_a_long_window_sample(make_buffer):
    points = _explore(make_buffer, 64, 2, before=9, during=4, batch_size=64, length=6)
    assert points > 5


def test_writer_recycling_chunks_at_any_point_of_a_sample(make_buffer):
    # 4 chunks of 2 rows, all full: the writer recycles the oldest two meanwhile.
    points = _explore(make_buffer, 8, 2, before=7, during=4, batch_size=64, length=3)
    assert points > 5


def test_tail_rows_follow_the_window_past_a_terminal(make_buffer):
    buf = make_buffer(capacity=200, chunk_size=4, seed=3)
    with buf.writer() as w:
        for pos in range(12):   # episodes of 3 steps: positions 2, 5, 8, 11 are terminal
            w.add(**step_for(7, pos, pos // 3, pos % 3, pos % 3 == 2))
    seen = set()
    for _ in range(20):
        batch = buf.sample_sequences(32, 4, time_major=False, tail=1)
        pos, done = batch["action"][:, :, 3], batch["done"]
        assert (np.diff(pos, axis=1) == 1).all()         # one stream, contiguous
        assert not done[:, :2].any()                      # the first 3 rows: one episode
        seen.update(pos[:, 0].astype(int).tolist())
    assert seen == {0, 3, 6}   # 3 steps of an episode + the next episode's first row
    with pytest.raises(shmbuf.NotEnoughDataError):
        buf.sample_sequences(4, 4)                        # without tail nothing fits
    for bad in (-1, 4, True, 1.0):
        with pytest.raises(ValueError, match="tail"):
            buf.sample_sequences(4, 4, tail=bad)


# -- a corrupt chunk table ------------------------------------------------------------
#
# Another process may scribble over the header.  The C window check reads chunk
# indices, counts and links from it, so every such word is bounds-checked: the
# sampler may then find garbage windows or none, but it never reads outside the
# mapping, never hangs, and fails only with a shmbuf error.

_WORD = st.one_of(st.integers(0, 80), st.sampled_from([2 ** 31, 2 ** 32 + 4, 2 ** 40, 2 ** 63]),
                  st.integers(0, 2 ** 64 - 1))


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(st.lists(st.tuples(st.integers(0, 15), st.sampled_from(["state", "count", "next",
                                                                "next_seq"]), _WORD),
                min_size=1, max_size=12))
def test_sampler_survives_a_scribbled_chunk_table(scribbles):
    with shmbuf.create(SPEC, 64, chunk_size=4) as buf:
        with buf.writer() as w:
            for pos in range(100):
                w.add(**step_for(1, pos, pos // 30, pos % 30, pos % 30 == 29))
        mm, lay = buf._segment.mmap, buf._layout
        for chunk, field, value in scribbles:
            at = lay.chunk_field(chunk, field)
            mm[at:at + 8] = value.to_bytes(8, "little")
        for length in (1, 3, 9):
            try:
                batch = buf.sample_sequences(16, length, rng=length)
            except (shmbuf.NotEnoughDataError, shmbuf.SampleRetryError):
                continue
            assert batch["obs"].shape == (length, 16, 3, 8, 8)


def test_window_check_rejects_arguments_that_do_not_fit(make_buffer):
    from shmbuf.protocol import _window_check
    from shmbuf.protocol.geometry import geometry_of, pack
    buf = make_buffer(SPEC, 64, chunk_size=4)
    mm, geometry = buf._segment.mmap, buf._finder.geometry
    picked = np.empty(4, np.int64)
    rows, hops = np.empty((4, 3), np.int64), np.empty((4, 3), np.int64)
    args = (0, 3, 0, 4, 3, picked, rows, hops, hops.copy())
    assert _window_check.find(mm, geometry, np.zeros(4, np.int64), *args) == (0, 4)  # empty
    with pytest.raises(ValueError, match="8-byte"):
        _window_check.find(mm, geometry, np.zeros(4, np.int32)[:3], *args)
    with pytest.raises(ValueError, match="geometry"):
        _window_check.find(mm, pack({**geometry_of(buf._layout), "n_chunks": 10**9}),
                      np.zeros(4, np.int64), *args)
    with pytest.raises(ValueError, match="rows"):
        _window_check.find(mm, geometry, np.zeros(4, np.int64), 0, 3, 0, 4, 3, picked,
                      rows[:2], hops, hops.copy())
    with pytest.raises(ValueError, match="tail"):
        _window_check.find(mm, geometry, np.zeros(4, np.int64), 0, 3, 3, 4, 3, picked, rows,
                      hops, hops.copy())
