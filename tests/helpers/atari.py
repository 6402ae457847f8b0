"""Real Atari frames for the compression tests (ale-py's wheel ships the ROMs), and the
steps they store: ``obs = frames[idx]`` and ``idx``, so any batch is checked against the
ground truth with one comparison."""
import os

import numpy as np
import pytest

FRAME = (3, 64, 64)
SHM = "/dev/shm"


def spec():
    return {"obs": (FRAME, np.uint8), "idx": ((), np.int64), "done": ((), np.bool_)}


def fill(buf, frames, steps, start=0, episode=50):
    """``steps`` steps from step ``start`` on, frames in a cycle, an episode every ``episode``."""
    with buf.writer() as w:
        for j in range(start, start + steps):
            i = j % len(frames)
            w.add(obs=frames[i], idx=i, done=j % episode == episode - 1)


def check(frames, batch):
    assert np.array_equal(batch["obs"], frames[batch["idx"]])


def shm_used() -> int:
    """Bytes in use in /dev/shm, as statvfs counts them (every process's)."""
    st = os.statvfs(SHM)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def play(game: str, steps: int, seed: int) -> np.ndarray:
    """``steps`` frames of ``game`` under a seeded random policy, 64x64, channels first."""
    ale_py = pytest.importorskip("ale_py")
    import gymnasium as gym
    from PIL import Image

    gym.register_envs(ale_py)
    env = gym.make(f"ALE/{game}-v5", obs_type="rgb")
    rng = np.random.default_rng(seed)
    out = np.empty((steps, *FRAME), np.uint8)
    obs, _ = env.reset(seed=seed)
    try:
        for i in range(steps):
            out[i] = np.asarray(Image.fromarray(obs).resize((64, 64), Image.BOX)).transpose(2, 0, 1)
            obs, _, term, trunc, _ = env.step(int(rng.integers(env.action_space.n)))
            if term or trunc:
                obs, _ = env.reset()
    finally:
        env.close()
    return out
