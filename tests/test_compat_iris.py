"""The IRIS buffers (``IRISReplayBuffer``, ``IRISOnPolicyBuffer``), from torchwm's documented
contract.

Encoded steps (``workers.step_for``): every sampled element names its writer,
episode and position.  A sequence of ``L`` actions carries ``L + 1`` frames,
the last being the frame the final action led to: the next step of the same
stream and episode.
"""
import os
import pickle

import numpy as np
import pytest
from helpers.transition_helpers import (
    Stream,
    add_step,
    report_from_child,
    run_attacher,
    run_writers,
)
from helpers.workers import obs_for, step_for, verify_window

import shmbuf
from shmbuf.compat.iris import IRISOnPolicyBuffer, IRISReplayBuffer, OnPolicyBufferFullError

OBS = (3, 8, 8)


# -- helpers ---------------------------------------------------------------------------
def valid_starts(steps: list, frames: int, live=None) -> set:
    """Reference model: (writer, pos) of every start of ``frames - 1`` steps of one
    episode (the last may be terminal) followed by one more step of the stream."""
    by_writer = {}
    for s in steps:
        if live is None or (s[0], s[1]) in live:
            by_writer.setdefault(s[0], []).append(s)
    out = set()
    for run in by_writer.values():
        for i in range(len(run) - frames + 1):
            window = run[i:i + frames]
            contiguous = all(w[1] == window[0][1] + j for j, w in enumerate(window))
            same = all(w[2] == window[0][2] for w in window[:-1])
            if contiguous and same and not any(w[3] for w in window[:-2]):
                out.add((window[0][0], window[0][1]))
    return out


def check_sequences(batch, steps: list) -> list:
    """Verify every window of a ``sample_sequence()``; return their (writer, first pos)."""
    ledger = {(w, p): (e, d) for w, p, e, d in steps}
    obs, act, rew, term = batch
    n, length = rew.shape
    assert obs.shape[:2] == (n, length + 1) and act.shape[:2] == term.shape == (n, length)
    starts = []
    for b in range(n):
        verify_window(obs[b, :length], act[b], rew[b], term[b])
        assert not term[b, :-1].any(), "a window continues past a terminal step"
        writer, episode, last = (int(act[b, -1, i]) for i in (0, 1, 3))
        ended = bool(term[b, -1])
        assert ledger[(writer, last)] == (episode, ended)
        nxt = ledger.get((writer, last + 1))
        assert nxt is not None, "the step after the window was never added"
        if ended:   # the frame after a terminal step was never stored: it repeats
            assert (obs[b, length] == obs[b, length - 1]).all(), "terminal frame not repeated"
        else:
            assert nxt[0] == episode, "the extra frame is from another episode"
            assert (obs[b, length] == obs_for(writer, last + 1)).all(), "wrong extra frame"
        starts.append((writer, int(act[b, 0, 3])))
    return starts


def check_single(step, steps: list) -> tuple:
    """Verify one ``sample_single()``; return its (writer, pos)."""
    obs, act, rew, term = step
    assert obs.shape == OBS and obs.dtype == np.uint8 and act.dtype == np.float32
    assert isinstance(rew, np.float32) and isinstance(term, np.float32)
    writer, pos = int(act[0]), int(act[3])
    assert (obs == obs_for(writer, pos)).all() and rew == pos
    assert term == float({(w, p): d for w, p, _, d in steps}[(writer, pos)])
    return writer, pos


# -- the documentation's example, typed out (only the import changed) ----------------------
class GymEnv:
    """Stand-in env with the old gym API: reset() -> obs, 4-tuple step."""

    def __init__(self, episode_len: int):
        self.episode_len, self.t = episode_len, 0

    def reset(self):
        self.t = 0
        return np.zeros((3, 64, 64), np.uint8)

    def step(self, action):
        self.t += 1
        return (np.full((3, 64, 64), self.t, np.uint8), float(self.t),
                self.t == self.episode_len, {})


