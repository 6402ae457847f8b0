"""PlaNet Memory / Episode: the TorchWM docs' examples, then the documented contract.

Behaviour tests use encoded episodes (tests/helpers/planet_workers.py): every sampled
element is decoded and checked against the step it must have come from.
"""
import multiprocessing as mp
import pickle
import time

import numpy as np
import pytest
import torch
from helpers.planet_workers import (
    ACTION_SIZE,
    OBS_SHAPE,
    append_episodes,
    check_batch,
    episode_length,
    halve,
    obs_value,
    record,
)
from helpers.procs import join_all, running

import shmbuf
from shmbuf.compat.planet import Episode, Memory, SampleTooLargeError


@pytest.fixture
def memories():
    """Memory(...) that is closed (so unlinked) at teardown."""
    made = []

    def make(size=10, **kw):
        kw.setdefault("steps_per_episode", 12)
        kw.setdefault("seed", 0)
        memory = Memory(size, **kw)
        made.append(memory)
        return memory

    yield make
    for memory in made:
        memory.close()


def small(memories, size=10, **kw):
    return memories(size, obs_shape=OBS_SHAPE, action_size=ACTION_SIZE, **kw)


def fill(memory, writer=0, episodes=range(5), **kw):
    for k in episodes:
        memory.append([record(writer, k, **kw)])


def draws(memory, n, tracelen, batch=500, time_first=False, **kw):
    """(writer, episode, start) of ``n`` sequences, each checked by ``check_batch(**kw)``."""
    found = []
    while len(found) < n:
        seqs, lengths = memory.sample(min(batch, n - len(found)), tracelen=tracelen,
                                      time_first=time_first)
        found += check_batch(seqs, lengths, tracelen, time_first, **kw)
    return found


def chi_square(counts, expected):
    counts = np.asarray(counts, float)
    return float(((counts - expected) ** 2 / expected).sum())


# -- the docs' examples, typed out; only the import changed --------------------------

def test_docs_memory_and_episode_example():
    from shmbuf.compat.planet import Episode, Memory  # was: from torchwm import Memory, Episode

    C, H, W, action_dim = 3, 8, 8, 4
    obs, action, reward, done = torch.rand(C, H, W), torch.rand(action_dim), 0.5, False
    final_obs = torch.rand(C, H, W)

    memory = Memory(size=100)  # keep at most 100 episodes

    # Record an episode
    episode = Episode()
    episode.append(obs, action, reward, done)
    episode.append(obs, action, reward, done)
    episode.terminate(final_obs)  # converts lists to numpy arrays

    memory.append([episode])
    with memory:
        # The example's own episode has 2 steps: too short for tracelen=50.
        with pytest.raises(ValueError, match="length >= 50"):
            memory.sample(batch_size=32, tracelen=50)

        episode = Episode()
        for step in range(60):
            episode.append(torch.full((C, H, W), float(step)), torch.full((action_dim,), step + .5),
                           float(step), step == 59)
        episode.terminate(torch.full((C, H, W), 60.0))
        memory.append([episode])

        # Sample sub-sequences for training
        sequences, lengths = memory.sample(batch_size=32, tracelen=50)
        observations, actions, rewards, terminals = sequences
        assert observations.shape == (32, 51, C, H, W)
        assert actions.shape == (32, 50, action_dim)
        assert rewards.shape == terminals.shape == (32, 50)
        assert lengths.shape == (32,) and (lengths == 60).all()
        start = observations[:, 0, 0, 0, 0]
        np.testing.assert_array_equal(observations[:, :, 0, 0, 0], start[:, None] + np.arange(51))
        np.testing.assert_array_equal(actions[:, :, 0], start[:, None] + np.arange(50) + .5)

        sequences, lengths = memory.sample(batch_size=32, tracelen=50, time_first=True)
        assert sequences[0].shape == (51, 32, C, H, W)
        assert [s.shape for s in sequences[1:]] == [(50, 32, action_dim), (50, 32), (50, 32)]
        assert len(memory) == 2 and memory.size == 62


class _FakeEnv:
    """Counts steps: obs are uint8 frames filled with the step number; done after 60."""

    def __init__(self, action_dim):
        self.action_dim, self.steps = action_dim, 0

    def reset(self):
        self.steps = 0
        return np.zeros((3, 8, 8), np.uint8), {}

    def step(self, action):
        assert action.shape == (self.action_dim,)
        self.steps += 1
        return np.full((3, 8, 8), self.steps, np.uint8), float(self.steps), self.steps == 60, {}


