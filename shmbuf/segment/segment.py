"""One POSIX shared-memory segment: create, attach, close, unlink.

Segments are made with posix_ipc, not multiprocessing.shared_memory: on
Python <= 3.12 the latter registers every *attached* segment with the
resource tracker, which unlinks it when the attaching process exits
(cpython #82300).  Nothing here registers anything anywhere, so only an
explicit unlink removes a segment.
"""
from __future__ import annotations

import errno
import fcntl
import mmap
import os
import re
import secrets
import sys
import time

import numpy as np
import posix_ipc

from .._errors import (
    BufferClosedError,
    CorruptSegmentError,
    OwnerAliveError,
    SegmentExistsError,
    SegmentNotFoundError,
    SegmentPermissionError,
    SharedMemoryFullError,
)
from ..posix.procs import my_start_time
from ..posix.space import Space
from ..posix.wait import poll
from ..protocol import header as _header
from ..protocol.layout import CLOSED_OWNER, COLUMN_TABLE, KINDS, META, PAGE, decode_header
from .pages import MADV_POPULATE_WRITE

ATTACH_TIMEOUT = 5.0  # seconds an attacher waits for a creator to finish its header
CREATING_GRACE = 1.0  # seconds an unmarked entry without a header may still be a creator's
PREFIX = "shmbuf-"
SHM_DIR = "/dev/shm"


def check_platform(platform: str = sys.platform, shm_dir: str = SHM_DIR) -> None:
    """Raise ImportError unless this is Linux with POSIX shared memory in ``shm_dir``."""
    if not platform.startswith("linux") or not os.path.isdir(shm_dir):
        raise ImportError(
            f"shmbuf needs Linux with POSIX shared memory mounted at {shm_dir} (it also reads "
            f"/proc to tell live processes from dead ones); this is {platform!r}"
            f"{'' if os.path.isdir(shm_dir) else f' without {shm_dir}'}. In a container, "
            "mount a tmpfs there (docker run --shm-size=...)")


