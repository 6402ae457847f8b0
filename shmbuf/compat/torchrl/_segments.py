"""The data segment of a ``LazyShmStorage``: made at the first write, attached, grown, renewed.

A mixin of ``LazyShmStorage``: the first element written (in any process)
fixes the schema; the segment of generation 0 is created then, or attached
by a process that lost the race, and ``_bind`` rebuilds the storage-shaped
views over its columns.  Indexed mode grows into a new generation when a
write brings new keys; ``empty()`` in streams mode renews the data into a
new, empty generation.

A new generation is made whole before anyone is told: its segment is
created (and filled, when grown) under the next name, then GEN and READY
(``_control``) name it, then the old segment is removed.  Every process
follows READY: the generation it names is the current one, attached at the
next call that needs the data.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, TypeVar

import numpy as np

from ..._errors import BufferClosedError, SegmentExistsError, SegmentNotFoundError
from ...store import buffer as store
from ...writing.compress import Compress
from . import _control, _schema
from ._control import GEN, INDEXED, MODE, NONE, READY, STREAMS, WRITTEN, Control

T = TypeVar("T")


def schema_batch(schema: dict) -> list:
    """The element's batch dims under a schema (the first leaf's shape for tensors)."""
    if "batch" in schema:
        return schema["batch"]
    return schema["leaves"][0][3]


class DataSegments:
    """The storage's data segment, per generation (see the module docstring)."""

    _ctl: Control
    _data: store.Buffer | None = None
    _data_gen = -1
    _views = None       # the storage-shaped TensorDict / tensor / pytree over the columns
    _local = None       # non-tensor entries, kept per process (as LazyTensorStorage keeps them)
    _schema_cache: dict = None  # type: ignore[assignment]  # None until the data is bound
    max_size: int
    ndim: int
    if TYPE_CHECKING:  # LazyShmStorage's
        @property
        def name(self) -> str: ...

        @property
        def owner(self) -> bool: ...

    def _data_buffer(self) -> store.Buffer | None:
        """This process's handle on the current data segment; None before the first write."""
        ctl = self._ctl
        while True:
            ready = ctl[READY]
            if not ready:
                return None
            gen = ready - 1
            if self._data is not None and self._data_gen == gen:
                return self._data
            try:
                buf = store.attach(ctl.data_name(gen))
            except (SegmentNotFoundError, BufferClosedError):
                if ctl[READY] != ready:
                    continue   # renewed again meanwhile: the newer one is current
                raise
            self._bind(buf, gen)
            return buf

    def _on_data(self, call: Callable[[store.Buffer], T]) -> T:
        """``call(buf)`` on the current data buffer, again on the next generation's if an
        ``empty()`` (in any process) removed the one it ran on meanwhile."""
        while True:
            buf = self._held()
            try:
                return call(buf)
            except BufferClosedError:
                if self._data_buffer() is buf:
                    raise   # closed for good, not renewed

    def _held(self) -> store.Buffer:
        """The data buffer; RuntimeError before the first write."""
        buf = self._data_buffer()
        if buf is None:
            raise RuntimeError(f"LazyShmStorage {self.name!r} holds no data yet: nothing was "
                               "written to it")
        return buf

    def _bind(self, buf: store.Buffer, gen: int) -> None:
        old, self._data, self._data_gen = self._data, buf, gen
        if old is not None and old is not buf:
            old.close()
        meta = buf.meta["torchrl"]
        local = self._local if self._views is None else _schema.take_local(
            self._schema_cache, self._views)
        self._schema_cache = meta["schema"]
        self.max_size = meta["max_size"]
        self._views = _schema.build(meta["schema"], buf.arrays, buf.capacity)
        _schema.merge_local(self._views, local)
        self.__dict__.pop("_total_shape_value", None)
        self.__dict__["_storage_keys"] = None

    def _rows_for(self, schema: dict) -> tuple[int, int]:
        """``(rows along dim 0, max_size)`` for elements of ``schema``, as TorchRL rounds."""
        requested = self._ctl.params["max_size"]
        if self.ndim == 1:
            return requested, requested
        per_row = int(np.prod(schema_batch(schema)[: self.ndim - 1]))
        rows = -(requested // -per_row)
        return rows, rows * per_row

    def _create_data(self, schema: dict, rows: int, max_size: int, mode: int, gen: int):
        """Create the data segment of generation ``gen`` (SegmentExistsError if another
        process was first); a process that did not construct the storage keeps it for the
        one that did."""
        ctl, ours = self._ctl, self.owner
        buf = store.create(_schema.spec_of(schema), rows, name=ctl.data_name(gen),
                           done_key=_schema.END_COLUMN, priorities=True,
                           prefault=mode == INDEXED, overcommit=mode != INDEXED,
                           compress=self._compress(schema),
                           handle_signals=None if ours else False,
                           meta={"torchrl": {"schema": schema, "max_size": max_size,
                                             "storage": ctl.buffer.name}})
        if not ours:
            buf.keep()   # the constructing process removes it (_finalize)
        return buf

    def _make_data(self, schema: dict, mode: int) -> None:
        """Create the first generation's data segment for ``schema`` or, if another
        process was first, attach to it and check that the two agree."""
        ctl = self._ctl
        gen = ctl[GEN]
        rows, max_size = self._rows_for(schema)
        try:
            buf = self._create_data(schema, rows, max_size, mode, gen)
        except SegmentExistsError:
            buf = store.attach(ctl.data_name(gen))
            theirs = buf.meta["torchrl"]["schema"]
            why = _schema.compare(theirs, schema, exact=True)
            if why is not None:
                buf.close()
                raise ValueError(f"data: another process wrote the storage first, with "
                                 f"another schema ({why}); nothing was written") from None
        if ctl[GEN] != gen:
            # An empty() renewed the data meanwhile, so this name was removed and made
            # again here: drop it, and follow the current generation.
            buf.close()
            _control.remove_segment(ctl.data_name(gen))
            self._held()
            return
        self._bind(buf, gen)
        ctl.advance(READY, gen + 1)   # the creator publishes; an attacher too, if it died

    def _publish(self, buf: store.Buffer, gen: int) -> None:
        """Make ``buf``, made whole as generation ``gen``, the current data everywhere;
        remove the old generation's segment, whoever created it."""
        ctl = self._ctl
        ctl.advance(GEN, gen)
        if not ctl.advance(READY, gen + 1):   # not expected: one process creates each name
            buf.close()
            _control.remove_segment(ctl.data_name(gen))
            self._held()
            return
        self._bind(buf, gen)
        _control.remove_segment(ctl.data_name(gen - 1))

    def _grow(self, schema: dict) -> None:
        """Move the data to a new generation whose schema has new keys (indexed mode:
        TorchRL's storages take new keys at any write); the old columns are copied."""
        old = self._held()
        gen = self._data_gen + 1
        buf = self._create_data(schema, old.capacity, self.max_size, INDEXED, gen)
        for name, column in old.arrays.items():
            buf.arrays[name][...] = column
        self._publish(buf, gen)

    def _renew(self) -> None:
        """``empty()`` in streams mode: a new, empty generation with the same schema and
        size; the old one's steps go with its segment.  If another process renewed
        the same generation at the same moment, its new one is taken."""
        old = self._data_buffer()
        if old is None:
            return
        gen = self._data_gen + 1
        try:
            buf = self._create_data(self._schema_cache, old.capacity, self.max_size,
                                    STREAMS, gen)
        except SegmentExistsError:
            return   # emptied by another process just now: its generation is the new one
        self._ctl[WRITTEN] += old.stats().steps_written   # the write count goes on
        self._publish(buf, gen)

    def _compress(self, schema: dict) -> Compress | None:
        conf = self._ctl.params["compress"]
        if conf is None:
            return None
        columns = {".".join(key): col for key, col, _, _ in schema["leaves"]}
        unknown = [c for c in conf["columns"] if c not in columns]
        if unknown:
            raise ValueError(f"compress: keys {unknown} are not in the data (keys "
                             f"{sorted(columns)}; nested keys are joined by '.')")
        return Compress([columns[c] for c in conf["columns"]], codec=conf["codec"],
                        level=conf["level"], hot_steps=conf["hot_steps"])

    def _claim_mode(self, mode: int) -> None:
        """Fix the storage's mode at its first write; refuse the other one afterwards."""
        ctl = self._ctl
        now = ctl[MODE]
        if now == NONE:
            ctl[MODE] = mode
        elif now != mode:
            raise RuntimeError(
                f"LazyShmStorage {self.name!r} is written in {_control.MODE_NAMES[now]} "
                f"mode, so it cannot also be written in {_control.MODE_NAMES[mode]} mode: "
                "use ShmWriter for every writer of a storage, or TorchRL's writers for all")
