"""Children for tests/test_write_steps.py: a writer wrapping a small ring flat out, and a
process that dies holding a chunk pin."""
import os
import signal

import numpy as np

import shmbuf

WAIT = 60


def wrap_until_stopped(name: str, ready):
    """Add steps ``step=t, ctx=-1`` until the buffer's writers are stopped."""
    buf = shmbuf.attach(name)
    try:
        w = buf.writer()
        t = 0
        minus = np.full(3, -1, np.float32)
        try:
            while True:
                w.add(step=t, ctx=minus)
                t += 1
                if t == 64:
                    ready.set()
        except shmbuf.WritersStoppedError:
            pass
        finally:
            w.close()
    finally:
        buf.close()


def die_pinning(name: str, chunk: int, pinned):
    """Pin ``chunk`` as write_steps does, say so, and die holding the pin."""
    buf = shmbuf.attach(name)
    buf._ring.pins.pinned(np.array([chunk])).__enter__()
    pinned.set()
    os.kill(os.getpid(), signal.SIGKILL)