@pytest.mark.slow
def test_doc_iris_example_shapes_and_dtypes():
    # docs: from torchwm import IRISReplayBuffer, IRISOnPolicyBuffer
    from shmbuf.compat.iris import IRISOnPolicyBuffer, IRISReplayBuffer

    # Main replay buffer
    buffer = IRISReplayBuffer(
        size=2000,   # docs: 50000 (600 MB); 2000 keeps the test small
        obs_shape=(3, 64, 64),
        action_size=6,
        seq_len=20,
        batch_size=64,
    )
    rng = np.random.default_rng(0)
    with buffer:
        for i in range(30):   # not in the docs: enough steps to sample from
            obs = rng.integers(0, 256, (3, 64, 64), dtype=np.uint8)
            action = rng.standard_normal(6).astype(np.float32)
            reward = float(i)
            done = False
            buffer.add(obs, action, reward, done)

        # Sample sequences (one extra obs frame for next-frame prediction)
        obs_batch, act_batch, rew_batch, term_batch = buffer.sample_sequence()
        assert obs_batch.shape == (64, 21, 3, 64, 64) and obs_batch.dtype == np.uint8
        assert act_batch.shape == (64, 20, 6) and act_batch.dtype == np.float32
        assert rew_batch.shape == (64, 20) and rew_batch.dtype == np.float32
        assert term_batch.shape == (64, 20) and term_batch.dtype == np.float32

        # Single-transition sampling
        obs, act, rew, done = buffer.sample_single()
        assert obs.shape == (3, 64, 64) and act.shape == (6,) and done == 0.0

        # On-policy buffer for episode collection
        on_policy = IRISOnPolicyBuffer(max_steps=1000)

        env = GymEnv(episode_len=25)     # not in the docs: an env to collect from
        obs, done = env.reset(), False
        while not done:
            action = rng.standard_normal(6).astype(np.float32)   # not in the docs
            next_obs, reward, done, _ = env.step(action)         # not in the docs
            on_policy.add(obs, action, reward, done)
            obs = next_obs                                       # not in the docs

        # Transfer to main buffer
        for i in range(len(on_policy)):
            buffer.add(on_policy.observations[i], on_policy.actions[i],
                       on_policy.rewards[i], on_policy.terminals[i])
        on_policy.clear()

        assert len(on_policy) == 0 and len(buffer) == 55
        assert (buffer.steps, buffer.episodes) == (55, 1)
        obs_batch, act_batch, rew_batch, term_batch = buffer.sample_sequence(seq_len=5)
        assert obs_batch.shape == (64, 6, 3, 64, 64) and rew_batch.shape == (64, 5)


# -- window contents ---------------------------------------------------------------------
def test_sequences_carry_the_right_extra_frame_and_cover_every_valid_window():
    with IRISReplayBuffer(1000, OBS, 6, seq_len=4, batch_size=150, seed=1) as rb:
        steps = Stream(1).episodes(rb, [3, 9, 1, 12, 5, 7, 2], tail=6).steps
        seen = set()
        for _ in range(6):
            seen.update(check_sequences(rb.sample_sequence(), steps))
        assert seen == valid_starts(steps, 5)
        # the terminal step's frame is the extra frame of windows ending there
        assert {(1, 7), (1, 20), (1, 25), (1, 32)} <= seen
        # and windows whose last action is terminal are sampled (term == 1)
        assert {(1, 8), (1, 21), (1, 26), (1, 33)} <= seen
        seen = set()
        for _ in range(2):
            seen.update(check_sequences(rb.sample_sequence(seq_len=1), steps))
        assert seen == valid_starts(steps, 2)


