"""``LazyShmStorage``: TorchRL's ``LazyTensorStorage`` with its tensors in a shmbuf segment.

The storage is TorchRL's own ``LazyTensorStorage`` (every index, slice,
tensorclass, pytree and ``ndim`` rule is TorchRL's code), but its
``_storage`` is rebuilt from zero-copy views of a shmbuf buffer's columns
(``_schema.build``), and everything TorchRL keeps per process (the length,
the last cursor, the mutation revision) lives in the control block
(``_control``), so every process that holds the storage sees the same data.

Two modes, fixed by the first write (see the guide):

- indexed: TorchRL's writers call ``set(cursor, data)``; rows are written in
  place, as in ``LazyTensorStorage``, and ``len`` is TorchRL's count.
- streams: ``ShmWriter`` appends through shmbuf writers, one lock-free
  stream per process; a storage index is still a row, ``len`` is the steps
  held, and ``storage[:]`` reads exactly the rows that hold a step.
"""
from __future__ import annotations

import os
import warnings
import weakref
from typing import Any

import numpy as np
import torch
from tensordict import is_tensor_collection
from torch.compiler import is_compiling
from torch.utils._pytree import tree_map
from torchrl.data.replay_buffers.storages import LazyTensorStorage

from ..._args import check_int
from ..._errors import CorruptSegmentError
from ..._registry import register
from ...store import buffer as store
from ...writing.compress import Compress
from . import _checkpoints, _control, _rows, _schema
from ._control import GEN, INDEXED, MODE, NONE, STREAMS, Control
from ._counters import SharedCounters
from ._segments import DataSegments


def _check_device(device):
    if isinstance(device, str) and device == "auto":
        return "auto"
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device: {device!r} is not a torch device ({exc}); pass 'cpu', "
                         "'cuda', 'cuda:N' or 'auto'") from None


def _check_compress(compress) -> dict | None:
    if compress is None:
        return None
    if not isinstance(compress, Compress):
        raise TypeError(f"compress must be None or a shmbuf.Compress naming keys of the data, "
                        f"got {compress!r}")
    return {"columns": list(compress.columns), "codec": compress.codec, "level": compress.level,
            "hot_steps": compress.hot_steps}


def _element(cursor, data):
    """The first element of what ``set(cursor, data)`` writes (what fixes the schema)."""
    if isinstance(cursor, (int, np.integer)) and not isinstance(cursor, bool):
        return data
    if isinstance(data, list):
        return data[0]
    if is_tensor_collection(data) or isinstance(data, torch.Tensor):
        return data[0]
    return tree_map(lambda x: x[0], data)


def _finalize(ctl: Control, owner_pid: int) -> None:
    """The constructing process removes the data segment, whoever made it, then its control."""
    if os.getpid() == owner_pid:
        _control.remove_segment(ctl.data_name(ctl[GEN]))
    ctl.buffer.close()


