"""Children for tests/test_priorities.py: draw by priority, or update priorities forever."""
import numpy as np

import shmbuf
from shmbuf.select import Prioritized


def draw_starts(name, seed, calls, n, length, exponent, maxfrac, conn):
    """Send the first steps (x) of ``calls * n`` prioritized windows drawn in this process."""
    buf = shmbuf.attach(name)
    # An explicit generator: an attached handle's own stream depends on this process's
    # pid (one stream per process), which would make the test's draws differ run to run.
    rng = np.random.default_rng(seed)
    try:
        sel = Prioritized(exponent=exponent, maxfrac=maxfrac)
        conn.send(np.concatenate([buf.sample_sequences(n, length, select=sel, rng=rng)["x"][0]
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


def update_rounds(name, ids, seed, rounds, final, start, conn):
    """``rounds`` rounds, each begun at ``start`` (a Barrier the parent joins): one call
    that updates 20,000 random picks of ``ids`` (repeats and all) to rising values above
    every earlier round's, so that every pick raises its block's bound while the other
    process does the same; ``r`` on ``conn`` after round r.  Then all of ``ids`` to
    ``final``, and ``rounds`` on ``conn``."""
    buf = shmbuf.attach(name)
    try:
        rng = np.random.default_rng(seed)
        for r in range(rounds):
            start.wait(60)
            pick = ids[rng.integers(0, len(ids), 400_000)]
            values = rng.uniform(0, r + 1, len(pick)).astype(np.float32)
            buf.update_priorities(pick, values)
            conn.send(r)
        buf.update_priorities(ids, final)
        conn.send(rounds)
    finally:
        buf.close()