def test_newest_step_is_sampled():
    with IRISReplayBuffer(100, OBS, 6, seq_len=3, batch_size=64, seed=2) as rb:
        stream = Stream(1).add(rb, 4)
        assert set(check_sequences(rb.sample_sequence(), stream.steps)) == {(1, 0)}
        # its frame is the extra frame at once; its action once a successor exists
        stream.add(rb, 1)
        obs, act, rew, term = rb.sample_sequence()
        assert set(check_sequences((obs, act, rew, term), stream.steps)) == {(1, 0), (1, 1)}
        assert 3 in act[:, -1, 3] and 3 in rew[:, -1]
        seen = {check_single(rb.sample_single(), stream.steps) for _ in range(60)}
        assert seen == {(1, p) for p in range(5)}   # sample_single draws the newest at once


def test_too_little_data_raises():
    with IRISReplayBuffer(100, OBS, 6, seq_len=4, batch_size=8) as rb:
        with pytest.raises(shmbuf.NotEnoughDataError):
            rb.sample_sequence()
        with pytest.raises(shmbuf.NotEnoughDataError):
            rb.sample_single()
        Stream(1).add(rb, 4)   # 4 actions need 5 frames
        with pytest.raises(shmbuf.NotEnoughDataError, match="seq_len=4"):
            rb.sample_sequence()
        assert rb.sample_sequence(seq_len=3)[0].shape == (8, 4) + OBS
    with IRISReplayBuffer(100, OBS, 6, seq_len=4, batch_size=8) as rb:
        Stream(1).episodes(rb, [3] * 10 + [2] * 10, tail=3)   # no episode of 4 actions
        with pytest.raises(ValueError):   # NotEnoughDataError is a ValueError too
            rb.sample_sequence()
        for bad in (0, 100, 2.0):
            with pytest.raises((TypeError, ValueError), match="seq_len"):
                rb.sample_sequence(bad)


def test_wraparound_never_splices_newest_onto_oldest():
    with IRISReplayBuffer(64, OBS, 6, seq_len=9, batch_size=300, seed=4) as rb:
        steps = Stream(1).episodes(rb, [40, 95, 120], tail=45).steps   # 300 steps
        starts = check_sequences(rb.sample_sequence(), steps)
        assert min(p for _, p in starts) >= 300 - 64
        assert max(p for _, p in starts) == 300 - 10   # the extra frame is the newest
        last = {(1, p) for p in range(300 - 64, 300)}   # live steps are among these
        assert set(starts) <= valid_starts(steps, 10, live=last)
        singles = [check_single(rb.sample_single(), steps) for _ in range(50)]
        assert min(p for _, p in singles) >= 300 - 64


def test_two_writer_streams_in_one_process_never_mix():
    with IRISReplayBuffer(400, OBS, 6, seq_len=5, batch_size=300, seed=5) as rb:
        other = IRISReplayBuffer.attach(rb.name)   # a second handle: its own writer stream
        try:
            streams = {1: (Stream(1), rb, 11), 2: (Stream(2), other, 17)}
            for pos in range(150):
                for stream, handle, n in streams.values():
                    stream.add(handle, 1, end=pos % n == n - 1)
            steps = streams[1][0].steps + streams[2][0].steps
            seen = set(check_sequences(rb.sample_sequence(), steps))
            seen |= set(check_sequences(other.sample_sequence(), steps))
            assert {w for w, _ in seen} == {1, 2}
            assert seen <= valid_starts(steps, 6)
        finally:
            other.close()


def test_len_capacity_and_counters():
    with IRISReplayBuffer(64, OBS, 6, seq_len=3, batch_size=2) as rb:
        assert (len(rb), rb.buffer_capacity, rb.steps, rb.episodes) == (0, 64, 0, 0)
        stream = Stream(1).episodes(rb, [10, 10], tail=5)
        assert (len(rb), rb.steps, rb.episodes, rb.idx, rb.full) == (25, 25, 2, 25, False)
        stream.episodes(rb, [10] * 20)
        assert rb.steps == 225 and rb.episodes == 22 and rb.full
        assert 64 - rb.buffer.chunk_size <= len(rb) <= 64