def test_docs_episodic_memory_for_planning_example():
    action_dim, max_steps = 2, 100
    env = _FakeEnv(action_dim)

    def plan(episode):
        return torch.full((action_dim,), float(episode.size))

    memory = Memory(size=50)
    episode = Episode(postprocess_fn=lambda x: x / 255.0)

    obs, _ = env.reset()
    episode.append(obs, torch.zeros(action_dim), 0.0, False)

    for _ in range(max_steps):
        action = plan(episode)
        obs, reward, done, _ = env.step(action)
        episode.append(obs, action, reward, done)
        if done:
            episode.terminate(obs)
            memory.append([episode])
            break

    # Sample for training
    sequences, lengths = memory.sample(batch_size=16, tracelen=50, time_first=True)
    with memory:
        x, u, r, t = sequences
        assert x.shape == (51, 16, 3, 8, 8) and x.dtype == np.float32
        assert u.shape == (50, 16, action_dim) and r.shape == t.shape == (50, 16)
        assert (lengths == 61).all()  # the reset step plus 60 env steps
        # Appends 0..60 recorded frames 0..60, then terminate() repeated frame 60.
        index = np.minimum(np.round(x[:, :, 0, 0, 0] * 255), 255)
        first = index[0]
        np.testing.assert_array_equal(index, np.minimum(first + np.arange(51)[:, None], 60))
        np.testing.assert_allclose(x[:, :, 1, 2, 3], index / 255.0, rtol=1e-6)
        np.testing.assert_array_equal(u[:, :, 0], first + np.arange(50)[:, None])
        np.testing.assert_array_equal(t, first + np.arange(50)[:, None] == 60)


# -- sampled contents --------------------------------------------------------------

@pytest.mark.parametrize("tracelen", [1, 2, 5])
@pytest.mark.parametrize("time_first", [False, True])
def test_every_window_lies_in_one_episode_and_lines_up(memories, tracelen, time_first):
    memory = small(memories)
    fill(memory, 0, range(6))
    fill(memory, 1, range(3), torch_inputs=True)
    found = draws(memory, 300, tracelen, batch=100, time_first=time_first)
    held = {(w, k) for w, k, _ in found}
    eligible = {(w, k) for w, ks in ((0, range(6)), (1, range(3))) for k in ks
                if episode_length(w, k) >= tracelen}
    assert held == eligible


def test_tracelen_one_keeps_the_time_axis(memories):
    memory = small(memories)
    fill(memory)
    (x, u, r, t), lengths = memory.sample(7)
    assert (x.shape, u.shape, r.shape, t.shape) == ((7, 2) + OBS_SHAPE, (7, 1, 3), (7, 1), (7, 1))
    check_batch((x, u, r, t), lengths, 1)
    (x, u, r, t), lengths = memory.sample(7, tracelen=1, time_first=True)
    assert (x.shape, u.shape, r.shape, t.shape) == ((2, 7) + OBS_SHAPE, (1, 7, 3), (1, 7), (1, 7))
    check_batch((x, u, r, t), lengths, 1, time_first=True)
    assert x.dtype == u.dtype == r.dtype == np.float32 and t.dtype == np.bool_
    assert lengths.dtype == np.int64


def test_episodes_are_drawn_uniformly_per_episode(memories):
    # Valid starts per episode: 1, 4, 10, 22, 46; a per-start draw would pick the
    # longest episode 46 times as often as the shortest.  One episode is too short.
    lengths = np.array([3, 6, 12, 24, 48, 2])
    memory = small(memories, steps_per_episode=48)
    for k, n in enumerate(lengths):
        memory.append([record(0, k, length=int(n))])
    found = []
    while len(found) < 5000:
        seqs, got = memory.sample(1000, tracelen=3)
        found += check_batch(seqs, got, 3, length_of=lambda w, k: lengths[k])
    counts = np.bincount([k for _, k, _ in found], minlength=6)
    assert counts[5] == 0, "an episode shorter than tracelen was sampled"
    # 4 degrees of freedom: P(chi2 > 30) is about 5e-6.
    assert chi_square(counts[:5], 1000) < 30, counts
    starts = np.bincount([s for _, k, s in found if k == 4], minlength=46)
    assert len(starts) == 46 and chi_square(starts, counts[4] / 46) < 110, starts  # 45 dof


