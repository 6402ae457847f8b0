"""A small gymnasium env that swm's World can drive without pygame or OpenCV."""
from __future__ import annotations

from typing import ClassVar

import gymnasium as gym
import numpy as np

ENV_ID = "shmbuf_test/Dot-v0"


class Dot(gym.Env):
    """A dot moved by 2-D actions; frames are drawn with numpy."""

    metadata: ClassVar[dict] = {"render_modes": ["rgb_array"]}

    def __init__(self, render_mode=None, size: int = 16):
        self.render_mode, self.size = render_mode, size
        self.observation_space = gym.spaces.Box(0, 1, (2,), np.float32)
        self.action_space = gym.spaces.Box(-1, 1, (2,), np.float32)
        self.pos = np.zeros(2, np.float32)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.pos = self.np_random.uniform(0, 1, 2).astype(np.float32)
        return self.pos.copy(), {}

    def step(self, action):
        self.pos = np.clip(self.pos + 0.1 * np.asarray(action, np.float32), 0, 1)
        return self.pos.copy(), float(-np.abs(self.pos - 0.5).sum()), False, False, {}

    def render(self):
        img = np.zeros((self.size, self.size, 3), np.uint8)
        i, j = (self.pos * (self.size - 1)).astype(int)
        img[i, j] = 255
        return img


if ENV_ID not in gym.registry:
    gym.register(ENV_ID, entry_point=Dot)


def world_class():
    """swm's World, or None with the reason it cannot be imported here."""
    try:
        from stable_worldmodel import World
        from stable_worldmodel.policy import RandomPolicy  # noqa: F401
    except (ImportError, RuntimeError, OSError) as exc:   # e.g. a torchvision built for CUDA torch
        return None, f"{type(exc).__name__}: {exc}"
    return World, None


def make_world(num_envs: int = 2, steps: int = 6, seed: int = 0):
    from stable_worldmodel import World
    from stable_worldmodel.policy import RandomPolicy

    world = World(ENV_ID, num_envs=num_envs, image_shape=(16, 16), max_episode_steps=steps,
                  goal_conditioned=False)
    world.set_policy(RandomPolicy(seed=seed))
    return world
