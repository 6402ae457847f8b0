"""Small gymnasium envs for the recorder tests: observations that name their own step."""
import gymnasium as gym
import numpy as np
from gymnasium import spaces


class StepEnv(gym.Env):
    """Each observation says which episode and step it is, and which action led to it.

    ``obs["ids"] = [episode id, t, last action]`` (last action -1 after a
    reset) and ``obs["image"]`` is a 3x8x8 uint8 frame filled with ``t``.
    The reward of step t taken with action a is ``10 * t + a``.  An episode
    lasts 2..max_len steps; it terminates when its id is even and is
    truncated otherwise.
    """

    metadata = {"render_modes": []}

    def __init__(self, max_len: int = 12):
        self.max_len = max_len
        self.observation_space = spaces.Dict({
            "image": spaces.Box(0, 255, (3, 8, 8), np.uint8),
            "ids": spaces.Box(-1, 1 << 20, (3,), np.int64),
        })
        self.action_space = spaces.Discrete(3)

    def _obs(self, last_action: int):
        image = np.full((3, 8, 8), self._t % 256, np.uint8)
        return {"image": image, "ids": np.array([self._ep, self._t, last_action], np.int64)}

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self._ep = int(self.np_random.integers(1 << 20))
        self._t = 0
        self._len = int(self.np_random.integers(2, self.max_len + 1))
        return self._obs(-1), {}

    def step(self, action):
        action = int(action)
        self._t += 1
        end = self._t >= self._len
        terminated = end and self._ep % 2 == 0
        truncated = end and not terminated
        return self._obs(action), float(10 * self._t + action), terminated, truncated, {}


def make_step_env(max_len: int = 12):
    return StepEnv(max_len)


def make_recorded_step_env(buffer, max_len: int = 12):
    """A StepEnv that records itself (for the sub-envs of an async vector env)."""
    from shmbuf.gym import RecordEpisodes

    return RecordEpisodes(StepEnv(max_len), buffer)


class DictActionStepEnv(StepEnv):
    """StepEnv with a Dict action: ``move`` is the action the observations name."""

    def __init__(self, max_len: int = 12):
        super().__init__(max_len)
        self.action_space = spaces.Dict({"move": spaces.Discrete(3),
                                         "force": spaces.Box(-1.0, 1.0, (2,), np.float32)})

    def step(self, action):
        assert action["force"].shape == (2,)
        return super().step(action["move"])