def test_fifo_by_episode_across_writer_streams(memories):
    memory = small(memories, size=3)
    other = Memory.attach(memory.name)  # a second handle: its own writer stream
    try:
        handles = [memory, other, memory, other, other, memory]
        for k, handle in enumerate(handles):
            handle.append(record(0, k))
            newest = range(max(0, k - 2), k + 1)
            assert len(memory) == len(other) == len(newest)
            assert memory.size == sum(episode_length(0, j) for j in newest)
        found = draws(memory, 400, 1)
        assert {k for _, k, _ in found} == {3, 4, 5}
        assert memory.max_episodes == 3
    finally:
        other.close()


def test_partial_and_in_progress_episodes_are_not_held(memories):
    memory = small(memories)
    fill(memory, 0, range(2))
    # A writer that died after 3 of an episode's 11 rows: its rows stay, unheld.
    w = memory.buffer.writer()
    for s in range(3):
        w.add(x=obs_value(9, 9, s), u=np.zeros(3, np.float32), r=0.0, t=False, length=10)
    w.close()
    fill(memory, 0, range(2, 4))
    assert len(memory) == 4
    assert 9 not in {w for w, _, _ in draws(memory, 400, 1)}


def test_episodes_longer_than_the_hint_leave_early_but_never_half(memories):
    memory = small(memories, size=5, steps_per_episode=4)   # 32 rows
    for k in range(6):
        memory.append(record(0, k, length=10))               # 11 rows each
        assert len(memory) == min(k + 1, 2)
    found = draws(memory, 300, 5, length_of=lambda w, k: np.full_like(k, 10))
    assert {k for _, k, _ in found} == {4, 5}


# -- Memory() and the deque views -------------------------------------------------------

def test_memory_without_size_keeps_every_episode_until_its_store_is_full():
    memory = Memory(capacity=40, obs_shape=OBS_SHAPE, action_size=ACTION_SIZE)  # chunks of 1
    try:
        assert memory.max_episodes is None and memory.episodes.maxlen is None
        for k in range(3):
            memory.append(record(0, k, length=10))                # 11 rows each: 33 of 40
        before = memory.buffer.stats().steps_written
        with pytest.raises(shmbuf.MemoryFullError, match="size=None.*room for 7 more.*need 17"):
            memory.append([record(0, 3, length=5), record(0, 4, length=10)])
        assert isinstance(shmbuf.MemoryFullError("x"), OverflowError)
        assert memory.buffer.stats().steps_written == before      # nothing written
        assert list(memory.eps_lengths) == [10, 10, 10] and memory.size == 30
        memory.append(record(0, 5, length=6))                     # 7 rows still fit
        assert len(memory.episodes) == 4 and memory.buffer.stats().oldest_step == 0  # no eviction
        found = draws(memory, 200, 5, length_of=lambda w, k: np.where(k == 5, 6, 10))
        assert {k for _, k, _ in found} == {0, 1, 2, 5}
        state = memory.state_dict()
        with Memory(capacity=30, obs_shape=OBS_SHAPE, action_size=ACTION_SIZE) as small_one:
            small_one.append(record(0, 9, length=2))
            with pytest.raises(shmbuf.MemoryFullError):           # 40 rows cannot fit in 30
                small_one.load_state_dict(state)
            assert list(small_one.eps_lengths) == [2]             # nothing changed
        with Memory(capacity=40) as fresh:                         # takes the checkpoint's schema
            fresh.load_state_dict(state)
            assert list(fresh.eps_lengths) == [10, 10, 10, 6]
    finally:
        memory.close()