# -- validation ------------------------------------------------------------------------------
def test_bad_adds_are_rejected_naming_the_argument_and_write_nothing():
    with IRISReplayBuffer(50, OBS, 6, seq_len=2, batch_size=4, seed=6) as rb:
        good = step_for(1, 0, 0, 0, False)
        cases = [
            (TypeError, "obs", (good["obs"] / 2.0, good["action"], 0.0, False)),
            (ValueError, "obs", (np.zeros((8, 8, 3), np.uint8), good["action"], 0.0, False)),
            (ValueError, "obs", ({"image": good["obs"]}, good["action"], 0.0, False)),
            (ValueError, "action", (good["obs"], np.zeros(7, np.float32), 0.0, False)),
            (TypeError, "reward", (good["obs"], good["action"], "1.0", False)),
            (TypeError, "done", (good["obs"], good["action"], 0.0, 2)),
        ]
        for exc, word, args in cases:
            with pytest.raises(exc, match=word):
                rb.add(*args)
        assert rb.steps == 0 and len(rb) == 0
        steps = Stream(1).add(rb, 4).steps
        check_sequences(rb.sample_sequence(), steps)


@pytest.mark.parametrize("kwargs, word", [
    (dict(size=0), "size"), (dict(size=-5), "size"), (dict(obs_shape=(3, 8, -1)), "obs_shape"),
    (dict(action_size=1.5), "action_size"), (dict(seq_len=2.5), "seq_len"),
    (dict(seq_len=0), "seq_len"), (dict(batch_size=True), "batch_size"),
])
def test_bad_constructor_arguments_create_nothing(kwargs, word):
    args = {**dict(size=100, obs_shape=OBS, action_size=6, seq_len=4, batch_size=2), **kwargs}
    with pytest.raises((TypeError, ValueError), match=word):
        IRISReplayBuffer(**args)


@pytest.mark.parametrize("size, seq_len", [(100, 100), (1, 1), (10, 50)])
def test_a_window_larger_than_the_buffer_fails_at_sampling(size, seq_len):
    # As upstream: the constructor takes it, and the call that needs the window refuses.
    with IRISReplayBuffer(size, OBS, 6, seq_len=seq_len, batch_size=2) as rb:
        Stream(1).add(rb, size)
        assert len(rb) == size
        for call in (rb.sample_sequence, rb.prefetch, rb.dataset):
            with pytest.raises(shmbuf.NotEnoughDataError, match=f"size={size}"):
                call()


# -- lifecycle, handles, seeding ----------------------------------------------------------
def test_lifecycle_name_context_attach_and_pickle():
    name = f"shmbuf-test-iris-{os.getpid()}"
    with IRISReplayBuffer(50, OBS, 6, seq_len=3, batch_size=4, name=name) as rb:
        assert rb.name == name and os.path.exists(f"/dev/shm/{name}")
        twin = pickle.loads(pickle.dumps(rb))
        assert (twin.size, twin.obs_shape, twin.seq_len, twin.batch_size) == (50, OBS, 3, 4)
        Stream(1).add(twin, 5)
        assert len(rb) == 5
        twin.close()
        twin.close()
        assert os.path.exists(f"/dev/shm/{name}")   # an attached handle never unlinks
        from shmbuf.compat.dreamer import ReplayBuffer
        with pytest.raises(shmbuf.CorruptSegmentError, match="IRISReplayBuffer"):
            ReplayBuffer.attach(name)
        with pytest.raises(shmbuf.BufferClosedError):
            twin.sample_single()
    assert not os.path.exists(f"/dev/shm/{name}")
    for call in (lambda: rb.add(np.zeros(OBS, np.uint8), np.zeros(6, np.float32), 0.0, False),
                 rb.sample_sequence, rb.sample_single, lambda: len(rb)):
        with pytest.raises(shmbuf.BufferClosedError, match="closed"):
            call()
    with pytest.raises(shmbuf.SegmentNotFoundError):
        IRISReplayBuffer.attach(name)


