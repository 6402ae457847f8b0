"""Is the process that holds a slot or owns a segment still alive?

A pid alone can be reused, so every pid recorded in a header goes with the
process's start time (field 22 of /proc/PID/stat, clock ticks after boot).
"""
from __future__ import annotations

import os

# This process's pid, set again by a fork hook in the child, so that the hot paths
# (every add, every sample) notice a fork without a getpid() system call each.
_PID = [os.getpid()]
os.register_at_fork(after_in_child=lambda: _PID.__setitem__(0, os.getpid()))


def this_pid() -> int:
    """``os.getpid()`` without a system call (kept by a fork hook)."""
    return _PID[0]


def start_time(pid: int) -> int | None:
    """Start time of ``pid``, or None if no such live (non-zombie) process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name (field 2) may contain spaces and parens; fields
    # after the last ')' are plain.  rest[0] is field 3 (state).
    rest = raw[raw.rfind(b")") + 2:].split()
    if rest[0] in (b"Z", b"X"):
        return None
    return int(rest[19])


def is_alive(pid: int, start: int) -> bool:
    """True if ``pid`` runs and started at ``start`` (0: start not yet recorded)."""
    if pid <= 0:
        return False
    actual = start_time(pid)
    return actual is not None and (start == 0 or actual == start)


def my_start_time() -> int:
    return start_time(os.getpid()) or 0


STAMP_PID_SHIFT = 42
STAMP_START_MASK = (1 << STAMP_PID_SHIFT) - 1
PID_BITS_MASK = (1 << 22) - 1   # Linux pids are below 2**22 (pid_max's ceiling)


def stamp_of(pid: int, start: int) -> int:
    """One word naming a process: ``pid << 42 | start time`` (low 42 bits of the ticks)."""
    return (pid & PID_BITS_MASK) << STAMP_PID_SHIFT | (start & STAMP_START_MASK)


_MINE: tuple[int, int] = (0, 0)   # (pid, stamp): read from /proc once per process


def my_stamp() -> int:
    """This process's ``stamp_of`` (read again in a forked child)."""
    global _MINE
    pid = os.getpid()
    if _MINE[0] != pid:
        _MINE = (pid, stamp_of(pid, my_start_time()))
    return _MINE[1]


def stamp_alive(stamp: int) -> bool:
    """True if the process a ``stamp_of`` word names runs (its pid, with that start)."""
    pid = stamp >> STAMP_PID_SHIFT
    actual = start_time(pid) if pid > 0 else None
    return actual is not None and actual & STAMP_START_MASK == stamp & STAMP_START_MASK