def test_memory_with_no_arguments_sizes_its_store_at_the_first_append():
    memory = Memory()
    try:
        assert memory.capacity is None and "unbounded" in repr(memory)
        assert len(memory) == 0 and list(memory.episodes) == [] and memory.size == 0
        memory.append(record(0, 0))
        row = 4 * 6 + 4 * 3 + 4 + 1 + 8   # x (2, 3), u (3,), r f32, t bool, length i64
        assert row * 10**6 < 2**30 and memory.capacity == 10**6   # at most a million rows
        assert memory.buffer.capacity == 10**6
        with Memory.attach(memory.name) as other:                 # workers see the same bounds
            assert other.max_episodes is None and other.capacity == 10**6
            other.append(record(1, 0))
        assert list(memory.eps_lengths) == [episode_length(0, 0), episode_length(1, 0)]
    finally:
        memory.close()
    with Memory() as lazy:   # (3, 64, 64) float32 frames: 1 GiB of rows, sized without creating
        frames = lazy._capacity({"x": ((3, 64, 64), np.float32), "u": ((2,), np.float32)})[0]
    assert frames == 2**30 // (3 * 64 * 64 * 4 + 8) == 21841


def test_episodes_and_eps_lengths_read_like_upstreams_deques(memories):
    memory = small(memories, size=3)
    assert memory.episodes.maxlen == memory.eps_lengths.maxlen == 3
    assert len(memory.episodes) == 0 and list(memory.eps_lengths) == []
    with pytest.raises(IndexError):
        memory.episodes[0]
    for k in range(5):
        memory.append(record(0, k))
    lengths = [episode_length(0, k) for k in range(2, 5)]
    assert len(memory.episodes) == len(memory.eps_lengths) == 3
    assert list(memory.eps_lengths) == lengths and memory.size == sum(lengths)
    assert memory.eps_lengths[-1] == lengths[-1] and memory.eps_lengths[0] == lengths[0]
    eps = list(memory.episodes)
    assert [ep.size for ep in eps] == lengths and all(ep.terminated for ep in eps)
    for k, ep in zip(range(2, 5), eps):   # the stored copy is the recorded episode
        original = record(0, k)
        for field in "xurt":
            np.testing.assert_array_equal(getattr(ep, field), np.asarray(
                getattr(original, field), ep.x.dtype if field == "x" else None).reshape(
                    getattr(ep, field).shape))
    np.testing.assert_array_equal(memory.episodes[-1].x, eps[-1].x)
    np.testing.assert_array_equal(memory.episodes[-3].u, eps[0].u)
    with pytest.raises(IndexError):
        memory.episodes[3]
    with pytest.raises(IndexError):
        memory.eps_lengths[-4]
    with pytest.raises(TypeError):
        memory.episodes[0:2]   # deques do not slice either
    with pytest.raises(AttributeError):
        memory.episodes.append(eps[0])   # read-only
    with pytest.raises(AttributeError):
        memory.eps_lengths = []
    other = Memory.attach(memory.name)
    try:
        assert list(other.eps_lengths) == lengths and other.episodes.maxlen == 3
    finally:
        other.close()


# -- the memory guard ------------------------------------------------------------------

def test_memory_guard_default_is_200_mib_and_raises_before_reading(memories):
    frame = (3, 64, 64)
    memory = memories(1, steps_per_episode=60, obs_shape=frame, action_size=2)
    ep = Episode()
    for _s in range(55):
        ep.append(np.zeros(frame, np.float32), np.zeros(2, np.float32), 0.0, False)
    ep.terminate(np.zeros(frame, np.float32))
    memory.append(ep)
    assert memory.max_sample_bytes == 200 * 2**20
    samples = memory.buffer.stats().samples
    # 100 x 51 frames of 48 KiB are 239 MiB.
    with pytest.raises(SampleTooLargeError, match="max_sample_bytes") as err:
        memory.sample(100, tracelen=50)
    assert isinstance(err.value, MemoryError)
    assert memory.buffer.stats().samples == samples, "the guard must raise before sampling"
    (x, _, _, _), _ = memory.sample(8, tracelen=50)
    assert x.shape == (8, 51) + frame


def test_memory_guard_threshold_is_configurable(memories):
    row = 6 * 4 + ACTION_SIZE * 4 + 4 + 1 + 8  # x, u, r, t and the hidden int64 length
    need = 5 * (3 + 1) * row                       # batch 5, tracelen 3
    memory = small(memories, max_sample_bytes=need)
    fill(memory)
    check_batch(*memory.sample(5, tracelen=3), 3)
    with pytest.raises(SampleTooLargeError):
        memory.sample(6, tracelen=3)
    memory.max_sample_bytes = need - 1
    with pytest.raises(MemoryError):
        memory.sample(5, tracelen=3)
    with pytest.raises(ValueError, match="max_sample_bytes"):
        memory.max_sample_bytes = 0
    attached = Memory.attach(memory.name)  # attachers get the constructor's threshold
    try:
        assert attached.max_sample_bytes == need
        check_batch(*attached.sample(5, tracelen=3), 3)
    finally:
        attached.close()


