"""Real Atari frames for the compression tests: ale-py's wheel ships the ROMs."""
import numpy as np
import pytest

FRAME = (3, 64, 64)


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