check_platform()
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
    if type(exc) is ValueError:   # posix_ipc's EINVAL: the entry is no segment at all
        path = os.path.join(SHM_DIR, name)
        kind = "a directory" if os.path.isdir(path) else "not a shared-memory object"
        return CorruptSegmentError(
            f"cannot {action} {path!r}: it is {kind}, not a shmbuf buffer "
            f"({exc}); shmbuf buffers are files in {SHM_DIR}")
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
    name: str = None  # type: ignore[assignment]  # set by _wrap
    size = 0
    owner = False
    space: Space | None = None  # the pages reserved, through a descriptor kept open
    inode = None      # the creator's: what its name must still lead to once published

    @classmethod
    def create(cls, name: str, size: int, *, reserve: int | None = None,
               populate: bool = True) -> "Segment":
        """Create ``name`` with O_CREAT|O_EXCL, mode 0600, ``size`` bytes long.

        The first ``reserve`` bytes (all if None) are reserved now, the rest
        as it fills (``posix.space``); ``populate`` maps the reserved pages now.
        """
        reservation = Reservation(name)
        try:
            return reservation.allocate(size, reserve=reserve, populate=populate)
        except BaseException:
            reservation.unlink()
            raise

    @classmethod
    def attach(cls, name: str) -> "Segment":
        """Map the existing segment ``name``; the result never unlinks it."""
        validate_name(name)
        try:
            shm = posix_ipc.SharedMemory("/" + name)
        except (posix_ipc.Error, ValueError) as exc:   # posix_ipc: ValueError for EINVAL
            raise _translate(exc, name, "attach to") from None
        try:
            size = shm.size
            mm = mmap.mmap(shm.fd, size, flags=mmap.MAP_SHARED) if size else None
            fd = os.dup(shm.fd)
        except OSError as exc:
            raise _translate(exc, name, "attach to") from exc
        finally:
            shm.close_fd()
        return cls._wrap(name, mm, size, owner=False, fd=fd)

    @classmethod
    def _wrap(cls, name, mm, size, owner, fd):
        seg = cls()
        seg.name, seg.mmap, seg.size, seg.owner = name, mm, size, owner
        seg.space = Space(fd, name, size, SHM_DIR)
        return seg

    def admit(self, own: bool = False) -> None:
        """Attach's last check, for every kind: refuse a closed buffer; with ``own``, adopt it.

        Adopting takes the owner record from a dead owner (``_header.take_ownership``)
        and makes this the owner: it unlinks the segment at close.

        Raises:
            BufferClosedError: its owner closed it (it is being removed).
            OwnerAliveError: ``own`` and the owner is alive, or a rival adopted it first.
        """
        word = _header.closed_word(self.mmap)
        if word:
            raise BufferClosedError(_header.closed_message(self.name, word))
        if own:
            live = _header.take_ownership(self.mmap, os.getpid(), my_start_time())
            if live:
                raise OwnerAliveError(
                    f"buffer {self.name!r} is owned by pid {live}, which is alive; "
                    "attach(name, own=True) takes over only a buffer whose owner died. Attach "
                    f"without own=True to share it, or stop pid {live} first")
            self.owner = True  # this process unlinks it now

    def publish(self, header: bytes) -> None:
        """Write ``header`` at offset 0, its magic last: attachers wait for it.

        Then the creator checks that its name still leads to this segment.
        Someone who removed the name while the header was unpublished (``shmbuf
        rm --force`` during a large create) could not mark it closed; after
        this check, a removal marks it (``unlink`` marks again after removing
        the name), so the handle learns it at its first call.

        Raises:
            SegmentNotFoundError: the name was removed (or now names another
                segment); the name is left alone and ``unlink`` does nothing.
        """
        _header.publish_header(self.mmap, header)
        if self.space is not None:
            fcntl.flock(self.space.fd, fcntl.LOCK_UN)   # the creation mark: done
        if self.inode is not None and _inode_of(self.name) != self.inode:
            self.owner = False   # the name is not ours to unlink any more
            raise SegmentNotFoundError(
                errno.ENOENT, f"segment {self.name!r} was removed while it was being created "
                "(by 'shmbuf rm --force' or another unlink of that name): nobody could attach "
                "to it, so create gave it up and nothing was created; create it again")

    def write_meta(self, layout, raw: bytes) -> None:
        """Before ``publish``: copy metadata too long for the header to its room.

        Its pages are reserved first (a sparse segment's would otherwise be
        taken at the copy, with SIGBUS and no error if /dev/shm is full).
        """
        at = layout.meta_offset
        if at == META:
            return   # encode_header puts it in the header itself
        if self.space is not None:
            self.space.reserve(at, len(raw), "the metadata")
        assert self.mmap is not None   # a created segment is mapped
        self.mmap[at:at + len(raw)] = raw

    def published(self) -> bool:
        """True once the creator has written a whole header, or the segment is foreign.

        The magic is stored last, so its word stays zero until the header is
        whole; a segment whose first word is anything else is decoded at
        once (a wrong magic is an immediate CorruptSegmentError, not a wait).
        """
        return (self.mmap is not None and self.size >= COLUMN_TABLE
                and _header.header_written(self.mmap))

    def header(self, kind: int | None = None, timeout: float = ATTACH_TIMEOUT):
        """Decode and check the header: ``(layout, owner fields)``.

        A creator publishes the header after its name exists, so this waits
        up to ``timeout`` seconds for the magic.  A segment made before the
        wait began that never gets one is not a shmbuf buffer.

        Raises CorruptSegmentError (naming the segment) if it is not a shmbuf
        buffer, or not of ``kind`` when one is given.
        """
        if not self.published():
            self._wait_published(timeout)
        layout, owner = decode_header(self.mmap, self.size, self.name)
        if kind is not None and owner["kind"] != kind:
            holds, attach_with = KINDS[owner["kind"]]
            raise CorruptSegmentError(f"segment {self.name!r} holds {holds}, not "
                                      f"{KINDS[kind][0]}; attach it with {attach_with}")
        return layout, owner

    def _wait_published(self, timeout: float) -> None:
        if self.mmap is None or self.size < COLUMN_TABLE:
            # Created, not sized yet: map it again once the creator has.
            self._remap(timeout)

        def ready():
            if self.published():
                return True
            self._refuse_unless_being_created()
            return None

        poll(ready, timeout, lambda: CorruptSegmentError(
            f"segment {self.name!r} has no complete shmbuf header after {timeout} s; "
            "is it a shmbuf buffer? ('python -m shmbuf ls' flags foreign entries)"))

    def _remap(self, timeout: float) -> None:
        def sized():
            again = Segment.attach(self.name)
            if again.mmap is not None and again.size >= COLUMN_TABLE:
                return again
            try:
                again._refuse_unless_being_created()
            finally:
                again.close()
            return None

        again = poll(sized, timeout, lambda: CorruptSegmentError(
            f"segment {self.name!r} is {self.size} bytes, too small for a shmbuf header, "
            f"after {timeout} s; is it a shmbuf buffer?"))
        self.close()
        self.mmap, self.size, self.space = again.mmap, again.size, again.space

    def _refuse_unless_being_created(self) -> None:
        """Raise CorruptSegmentError at once for an entry without a header that nobody makes.

        A creator holds the creation mark (a lock on the segment) from its
        O_EXCL open until ``publish``; an entry without it that has not
        changed size for ``CREATING_GRACE`` seconds (the instant between the
        open and the lock, or a creator that died) is not being made.
        """
        fd = self.space.fd if self.space is not None else -1
        if fd < 0:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return                                    # a creator holds the mark
        fcntl.flock(fd, fcntl.LOCK_UN)
        st = os.fstat(fd)
        if time.time() - st.st_mtime < CREATING_GRACE:   # a resize sets it, as the open does
            return
        raise CorruptSegmentError(
            f"{os.path.join(SHM_DIR, self.name)!r} ({st.st_size} bytes) has no shmbuf header "
            "and no shmbuf process is creating it: it is not a shmbuf buffer (or its creator "
            f"died before finishing it). Remove it with 'python -m shmbuf rm --force "
            f"{self.name}' if it is a leftover")

    def close(self) -> None:
        """Unmap, unless numpy views still export the mapping (then they keep it alive)."""
        space, self.space = self.space, None
        if space is not None:
            space.close()
        mm, self.mmap = self.mmap, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass  # views outlive us; the mapping goes when the last one does

    def unlink(self) -> None:
        """Remove the name; a no-op once ``publish`` found it no longer leads here."""
        if self.owner or self.inode is None:
            unlink(self.name)