def test_small_threshold_still_samples_in_rounds(memories):
    # Room for the batch and one candidate window: rejected slots refill one at a time.
    row = 6 * 4 + ACTION_SIZE * 4 + 4 + 1 + 8
    memory = small(memories, size=3, max_sample_bytes=9 * 3 * row)
    fill(memory, 0, range(6))   # 6 episodes stored, 3 held: many candidates rejected
    for _ in range(10):
        found = check_batch(*memory.sample(8, tracelen=2), 2)
        assert {k for _, k, _ in found} <= {3, 4, 5}


# -- errors ------------------------------------------------------------------------------

def test_empty_or_too_short_raises_value_error(memories):
    lazy = memories(5)
    with pytest.raises(ValueError, match="empty"):
        lazy.sample(4)
    memory = small(memories)
    with pytest.raises(shmbuf.NotEnoughDataError, match="empty"):
        memory.sample(4)
    memory.append(record(0, 0, length=4))
    with pytest.raises(ValueError, match="length >= 5"):
        memory.sample(4, tracelen=5)
    check_batch(*memory.sample(4, tracelen=4), 4)
    for bad, exc in ((0, ValueError), (2.0, TypeError), (True, TypeError)):
        with pytest.raises(exc, match="batch_size"):
            memory.sample(bad)
        with pytest.raises(exc, match="tracelen"):
            memory.sample(2, tracelen=bad)


def test_episode_records_numpy_or_torch_and_postprocesses_every_obs():
    a, b = record(1, 2, torch_inputs=True), record(1, 2)
    c = record(1, 2, doubled=True)
    n = episode_length(1, 2)
    for ep in (a, b, c):
        assert ep.size == n and ep.terminated
        assert ep.x.shape == (n + 1,) + OBS_SHAPE and ep.u.shape == (n, ACTION_SIZE)
        assert ep.r.shape == ep.t.shape == (n,) and ep.t.dtype == np.bool_
        np.testing.assert_array_equal(ep.x, b.x)
        np.testing.assert_array_equal(ep.u, b.u)
    np.testing.assert_array_equal(c.x[-1], obs_value(1, 2, n))  # the final obs is postprocessed
    frame, act = np.ones(OBS_SHAPE, np.float32), torch.ones(3)
    ep = Episode()
    ep.append(frame, act, 1.0, False)
    frame[:], act[:] = 7, 7  # the episode keeps copies
    assert (ep.x[0] == 1).all() and (ep.u[0] == 1).all()
    ep = Episode(postprocess_fn=halve)
    ep.append(frame, act, 1.0, False)
    ep.terminate(frame)
    assert (ep.x == 3.5).all()


def test_episode_rejects_bad_steps():
    ep = Episode()
    ep.append(np.zeros(OBS_SHAPE), np.zeros(3), 0.0, False)
    with pytest.raises(ValueError, match="obs"):
        ep.append(np.zeros((2, 4)), np.zeros(3), 0.0, False)
    with pytest.raises(ValueError, match="act"):
        ep.append(np.zeros(OBS_SHAPE), np.zeros(2), 0.0, False)
    with pytest.raises(ValueError, match="reward"):
        ep.append(np.zeros(OBS_SHAPE), np.zeros(3), [1.0, 2.0], False)
    with pytest.raises(ValueError, match="terminal"):
        ep.append(np.zeros(OBS_SHAPE), np.zeros(3), 0.0, 0.5)
    with pytest.raises(TypeError, match="obs"):
        ep.append("frame", np.zeros(3), 0.0, False)
    with pytest.raises(ValueError, match="final_obs"):
        ep.terminate(np.zeros((3, 2)))
    assert ep.size == 1  # nothing half-recorded
    ep.terminate(np.zeros(OBS_SHAPE))
    with pytest.raises(RuntimeError, match="terminated"):
        ep.append(np.zeros(OBS_SHAPE), np.zeros(3), 0.0, False)
    with pytest.raises(RuntimeError, match="terminated"):
        ep.terminate(np.zeros(OBS_SHAPE))
    with pytest.raises(ValueError, match="at least one step"):
        Episode().terminate(np.zeros(OBS_SHAPE))
    with pytest.raises(TypeError, match="postprocess_fn"):
        Episode(postprocess_fn=3)