def test_seed_makes_sampling_reproducible():
    def draw(seed):
        with IRISReplayBuffer(200, OBS, 6, seq_len=5, batch_size=16, seed=seed) as rb:
            Stream(1).episodes(rb, [20, 30, 40], tail=30)
            return ([rb.sample_sequence()[1][:, 0, 3].tolist() for _ in range(3)],
                    [int(rb.sample_single()[1][3]) for _ in range(5)])

    assert draw(7) == draw(7)
    assert draw(7) != draw(8)


# -- the on-policy buffer ----------------------------------------------------------------------
def test_on_policy_buffer_lists_arrays_and_copies():
    on_policy = IRISOnPolicyBuffer()
    assert on_policy.max_steps == 1000 and len(on_policy) == 0
    frame = np.zeros(OBS, np.uint8)
    for i in range(3):
        frame[:] = i
        on_policy.add(frame, np.full(6, i, np.float32), float(i), i == 2)
    frame[:] = 99   # a caller reusing its array must not change what was stored
    assert [int(o[0, 0, 0]) for o in on_policy.observations] == [0, 1, 2]
    assert on_policy.rewards == [0.0, 1.0, 2.0] and on_policy.terminals == [0.0, 0.0, 1.0]
    obs, act, rew, term = on_policy.get_arrays()
    assert obs.shape == (3,) + OBS and obs.dtype == np.uint8
    assert act.shape == (3, 6) and act.dtype == np.float32
    assert rew.shape == term.shape == (3,) and term.tolist() == [0.0, 0.0, 1.0]
    kept = on_policy.observations
    on_policy.clear()
    assert len(on_policy) == 0 and len(kept) == 3 and on_policy.observations == []
    assert [a.shape for a in on_policy.get_arrays()] == [(0,)] * 4


def test_on_policy_buffer_enforces_max_steps():
    on_policy = IRISOnPolicyBuffer(max_steps=3)
    for _i in range(3):
        on_policy.add(np.zeros(OBS, np.uint8), np.zeros(6, np.float32), 0.0, False)
    with pytest.raises(OnPolicyBufferFullError, match="max_steps=3"):
        on_policy.add(np.zeros(OBS, np.uint8), np.zeros(6, np.float32), 0.0, False)
    assert isinstance(OnPolicyBufferFullError("x"), OverflowError)
    assert len(on_policy) == 3 and len(on_policy.rewards) == 3
    on_policy.clear()
    on_policy.add(np.zeros(OBS, np.uint8), np.zeros(6, np.float32), 0.0, True)
    assert len(on_policy) == 1
    for bad in (0, -1, 2.5):
        with pytest.raises((TypeError, ValueError), match="max_steps"):
            IRISOnPolicyBuffer(max_steps=bad)


def test_on_policy_buffer_rejects_bad_steps_appending_nothing():
    on_policy = IRISOnPolicyBuffer(max_steps=10)
    on_policy.add(np.zeros(OBS, np.uint8), np.zeros(6, np.float32), 0.0, False)
    cases = [
        (ValueError, "obs", (np.zeros((8, 8, 3), np.uint8), np.zeros(6, np.float32), 0.0, 0)),
        (ValueError, "obs", (np.zeros(OBS, np.float32), np.zeros(6, np.float32), 0.0, 0)),
        (ValueError, "action", (np.zeros(OBS, np.uint8), np.zeros(5, np.float32), 0.0, 0)),
        (TypeError, "obs", (np.array(["a"]), np.zeros(6, np.float32), 0.0, 0)),
        (TypeError, "reward", (np.zeros(OBS, np.uint8), np.zeros(6, np.float32), [1, 2], 0)),
        (TypeError, "reward", (np.zeros(OBS, np.uint8), np.zeros(6, np.float32), "x", 0)),
        (ValueError, "done", (np.zeros(OBS, np.uint8), np.zeros(6, np.float32), 0.0, 0.5)),
    ]
    for exc, word, args in cases:
        with pytest.raises(exc, match=word):
            on_policy.add(*args)
    assert [len(x) for x in (on_policy.observations, on_policy.actions, on_policy.rewards,
                             on_policy.terminals)] == [1, 1, 1, 1]


