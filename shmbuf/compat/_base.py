"""What every seed facade shares: a core buffer, attach, checkpoints, writers.

A facade owns one core ``Buffer`` (``self.buffer``) and keeps its own
constructor parameters in the buffer's JSON metadata, so that
``Class.attach(name)`` in another process rebuilds the same facade.
"""
from __future__ import annotations

import numpy as np

from .. import _open
from .._errors import CorruptSaveError, CorruptSegmentError
from .._registry import register  # noqa: F401  # the facades' decorator, re-exported
from ..disk import saved as _saved
from ..segment.lifecycle import Shared
from ..store import buffer as store
from ..writing.cast import host_array
from ..writing.compress import Compress


def to_torch(value):
    """numpy arrays (nested in dicts/lists) as torch tensors; plain values as they are."""
    import torch

    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(value).copy())
    if isinstance(value, dict):
        return {k: to_torch(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_torch(v) for v in value)
    return value


def to_numpy(value):
    """The inverse of ``to_torch``: tensors back to numpy arrays."""
    if type(value).__module__.startswith("torch"):
        return host_array(value)
    if isinstance(value, dict):
        return {k: to_numpy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [to_numpy(v) for v in value]
    if isinstance(value, tuple):
        return tuple(to_numpy(v) for v in value)
    return value


class Facade(Shared):
    """Base of the seed facades; subclasses set FACADE and implement ``_setup``.

    The lifecycle is ``Shared``'s: the facade is open while its ``buffer``
    is, closing it releases this process's writer and closes the buffer
    (the owner's close unlinks), and pickling sends the name.
    """

    FACADE = ""
    # None until _create or _attach made it (and after a constructor that failed first).
    buffer: store.Buffer = None  # type: ignore[assignment]
    _writer = None

    # -- construction ---------------------------------------------------------
    def _create(self, spec: dict, capacity: int, params: dict, *, name=None, seed=None,
                chunk_size=None, done_key="done", episode_slots=None, rate_limit=None,
                overcommit=False, compress=None, frames: tuple[str, ...] = ("obs",)) -> None:
        """Create the owning core buffer and remember ``params`` in its metadata.

        ``compress``: None or False (raw), True (the ``frames`` columns with
        ``Compress``'s defaults), or a ``shmbuf.Compress`` naming core columns.
        """
        if compress is True:
            compress = Compress(frames)
        elif compress is False:
            compress = None
        elif compress is not None and not isinstance(compress, Compress):
            raise TypeError(f"compress must be True, False, None or a shmbuf.Compress, "
                            f"got {compress!r}")
        self.buffer = store.create(spec, capacity, name=name, seed=seed, chunk_size=chunk_size,
                                   done_key=done_key, episode_slots=episode_slots,
                                   meta={"facade": self.FACADE, "params": params},
                                   rate_limit=rate_limit, overcommit=overcommit,
                                   compress=compress)
        self._track(self.buffer.name, owner=True)
        self._setup(params)

    def _setup(self, params: dict) -> None:
        """Set the facade's attributes from its parameters (both create and attach)."""
        raise NotImplementedError

    @classmethod
    def attach(cls, name: str, *, seed=None, own: bool = False, handle_signals=None):
        """Attach to a buffer of this kind, made by another process, by name.

        ``own=True`` takes over a buffer whose creator died (``shmbuf.attach``):
        this process then unlinks it at close and answers for SIGTERM.

        Raises:
            SegmentNotFoundError: no such segment.
            CorruptSegmentError: the segment was not made by this facade.
            OwnerAliveError: ``own=True`` but its owner is alive.

        Example:
            >>> rb = ReplayBuffer.attach("shmbuf-1a2b3c4d5e6f")
            >>> rb = ReplayBuffer.attach("shmbuf-1a2b3c4d5e6f", own=True)  # after a crash
        """
        if own:  # a look first: adopting another class's buffer would unlink it on refusal
            cls._from_buffer(store.attach(name)).close()
        return cls._from_buffer(store.attach(name, seed=seed, own=own,
                                             handle_signals=handle_signals))

    # -- saving to disk -------------------------------------------------------------
    def save(self, path, **options):
        """Write the live steps to the directory ``path`` (``Buffer.save``: same options).

        ``Class.load(path)`` (or ``shmbuf.load``) rebuilds this facade from it.

        Example:
            >>> rb.save("ckpt/replay")
            >>> rb2 = ReplayBuffer.load("ckpt/replay")
        """
        self._check_open()
        if self.buffer is None:
            raise ValueError(f"{self._describe()} holds no buffer yet; add steps first")
        return self.buffer.save(path, **options)

    @classmethod
    def load(cls, path, name: str | None = None, capacity: int | None = None, *, seed=None,
             handle_signals=None):
        """A new buffer of this class from a save of one (see ``shmbuf.load``).

        Raises:
            CorruptSaveError: the save was made by another class (or is damaged).
        """
        manifest = _saved.read_manifest(path)
        if manifest["meta"].get("facade") != cls.FACADE:
            raise CorruptSaveError(
                f"{str(path)!r} was saved by {_saved.saved_by(manifest)}, not by "
                f"{cls.__name__}; load it with the matching class or shmbuf.load")
        return _open.load_steps(path, name, capacity, seed=seed, handle_signals=handle_signals)

    @classmethod
    def _open_segment(cls, segment, layout, owner, *, seed=None, own: bool = False,
                      handle_signals: bool | None = None):
        """This facade over an attached step-store segment (the registry's way in)."""
        return cls._from_buffer(store.open_segment(
            segment, layout, owner, seed=seed, own=own, handle_signals=handle_signals))

    @classmethod
    def _from_buffer(cls, buffer):
        """The facade over attached ``buffer``; closes it if another facade made it."""
        try:
            made_by = buffer.meta.get("facade")
            if made_by != cls.FACADE:
                raise CorruptSegmentError(
                    f"segment {buffer.name!r} was made by {made_by or 'shmbuf.create'}, not by "
                    f"{cls.__name__}; attach it with the matching class or shmbuf.attach")
            self = cls.__new__(cls)
            self.buffer = buffer
            self._track(buffer.name, owner=buffer.owner)
            self._setup(buffer.meta["params"])
            return self
        except BaseException:
            buffer.close()
            raise

    # -- writers and lifecycle --------------------------------------------------
    def _get_writer(self):
        """This process's writer, made on first use (a forked child gets its own)."""
        if self._writer is None:
            self._writer = self.buffer.writer()  # raises BufferClosedError once closed
        return self._writer

    def _drop_writer(self) -> None:
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()

    def _closed_mark(self):
        return None if self.buffer is None else self.buffer._closed_mark()

    def _release(self) -> None:
        self._drop_writer()
        if self.buffer is not None:
            self.buffer.close()

    # -- checkpoints --------------------------------------------------------------
    def state_dict(self) -> dict:
        """Copies of every live step, as torch tensors and plain Python values.

        ``torch.save(buf.state_dict(), path)`` then
        ``torch.load(path, weights_only=True)`` works.
        """
        state = self.buffer.state_dict()   # tensors already; one copy of the live steps
        state["facade"] = self.FACADE
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore a ``state_dict`` into this buffer, keeping this buffer's capacity.

        Raises:
            ValueError: the checkpoint was made by another facade or has another
                schema; nothing is changed.
        """
        if not isinstance(state, dict):
            raise ValueError(f"state: expected a dict from state_dict(), got "
                             f"{type(state).__name__}")
        state = dict(state)
        made_by = state.pop("facade", None)
        if made_by != self.FACADE:
            raise ValueError(f"state: checkpoint was made by {made_by!r}, not {self.FACADE!r}")
        self._drop_writer()  # its open chunk would otherwise survive the restore
        self.buffer.load_state_dict(state)
