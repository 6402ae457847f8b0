"""The words every segment has: the magic (header publication), the closed mark, the owner record.

The step store and keyed rings alike publish their header and are closed
and adopted through these words; ``segment`` calls them, nothing else does.
"""
from __future__ import annotations

import os

from .._errors import BufferClosedError, WritersStoppedError
from ..posix.procs import is_alive
from . import _atomic as atomic
from .layout import CLOSED_BY, LAYOUT_VERSION, MAGIC, read_field
from .words import _CLOSED, _OWNER, _OWNER_STAMP, _STOPPED, _U32


# -- the header ------------------------------------------------------------------
def publish_header(mm, header: bytes) -> None:
    """Copy ``header`` to offset 0 with the magic word stored last, with release order.

    An attacher that loads the magic with acquire order sees every other
    byte of the header, so a creator's name may exist before its header does.
    """
    mm[8:len(header)] = header[8:]
    atomic.store_release(mm, 0, int.from_bytes(header[:8], "little"))


def header_published(mm) -> bool:
    """True once ``publish_header`` has stored the magic."""
    return atomic.load_acquire(mm, 0) == MAGIC


def header_written(mm) -> bool:
    """True once the first word is set: by ``publish_header``, or by something not shmbuf.

    A creator stores the magic last, so a zero word means "not yet"; any
    other word is final, and decoding the header tells a buffer from a
    foreign segment (a wrong magic) at once instead of waiting for it.
    """
    return atomic.load_acquire(mm, 0) != 0


# -- the closed mark and the owner record (segments of every kind) -----------------


def mark_closed(mm, reason: int, pid: int) -> bool:
    """Set the closed word to ``reason << 32 | pid`` unless it is set; True if this call set it.

    Only a whole header of this layout version is marked: the word of a
    foreign or older segment may mean something else.
    """
    if not header_published(mm) or read_field(mm, "version") != LAYOUT_VERSION:
        return False
    return atomic.compare_exchange(mm, _CLOSED, 0, reason << 32 | pid)


def closed_word(mm) -> int:
    """0 while the buffer is open, else ``reason << 32 | pid`` of who closed it."""
    return atomic.load_acquire(mm, _CLOSED)


class ClosedMark:
    """The closed word of one handle's mapping, checked with one relaxed load (both store kinds).

    A memoryview read is a plain aligned load, half the cost of a numpy
    scalar read.  ``check(pid)`` raises BufferClosedError once the word is
    set, for every handle but the one that set it through ``close_here``
    (and only in the process that did: a forked copy of that handle is
    another handle): after ``unlink()`` an owner may keep using its
    mapping, while a second handle in the same process (a collector
    thread's, say) stops like any other process's.
    """

    exempt_pid: int | None = None   # the pid in which this handle set the word

    def __init__(self, mm, name):
        self._mm = mm
        self.view = memoryview(mm)[_CLOSED:_CLOSED + 8].cast("Q")
        self.name = name

    def close_here(self, reason: int) -> bool:
        """Set the word through this mapping (before the name goes); True if this call set it.

        Only then is this handle exempt from ``check`` afterwards.
        """
        pid = os.getpid()
        if mark_closed(self._mm, reason, pid):
            self.exempt_pid = pid
            return True
        return False

    def check(self, pid: int | None = None) -> None:
        """Raise BufferClosedError if the word is set, unless this handle set it in ``pid``.

        ``pid``: this process's id, if the caller has it at hand (else ``os.getpid()``).
        """
        word = self.view[0]
        if word and self.exempt_pid != (os.getpid() if pid is None else pid):
            raise BufferClosedError(closed_message(self.name, word))


# -- writers stopped (Buffer.stop_writers) ------------------------------------------
# One word beside the closed word (its line): 0 while writers may write, else the
# pid of the process that stopped them.  Writers load it on every add with the
# closed word; the rate limiter's waits load it on every poll, so a waiting
# writer wakes within a poll interval.
def stop_writers(mm, pid: int) -> None:
    """Stop every writer of the buffer (in every process) until ``resume_writers``."""
    atomic.store_release(mm, _STOPPED, pid)


def resume_writers(mm) -> None:
    atomic.store_release(mm, _STOPPED, 0)


def writers_stopped(mm) -> int:
    """0 while writers may write, else the pid that stopped them."""
    return atomic.load_acquire(mm, _STOPPED)


class StopMark:
    """The writers_stopped word of one mapping, checked with one relaxed load (as ClosedMark)."""

    def __init__(self, mm, name):
        self.view = memoryview(mm)[_STOPPED:_STOPPED + 8].cast("Q")
        self.name = name

    def check(self) -> None:
        """Raise WritersStoppedError if someone stopped the buffer's writers."""
        pid = self.view[0]
        if pid:
            raise WritersStoppedError(
                f"buffer {self.name!r}: its writers were stopped by Buffer.stop_writers() "
                f"(pid {pid}); nothing was written. A worker loop ends here; "
                "Buffer.resume_writers() lets writers write again")


def closed_message(name, word: int) -> str:
    reason, pid = word >> 32, word & _U32
    return (f"buffer {name!r} was closed by {CLOSED_BY.get(reason, 'its owner')} (pid {pid}) "
            "and its name removed; no more steps can be added or sampled. A worker "
            "stops here; attach to a new buffer to continue")


def _owner(mm) -> tuple[int, int]:
    """The owner word and the start time that goes with its lease (0: not recorded yet)."""
    state = atomic.load_acquire(mm, _OWNER)
    stamp = atomic.load_acquire(mm, _OWNER_STAMP)
    start = stamp >> 16 if (stamp & 0xFFFF) == ((state >> 32) & 0xFFFF) else 0
    return state, start


def owner_record(mm) -> tuple[int, int]:
    """(pid, start time or 0 if not yet recorded) of the segment's owner now."""
    state, start = _owner(mm)
    return state & _U32, start


def owner_alive(mm) -> bool:
    return is_alive(*owner_record(mm))


def take_ownership(mm, pid: int, start: int) -> int:
    """Make ``pid`` the owner if the recorded owner is dead; return 0, or the live owner's pid.

    One compare-and-swap on the owner word decides between rivals, like a
    writer slot's claim: the loser reads the winner's pid.  The start time
    is stored after the CAS, tagged with the new lease, so a reader never
    pairs the new pid with the old start time.
    """
    state, seen = _owner(mm)
    holder = state & _U32
    if holder and is_alive(holder, seen):
        return holder
    lease = ((state >> 32) + 1) & _U32 or 1
    if not atomic.compare_exchange(mm, _OWNER, state, lease << 32 | pid):
        return owner_record(mm)[0]  # a rival won
    atomic.store_release(mm, _OWNER_STAMP, start << 16 | (lease & 0xFFFF))
    return 0