def test_on_policy_episode_transferred_into_the_replay_buffer():
    with IRISReplayBuffer(200, OBS, 6, seq_len=4, batch_size=100, seed=3) as rb:
        on_policy = IRISOnPolicyBuffer(max_steps=50)
        steps = []
        for episode, n in enumerate((12, 9)):
            for t in range(n):
                pos = len(steps)
                add_step(on_policy, step_for(1, pos, episode, t, t == n - 1))
                steps.append((1, pos, episode, t == n - 1))
            for i in range(len(on_policy)):
                rb.add(on_policy.observations[i], on_policy.actions[i],
                       on_policy.rewards[i], on_policy.terminals[i])
            on_policy.clear()
        assert (len(rb), rb.episodes) == (21, 2)
        assert set(check_sequences(rb.sample_sequence(), steps)) == valid_starts(steps, 5)


# -- checkpoints -----------------------------------------------------------------------------
@pytest.mark.slow
def test_checkpoint_round_trip_through_torch_save(tmp_path):
    torch = pytest.importorskip("torch")
    with IRISReplayBuffer(120, OBS, 6, seq_len=4, batch_size=200, seed=9) as rb:
        other = IRISReplayBuffer.attach(rb.name)
        try:
            steps = Stream(1).episodes(rb, [30, 50], tail=40).steps   # wraps: 120 steps
            steps += Stream(2).episodes(other, [9, 9], tail=4).steps
        finally:
            other.close()
        before = rb.buffer.snapshot()
        torch.save(rb.state_dict(), tmp_path / "rb.pt")
    state = torch.load(tmp_path / "rb.pt", weights_only=True)
    with IRISReplayBuffer(120, OBS, 6, seq_len=4, batch_size=200, seed=10) as fresh:
        fresh.load_state_dict(state)
        after = fresh.buffer.snapshot()
        for k, v in before["columns"].items():
            np.testing.assert_array_equal(after["columns"][k], v)
        live = {(int(a[0]), int(a[3])) for a in after["columns"]["action"]}
        assert len(fresh) == len(live)
        starts = check_sequences(fresh.sample_sequence(), steps)
        assert set(starts) <= valid_starts(steps, 5, live=live)
        assert {w for w, _ in starts} == {1, 2}
        check_single(fresh.sample_single(), steps)
    with pytest.raises(ValueError, match="made by"):
        from shmbuf.compat.dreamer import ReplayBuffer
        with ReplayBuffer(120, OBS, 6, seq_len=5) as dreamer:
            dreamer.load_state_dict(state)
    with pytest.raises(ValueError, match="schema"):
        with IRISReplayBuffer(120, OBS, 7, seq_len=5) as wrong:
            wrong.load_state_dict(state)


