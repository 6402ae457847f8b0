"""The one bounded backoff loop: poll a condition until it holds or time runs out.

Waits for data (``Buffer.wait_ready``), for a creator that has not
finished its header (``Segment.header``) and the rate limiter's waits
(``shmbuf.writing.ratelimit``) all poll shared words that another
process will change; this loop sleeps between polls, starting at 0.1 ms and
doubling to at most 20 ms, so a short wait stays short and a long one costs
no CPU.
"""
from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")
FIRST_PAUSE = 1e-4
MAX_PAUSE = 0.02


def poll(ready: Callable[[], T | None], timeout: float | None,
         on_timeout: Callable[[], BaseException], max_pause: float = MAX_PAUSE) -> T:
    """Call ``ready()`` until it returns something other than None; return that.

    Raises ``on_timeout()`` once ``timeout`` seconds (None: never) have passed
    without a result.  ``ready`` runs at least once, even with ``timeout=0``.
    Pauses double up to ``max_pause`` (the rate limiter's waits poll faster).
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    pause = FIRST_PAUSE
    while True:
        result = ready()
        if result is not None:
            return result
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise on_timeout()
            time.sleep(min(pause, left))
        else:
            time.sleep(pause)
        pause = min(pause * 2, max_pause)


def check_timeout(timeout) -> float | None:
    """``timeout`` as seconds >= 0 or None; TypeError / ValueError naming it otherwise."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) and not (
            hasattr(timeout, "dtype") and getattr(timeout, "ndim", 1) == 0):
        raise TypeError(f"timeout must be None or a number of seconds, got {timeout!r}")
    if not timeout >= 0:
        raise ValueError(f"timeout must be None or >= 0 seconds, got {timeout!r}")
    return float(timeout)
