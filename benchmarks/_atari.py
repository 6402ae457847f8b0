"""Real Atari frames for the compression benchmarks, in DreamerV3's frame shape (3, 64, 64) uint8.

Games are played by ale-py (its wheel ships the ROMs) with a random policy, sticky actions and
frame skip 4 (the ALE v5 defaults); each 210x160 RGB frame is area-resized to 64x64 with PIL
and stored channels first.  Episodes are capped so that every game contributes.
"""
from __future__ import annotations

import numpy as np

GAMES = ("Breakout", "MsPacman", "Pong", "SpaceInvaders", "Seaquest")
FRAME = (3, 64, 64)


def play(game: str, steps: int, seed: int = 0,
         max_episode: int = 2000) -> tuple[np.ndarray, np.ndarray]:
    """``steps`` frames of ``game`` in play order, and the done flag of each step.

    Args:
        game: an ALE game name, such as ``"Breakout"``.
        steps: how many frames to return.
        seed: the environment's and the policy's seed.
        max_episode: an episode longer than this is cut (its last step gets done=True).
    Returns:
        ``(frames, done)``: uint8 ``(steps, 3, 64, 64)`` and bool ``(steps,)``.
    """
    import ale_py
    import gymnasium as gym
    from PIL import Image

    gym.register_envs(ale_py)
    env = gym.make(f"ALE/{game}-v5", obs_type="rgb")
    rng = np.random.default_rng(seed)
    frames = np.empty((steps, *FRAME), np.uint8)
    done = np.zeros(steps, bool)
    obs, _ = env.reset(seed=seed)
    length = 0
    try:
        for i in range(steps):
            small = Image.fromarray(obs).resize((64, 64), Image.BOX)
            frames[i] = np.asarray(small).transpose(2, 0, 1)
            obs, _, term, trunc, _ = env.step(int(rng.integers(env.action_space.n)))
            length += 1
            if term or trunc or length >= max_episode:
                done[i] = True
                obs, _ = env.reset()
                length = 0
    finally:
        env.close()
    return frames, done


def noise(steps: int, seed: int = 0) -> np.ndarray:
    """``steps`` frames of uniform random bytes: the incompressible case."""
    return np.random.default_rng(seed).integers(0, 256, (steps, *FRAME), np.uint8)
