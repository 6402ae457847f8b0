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