@register
class LazyShmStorage(SharedCounters, DataSegments, LazyTensorStorage):
    """A drop-in for ``torchrl.data.LazyTensorStorage`` whose data lives in shared memory.

    The columns are made from the first element written, in whichever
    process writes first.  Pickling sends the storage's name: a
    ``ReplayBuffer`` holding it can go to spawned or forked processes, and
    all of them read and write the same rows.  ``shmbuf.compat.torchrl.attach(name)``
    (or ``shmbuf.attach(name)``) opens it in any process.

    Args:
        max_size: elements held (over the first ``ndim`` dims), >= 1.
        device: where sampled tensors are sent ("cpu", "cuda:N", or "auto":
            the device of the first data); the data itself stays in shared
            memory.
        ndim: storage dims counted by ``max_size``, as TorchRL's.
        compilable: as TorchRL's: the length, revision and last cursor stay
            in this process (TorchRL documents such a storage as not
            shareable) and ``set`` is TorchRL's own, which ``torch.compile``
            traces (without the schema checks).
        shared_init: as TorchRL's, the data stays on the CPU (a non-CPU
            ``device`` is reset, with a warning); the storage is shared either way.
        consolidated: accepted for compatibility with TorchRL's signature, no effect.
        cleanup_memmap: accepted for compatibility with TorchRL's signature, no effect.
        name: the storage's name (a shmbuf segment name); generated if None.
        compress: a ``shmbuf.Compress`` naming data keys (nested keys
            joined by "."): their cold chunks are kept compressed
            (``ShmWriter`` data only).
        handle_signals: as ``shmbuf.create``.

    Raises:
        TypeError / ValueError: a bad argument, naming it.
        SegmentExistsError: ``name`` is taken.

    Example:
        >>> rb = TensorDictReplayBuffer(storage=LazyShmStorage(100_000), batch_size=256)
        >>> rb.extend(collector_batch)
    """

    FACADE = _control.FACADE
    _ctl: Control = None  # type: ignore[assignment]   # class defaults: close() works early
    _data: store.Buffer | None = None
    _data_gen = -1
    _views: Any = None   # the storage-shaped TensorDict / tensor / pytree over the columns
    _local = None   # non-tensor entries, kept per process (as LazyTensorStorage keeps them)
    _schema_cache: dict = None  # type: ignore[assignment]  # None until the data is bound
    _finalizer = None
    _owner_pid = None   # the constructing process (a forked child is not it)
    _pending = None

    def __init__(self, max_size, *, device="cpu", ndim: int = 1, compilable: bool = False,
                 consolidated: bool = False, shared_init: bool = False,
                 cleanup_memmap: bool = True, name: str | None = None, compress=None,
                 handle_signals: bool | None = None):
        params = {"max_size": check_int("max_size", max_size, 1),
                  "ndim": check_int("ndim", ndim, 1, 8),
                  "device": str(_check_device(device)),
                  "compress": _check_compress(compress),
                  "compilable": bool(compilable), "shared_init": bool(shared_init)}
        ctl = Control.create(name, params, handle_signals)
        self._owner_pid = os.getpid()
        self._finalizer = weakref.finalize(self, _finalize, ctl, self._owner_pid)
        self._setup(ctl)

    def _setup(self, ctl: Control) -> None:
        """Set what TorchRL's constructors set, from the control block's parameters."""
        params = ctl.params
        self._ctl = ctl
        self.max_size = params["max_size"]
        self.ndim = params["ndim"]
        self.device = _check_device(params["device"])
        self.checkpointer = None
        # compilable: TorchRL keeps the length, the revision and the last cursor in this
        # process (its documented limit: such a storage is not shared); the data is.
        self._compilable = params["compilable"]
        if self._compilable:
            self.__dict__.update(_local_len=0, _local_revision=torch.zeros((), dtype=torch.int64),
                                 _local_cursor=torch.full((), -1, dtype=torch.int64))
            # TorchRL's own set, which torch.compile traces; the schema checks are skipped.
            self.__dict__["set"] = LazyTensorStorage.set.__get__(self, type(self))
        self._attached_entities_list: list = []
        self._last_cursor = None
        self.__dict__["_storage_keys"] = None
        self.consolidated = False
        # Always shared: the first writer in any process makes the columns (TorchRL's
        # collectors then let their workers write first instead of a fake first batch).
        self.shared_init = True
        self._cpu_only = params["shared_init"]   # TorchRL's shared_init keeps data on the CPU
        self.cleanup_memmap = True

    # -- identity and lifecycle -------------------------------------------------
    @property
    def name(self) -> str:
        """The storage's name: ``attach(name)`` opens it in any process."""
        return self._ctl.buffer.name

    @property
    def owner(self) -> bool:
        """True in the process that constructed the storage (it removes the segments)."""
        return (self._finalizer is not None and self._finalizer.alive
                and self._owner_pid == os.getpid())

    @property
    def buffer(self) -> store.Buffer | None:
        """The shmbuf ``Buffer`` holding the data (None before the first write)."""
        return self._data_buffer()

    @property
    def mode(self) -> str:
        """How the storage is written: "empty", "indexed" or "streams"."""
        return {NONE: "empty", INDEXED: "indexed", STREAMS: "streams"}[self._ctl[MODE]]

    def close(self) -> None:
        """Close this process's handles; the constructing process also removes the segments."""
        data, self._data, self._views = self._data, None, None
        if data is not None:
            data.close()
        if self._finalizer is not None:
            self._finalizer()
        elif self._ctl is not None:
            self._ctl.buffer.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __reduce__(self):
        state = {"_attached_entities_list": self._attached_entities_list,
                 "device": self.device}
        return _reattach, (self.name,), state

    def __setstate__(self, state):
        self.__dict__.update(state)

    @classmethod
    def _open_segment(cls, segment, layout, owner, *, seed=None, own: bool = False,
                      handle_signals: bool | None = None):
        """The storage over an attached control segment (the registry's way in)."""
        return cls._from_control(store.open_segment(
            segment, layout, owner, seed=seed, own=own, handle_signals=handle_signals))

    @classmethod
    def _from_control(cls, buffer: store.Buffer) -> "LazyShmStorage":
        try:
            if buffer.meta.get("facade") != cls.FACADE:
                raise CorruptSegmentError(
                    f"segment {buffer.name!r} was made by "
                    f"{buffer.meta.get('facade') or 'shmbuf.create'}, not by LazyShmStorage; "
                    "open it with shmbuf.attach")
            self = cls.__new__(cls)
            self._setup(Control(buffer))
            return self
        except BaseException:
            buffer.close()
            raise

    # -- what TorchRL keeps per process, shared ---------------------------------------
    @property
    def _storage(self):
        if is_compiling():
            return self._views
        return self._views if self._data_buffer() is not None else None

    @_storage.setter
    def _storage(self, value) -> None:
        if value is None:
            return
        # A whole storage-shaped value (TorchRL's load_state_dict on an empty storage).
        self._claim_mode(INDEXED)
        if self._data_buffer() is None:
            self._init(_element(None, value))
        self._write_all(value)

    def _write_all(self, value) -> None:
        views = self._views
        if is_tensor_collection(value):
            views[: value.shape[0]].update_(value)
        else:
            tree_map(lambda dst, src: dst[: src.shape[0]].copy_(src), views, value)

    @property
    def initialized(self) -> bool:
        if is_compiling():
            return self._views is not None
        return self._data_buffer() is not None

    @initialized.setter
    def initialized(self, value) -> None:
        """TorchRL sets it after ``_init``; here it follows the data segment."""

    # -- TorchRL's storage API --------------------------------------------------------
    def _init(self, data) -> None:
        if self._ctl[MODE] == NONE:
            self._claim_mode(INDEXED)
        return self._init_standard(data)

    def _init_standard(self, data) -> None:
        if self._cpu_only and self.device not in (None, "auto") and self.device.type != "cpu":
            warnings.warn(f"LazyShmStorage(shared_init=True) keeps its data on the CPU, as "
                          f"TorchRL's does; the requested storage device ({self.device}) "
                          "cannot be honored and is reset to 'cpu'.", stacklevel=3)
            self.device = torch.device("cpu")
        if self.device == "auto":
            leaf = data if is_tensor_collection(data) or isinstance(data, torch.Tensor) \
                else next(iter(torch.utils._pytree.tree_leaves(data)))
            self.device = leaf.device
        schema = _schema.describe(data, self.ndim)
        self._local = _schema.local_part(schema, data, self._rows_for(schema)[0])
        self._make_data(schema, self._ctl[MODE])

    def set(self, cursor, data, *, set_cursor: bool = True):
        """Write ``data`` at ``cursor`` (TorchRL's writers); checked against the schema first.

        Raises:
            ValueError: ``data`` drifts from the first element written (a
                shape, or a dtype that does not cast safely); nothing is written.
                New keys add columns, as in ``LazyTensorStorage``.
            RuntimeError: the storage is written by ``ShmWriter``.
        """
        self._claim_mode(INDEXED)
        if self.initialized:
            element = _element(cursor, data)
            why = _schema.drift(self._schema_cache, element, exact=False)
            if why is not None:
                raise ValueError(f"data: {why}; a LazyShmStorage keeps the shapes and dtypes "
                                 "of the first element written. Nothing was written")
            grown = _schema.grow(self._schema_cache, element)
            if grown is not None:
                self._grow(grown)
        return super().set(cursor, data, set_cursor=set_cursor)

    def get(self, index):
        """The elements at ``index``, as ``LazyTensorStorage.get`` gives them.

        In streams mode (``ShmWriter``) a slice along dim 0 (alone, or first
        in a tuple) selects the rows that hold a step now, so ``storage[:]``
        is exactly the steps held.
        Other indices name rows; a row holds the step written there until
        writers recycle its chunk, then a newer one.  A compressing storage
        reads every row it names through the store (``StorePort.read_rows``),
        decoded, so the result is a copy (an int index too), never a view:
        each row is the step it holds when read, whole, never torn (a row
        whose chunk a writer recycles during the read is read again), and a
        row that holds no step then (never written, or being refilled) reads
        as zeros; a slice leaves such rows out.

        Raises:
            RuntimeError: nothing was written yet.
            IndexError / TypeError: a row outside the storage, or an index of
                another form (streams mode with compression).
        """
        pending, self._pending = self._pending, None
        if pending is not None and pending[0] is index:
            return pending[1]
        if self._ctl[MODE] == STREAMS:
            buf = self._data_buffer()
            if buf is None:
                raise RuntimeError("Cannot get elements out of a non-initialized storage.")
            out = _rows.get(buf, self._schema_cache, self._views, index,
                            compressed=self._ctl.params["compress"] is not None)
        else:
            out = super().get(index)
        return self._to_device(out)

    def _to_device(self, out):
        device = self.device
        if isinstance(device, torch.device) and device.type not in ("cpu", "meta"):
            return out.to(device) if hasattr(out, "to") else tree_map(
                lambda x: x.to(device), out)
        return out

    def _stash(self, index, batch) -> None:
        """Hand ``batch`` to the next ``get(index)`` (a sampler that already gathered it)."""
        self._pending = (index, batch)

    def _rand_given_ndim(self, batch_size):
        if self._ctl[MODE] != STREAMS:
            return super()._rand_given_ndim(batch_size)
        rows = torch.from_numpy(self._held().committed_rows())
        pick = rows[torch.randint(0, len(rows), (batch_size,), generator=self._rng)]
        if self.ndim == 1:
            return pick
        dims = self._views.shape[1:self.ndim]
        return (pick,) + tuple(torch.randint(d, (batch_size,), generator=self._rng)
                               for d in dims)

    # -- checkpoints ----------------------------------------------------------------
    def state_dict(self) -> dict:
        """TorchRL's checkpoint of the rows; with ``ShmWriter`` data, the streams' own."""
        if self._ctl[MODE] == STREAMS:
            return _checkpoints.state_dict(self)
        return super().state_dict()

    def load_state_dict(self, state_dict) -> None:
        if "shmbuf_streams" in state_dict:
            return _checkpoints.load_state_dict(self, state_dict)
        self._claim_mode(INDEXED)
        return super().load_state_dict(state_dict)

    def dumps(self, path) -> None:
        if self._ctl[MODE] == STREAMS:
            return _checkpoints.dumps(self, path)
        return super().dumps(path)

    def loads(self, path) -> None:
        if _checkpoints.holds_streams(path):
            return _checkpoints.loads(self, path)
        self._claim_mode(INDEXED)
        return super().loads(path)

    def _wait_for_init(self) -> None:
        """Nothing to wait for: ``initialized`` reads the control block."""

    def _empty(self):
        """Empty the storage for every process (``ReplayBuffer.empty()``).

        Streams mode (``ShmWriter``): the data moves to a new, empty segment
        of the same schema and size, and the old one is removed.  Every
        process that holds the storage (by pickle or ``attach``) sees it
        empty at its next call and writes and samples the new one from then
        on.  An ``extend`` that runs in another process while ``empty()``
        does may land in the old segment, before it goes: its steps are then
        dropped with it (the rows it returned no longer name them).  Either way a
        batch is never split between the two segments, and no step comes
        back torn.  ``ShmWriter``'s write count starts again from 0, unless
        ``empty(empty_write_count=False)``.
        """
        if self._ctl[MODE] == STREAMS:
            self._renew()
            self._bump_mutation_revision()
            return
        super()._empty()


def attach(name: str) -> LazyShmStorage:
    """Open the ``LazyShmStorage`` called ``name``, made by any process; this handle
    never removes it.  (``Storage.attach(buffer)`` is TorchRL's own method, for
    replay buffers that read a storage.)

    Raises:
        SegmentNotFoundError: no storage has that name.
        CorruptSegmentError: ``name`` is a shmbuf buffer, but not a LazyShmStorage.

    Example:
        >>> storage = shmbuf.compat.torchrl.attach("shmbuf-1a2b3c4d5e6f")
    """
    return LazyShmStorage._from_control(store.attach(name))


_reattach = attach

