"""Children for tests/test_priorities.py: draw by priority, or update priorities forever."""
import numpy as np

import shmbuf
from shmbuf import _prioritized


def draw_starts(name, seed, calls, n, length, exponent, maxfrac, conn):
    """Send the start rows of ``calls * n`` prioritized windows drawn in this process."""
    buf = shmbuf.attach(name)
    try:
        rng = np.random.default_rng(seed)
        starts = [_prioritized.draw(buf._finder, rng, n, length, 0, exponent, maxfrac).rows[:, 0]
                  for _ in range(calls)]
        conn.send(np.concatenate(starts))
    finally:
        buf.close()


def update_forever(name, ids, seed, conn):
    """Update random subsets of ``ids`` to random priorities; one byte on ``conn`` per call."""
    buf = shmbuf.attach(name)
    rng = np.random.default_rng(seed)
    while True:
        pick = ids[rng.integers(0, len(ids), 2500)]
        buf.update_priorities(pick, rng.gamma(0.5, 2.0, len(pick)).astype(np.float32))
        conn.send_bytes(b"u")
