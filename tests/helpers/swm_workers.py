"""Child-process bodies for tests/test_compat_swm*.py (importable by spawned children)."""
from __future__ import annotations

import numpy as np


def tagged_episode(writer_id: int, ep: int, steps: int) -> dict:
    """An episode whose every row names its writer, episode and step (checkable later)."""
    t = np.arange(steps)
    return {
        "pixels": np.full((steps, 4, 4, 3), (writer_id * 16 + ep) % 256, np.uint8),
        "action": np.stack([np.full(steps, writer_id, np.float32), t.astype(np.float32)], 1),
        "who": np.full(steps, writer_id, np.int64),
        "ep": np.full(steps, ep, np.int64),
        "t": t.astype(np.int64),
    }


def write_tagged(rb, writer_id: int, episodes: int, steps: int) -> None:
    """Spawned collector: write ``episodes`` tagged episodes into the shared ReplayBuffer."""
    for ep in range(episodes):
        rb.write_episode(tagged_episode(writer_id, ep, steps))


def write_shm_dataset(path: str, episodes: int, steps: int) -> None:
    """Spawned writer: fill ``shm://NAME`` through swm's format registry, then exit."""
    from stable_worldmodel.data.format import get_format

    import shmbuf.compat.swm  # noqa: F401  # registers the format

    with get_format("shmbuf").open_writer(path, mode="error") as w:
        for ep in range(episodes):
            w.write_episode(tagged_episode(0, ep, steps))


def rb_len(rb) -> int:
    return len(rb)


def play_frames(steps: int, seed: int = 1) -> np.ndarray:
    """``(steps, 64, 64, 3)`` uint8 frames: Breakout played by a random policy
    (``helpers.atari``), or, where ale-py is not installed (stable-worldmodel's own CI
    environment), a rendered Breakout-like scene (bricks, a moving ball and paddle):
    either compresses well in chunks."""
    try:
        import ale_py  # noqa: F401
    except ImportError:
        return _rendered_frames(steps, seed)
    from helpers.atari import play

    return np.ascontiguousarray(play("Breakout", steps, seed).transpose(0, 2, 3, 1))


def _rendered_frames(steps: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    out = np.zeros((steps, 64, 64, 3), np.uint8)
    colors = rng.integers(60, 256, (6, 3), dtype=np.uint8)
    bricks = np.ones((6, 16), np.bool_)
    x, y, dx, dy, paddle = 30.0, 40.0, 1.3, -1.1, 28
    for i in range(steps):
        f = out[i]
        for r in range(6):
            for c in np.flatnonzero(bricks[r]):
                f[8 + 3 * r:10 + 3 * r, 4 * c:4 * c + 3] = colors[r]
        x, y = x + dx, y + dy
        if not 0 <= x <= 62:
            dx, x = -dx, min(max(x, 0), 62)
        if y <= 8 + 18 and bricks[int(max(0, y - 8)) // 3 % 6, int(x) // 4 % 16]:
            bricks[int(max(0, y - 8)) // 3 % 6, int(x) // 4 % 16] = False
            dy = -dy
        if not 2 <= y <= 58:
            dy, y = -dy, min(max(y, 2), 58)
        paddle = int(min(max(paddle + rng.integers(-2, 3), 0), 56))
        f[60:62, paddle:paddle + 8] = 200
        f[int(y):int(y) + 2, int(x):int(x) + 2] = 255
        if not bricks.any():
            bricks[:] = True
    return out


def frame_episode(frames: np.ndarray, start: int, steps: int) -> dict:
    """Steps ``start ..`` of the frame stream: ``pixels`` ``frames[tag % len]``, ``tag``
    the step's number, ``action`` made from it (every value checkable from ``tag``)."""
    tag = np.arange(start, start + steps, dtype=np.int64)
    return {"pixels": frames[tag % len(frames)],
            "action": np.stack([tag, -tag], 1).astype(np.float32),
            "tag": tag}


def write_frame_episodes(rb, frames: np.ndarray, first: int, episodes: int,
                         steps: int) -> None:
    """Collector process: ``episodes`` frame episodes, tags from ``first`` on."""
    for e in range(episodes):
        rb.write_episode(frame_episode(frames, first + e * steps, steps))
