"""One lifecycle for every object over a named segment, like CPython's SharedMemory.

``Buffer``, ``KeyedRings``, every seed facade and ``HistoryBuffer`` close,
unlink, pickle and use ``with`` through ``Shared``:

- ownership comes from the constructor: the process that created the
  segment owns it and unlinks it on ``close()``, at the end of a ``with``
  block, on garbage collection or at exit; ``attach`` never unlinks;
- ``close()`` is idempotent, and afterwards every method raises
  ``BufferClosedError`` naming the object and its segment, like I/O on a
  closed file;
- ``keep()`` makes the owner leave the segment in place when it closes or
  exits (data meant to outlive its writer); ``shmbuf rm`` and, once that
  process has exited, ``shmbuf gc`` remove it;
- ``unlink()`` removes the name at once, for the owner in its own process
  only; a forked child that inherited the owner, and every finalizer
  outside the creating process, only close.  The handle that unlinked may
  go on using its mapping; every other handle, in this process too, gets
  ``BufferClosedError`` (``header.ClosedMark``);
- pickling sends the name: the receiving process calls ``Class.attach(name)``.
"""
from __future__ import annotations

import os
import weakref
from typing import TYPE_CHECKING, Any

from .._errors import BufferClosedError, SegmentNotFoundError
from ..posix import signals
from ..protocol.layout import CLOSED_OWNER
from .segment import unlink as unlink_segment


def _finalize(resource, unlink_in_pid: int | None) -> None:
    """Finalizer of an owning object: close ``resource``; unlink it too in the creating pid."""
    # A forked child that inherits the object must never destroy the trainer's data.
    if unlink_in_pid == os.getpid():
        try:
            resource.unlink()
        except FileNotFoundError:
            pass
    resource.close()


class Shared:
    """Base of every shmbuf object over one named segment; see the module docstring.

    A subclass opens the handle with ``_open(segment)`` when it maps the
    segment itself, or ``_track(name, owner)`` when it holds another handle
    (a facade's ``Buffer``) or holds the name before the segment is sized
    (``resource`` is then what the finalizer closes, and unlinks in the owner's
    process).  It extends ``_release`` to drop its references into the
    mapping, and has a classmethod ``attach(name)`` for unpickling.
    """

    KIND_NAME = ""            # how messages name the object; default: its class name
    _name = None
    _closed = True            # class defaults: close() works after a failed constructor
    _creator_pid = None       # the creating process; None for attached handles
    _finalizer = None
    _resource = None          # what the finalizer closes (given to _track)
    _segment = None

    if TYPE_CHECKING:  # every subclass defines it; __reduce__ attaches with it
        @classmethod
        def attach(cls, name: str, *args: Any, **kwargs: Any) -> Any: ...

    def _open(self, segment) -> None:
        """Open over a mapped ``Segment``: closed (and unlinked, by its owner) at the end."""
        self._segment = segment
        self._track(segment.name, segment.owner, segment)

    def _track(self, name: str | None, owner: bool, resource=None) -> None:
        """Open as the handle of segment ``name``; ``resource``: closed by the finalizer."""
        self._name = name
        self._creator_pid = os.getpid() if owner else None
        self._closed = False
        if resource is not None:
            self._resource = resource
            self._finalizer = weakref.finalize(self, _finalize, resource, self._creator_pid)

    def _disown(self) -> None:
        """Stop finalizing the resource given to ``_track`` (another object owns it now)."""
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None

    @property
    def name(self) -> str | None:
        """The segment's name, for ``attach(name)`` in any process."""
        return self._name

    @property
    def owner(self) -> bool:
        """True in the process that created the segment (which unlinks it)."""
        return self._creator_pid is not None and self._creator_pid == os.getpid()

    @property
    def closed(self) -> bool:
        """True once ``close()`` was called in this process."""
        return self._closed

    def _describe(self) -> str:
        return f"{self.KIND_NAME or type(self).__name__} {self._name!r}"

    def _check_open(self) -> None:
        if self._closed:
            raise BufferClosedError(f"{self._describe()} is closed")

    def _release(self) -> None:
        """Drop this object's references into the mapping (subclasses extend)."""

    def _closed_mark(self):
        """The ``header.ClosedMark`` of the mapping this object works through, or None.

        ``unlink`` sets the closed word through it, which exempts this handle
        alone from the closed check (subclasses with a mapping override).
        """
        return None

    def close(self) -> None:
        """Unmap in this process; the owner also unlinks.  Idempotent.

        Views handed out earlier stay valid (they keep the mapping alive), but
        every method raises BufferClosedError afterwards.
        """
        if self._closed:
            return
        self._closed = True
        try:
            self._release()
        finally:
            if self._finalizer is not None:
                self._finalizer()

    def keep(self) -> None:
        """Leave the segment in place when this owner closes, is dropped or exits.

        For data meant to outlive the process that wrote it: any process can
        attach to it afterwards.  The header still names this process as the
        owner, so while it lives ``shmbuf rm NAME`` refuses without
        ``--force``; once it has exited, ``shmbuf rm NAME`` removes it, and
        so does ``shmbuf gc`` when no live writer uses it.  SIGTERM no longer
        unlinks it either.  A no-op on a handle that does not own its segment.

        Example:
            >>> buf = shmbuf.create(spec, 10_000, name="dataset")
            >>> buf.keep(); buf.close()          # still in /dev/shm: shmbuf.attach("dataset")
        """
        if not self.owner:
            return
        self._creator_pid = None
        if self._finalizer is not None and self._resource is not None:
            self._finalizer.detach()
            self._finalizer = weakref.finalize(self, _finalize, self._resource, None)
        signals.forget(self)

    def unlink(self) -> None:
        """Remove the segment's name now (owner, in its own process, only).

        Mappings stay valid; nobody can attach by the name afterwards.  A
        no-op for an object that has no segment yet, or whose name is gone.
        """
        if self._name is None:
            return
        if not self.owner:
            raise PermissionError(
                f"{self._describe()} was attached, not created, in this process; only its "
                f"owner unlinks it (or run 'python -m shmbuf rm {self._name}')")
        mark = self._closed_mark()
        if mark is not None:
            # Marked through our own mapping, so that this handle, and no other
            # (in this process or any), may go on using it after the unlink.
            mark.close_here(CLOSED_OWNER)
        try:
            unlink_segment(self._name)
        except FileNotFoundError:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __reduce__(self):
        return unpickled, (type(self).attach, self._name)


def unpickled(attach, name: str, *args):
    """Unpickling a handle: ``attach(name, *args)``, or an error that says why there is none.

    A handle pickles its name, never its bytes (like CPython's SharedMemory),
    so a pickle kept in a file outlives the segment it names.
    """
    try:
        return attach(name, *args)
    except SegmentNotFoundError as exc:
        raise SegmentNotFoundError(
            exc.errno, f"unpickling a shmbuf handle of {name!r}: shmbuf handles pickle by "
            "name (the receiver attaches to the live segment), and no segment has that name "
            "any more, so there is nothing to attach to. To keep a buffer's contents, save "
            "it: buf.save(path) writes it to disk, and shmbuf.load(path) makes a live "
            "buffer of it again") from None