def _inode_of(name: str) -> int | None:
    """The inode that ``/dev/shm/name`` is now, or None if there is none."""
    try:
        return os.stat(os.path.join(SHM_DIR, name)).st_ino
    except FileNotFoundError:
        return None


def unlink(name: str, reason: int = CLOSED_OWNER) -> None:
    """Mark buffer ``name`` closed, then remove it from /dev/shm; mapped views stay valid.

    Every unlink goes through here (owners' close and unlink, ``shmbuf rm``
    and ``gc``), so writers and samplers in other processes always learn
    that the buffer is gone (``BufferClosedError``) instead of writing on
    into memory that nobody can attach to any more.
    """
    validate_name(name)
    _remove(name, reason, quiet=False)


def _unlink_quietly(name: str) -> None:
    _remove(name, CLOSED_OWNER, quiet=True)


def _remove(name: str, reason: int, quiet: bool) -> None:
    """Mark shmbuf segment ``name`` closed, remove the name, and mark it again if it was not.

    The second mark is for a segment whose creator was still writing its
    header at the first (the descriptor stays open, so the segment is still
    reachable after the name is gone): if the creator published since, it
    learns that its name is gone from the closed word; if it publishes later,
    ``Segment.publish`` finds the name gone.  Either way no creator writes on
    into a segment that nobody can attach to.
    """
    try:
        shm = posix_ipc.SharedMemory("/" + name)
    except posix_ipc.Error:
        shm = None   # gone, or not ours to open: the unlink below reports it
    try:
        marked = shm is not None and _mark_through(shm, reason)
        try:
            posix_ipc.unlink_shared_memory("/" + name)
        except posix_ipc.Error as exc:
            if not quiet:
                raise _translate(exc, name, "unlink") from None
        if shm is not None and not marked:
            _mark_through(shm, reason)
    finally:
        if shm is not None:
            shm.close_fd()


def _mark_through(shm, reason: int) -> bool:
    """Set the closed word through descriptor ``shm``; True if it is set by this call."""
    try:
        if os.fstat(shm.fd).st_size < COLUMN_TABLE:
            return False   # not sized yet: its creator's publish will find the name gone
        mm = mmap.mmap(shm.fd, COLUMN_TABLE, flags=mmap.MAP_SHARED)
    except (OSError, ValueError):
        return False   # not mappable: nobody can be writing into it through us
    try:
        return _header.mark_closed(mm, reason, os.getpid())
    finally:
        mm.close()


