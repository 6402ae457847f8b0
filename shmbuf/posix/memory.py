"""How much memory a new allocation may take here: what a batch is checked against."""
from __future__ import annotations

import os


def available_bytes() -> int | None:
    """Bytes this process may still allocate: the kernel's MemAvailable, lowered to what
    is left under this cgroup's memory.max if one is set; None where neither is known."""
    avail = _meminfo_available()
    left = _cgroup_left()
    known = [v for v in (avail, left) if v is not None]
    return min(known) if known else None


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_left() -> int | None:
    """memory.max - memory.current of this process's cgroup (v2), or None (no limit)."""
    try:
        with open("/proc/self/cgroup") as f:
            path = next((line.strip().split(":", 2)[2] for line in f
                         if line.startswith("0::")), None)
        if path is None:
            return None
        base = os.path.join("/sys/fs/cgroup", path.lstrip("/"))
        with open(os.path.join(base, "memory.max")) as f:
            limit = f.read().strip()
        if limit == "max":
            return None
        with open(os.path.join(base, "memory.current")) as f:
            return max(int(limit) - int(f.read().strip()), 0)
    except (OSError, ValueError):
        return None
