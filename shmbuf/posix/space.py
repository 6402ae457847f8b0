"""Taking /dev/shm pages for a segment as it fills: reserve, count, check the size.

A step store's segment has its full size from the start, but it is sparse:
only the pages that everybody writes (the header and the writer slots) are
reserved at ``create``.  Every other page is reserved with ``fallocate`` on
the segment's descriptor by the process that is about to make it readable
(a chunk's claimant, the writer of an episode-index entry), before the word
that makes it readable to others moves.  tmpfs answers a full filesystem
with ENOSPC there, and a reserved page can never raise SIGBUS when it is
touched later; an unreserved one can.  ``fallocate`` of pages that are
reserved already changes nothing, so neighbours sharing a boundary page and
a claimant killed before its publish cost nothing: the pages stay reserved
for the range they belong to.

The bytes reserved are the segment's ``st_blocks * 512``: no header word
counts them.
"""
from __future__ import annotations

import errno
import os

from .._errors import SharedMemoryFullError

# The page size the layout aligns columns to (protocol.layout uses this one).
PAGE = 4096

_FULL = (errno.ENOSPC, errno.ENOMEM, errno.EFBIG)


def fs_bytes(shm_dir: str) -> tuple[int, int]:
    """(total size, bytes free for unprivileged users) of the filesystem at ``shm_dir``."""
    st = os.statvfs(shm_dir)
    return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize


def human(n: int) -> str:
    """``n`` bytes in the largest binary unit that keeps it at 1 or more."""
    for shift, unit in ((40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB")):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} B"


class Space:
    """The reserved pages of one segment, through a descriptor it keeps open.

    ``reserve(offset, length)`` reserves exactly the pages that hold those
    bytes (page-aligned outwards).  ``full`` is True once every page is
    reserved (a prefaulted buffer, or one whose ring has gone round once):
    then callers may skip asking.
    """

    def __init__(self, fd: int, name: str, size: int, shm_dir: str):
        self.fd, self.name, self.size, self.shm_dir = fd, name, size, shm_dir
        self.full = self.reserved_bytes() >= size

    def reserve(self, offset: int, length: int, what: str) -> None:
        """Reserve the pages of bytes ``[offset, offset + length)``.

        Raises:
            SharedMemoryFullError: /dev/shm cannot hold them; nothing was
                reserved by this call, and it may be retried later.
        """
        if self.full or length <= 0:
            return
        start = offset - offset % PAGE
        end = min(self.size, -(-(offset + length) // PAGE) * PAGE)
        try:
            os.posix_fallocate(self.fd, start, end - start)
        except OSError as exc:
            if exc.errno not in _FULL:
                raise
            raise self.full_error(end - start, what, exc.errno) from None

    def full_error(self, need: int, what: str, code: int = errno.ENOSPC) -> SharedMemoryFullError:
        """The error of a reservation of ``need`` bytes that /dev/shm refused."""
        total, free = fs_bytes(self.shm_dir)
        return SharedMemoryFullError(
            code, f"buffer {self.name!r}: {self.shm_dir} cannot reserve {need} bytes for "
            f"{what}: it has {free} bytes ({human(free)}) left of {human(total)}, and the buffer "
            f"holds {self.reserved_bytes()} of its {self.size} bytes. Nothing was written: "
            "the buffer keeps what it holds, samplers go on, and this call may be retried "
            "once space is freed ('python -m shmbuf gc' removes buffers of dead owners), or "
            "create smaller buffers or give the machine more shared memory "
            "(docker run --shm-size=...)")

    def reserved_bytes(self) -> int:
        """Bytes of /dev/shm that the segment holds now (``st_blocks * 512``)."""
        return os.fstat(self.fd).st_blocks * 512

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


def check_fits(name: str, total_bytes: int, fixed_bytes: int, row_bytes: int, capacity: int,
               shm_dir: str) -> None:
    """Refuse a segment larger than the whole filesystem at ``shm_dir`` (it could never fill).

    ``fixed_bytes`` is the part that does not grow with the capacity, and
    ``row_bytes`` what each step adds, so the message says what would fit.
    """
    total, _ = fs_bytes(shm_dir)
    if total_bytes <= total:
        return
    fits = max(0, (total - fixed_bytes) // row_bytes)
    raise SharedMemoryFullError(
        errno.ENOSPC, f"buffer {name!r}: capacity {capacity} needs {total_bytes} bytes "
        f"({human(total_bytes)}) but {shm_dir} holds {total} bytes ({human(total)}) in all, so it "
        f"could never be filled; a capacity of about {fits} steps would fit. Pass a smaller "
        "capacity, give the machine more shared memory (docker run --shm-size=...), or pass "
        "overcommit=True to create it anyway (pages are reserved as the buffer fills, and a "
        "writer gets SharedMemoryFullError when /dev/shm runs out)")