def _mark_closed(name: str, reason: int) -> None:
    """Set the closed word of shmbuf segment ``name``; quiet for anything else."""
    try:
        shm = posix_ipc.SharedMemory("/" + name)
    except posix_ipc.Error:
        return
    try:
        _mark_through(shm, reason)
    finally:
        shm.close_fd()


def list_segments() -> list[str]:
    """Names of every entry in /dev/shm (shmbuf's or not)."""
    try:
        return sorted(os.listdir(SHM_DIR))
    except FileNotFoundError:
        return []


class Reservation:
    """A segment name taken with O_CREAT|O_EXCL before its size is known.

    HistoryBuffer and keyed rings learn their schema at the first append;
    holding the name from construction makes a taken name fail there, with
    the kernel's answer, and ``allocate`` later sizes the same object (through
    the descriptor kept open, so nobody can swap the name in between).
    Attachers that come meanwhile see a 0-byte segment and wait in
    ``Segment.header``.
    """

    _shm = None
    _owner_removed = False   # the owner itself removed the name: no check at publish

    def __init__(self, name: str):
        validate_name(name)
        try:
            self._shm = posix_ipc.SharedMemory("/" + name, posix_ipc.O_CREX, mode=0o600)
        except posix_ipc.Error as exc:
            raise _translate(exc, name, "create") from None
        self.name = name
        # The creation mark: held (through this descriptor and its dups) until
        # ``publish``, so an attacher can tell a segment being made from a
        # foreign or abandoned entry.  Blocking: an attacher may be testing it.
        fcntl.flock(self._shm.fd, fcntl.LOCK_EX)

    def allocate(self, size: int, *, reserve: int | None = None,
                 populate: bool = True) -> Segment:
        """Size the segment to ``size`` bytes, reserve its first ``reserve`` (all if None)
        now, and map it (owner); ``populate`` maps the reserved pages into this process.

        On failure the name stays reserved, at 0 bytes.  Raises
        SharedMemoryFullError when /dev/shm is too small.
        """
        if self._shm is None:
            raise BufferClosedError(f"reservation of segment {self.name!r} is closed")
        fd = self._shm.fd
        reserve = size if reserve is None else min(reserve, size)
        try:
            # Reserved pages cannot raise SIGBUS when they are touched later:
            # a /dev/shm that is too small fails here (or at a chunk claim).
            os.ftruncate(fd, size)
            if reserve:
                os.posix_fallocate(fd, 0, reserve)
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
            if populate and reserve:
                _populate(mm, reserve)
            fd = os.dup(fd)
        except BaseException as exc:
            try:
                os.ftruncate(fd, 0)
            except OSError:
                pass
            if not isinstance(exc, Exception):
                raise
            raise _translate(exc, self.name, "create") from exc
        inode = os.fstat(fd).st_ino
        self.close()
        seg = Segment._wrap(self.name, mm, size, owner=True, fd=fd)
        seg.inode = None if self._owner_removed else inode
        return seg

    def removed_by_owner(self) -> None:
        """The owner unlinked the name on purpose: ``publish`` must not take it for a removal
        by someone else (the owner keeps using what it unlinked)."""
        self._owner_removed = True

    def close(self) -> None:
        """Close the descriptor (idempotent); the name stays until ``unlink``."""
        shm, self._shm = self._shm, None
        if shm is not None:
            shm.close_fd()

    def unlink(self) -> None:
        """Remove the name and close; quiet if the name is already gone."""
        self.close()
        _unlink_quietly(self.name)


def _populate(mm, length: int) -> None:
    """Map the first ``length`` bytes of ``mm`` into this process in one call."""
    try:
        mm.madvise(MADV_POPULATE_WRITE, 0, length)
    except OSError:
        # Kernels before 5.14: touch one byte per page instead.
        np.frombuffer(mm, np.uint8, length)[::PAGE] = 0


def column_views(segment: Segment, layout, columns) -> dict:
    """Numpy views ``(capacity, *shape)`` of ``columns`` inside ``segment``.

    ``frombuffer`` holds a buffer export on the mmap, so the mapping cannot be
    closed under a view that a caller still holds (it is unmapped when the
    last view goes).
    """
    mm = segment.mmap
    assert mm is not None, "the segment is mapped (its header was read); only a closed one is not"
    return {c.name: np.frombuffer(mm, c.dtype, layout.capacity * c.row_bytes // c.dtype.itemsize,
                                  c.offset).reshape((layout.capacity,) + c.shape)
            for c in columns}
