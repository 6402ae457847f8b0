"""The Dreamer ``ReplayBuffer`` facade, from torchwm's documented contract.

Encoded steps (``workers.step_for``): every sampled element names its writer,
episode and position, so each window is checked element by element.
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
from helpers.workers import step_for, verify_window

import shmbuf
from shmbuf.compat.dreamer import ReplayBuffer

OBS = (3, 8, 8)


# -- helpers ---------------------------------------------------------------------------
def write_episodes(rb, writer: int, lengths, tail: int = 0) -> list:
    return Stream(writer).episodes(rb, lengths, tail).steps


def valid_starts(steps: list, length: int, live=None) -> set:
    """Reference model: (writer, pos) of every window start that may be sampled."""
    by_writer = {}
    for s in steps:
        if live is None or (s[0], s[1]) in live:
            by_writer.setdefault(s[0], []).append(s)
    out = set()
    for run in by_writer.values():
        for i in range(len(run) - length + 1):
            window = run[i:i + length]
            same = all(w[2] == window[0][2] and w[1] == window[0][1] + j
                       for j, w in enumerate(window))
            if same and not any(w[3] for w in window[:-1]):
                out.add((window[0][0], window[0][1]))
    return out


def check_batch(batch, terminals: set) -> list:
    """Verify every window of a time-major ``sample()``; return their (writer, first pos)."""
    obs, act, rew, term = batch
    starts = []
    for b in range(obs.shape[1]):
        verify_window(obs[:, b], act[:, b], rew[:, b], term[:, b])
        writer, pos = int(act[0, b, 0]), act[:, b, 3].astype(int)
        want = [float((writer, int(p)) in terminals) for p in pos]
        assert term[:, b].tolist() == want, "terminal flags do not match the steps"
        starts.append((writer, int(pos[0])))
    return starts


def terminal_set(steps) -> set:
    return {(w, p) for w, p, _, done in steps if done}


# -- the documentation's examples, typed out (only the import changed) -------------------
def test_doc_top_level_example():
    import shmbuf.compat.dreamer as torchwm  # docs: import torchwm

    # docs: size=100000; 1000 keeps the test small
    buffer = torchwm.ReplayBuffer(size=1000, obs_shape=(3, 64, 64), action_size=6)
    with buffer:
        assert (buffer.size, buffer.seq_len, buffer.batch_size) == (1000, 50, 50)
        assert buffer.obs_shape == (3, 64, 64) and buffer.action_size == 6


@pytest.mark.slow
def test_doc_dreamer_example_shapes_and_dtypes():
    from shmbuf.compat.dreamer import ReplayBuffer  # docs: from torchwm import ReplayBuffer

    buffer = ReplayBuffer(
        size=1000,              # docs: 100000 (1.2 GB); 1000 keeps the test small
        obs_shape=(3, 64, 64),  # C, H, W
        action_size=6,          # continuous action dimension
        seq_len=50,             # sequence length per sample
        batch_size=50,          # parallel sequences per batch
    )
    rng = np.random.default_rng(0)
    with buffer:
        for i in range(60):
            obs = {"image": rng.integers(0, 256, (3, 64, 64), dtype=np.uint8)}
            action = rng.standard_normal(6).astype(np.float32)
            reward = float(i)
            done = 0.0
            # Add a transition during environment interaction
            buffer.add(obs, action, reward, done)

        # Sample a training batch
        obs_batch, act_batch, rew_batch, term_batch = buffer.sample()
        assert obs_batch.shape == (50, 50, 3, 64, 64) and obs_batch.dtype == np.uint8
        assert act_batch.shape == (50, 50, 6) and act_batch.dtype == np.float32
        assert rew_batch.shape == (50, 50) and rew_batch.dtype == np.float32
        assert term_batch.shape == (50, 50) and term_batch.dtype == np.float32
        assert (np.diff(rew_batch, axis=0) == 1).all()   # time-major, contiguous


class GymnasiumEnv:
    """Stand-in env with the gymnasium API: reset() -> (obs, info), 5-tuple step."""

    def __init__(self, episode_len: int = 7):
        self.episode_len, self.t = episode_len, 0

    def reset(self):
        self.t = 0
        return np.full((3, 64, 64), 0, np.uint8), {}

    def step(self, action):
        self.t += 1
        done = self.t % self.episode_len == 0
        return np.full((3, 64, 64), self.t % 256, np.uint8), 1.0, done, False, {}


class GymEnv(GymnasiumEnv):
    """Stand-in env with the old gym API: reset() -> obs, 4-tuple step."""

    def reset(self):
        return super().reset()[0]

    def step(self, action):
        obs, reward, done, _, info = super().step(action)
        return obs, reward, done, info


def policy(obs):
    return np.full(6, 0.5, np.float32)


def test_doc_recording_pattern():
    env, total_steps = GymnasiumEnv(episode_len=7), 120
    # docs: size=100000; 1000 keeps the test small
    buffer = ReplayBuffer(size=1000, obs_shape=(3, 64, 64), action_size=6)
    with buffer:
        obs, _ = env.reset()

        for _step in range(total_steps):
            action = policy(obs)
            next_obs, reward, done, truncated, _ = env.step(action)
            buffer.add({"image": obs}, action, reward, float(done or truncated))
            obs = next_obs

        assert buffer.steps == 120 and buffer.episodes == 120 // 7


@pytest.mark.slow
def test_doc_training_loop_pattern():
    env = GymEnv(episode_len=80)
    buffer = ReplayBuffer(size=1000, obs_shape=(3, 64, 64), action_size=6)
    step, total_steps, collect_steps, update_steps = 0, 120, 60, 2
    losses = []

    def world_model_train_step(obs_batch, act_batch, rew_batch, term_batch):
        assert obs_batch.shape == (50, 50, 3, 64, 64) and act_batch.shape == (50, 50, 6)
        assert rew_batch.shape == term_batch.shape == (50, 50)
        losses.append(float(rew_batch.mean()))
        return losses[-1]

    with buffer:
        while step < total_steps:
            # Collect experience
            obs = env.reset()
            for _ in range(collect_steps):
                action = policy(obs)
                next_obs, reward, done, _ = env.step(action)
                buffer.add({"image": obs}, action, reward, float(done))
                obs = next_obs

            # Train on sampled sequences
            for _ in range(update_steps):
                obs_batch, act_batch, rew_batch, term_batch = buffer.sample()
                world_model_train_step(obs_batch, act_batch, rew_batch, term_batch)
            step += collect_steps  # not in the docs: their loop never advances ``step``
    assert len(losses) == 4


# -- window contents ---------------------------------------------------------------------
def test_windows_never_cross_episodes_and_cover_every_valid_start():
    with ReplayBuffer(1000, OBS, 6, seq_len=5, batch_size=150, seed=1) as rb:
        steps = write_episodes(rb, 1, [3, 9, 1, 12, 5, 7, 2], tail=6)
        terminals = terminal_set(steps)
        seen = set()
        for _ in range(2):
            seen.update(check_batch(rb.sample(), terminals))
        assert seen == valid_starts(steps, 5)
        # windows that end on a terminal step are drawn, and carry the flag
        assert {(1, 7), (1, 20), (1, 25), (1, 32)} <= seen


def test_newest_transition_is_sampled_and_exact_fit_works():
    with ReplayBuffer(100, OBS, 6, seq_len=4, batch_size=64, seed=2) as rb:
        stream = Stream(1).add(rb, 4)
        starts = check_batch(rb.sample(), set())
        assert set(starts) == {(1, 0)}   # the only window holds the newest step
        stream.add(rb, 1)
        assert set(check_batch(rb.sample(), set())) == {(1, 0), (1, 1)}
        stream.add(rb, 3, end=True)
        assert set(check_batch(rb.sample(), {(1, 7)})) == {(1, p) for p in range(5)}


def test_too_little_data_raises():
    with ReplayBuffer(100, OBS, 6, seq_len=4, batch_size=8) as rb:
        with pytest.raises(shmbuf.NotEnoughDataError):
            rb.sample()
        write_episodes(rb, 1, [], tail=3)
        with pytest.raises(shmbuf.NotEnoughDataError, match="seq_len=4"):
            rb.sample()
    with ReplayBuffer(100, OBS, 6, seq_len=4, batch_size=8) as rb:
        write_episodes(rb, 1, [3] * 20 + [1] * 10, tail=3)   # 73 steps, no episode of 4
        with pytest.raises(ValueError):      # NotEnoughDataError is a ValueError too
            rb.sample()


def test_full_buffer_with_size_below_twice_seq_len_returns():
    # Upstream loops forever here: full, and seq_len < size <= 2 * seq_len - 1.
    with ReplayBuffer(5, OBS, 6, seq_len=3, batch_size=32, seed=3) as rb:
        write_episodes(rb, 1, [], tail=12)
        assert rb.full
        starts = check_batch(rb.sample(), set())
        assert {p for _, p in starts} <= {7, 8, 9}   # within the last 5 steps


def test_wraparound_never_splices_newest_onto_oldest():
    with ReplayBuffer(64, OBS, 6, seq_len=10, batch_size=300, seed=4) as rb:
        steps = write_episodes(rb, 1, [40, 95, 120], tail=45)   # 300 steps, wraps 4x
        starts = check_batch(rb.sample(), terminal_set(steps))
        assert min(p for _, p in starts) >= 300 - 64
        assert max(p for _, p in starts) == 300 - 10   # the window ending on the newest
        last = {(1, p) for p in range(300 - 64, 300)}   # live steps are among these
        assert set(starts) <= valid_starts(steps, 10, live=last)


def test_two_writer_streams_in_one_process_never_mix():
    with ReplayBuffer(400, OBS, 6, seq_len=6, batch_size=300, seed=5) as rb:
        other = ReplayBuffer.attach(rb.name)   # a second handle: its own writer stream
        try:
            steps = []
            for pos in range(150):
                for writer, handle, n in ((1, rb, 11), (2, other, 17)):
                    episode, t = divmod(pos, n)
                    add_step(handle, step_for(writer, pos, episode, t, t == n - 1))
                    steps.append((writer, pos, episode, t == n - 1))
            seen = set(check_batch(rb.sample(), terminal_set(steps)))
            seen |= set(check_batch(other.sample(), terminal_set(steps)))
            assert {w for w, _ in seen} == {1, 2}
            assert seen <= valid_starts(steps, 6)
        finally:
            other.close()


def test_counters_follow_upstream_single_process():
    with ReplayBuffer(20, OBS, 6, seq_len=2, batch_size=2) as rb:
        assert (rb.steps, rb.episodes, rb.idx, rb.full) == (0, 0, 0, False)
        stream = Stream(1).episodes(rb, [5, 5], tail=3)
        assert (rb.steps, rb.episodes, rb.idx, rb.full) == (13, 2, 13, False)
        stream.episodes(rb, [1], tail=8)
        assert (rb.steps, rb.episodes, rb.idx, rb.full) == (22, 3, 2, True)


# -- validation ------------------------------------------------------------------------------
def test_bad_adds_are_rejected_naming_the_argument_and_write_nothing():
    with ReplayBuffer(50, OBS, 6, seq_len=2, batch_size=4, seed=6) as rb:
        good = step_for(1, 0, 0, 0, False)
        cases = [
            (TypeError, "obs", ({"image": good["obs"].astype(np.float32) + 0.5},
                                good["action"], 0.0, 0.0)),
            (ValueError, "obs", ({"image": np.zeros((8, 8, 3), np.uint8)}, good["action"],
                                 0.0, 0.0)),
            (TypeError, "obs", (good["obs"], good["action"], 0.0, 0.0)),
            (TypeError, "image", ({"pixels": good["obs"]}, good["action"], 0.0, 0.0)),
            (ValueError, "action", ({"image": good["obs"]}, np.zeros(5, np.float32), 0.0, 0.0)),
            (TypeError, "action", ({"image": good["obs"]}, np.zeros(6, complex), 0.0, 0.0)),
            (ValueError, "reward", ({"image": good["obs"]}, good["action"], [1.0, 2.0], 0.0)),
            (TypeError, "done", ({"image": good["obs"]}, good["action"], 0.0, 0.5)),
        ]
        for exc, word, args in cases:
            with pytest.raises(exc, match=word):
                rb.add(*args)
        assert rb.steps == 0
        with pytest.raises(shmbuf.NotEnoughDataError):
            rb.sample()
        write_episodes(rb, 1, [], tail=3)
        check_batch(rb.sample(), set())


@pytest.mark.parametrize("kwargs, word", [
    (dict(size=0), "size"), (dict(size=2.5), "size"), (dict(obs_shape=(3, 0, 8)), "obs_shape"),
    (dict(obs_shape="3x8x8"), "obs_shape"), (dict(action_size=0), "action_size"),
    (dict(seq_len=0), "seq_len"), (dict(seq_len="50"), "seq_len"),
    (dict(batch_size=0), "batch_size"), (dict(name="a/b"), "name"),
])
def test_bad_constructor_arguments_create_nothing(kwargs, word):
    args = {**dict(size=100, obs_shape=OBS, action_size=6, seq_len=4, batch_size=2), **kwargs}
    with pytest.raises((TypeError, ValueError), match=word):
        ReplayBuffer(**args)


def test_seq_len_above_size_constructs_and_fails_at_sample():
    # torchwm's own tests build ReplayBuffer(size=10, ..., seq_len=50): upstream takes it.
    with ReplayBuffer(10, OBS, 6, seq_len=50, batch_size=4) as rb:
        assert (rb.size, rb.seq_len) == (10, 50)
        write_episodes(rb, 1, [12])
        assert rb.steps == 12 and rb.full
        for call in (rb.sample, rb.prefetch, rb.dataset):
            with pytest.raises(shmbuf.NotEnoughDataError, match="seq_len=50.*size=10"):
                call()


# -- lifecycle, handles, seeding ----------------------------------------------------------
def test_lifecycle_name_context_attach_and_pickle():
    name = f"shmbuf-test-dreamer-{os.getpid()}"
    with ReplayBuffer(50, OBS, 6, seq_len=3, batch_size=4, name=name) as rb:
        assert rb.name == name and os.path.exists(f"/dev/shm/{name}")
        blob = pickle.dumps(rb)
        assert len(blob) < 300   # a handle, not the bytes
        twin = pickle.loads(blob)
        assert (twin.size, twin.obs_shape, twin.seq_len, twin.batch_size) == (50, OBS, 3, 4)
        write_episodes(twin, 1, [], tail=5)
        assert rb.steps == 5
        twin.close()
        twin.close()
        assert os.path.exists(f"/dev/shm/{name}")   # an attached handle never unlinks
        with pytest.raises(PermissionError):
            twin.unlink()
        from shmbuf.compat.iris import IRISReplayBuffer
        with pytest.raises(shmbuf.CorruptSegmentError, match="ReplayBuffer"):
            IRISReplayBuffer.attach(name)
        with pytest.raises(shmbuf.BufferClosedError):
            twin.sample()
    assert not os.path.exists(f"/dev/shm/{name}")
    with pytest.raises(shmbuf.BufferClosedError, match="closed"):
        rb.add({"image": np.zeros(OBS, np.uint8)}, np.zeros(6, np.float32), 0.0, 0.0)
    with pytest.raises(shmbuf.SegmentNotFoundError):
        ReplayBuffer.attach(name)


def test_unlink_removes_the_name_but_keeps_the_mapping():
    rb = ReplayBuffer(50, OBS, 6, seq_len=2, batch_size=4)
    try:
        write_episodes(rb, 1, [], tail=4)
        rb.unlink()
        assert not os.path.exists(f"/dev/shm/{rb.name}")
        check_batch(rb.sample(), set())
    finally:
        rb.close()


def test_seed_makes_sampling_reproducible():
    def draw(seed):
        with ReplayBuffer(200, OBS, 6, seq_len=5, batch_size=16, seed=seed) as rb:
            write_episodes(rb, 1, [20, 30, 40], tail=30)
            return [rb.sample()[1][0, :, 3].tolist() for _ in range(3)]

    assert draw(7) == draw(7)
    assert draw(7) != draw(8)


# -- checkpoints -----------------------------------------------------------------------------
@pytest.mark.slow
def test_checkpoint_round_trip_through_torch_save(tmp_path):
    torch = pytest.importorskip("torch")
    with ReplayBuffer(120, OBS, 6, seq_len=5, batch_size=200, seed=9) as rb:
        other = ReplayBuffer.attach(rb.name)
        try:
            steps = write_episodes(rb, 1, [30, 50], tail=40)            # wraps: 120 steps
            steps += write_episodes(other, 2, [9, 9], tail=4)
        finally:
            other.close()
        before = rb.buffer.snapshot()
        torch.save(rb.state_dict(), tmp_path / "rb.pt")
        counts = (rb.steps, rb.episodes)
    state = torch.load(tmp_path / "rb.pt", weights_only=True)
    with ReplayBuffer(120, OBS, 6, seq_len=5, batch_size=200, seed=10) as fresh:
        fresh.load_state_dict(state)
        after = fresh.buffer.snapshot()
        for k, v in before["columns"].items():
            np.testing.assert_array_equal(after["columns"][k], v)
        live = {(int(a[0]), int(a[3])) for a in after["columns"]["action"]}
        starts = check_batch(fresh.sample(), terminal_set(steps))
        assert set(starts) <= valid_starts(steps, 5, live=live)
        assert {w for w, _ in starts} == {1, 2}
        assert fresh.steps == len(live) <= counts[0]
    with pytest.raises(ValueError, match="made by"):
        from shmbuf.compat.iris import IRISReplayBuffer
        with IRISReplayBuffer(120, OBS, 6, seq_len=5) as iris:
            iris.load_state_dict(state)
    with pytest.raises(ValueError, match="schema"):
        with ReplayBuffer(120, (3, 8, 9), 6, seq_len=5) as wrong:
            wrong.load_state_dict(state)


# -- several processes -------------------------------------------------------------------------
def _terminals_of(lengths: dict, n_steps: int) -> set:
    return {(w, p) for w, n in lengths.items() for p in range(n - 1, n_steps, n)}


@pytest.mark.slow
def test_spawned_writers_and_a_sampling_trainer():
    """Three writers wrap a 600-step buffer while the trainer samples and checks everything.

    Writers pause before their last 100 steps, so at the end each one's newest
    steps are live however the children were scheduled.
    """
    lengths, n_steps, tail = {1: 37, 2: 23, 3: 50}, 1500, 100
    terminals = _terminals_of(lengths, n_steps)
    with ReplayBuffer(600, OBS, 6, seq_len=8, batch_size=32, seed=11) as rb:
        run_writers(rb, lengths, n_steps, tail,
                    lambda: check_batch(rb.sample(), terminals),
                    lambda: check_batch(rb.sample(), terminals))
        starts = []
        for _ in range(10):
            starts += check_batch(rb.sample(), terminals)
        assert {w for w, _ in starts} == {1, 2, 3}
        assert min(p for _, p in starts) >= n_steps - 600
        assert (rb.steps, rb.episodes) == (3 * n_steps,
                                           sum(n_steps // n for n in lengths.values()))


def _attach_and_report(name: str, conn):
    def work():
        with ReplayBuffer.attach(name, seed=0) as rb:
            obs, act, rew, term = rb.sample()
            for pos in range(6):
                add_step(rb, step_for(9, pos, 0, pos, pos == 5))
            return ("params", rb.size, rb.obs_shape, rb.seq_len, rb.batch_size,
                    obs.shape, act[:, :, 3].T.tolist())

    report_from_child(conn, work)


@pytest.mark.slow
def test_attach_by_name_from_another_process():
    with ReplayBuffer(100, OBS, 6, seq_len=4, batch_size=3, seed=12) as rb:
        write_episodes(rb, 1, [], tail=10)
        _, size, obs_shape, seq_len, batch_size, shape, positions = run_attacher(
            _attach_and_report, rb.name)
        assert (size, obs_shape, seq_len, batch_size) == (100, OBS, 4, 3)
        assert shape == (4, 3) + OBS
        assert all(np.diff(p).tolist() == [1, 1, 1] for p in positions)
        assert os.path.exists(f"/dev/shm/{rb.name}")   # the child never unlinked it
        assert rb.steps == 16 and rb.episodes == 1
        rb.batch_size = 200
        starts = check_batch(rb.sample(), {(9, 5)})
        assert (9, 2) in starts   # the child's whole episode, ending on its terminal
