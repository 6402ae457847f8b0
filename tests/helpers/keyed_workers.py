"""Spawned-worker bodies and entry encodings for test_keyed.py and test_compat_history.py.

Kept out of the test files so that spawned children import only numpy and
shmbuf.  Every entry encodes where it came from, so a reader detects any
torn, misplaced or stale entry:
  keyed rings: every element of row ``x`` of key k at position p is ``code(k, p)``;
  history:     ``step`` = t, ``action`` = [env, t], ``pixels`` = pattern(env, t).
"""
import numpy as np

WIDE = 512  # int64 elements per keyed row: 4 KiB, so that a torn copy is likely if allowed
_PATTERN = np.arange(4 * 4 * 3, dtype=np.int64).reshape(1, 4, 4, 3)


def code(key, pos):
    return np.asarray(key, np.int64) * 1_000_000_000 + np.asarray(pos, np.int64)


def keyed_rows(keys, counts) -> dict:
    """Rows for one ``KeyedRings.append``: key ``keys[i]`` at position ``counts[i]``."""
    values = code(keys, counts)
    return {"x": np.repeat(values[:, None], WIDE, axis=1)}


def keyed_writer(rings, keys, stop, ready, max_appends: int) -> int:
    """Append to ``keys`` (this worker's own) until ``stop`` has data or ``max_appends``.

    ``stop`` and ``ready`` are pipe ends (no named semaphores in /dev/shm); a
    byte goes to ``ready`` once 20 appends are visible.
    """
    keys = np.asarray(keys, np.int64)
    counts = np.zeros(len(keys), np.int64)
    for i in range(max_appends):
        rings.append(keys, keyed_rows(keys, counts))
        counts += 1
        if i == 20:
            ready.send(i)
        if i % 16 == 0 and stop.poll():
            break
    if max_appends <= 20:
        ready.send(max_appends)
    rings.close()
    return int(counts[0])


def pixels_for(env, t) -> np.ndarray:
    """(len, 1, 4, 4, 3) uint8 frames of envs ``env`` at steps ``t`` (arrays)."""
    env, t = np.asarray(env, np.int64), np.asarray(t, np.int64)
    return ((_PATTERN[None] * 7 + env[:, None, None, None, None] * 131
             + t[:, None, None, None, None] * 17) % 251).astype(np.uint8)


def history_info(envs, t) -> dict:
    """One ``HistoryBuffer.append`` of step ``t`` for ``envs``."""
    envs = np.asarray(envs, np.int64)
    steps = np.full(len(envs), t, np.int64)
    action = np.stack([envs, steps], axis=1).astype(np.float32)[:, None, :]
    return {"pixels": pixels_for(envs, steps), "step": steps, "action": action}


def history_worker(buf, envs, go, stop, ready, max_steps: int) -> int:
    """Wait for ``go``, then append steps 1.. for ``envs`` until ``stop`` or ``max_steps``.

    ``go``, ``stop`` and ``ready`` are pipe ends, as in ``keyed_writer``.
    """
    if not go.poll(60):
        raise TimeoutError("history_worker: go never came")
    t = 0
    for t in range(1, max_steps + 1):
        buf.append(history_info(envs, t), env_ids=envs)
        if t == 10:
            ready.send(t)
        if t % 8 == 0 and stop.poll():
            break
    if max_steps < 10:
        ready.send(t)
    buf.close()
    return t
