"""One POSIX shared-memory segment: create, attach, close, unlink.

Segments are made with posix_ipc, not multiprocessing.shared_memory: on
Python <= 3.12 the latter registers every *attached* segment with the
resource tracker, which unlinks it when the attaching process exits
(cpython #82300).  Nothing here registers anything anywhere, so only an
explicit unlink removes a segment.
"""
from __future__ import annotations

import errno
import mmap
import os
import re
import secrets
import weakref

import numpy as np
import posix_ipc

from ._layout import KINDS, decode_header
from ._errors import (BufferClosedError, CorruptSegmentError, SegmentExistsError, SegmentNotFoundError, SegmentPermissionError,
                      SharedMemoryFullError)

PREFIX = "shmbuf-"
SHM_DIR = "/dev/shm"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
MAX_NAME = 200


def validate_name(name) -> str:
    """Check a segment name before any system call sees it."""
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {name!r} ({type(name).__name__})")
    if len(name) > MAX_NAME:
        raise ValueError(f"name {name[:40]!r}... is {len(name)} characters; at most {MAX_NAME}")
    if not _NAME.fullmatch(name):
        raise ValueError(
            f"name {name!r} is not a valid segment name: use letters, digits, '.', '_' "
            "and '-', starting with a letter or digit (no '/', no NUL)")
    return name


def generate_name() -> str:
    """``shmbuf-`` + ``$SHMBUF_NAME_TAG`` (empty by default) + 12 random hex digits.

    The tag lets a job (or a test session) recognise the segments it made.
    """
    return PREFIX + os.environ.get("SHMBUF_NAME_TAG", "") + secrets.token_hex(6)


def _translate(exc: Exception, name: str, action: str) -> Exception:
    """The one place where system errors become shmbuf errors."""
    if isinstance(exc, posix_ipc.ExistentialError):
        if action == "create":
            return SegmentExistsError(
                errno.EEXIST, f"segment {name!r} already exists; pick another name, "
                f"attach to it with shmbuf.attach({name!r}), or remove it with "
                f"'python -m shmbuf rm {name}'")
        return SegmentNotFoundError(
            errno.ENOENT, f"no shared-memory segment named {name!r}; "
            "'python -m shmbuf ls' lists the buffers that exist")
    if isinstance(exc, posix_ipc.PermissionsError) or getattr(exc, "errno", None) in (
            errno.EACCES, errno.EPERM):
        return SegmentPermissionError(
            errno.EACCES, f"cannot {action} segment {name!r}: permission denied "
            "(segments are mode 0600, readable by their creator's user only)")
    code = getattr(exc, "errno", None)
    if code in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM):
        return SharedMemoryFullError(
            code, f"cannot {action} segment {name!r}: {SHM_DIR} has too little free space "
            f"({os.strerror(code)}). Free space with 'python -m shmbuf gc', lower capacity, "
            "or give the container more shared memory (docker run --shm-size=...)")
    return exc


def shm_free_bytes() -> int:
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


class Segment:
    """A mapped segment; ``owner`` is True for the process that created it."""

    mmap = None
    name = None
    size = 0
    owner = False

    @classmethod
    def create(cls, name: str, size: int, *, populate: bool = True) -> "Segment":
        """Create ``name`` with O_CREAT|O_EXCL, mode 0600, all ``size`` bytes reserved."""
        validate_name(name)
        try:
            shm = posix_ipc.SharedMemory("/" + name, posix_ipc.O_CREX, mode=0o600)
        except posix_ipc.Error as exc:
            raise _translate(exc, name, "create") from None
        try:
            # Reserve every page now: a /dev/shm that is too small fails here,
            # not with SIGBUS on some later write.
            os.posix_fallocate(shm.fd, 0, size)
            flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
            mm = mmap.mmap(shm.fd, size, flags=flags)
        except BaseException as exc:
            _unlink_quietly(name)
            if not isinstance(exc, Exception):
                raise
            raise _translate(exc, name, "create") from exc
        finally:
            shm.close_fd()
        return cls._wrap(name, mm, size, owner=True)

    @classmethod
    def attach(cls, name: str) -> "Segment":
        """Map the existing segment ``name``; the result never unlinks it."""
        validate_name(name)
        try:
            shm = posix_ipc.SharedMemory("/" + name)
        except posix_ipc.Error as exc:
            raise _translate(exc, name, "attach to") from None
        try:
            size = shm.size
            mm = mmap.mmap(shm.fd, size, flags=mmap.MAP_SHARED) if size else None
        except OSError as exc:
            raise _translate(exc, name, "attach to") from exc
        finally:
            shm.close_fd()
        return cls._wrap(name, mm, size, owner=False)

    @classmethod
    def _wrap(cls, name, mm, size, owner):
        seg = cls()
        seg.name, seg.mmap, seg.size, seg.owner = name, mm, size, owner
        return seg

    def header(self, kind: int | None = None):
        """Decode and check the header: ``(layout, owner fields)``.

        Raises CorruptSegmentError (naming the segment) if it is not a shmbuf
        buffer, or not of ``kind`` when one is given.
        """
        layout, owner = decode_header(b"" if self.mmap is None else self.mmap, self.size,
                                      self.name)
        if kind is not None and owner["kind"] != kind:
            holds, attach_with = KINDS[owner["kind"]]
            raise CorruptSegmentError(f"segment {self.name!r} holds {holds}, not "
                                      f"{KINDS[kind][0]}; attach it with {attach_with}")
        return layout, owner

    def close(self) -> None:
        """Unmap, unless numpy views still export the mapping (then they keep it alive)."""
        mm, self.mmap = self.mmap, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass  # views outlive us; the mapping goes when the last one does

    def unlink(self) -> None:
        unlink(self.name)


