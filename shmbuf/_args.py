"""Argument checks shared by every public entry point: one helper per rule."""
from __future__ import annotations

import numpy as np


def check_int(arg: str, value, lo: int | None = 1, hi: int | None = None) -> int:
    """``value`` as an int in ``[lo, hi]`` (None: unbounded), else a TypeError or
    ValueError naming ``arg``.

    Bools are refused although they are ints: ``capacity=True`` is a mistake.
    """
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{arg} must be an int, got {value!r} ({type(value).__name__})")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bound = (f"between {lo} and {hi}" if lo is not None and hi is not None
                 else f"at least {lo}" if lo is not None else f"at most {hi}")
        raise ValueError(f"{arg} must be {bound}, got {value}")
    return int(value)


def generator(arg: str, value) -> np.random.Generator:
    """``np.random.default_rng(value)`` for a random-stream argument, numpy's error
    (TypeError or ValueError) raised again naming ``arg`` and what it takes.

    Bools are refused although numpy takes them as seeds 0 and 1: ``rng=True`` is a mistake.
    """
    if isinstance(value, bool):
        exc: Exception = TypeError("a bool is no seed")
    else:
        try:
            return np.random.default_rng(value)
        except (TypeError, ValueError) as caught:
            exc = caught
    raise type(exc)(f"{arg} must be None, a seed (an int >= 0 or a sequence of them), a "
                    f"numpy SeedSequence, BitGenerator or Generator; got {value!r} "
                    f"({exc})") from None