def test_a_bad_episode_writes_nothing(memories):
    memory = small(memories, obs_dtype=np.uint8)
    good = Episode()
    good.append(np.zeros(OBS_SHAPE, np.uint8), np.zeros(3), 1.0, False)
    good.terminate(np.ones(OBS_SHAPE, np.uint8))
    lossy = record(0, 0)  # float observations with fractions
    with pytest.raises(TypeError, match=r"episodes\[1\]\.x"):
        memory.append([good, lossy])
    unfinished = Episode()
    unfinished.append(np.zeros(OBS_SHAPE, np.uint8), np.zeros(3), 0.0, False)
    with pytest.raises(ValueError, match=r"episodes\[1\].*not terminated"):
        memory.append([good, unfinished])
    with pytest.raises(ValueError, match="Episode"):
        memory.append([good, "episode"])
    with pytest.raises(ValueError, match="Episode"):
        memory.append(3)
    long = record(0, 0, length=200)
    with pytest.raises(ValueError, match="steps_per_episode"):
        memory.append([good, long])
    wide = Episode()
    wide.append(np.zeros(OBS_SHAPE, np.uint8), np.zeros(4), 0.0, False)
    wide.terminate(np.zeros(OBS_SHAPE, np.uint8))
    with pytest.raises(ValueError, match=r"episodes\[0\]\.u"):
        memory.append(wide)
    assert len(memory) == 0 and memory.buffer.stats().steps_written == 0
    memory.append([good, good])
    assert len(memory) == 2 and memory.size == 2


def test_constructor_arguments_are_checked():
    for kw, exc, word in (({"size": 0}, ValueError, "size"), ({"size": 2.5}, TypeError, "size"),
                          ({"size": 2, "steps_per_episode": 0}, ValueError, "steps_per_episode"),
                          ({"size": 2, "obs_shape": (3, 0)}, ValueError, "obs_shape"),
                          ({"size": 2, "action_size": -1}, ValueError, "action_size"),
                          ({"size": 2, "obs_dtype": object}, TypeError, "obs_dtype"),
                          ({"size": 2, "max_sample_bytes": 0}, ValueError, "max_sample_bytes")):
        with pytest.raises(exc, match=word):
            Memory(**kw)


# -- sharing and lifecycle -------------------------------------------------------------------

def test_schema_comes_from_the_first_episode_and_lazy_memory_cannot_be_sent(memories):
    memory = memories(4)
    assert memory.name is None and len(memory) == 0 and memory.size == 0
    with pytest.raises(TypeError, match="obs_shape"):
        pickle.dumps(memory)
    memory.unlink()  # nothing to unlink yet
    memory.append(record(0, 1))
    assert memory.buffer.spec["x"] == (OBS_SHAPE, np.dtype(np.float32))
    assert memory.buffer.spec["u"] == ((ACTION_SIZE,), np.dtype(np.float32))
    clone = pickle.loads(pickle.dumps(memory))
    try:
        assert clone.name == memory.name and not clone.buffer.owner
        assert len(clone) == 1
        clone.append(record(1, 1))
        assert len(memory) == 2
        with pytest.raises(PermissionError):
            clone.unlink()
    finally:
        clone.close()


def test_lifecycle_close_attach_and_context_manager(memories):
    with Memory(3, obs_shape=OBS_SHAPE, action_size=ACTION_SIZE, steps_per_episode=12) as memory:
        name = memory.name
        fill(memory, 0, range(2))
        with Memory.attach(name, seed=1) as attached:
            assert len(attached) == 2 and attached.max_episodes == 3
            check_batch(*attached.sample(4, tracelen=2), 2)
        assert "closed" in repr(attached)
    memory.close()  # idempotent
    for call in (lambda: memory.sample(1), lambda: memory.append(record(0, 0)),
                 lambda: len(memory)):
        with pytest.raises(shmbuf.BufferClosedError):
            call()
    with pytest.raises(shmbuf.SegmentNotFoundError):
        Memory.attach(name)
    plain = shmbuf.create({"obs": ((2,), np.float32)}, 64, done_key=None)
    try:
        with pytest.raises(shmbuf.CorruptSegmentError, match="Memory"):
            Memory.attach(plain.name)
    finally:
        plain.close()