def unlink(name: str) -> None:
    """Remove segment ``name`` from /dev/shm; mapped views stay valid."""
    validate_name(name)
    try:
        posix_ipc.unlink_shared_memory("/" + name)
    except posix_ipc.Error as exc:
        raise _translate(exc, name, "unlink") from None


def _unlink_quietly(name: str) -> None:
    try:
        posix_ipc.unlink_shared_memory("/" + name)
    except posix_ipc.Error:
        pass


def list_segments() -> list[str]:
    """Names of every entry in /dev/shm (shmbuf's or not)."""
    try:
        return sorted(os.listdir(SHM_DIR))
    except FileNotFoundError:
        return []


def finalize_segment(segment: "Segment", unlink_in_pid: int | None) -> None:
    """Finalizer of a buffer object: close; unlink too if this is the owner's pid."""
    # Owners unlink only in the process that created the buffer: a forked
    # child that inherits the object must never destroy the trainer's data.
    if unlink_in_pid == os.getpid():
        try:
            segment.unlink()
        except FileNotFoundError:
            pass
    segment.close()


def column_views(segment: Segment, layout, columns) -> dict:
    """Numpy views ``(capacity, *shape)`` of ``columns`` inside ``segment``.

    ``frombuffer`` holds a buffer export on the mmap, so the mapping cannot be
    closed under a view that a caller still holds (it is unmapped when the
    last view goes).
    """
    return {c.name: np.frombuffer(segment.mmap, c.dtype, layout.capacity * c.row_bytes
                                  // c.dtype.itemsize, c.offset).reshape((layout.capacity,) + c.shape)
            for c in columns}


class Mapped:
    """Lifecycle of an object over one segment, like CPython's SharedMemory.

    The creator owns the segment: ``close()``, the end of a ``with`` block,
    garbage collection or a normal exit unlink it, in the creating process
    only.  Attachers, and forked children of the owner, only unmap.
    """

    _segment = None
    _closed = True
    owner = False
    KIND_NAME = "buffer"

    def _open(self, segment: Segment) -> None:
        self._segment = segment
        self._pid = os.getpid()
        self.owner = segment.owner
        self._closed = False
        self._finalizer = weakref.finalize(self, finalize_segment, segment,
                                           self._pid if segment.owner else None)

    @property
    def name(self) -> str:
        """The segment's name, for ``attach(name)`` in any process."""
        return self._segment.name

    def _check_open(self) -> None:
        if self._closed:
            raise BufferClosedError(f"{self.KIND_NAME} {self._segment.name!r} is closed")

    def _release(self) -> None:
        """Drop this object's references into the mapping (subclasses extend)."""

    def close(self) -> None:
        """Unmap in this process; the owner also unlinks.  Idempotent.

        Views handed out earlier stay valid (they keep the mapping alive), but
        every method raises BufferClosedError afterwards.
        """
        if self._closed:
            return
        self._closed = True
        self._release()
        self._finalizer()

    def unlink(self) -> None:
        """Remove the segment's name now (owner, in its own process, only)."""
        if not self.owner or self._pid != os.getpid():
            raise PermissionError(
                f"{self.KIND_NAME} {self.name!r} was attached, not created, in this process; "
                f"only its owner unlinks it (or run 'python -m shmbuf rm {self.name}')")
        try:
            self._segment.unlink()
        except FileNotFoundError:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
