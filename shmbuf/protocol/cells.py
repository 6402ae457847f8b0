"""A shared 64-bit word raised atomically, never lowered.

Words that only move forward (a generation, a read position) are raised by
compare-and-swap, so a process that arrives late never takes back a value
another process already published.  The protocol's own words use it
(``keyed``), and so can a layer above that keeps a few words of its own in a
buffer column (the TorchRL plug-in's generation words): ``buf`` is any
writable buffer (the segment's mmap, or a numpy array over shared memory)
and ``offset`` the word's byte offset in it, 8-aligned.
"""
from __future__ import annotations

from . import _atomic as atomic


def load(buf, offset: int) -> int:
    """The word at ``offset``, loaded with acquire."""
    return atomic.load_acquire(buf, offset)


def raise_to(buf, offset: int, value: int) -> bool:
    """Raise the word at ``offset`` to ``value`` unless it is there or past already
    (signed compare); True if this call moved it."""
    while True:
        now = atomic.load_acquire(buf, offset)
        if now >= value:
            return False
        if atomic.compare_exchange(buf, offset, now, value):
            return True
