"""``Prioritized``'s draw and total score: the interface that issue 19's priorities fill in.

Until a buffer can hold priorities (``create(..., priorities=True)``), no
buffer can be sampled this way, and ``check`` says so at the door.
"""
from __future__ import annotations


def check(buffer) -> None:
    """Raise ValueError unless ``buffer`` keeps per-step priorities."""
    raise ValueError(f"select=Prioritized(...) needs a buffer made with "
                     f"create(..., priorities=True); {buffer.name!r} keeps no priorities")


def draw(finder, rng, n: int, length: int, tail: int, exponent: float, maxfrac: float):
    """``n`` windows drawn in proportion to their score (``sampling.Windows``)."""
    raise ValueError("select=Prioritized(...) needs a buffer made with priorities=True")


def total(buffer, length: int, tail: int, exponent: float, maxfrac: float, rng) -> float:
    """The sum of the scores of the windows ``(length, tail)`` that could start now."""
    raise ValueError("select=Prioritized(...) needs a buffer made with priorities=True")
