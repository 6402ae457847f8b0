"""Is the process that holds a slot or owns a segment still alive?

A pid alone can be reused, so every pid recorded in a header goes with the
process's start time (field 22 of /proc/PID/stat, clock ticks after boot).
"""
from __future__ import annotations

import os


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
