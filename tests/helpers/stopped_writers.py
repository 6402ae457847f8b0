"""Writers for tests/test_stop_writers.py: write until ``Buffer.stop_writers`` stops them."""
import time

import numpy as np

import shmbuf

SPEC = {"x": ((), np.int64), "done": ((), np.bool_)}


def write_until_stopped(buf, how: str, reports) -> None:
    """Write with ``add``, ``add_batch`` or ``extend`` until an error ends the loop; put
    ``(how, error class name, steps written, seconds from the last write's start to the
    error)`` on ``reports``."""
    w = buf.writer()
    steps, began = 0, time.monotonic()
    try:
        while True:
            began = time.monotonic()
            if how == "add":
                w.add(x=steps, done=False)
                steps += 1
            elif how == "add_batch":
                w.add_batch(x=np.full(4, steps), done=np.zeros(4, bool))
                steps += 4
            else:
                w.extend(x=np.arange(steps, steps + 8), done=np.zeros(8, bool))
                steps += 8
    except Exception as exc:  # the test judges which error it was
        reports.put((how, type(exc).__name__, steps, time.monotonic() - began))
    finally:
        w.close()
        buf.close()


def write_one(buf) -> str:
    """A fresh writer's first ``add`` in a new process: its outcome's class name."""
    try:
        with buf.writer() as w:
            w.add(x=1, done=False)
        return "ok"
    except shmbuf.ShmbufError as exc:
        return type(exc).__name__