def test_same_seed_same_samples(memories):
    a, b = small(memories, seed=5), small(memories, seed=5)
    for memory in (a, b):
        fill(memory, 0, range(6))
    for _ in range(3):
        (xa, *_), la = a.sample(20, tracelen=2)
        (xb, *_), lb = b.sample(20, tracelen=2)
        np.testing.assert_array_equal(xa, xb)
        np.testing.assert_array_equal(la, lb)


# -- checkpoints ----------------------------------------------------------------------------

def test_checkpoint_round_trip_through_torch_save(memories, tmp_path):
    memory = small(memories, size=4)
    fill(memory, 0, range(3))
    other = Memory.attach(memory.name)
    try:
        fill(other, 1, range(3))  # a second stream; 6 appended, 4 held
    finally:
        other.close()
    path = tmp_path / "memory.pt"
    torch.save(memory.state_dict(), path)
    state = torch.load(path, weights_only=True)

    fresh = memories(4)  # no schema yet: it takes the checkpoint's
    fresh.load_state_dict(state)
    assert len(fresh) == 4 and fresh.size == memory.size
    want = {(w, k) for w, k, _ in draws(memory, 300, 1)}
    assert {(w, k) for w, k, _ in draws(fresh, 300, 1)} == want
    assert fresh.capacity == memory.capacity

    fresh.append(record(2, 0))  # later appends are newer than every restored episode
    assert len(fresh) == 4
    got = {(w, k) for w, k, _ in draws(fresh, 400, 1)}
    assert (2, 0) in got and len(got) == 4 and got - {(2, 0)} < want

    smaller = memories(2, obs_shape=OBS_SHAPE, action_size=ACTION_SIZE)
    fill(smaller, 3, range(2))
    smaller.load_state_dict(torch.load(path, weights_only=True))  # replaces; keeps the newest 2
    assert len(smaller) == 2 and {w for w, _, _ in draws(smaller, 100, 1)} <= {0, 1}

    empty = memories(3)
    torch.save(empty.state_dict(), path)
    smaller.load_state_dict(torch.load(path, weights_only=True))
    assert len(smaller) == 0


def test_checkpoint_schema_mismatch_is_rejected(memories):
    memory = small(memories)
    fill(memory, 0, range(2))
    state = memory.state_dict()
    for target in (memories(3, obs_dtype=np.float64),
                   memories(3, obs_shape=(6,), action_size=ACTION_SIZE)):
        with pytest.raises(ValueError, match="schema"):
            target.load_state_dict(state)
        assert len(target) == 0
    with pytest.raises(ValueError, match="made by"):
        memory.load_state_dict(dict(state, facade="dreamer.ReplayBuffer"))
    assert len(memory) == 2


# -- several processes ------------------------------------------------------------------------

@pytest.mark.slow
def test_spawned_workers_append_while_the_trainer_samples():
    ctx = mp.get_context("spawn")
    per_worker, size = 30, 40
    memory = Memory(size, steps_per_episode=12, obs_shape=OBS_SHAPE, action_size=ACTION_SIZE,
                    seed=3)
    ready = ctx.Semaphore(0)
    procs = [ctx.Process(target=append_episodes, args=(memory, w, per_worker, ready))
             for w in range(3)]
    checked = 0
    try:
        with running(procs):
            assert ready.acquire(timeout=60), f"no worker appended: {[p.exitcode for p in procs]}"
            deadline = time.monotonic() + 120  # a hang guard, not a timing assertion
            while any(p.is_alive() for p in procs):
                assert time.monotonic() < deadline, "workers did not finish"
                time_first = checked % 2 == 1
                seqs, lengths = memory.sample(16, tracelen=3, time_first=time_first)
                checked += len(check_batch(seqs, lengths, 3, time_first))
            join_all(procs, 60)
        assert len(memory) == size
        found = draws(memory, 2000, 3)
        assert len({(w, k) for w, k, _ in found}) <= size
    finally:
        memory.close()
