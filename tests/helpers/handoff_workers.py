"""A process that lends batch regions like a DataLoader worker (``shmbuf.feed.handoff``)."""
import pickle

import numpy as np

SPEC = {"x": ((3,), np.int64), "y": ((), np.float32)}
LEAD = (4, 2)


def lend_batches(conn, n: int, keep_fd: bool = True) -> None:
    """Fill ``n`` regions (x = region number), send their pickled handoffs, then answer
    "state" with the regions' state words until told "stop".

    ``keep_fd=False`` closes the pool's memfd descriptor once the handoffs are pickled
    (the mapping stays), so that no process can open it through /proc any more: only the
    descriptor sent with the first handoff leads to the pool.
    """
    import os

    from shmbuf.feed.handoff import SlotPool

    pool = SlotPool(SPEC, LEAD)
    payloads = []
    for i in range(n):
        slot = pool.take()
        out = pool.tensors(slot)
        out["x"].fill_(i)
        out["y"].fill_(i + 0.5)
        payloads.append(pickle.dumps(pool.handoff(slot)))
    if not keep_fd:
        os.close(pool.fd)
    conn.send(payloads)
    while conn.poll(60):
        if conn.recv() != "state":
            return
        conn.send(pool._state.tolist())