# -- several processes -------------------------------------------------------------------------
def _all_steps(lengths: dict, n_steps: int) -> list:
    return [(w, p, p // n, p % n == n - 1) for w, n in lengths.items() for p in range(n_steps)]


@pytest.mark.slow
def test_spawned_writers_and_a_sampling_trainer():
    """Two writers wrap a 500-step buffer while the trainer samples and checks everything.

    Writers pause before their last 100 steps, so at the end each one's newest
    steps are live however the children were scheduled.
    """
    lengths, n_steps, tail = {1: 29, 2: 41}, 1500, 100
    steps = _all_steps(lengths, n_steps)
    with IRISReplayBuffer(500, OBS, 6, seq_len=7, batch_size=32, seed=11) as rb:

        def while_writing():
            check_sequences(rb.sample_sequence(), steps)
            check_single(rb.sample_single(), steps)

        run_writers(rb, lengths, n_steps, tail, while_writing,
                    lambda: check_sequences(rb.sample_sequence(), steps))
        starts = []
        for _ in range(10):
            starts += check_sequences(rb.sample_sequence(), steps)
        assert {w for w, _ in starts} == {1, 2}
        assert min(p for _, p in starts) >= n_steps - 500
        assert (rb.steps, rb.episodes) == (2 * n_steps,
                                           sum(n_steps // n for n in lengths.values()))


def _attach_and_report(name: str, conn):
    def work():
        with IRISReplayBuffer.attach(name, seed=0) as rb:
            obs, act, rew, term = rb.sample_sequence()
            report = ("params", rb.size, rb.obs_shape, rb.seq_len, rb.batch_size,
                      obs.shape, act[:, :, 3].tolist(), len(rb))
            for pos in range(6):
                add_step(rb, step_for(9, pos, 0, pos, pos == 5))
            return report

    report_from_child(conn, work)


@pytest.mark.slow
def test_attach_by_name_from_another_process():
    with IRISReplayBuffer(100, OBS, 6, seq_len=4, batch_size=3, seed=12) as rb:
        stream = Stream(1).add(rb, 10)
        _, size, obs_shape, seq_len, batch_size, shape, positions, length = run_attacher(
            _attach_and_report, rb.name)
        assert (size, obs_shape, seq_len, batch_size, length) == (100, OBS, 4, 3, 10)
        assert shape == (3, 5) + OBS
        assert all(np.diff(p).tolist() == [1, 1, 1] and p[-1] <= 8 for p in positions)
        assert os.path.exists(f"/dev/shm/{rb.name}")   # the child never unlinked it
        assert (len(rb), rb.episodes) == (16, 1)
        rb.batch_size = 200
        steps = stream.steps + [(9, p, 0, p == 5) for p in range(6)]
        starts = check_sequences(rb.sample_sequence(), steps)
        assert (9, 1) in starts   # the child's episode, its terminal frame last


# -- age_weights: IRIS's episode weighting by age ----------------------------------------
def test_age_weights_draw_episodes_by_age_group():
    from helpers.stats import chi2_pvalue

    weights = (1 / 8, 1 / 8, 1 / 4, 1 / 2)
    with IRISReplayBuffer(2000, OBS, 6, seq_len=4, batch_size=256, age_weights=weights,
                          seed=0) as rb:
        Stream(1).episodes(rb, [12] * 8, tail=3)
        assert rb.age_weights == weights
        assert IRISReplayBuffer.attach(rb.name).age_weights == weights   # in the metadata
        counts = np.zeros(8)
        for _ in range(20):
            batch = rb.sample_sequence()
            counts += np.bincount(batch[1][:, 0, 1].astype(int), minlength=8)
        # 8 episodes in 4 groups of 2: an episode of group g has weights[g] / 2
        assert chi2_pvalue(counts, np.repeat(weights, 2) / 2) > 1e-3
    with IRISReplayBuffer(2000, OBS, 6, seq_len=4, batch_size=64, age_weights=(0, 0, 0, 1),
                          seed=1) as rb:
        steps = Stream(1).episodes(rb, [12] * 8, tail=3).steps
        obs, act, rew, term = rb.sample_sequence()
        check_sequences((obs, act, rew, term), steps)
        assert set(act[:, 0, 1].astype(int)) <= {6, 7}        # the newest quarter only
        with rb.prefetch(device="cpu") as batches:
            assert set(next(batches)[1][:, 0, 1].int().tolist()) <= {6, 7}


@pytest.mark.parametrize("age_weights, err, words", [
    ([], ValueError, r"age_weights=\[\].*empty"),
    ((0.5, -1), ValueError, r"age_weights=\(0.5, -1\).*weights\[1\]"),
    ("0.5", TypeError, "age_weights='0.5'"),
])
def test_bad_age_weights_create_nothing(age_weights, err, words):
    # (the autouse fixture fails the test if a segment was left behind)
    with pytest.raises(err, match=words):
        IRISReplayBuffer(100, OBS, 6, seq_len=4, batch_size=2, age_weights=age_weights)
