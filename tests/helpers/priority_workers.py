"""Children for tests/test_priorities.py: draw by priority, or update priorities forever."""
import numpy as np

import shmbuf
from shmbuf.select import Prioritized


def draw_starts(name, seed, calls, n, length, exponent, maxfrac, conn):
    """Send the first steps (x) of ``calls * n`` prioritized windows drawn in this process."""
    buf = shmbuf.attach(name, seed=seed)
    try:
        sel = Prioritized(exponent=exponent, maxfrac=maxfrac)
        conn.send(np.concatenate([buf.sample_sequences(n, length, select=sel)["x"][0]
                                  for _ in range(calls)]))
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
