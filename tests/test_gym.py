"""shmbuf.gym: specs from spaces, and recorders checked against real gymnasium envs.

Every recorded episode is read back from the buffer and compared with what
``RecordEpisodeStatistics`` reported, and every sampled window is checked
against observations that name their own episode, step and action
(``helpers.gym_envs.StepEnv``).
"""
import faulthandler
import functools
import subprocess
import sys

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces
from gymnasium.error import ResetNeeded
from gymnasium.vector import AsyncVectorEnv, AutoresetMode, SyncVectorEnv
from gymnasium.wrappers import RecordEpisodeStatistics
from gymnasium.wrappers.vector import RecordEpisodeStatistics as RecordVectorStatistics
from helpers.gym_envs import DictActionStepEnv, StepEnv, make_recorded_step_env, make_step_env

import shmbuf
from shmbuf.gym import RecordEpisodes, RecordVectorEpisodes, UnsupportedSpaceError, spec_for

MODES = [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP, AutoresetMode.DISABLED]


@pytest.fixture(autouse=True)
def watchdog():
    """A hung env worker fails the run with tracebacks instead of hanging it."""
    faulthandler.dump_traceback_later(120, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def read_episodes(buf) -> list[dict]:
    """Finished episodes, oldest first, as ``{column: array}``, read through iter_episodes."""
    episodes = list(buf.iter_episodes())
    assert len(episodes) == len(buf.episodes())  # nothing was recycled
    return episodes


def summary(episodes) -> list[tuple[int, float]]:
    """(env steps, return) of each episode, sorted: a row per observation, so rows - 1 steps."""
    return sorted((len(ep["reward"]) - 1, round(float(ep["reward"].sum()), 3)) for ep in episodes)


def check_convention(ep: dict) -> None:
    """One episode as stored: a first row, then one row per step, done only at the end."""
    assert ep["is_first"][0] and not ep["is_first"][1:].any()
    assert not ep["done"][:-1].any()
    assert ep["reward"][0] == 0


def check_step_windows(batch: dict) -> None:
    """Windows of StepEnv rows (time-major): one episode, consecutive steps, right actions."""
    ids = batch["obs_ids"]                      # (L, B, 3): episode id, t, last action
    ep, t, last = ids[..., 0], ids[..., 1], ids[..., 2]
    assert (ep == ep[:1]).all(), "a window spans two episodes"
    assert (np.diff(t, axis=0) == 1).all(), "a window skips or repeats a step"
    first = batch["is_first"]
    assert (first == (t == 0)).all(), "is_first is not exactly the reset observation"
    assert (batch["action"][~first] == last[~first]).all(), \
        "an observation has another step's action"
    assert (batch["action"][first] == 0).all() and (last[first] == -1).all()
    want = np.where(first, 0, 10 * t + batch["action"])
    np.testing.assert_array_equal(batch["reward"], want)
    assert (batch["obs_image"] == (t % 256).astype(np.uint8)[..., None, None, None]).all()
    assert not batch["done"][:-1].any()


# -- specs ------------------------------------------------------------------------------------

def test_the_core_never_imports_gymnasium():
    code = "import shmbuf, sys; assert 'gymnasium' not in sys.modules, 'imported'"
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert got.returncode == 0, got.stderr


def test_spec_of_cartpole_and_pendulum():
    assert spec_for(gym.make("CartPole-v1")) == {
        "obs": ((4,), np.float32), "action": ((), np.uint8), "reward": ((), np.float32),
        "is_first": ((), np.bool_), "done": ((), np.bool_)}
    spec = spec_for(gym.make("Pendulum-v1"))
    assert spec["obs"] == ((3,), np.float32) and spec["action"] == ((1,), np.float32)


def test_spec_flattens_dicts_and_picks_the_smallest_exact_dtype():
    obs = spaces.Dict({
        "image": spaces.Box(0, 255, (3, 16, 16), np.uint8),
        "pos": spaces.Box(-1.0, 1.0, (2,), np.float64),
        "cell": spaces.Box(-3, 300, (2,), np.int64),
        "nested": spaces.Dict({"flag": spaces.MultiBinary(4), "pair": spaces.Tuple(
            (spaces.Discrete(3), spaces.Discrete(70_000, start=-5)))}),
    })
    act = spaces.Dict({"move": spaces.MultiDiscrete([3, 5]), "fire": spaces.Discrete(2),
                       "signed": spaces.MultiDiscrete([4], start=[-2])})
    env = StepEnv()
    env.observation_space, env.action_space = obs, act
    assert spec_for(env) == {
        "obs_image": ((3, 16, 16), np.uint8), "obs_pos": ((2,), np.float64),
        "obs_cell": ((2,), np.int16), "obs_nested_flag": ((4,), np.bool_),
        "obs_nested_pair_0": ((), np.uint8), "obs_nested_pair_1": ((), np.int32),
        "action_move": ((2,), np.uint8), "action_fire": ((), np.uint8),
        "action_signed": ((1,), np.int8),
        "reward": ((), np.float32), "is_first": ((), np.bool_), "done": ((), np.bool_)}


def test_spec_of_a_vector_env_is_its_single_env_spec(request):
    envs = gym.make_vec("CartPole-v1", num_envs=3)
    request.addfinalizer(envs.close)
    assert spec_for(envs) == spec_for(gym.make("CartPole-v1"))


def test_overrides_replace_columns_and_unknown_ones_fail():
    env = gym.make("CartPole-v1")
    assert spec_for(env, reward=((), np.float64))["reward"] == ((), np.float64)
    with pytest.raises(KeyError, match="'rewards'.*columns are"):
        spec_for(env, rewards=((), np.float64))


@pytest.mark.parametrize("space, kind", [
    (spaces.Text(12), "Text"),
    (spaces.Sequence(spaces.Box(0, 1, (3,))), "Sequence"),
    (spaces.Graph(node_space=spaces.Box(0, 1, (2,)), edge_space=None), "Graph"),
])
def test_unsupported_spaces_name_the_space_and_suggest_an_override(space, kind):
    env = StepEnv()
    env.observation_space = spaces.Dict({"ok": spaces.Discrete(2), "bad": space})
    with pytest.raises(UnsupportedSpaceError, match=rf"'obs_bad' comes from a {kind} space.*"
                                                    r"spec_for\(env, obs_bad="):
        spec_for(env)
    assert issubclass(UnsupportedSpaceError, TypeError)


def test_a_text_space_records_with_an_override(make_buffer):
    class Words(StepEnv):
        def __init__(self):
            super().__init__(max_len=3)
            self.observation_space = spaces.Text(8)

        def _obs(self, last_action):
            return f"t{self._t}a{last_action}"

    env = Words()
    buf = make_buffer(spec_for(env, obs=((), "U8")), capacity=64)
    rec = RecordEpisodes(env, buf)
    rec.reset(seed=0)
    while not any(rec.step(1)[2:4]):
        pass
    rec.close()
    (ep,) = read_episodes(buf)
    assert ep["obs"][0] == "t0a-1" and ep["obs"][1] == "t1a1"


def test_a_buffer_with_other_columns_is_refused(make_buffer):
    buf = make_buffer(spec_for(gym.make("Pendulum-v1")), capacity=64)
    with pytest.raises(ValueError, match="spec_for"):
        RecordEpisodes(gym.make("CartPole-v1"), buf)


# -- the single-env recorder ---------------------------------------------------------------------

def run_single(env, episodes: int, seed: int = 0, action=None) -> list[tuple[int, float]]:
    """Play ``episodes`` episodes; return what RecordEpisodeStatistics reported."""
    env = RecordEpisodeStatistics(env)
    env.action_space.seed(seed)
    reported = []
    env.reset(seed=seed)
    while len(reported) < episodes:
        a = env.action_space.sample() if action is None else action
        _, _, terminated, truncated, info = env.step(a)
        if terminated or truncated:
            reported.append((int(info["episode"]["l"]), round(float(info["episode"]["r"]), 3)))
            env.reset()
    return reported


@pytest.mark.parametrize("env_id, steps", [("CartPole-v1", 500), ("Pendulum-v1", 25)])
def test_single_env_episodes_match_record_episode_statistics(make_buffer, env_id, steps):
    env = gym.make(env_id, max_episode_steps=steps)
    buf = make_buffer(spec_for(env), capacity=4096)
    reported = run_single(RecordEpisodes(env, buf), episodes=12)
    episodes = read_episodes(buf)
    assert summary(episodes) == sorted(reported)
    for ep in episodes:
        check_convention(ep)
    ends = buf.episodes()
    if env_id == "Pendulum-v1":  # never terminates: every episode is a truncation
        assert not ends.terminal.any() and not any(ep["done"].any() for ep in episodes)
    else:
        assert ends.terminal.all() and all(ep["done"][-1] for ep in episodes)


def test_statistics_inside_the_recorder_see_the_same_episodes(make_buffer):
    env = RecordEpisodeStatistics(gym.make("CartPole-v1"))
    buf = make_buffer(spec_for(env), capacity=2048)
    rec = RecordEpisodes(env, buf)
    rec.action_space.seed(0)
    rec.reset(seed=0)
    while len(env.length_queue) < 8:
        if any(rec.step(rec.action_space.sample())[2:4]):
            rec.reset()
    assert summary(read_episodes(buf)) == sorted(
        (int(n), round(float(r), 3)) for n, r in zip(env.length_queue, env.return_queue))


def test_truncation_cuts_without_a_terminal(make_buffer):
    env = gym.make("CartPole-v1", max_episode_steps=5)
    buf = make_buffer(spec_for(env), capacity=256)
    rec = RecordEpisodes(env, buf)
    reported = run_single(rec, episodes=3, action=0)
    assert reported == [(5, 5.0)] * 3
    ends = buf.episodes()
    assert ends.length.tolist() == [6, 6, 6] and not ends.terminal.any()
    assert not buf.arrays["done"][:len(buf)].any()
    with pytest.raises(shmbuf.NotEnoughDataError):
        buf.sample_sequences(4, 7)  # no window spans a cut


def test_windows_pair_each_observation_with_its_own_action(make_buffer):
    env = StepEnv()
    buf = make_buffer(spec_for(env), capacity=2048, seed=1)
    rng = np.random.default_rng(0)
    rec = RecordEpisodes(env, buf)
    rec.reset(seed=3)
    for _ in range(1500):
        if any(rec.step(int(rng.integers(3)))[2:4]):
            rec.reset()
    for length in (1, 3, 6):
        check_step_windows(buf.sample_sequences(64, length))
    check_step_windows(buf.sample_sequences(64, 4, uniform="episodes"))
    for ep in read_episodes(buf):
        check_convention(ep)
        assert ep["obs_ids"][-1, 1] == len(ep["reward"]) - 1
        assert bool(ep["done"][-1]) == (ep["obs_ids"][0, 0] % 2 == 0)


def test_step_before_reset_and_reset_mid_episode(make_buffer):
    env = StepEnv(max_len=50)
    buf = make_buffer(spec_for(env), capacity=256)
    rec = RecordEpisodes(env, buf)
    with pytest.raises(ResetNeeded):
        rec.step(0)
    rec.reset(seed=0)
    rec.step(1)
    rec.reset()  # the running episode is cut, not terminal
    ends = buf.episodes()
    assert ends.length.tolist() == [2] and not ends.terminal.any()


def test_close_closes_the_writer_and_cuts_the_open_episode(make_buffer):
    env = StepEnv(max_len=50)
    buf = make_buffer(spec_for(env), capacity=256)
    rec = RecordEpisodes(env, buf)
    rec.reset(seed=0)
    rec.step(2)
    assert buf.stats().writers == 1
    rec.close()
    rec.close()
    assert buf.stats().writers == 0 and not buf.closed
    assert buf.episodes().length.tolist() == [2]
    assert buf.sample_sequences(1, 2)["action"][1, 0] == 2


def _no_zero_step_episode(buf, finished: int) -> None:
    """Only real episodes are indexed: none is a lone reset row, and samplers agree."""
    eps = buf.episodes()
    assert len(eps) == finished and eps.length.min() >= 2, eps.length.tolist()
    assert buf.count_episodes(1) == finished
    indexed = {int(ep["obs_ids"][0, 0]) for ep in buf.iter_episodes()}
    drawn = buf.sample_sequences(200, 1, uniform="episodes", rng=0)["obs_ids"][0, :, 0]
    assert set(drawn.tolist()) <= indexed   # a lone reset row would be drawn 1 time in E + 1


def test_closing_after_a_reset_with_no_step_indexes_no_episode(make_buffer):
    # gymnasium's usual loop: the last episode ends, reset() starts the next, close().
    env = StepEnv(max_len=4)
    buf = make_buffer(spec_for(env), capacity=256)
    rec = RecordEpisodes(env, buf)
    for seed in range(3):
        rec.reset(seed=seed)
        while not any(rec.step(1)[2:4]):
            pass
    rec.reset()
    rec.close()
    _no_zero_step_episode(buf, 3)


@pytest.mark.parametrize("mode", MODES, ids=[m.value for m in MODES])
def test_a_vector_recorder_closing_after_resets_indexes_no_zero_step_episode(make_buffer, mode):
    envs = make_vec("sync", mode, 2, functools.partial(make_step_env, 3))
    buf = make_buffer(spec_for(envs), capacity=512)
    rec = RecordVectorEpisodes(envs, buf)
    rec.reset(seed=0)
    for _ in range(50):   # until a sub-env's open episode is only its reset row
        _, _, term, trunc, _ = rec.step(np.array([1, 1]))
        ended = term | trunc
        if mode == AutoresetMode.DISABLED and ended.any():
            rec.reset(options={"reset_mask": ended})
        if mode == AutoresetMode.NEXT_STEP and ended.any():
            rec.step(np.array([1, 1]))   # this call writes the ended sub-envs' reset rows
        if ended.any() and len(buf.episodes()) >= 2:
            break
    finished = len(buf.episodes())
    assert finished >= 2
    rec.close()
    _no_zero_step_episode(buf, finished)


def test_spaces_and_values_pass_through_unchanged(make_buffer):
    env = gym.make("CartPole-v1")
    buf = make_buffer(spec_for(env), capacity=64)
    rec = RecordEpisodes(env, buf)
    assert rec.observation_space == env.observation_space
    assert rec.action_space == env.action_space
    plain = gym.make("CartPole-v1")
    a, b = rec.reset(seed=7), plain.reset(seed=7)
    np.testing.assert_array_equal(a[0], b[0])
    got, want = rec.step(1), plain.step(1)
    np.testing.assert_array_equal(got[0], want[0])
    assert got[1:] == want[1:]
    rec.close()


# -- the vector recorder ---------------------------------------------------------------------------

def make_vec(kind: str, mode, n: int, fn=make_step_env):
    fns = [fn] * n
    if kind == "sync":
        return SyncVectorEnv(fns, autoreset_mode=mode)
    return AsyncVectorEnv(fns, autoreset_mode=mode)


def run_vector(envs, steps: int, seed: int = 0) -> list[tuple[int, float]]:
    """Step a (recorded) vector env with random actions; return RecordEpisodeStatistics' reports."""
    mode = envs.metadata["autoreset_mode"]
    envs = RecordVectorStatistics(envs)
    rng = np.random.default_rng(seed)
    reported = []
    envs.reset(seed=seed)
    for _ in range(steps):
        actions = rng.integers(envs.single_action_space.n, size=envs.num_envs)
        _, _, term, trunc, info = envs.step(actions)
        if "episode" in info:
            for i in np.flatnonzero(info["_episode"]):
                reported.append((int(info["episode"]["l"][i]),
                                 round(float(info["episode"]["r"][i]), 3)))
        ended = term | trunc
        if mode == AutoresetMode.DISABLED and ended.any():
            envs.reset(options={"reset_mask": ended})
    return reported


ENVS = {"steps": make_step_env,  # CartPole's time limit of 15 steps truncates some episodes
        "cartpole": functools.partial(gym.make, "CartPole-v1", max_episode_steps=15)}


@pytest.mark.parametrize("env_name", list(ENVS))
@pytest.mark.parametrize("kind", ["sync", "async"])
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_vector_episodes_match_statistics_and_windows_are_whole(make_buffer, kind, mode,
                                                                env_name):
    envs = make_vec(kind, mode, 3, ENVS[env_name])
    try:
        buf = make_buffer(spec_for(envs), capacity=4096, seed=2)
        rec = RecordVectorEpisodes(envs, buf)
        reported = run_vector(rec, steps=150)
        episodes = read_episodes(buf)
        assert len(reported) > 20
        assert summary(episodes) == sorted(reported)
        for ep in episodes:
            check_convention(ep)
        ends = buf.episodes()
        assert ends.terminal.any() and not ends.terminal.all()  # both kinds of ending
        assert len(set(ends.stream.tolist())) == 3              # one stream per sub-env
        assert (ends.terminal == [bool(ep["done"][-1]) for ep in episodes]).all()
        if env_name == "steps":
            for length in (1, 4):
                check_step_windows(buf.sample_sequences(96, length))
        rec.close()
        assert buf.stats().writers == 0
        if env_name == "steps":
            check_step_windows(buf.sample_sequences(96, 2))
    finally:
        envs.close(**({"terminate": True} if kind == "async" else {}))


def test_next_step_reset_steps_are_never_transitions(make_buffer):
    envs = make_vec("sync", AutoresetMode.NEXT_STEP, 2)
    buf = make_buffer(spec_for(envs), capacity=1024)
    rec = RecordVectorEpisodes(envs, buf)
    rec.reset(seed=0)
    for _ in range(60):
        rec.step(np.array([2, 2]))  # the action given on a reset step is ignored and not stored
    rec.close()
    steps = buf.snapshot()["columns"]
    first = steps["is_first"]
    assert first.sum() > 4
    assert (steps["action"][first] == 0).all() and (steps["reward"][first] == 0).all()
    assert (steps["action"][~first] == 2).all()
    assert (steps["obs_ids"][~first, 1] > 0).all()


def test_vector_close_cuts_open_episodes_and_keeps_the_buffer(make_buffer):
    envs = make_vec("sync", AutoresetMode.NEXT_STEP, 2, functools.partial(make_step_env, 100))
    buf = make_buffer(spec_for(envs), capacity=1024)
    rec = RecordVectorEpisodes(envs, buf)
    rec.reset(seed=0)
    rec.step(np.array([1, 1]))
    rec.close()
    assert envs.closed and not buf.closed and buf.stats().writers == 0
    ends = buf.episodes()
    assert ends.length.tolist() == [2, 2] and not ends.terminal.any()


def test_disabled_mode_refuses_to_step_an_ended_env(make_buffer):
    envs = make_vec("sync", AutoresetMode.DISABLED, 2, functools.partial(make_step_env, 2))
    buf = make_buffer(spec_for(envs), capacity=256)
    rec = RecordVectorEpisodes(envs, buf)
    with pytest.raises(ResetNeeded):
        rec.step(np.array([0, 0]))
    rec.reset(seed=0)
    rec.step(np.array([0, 0]))
    rec.step(np.array([0, 0]))  # every episode lasts 2 steps
    with pytest.raises(ResetNeeded, match=r"\[0, 1\]"):
        rec.step(np.array([0, 0]))
    rec.close()


def test_recorders_inside_async_workers_write_straight_into_the_buffer(make_buffer):
    buf = make_buffer(spec_for(StepEnv()), capacity=4096, seed=4)
    fn = functools.partial(make_recorded_step_env, buf)
    envs = RecordVectorStatistics(AsyncVectorEnv([fn] * 2, autoreset_mode=AutoresetMode.SAME_STEP))
    try:
        reported = []
        rng = np.random.default_rng(0)
        envs.reset(seed=0)
        for _ in range(100):
            info = envs.step(rng.integers(3, size=2))[-1]
            for i in np.flatnonzero(info.get("_episode", [])):
                reported.append((int(info["episode"]["l"][i]),
                                 round(float(info["episode"]["r"][i]), 3)))
    finally:
        envs.close()  # closes each worker's recorder: its open episode is cut
    episodes = read_episodes(buf)
    assert len(episodes) == len(reported) + 2 and len(reported) > 10
    assert summary(episodes[:-2]) == sorted(reported)   # the last two were cut at close
    assert not buf.episodes().terminal[-2:].any()
    check_step_windows(buf.sample_sequences(64, 3))
    assert buf.stats().writers == 0


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_dict_actions_are_recorded_per_key(make_buffer, mode):
    envs = SyncVectorEnv([DictActionStepEnv] * 2, autoreset_mode=mode)
    buf = make_buffer(spec_for(envs), capacity=1024, seed=5)
    assert buf.spec["action_move"] == ((), np.uint8)
    assert buf.spec["action_force"] == ((2,), np.float32)
    rec = RecordVectorEpisodes(envs, buf)
    obs, _ = rec.reset(seed=1)
    rng = np.random.default_rng(1)
    for _ in range(80):
        move = rng.integers(3, size=2)
        force = np.stack([move, -move], axis=1).astype(np.float32) / 2
        _, _, term, trunc, _ = rec.step({"move": move, "force": force})
        if mode == AutoresetMode.DISABLED and (term | trunc).any():
            rec.reset(options={"reset_mask": term | trunc})
    rec.close()
    batch = buf.sample_sequences(64, 3)
    check_step_windows({**batch, "action": batch["action_move"]})
    first = batch["is_first"]
    np.testing.assert_array_equal(batch["action_force"][~first][:, 0] * 2,
                                  batch["action_move"][~first])
    assert (batch["action_force"][first] == 0).all()
