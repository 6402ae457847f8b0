"""What TorchRL's ``LazyTensorStorage`` keeps per process, kept in the control block.

A mixin of ``LazyShmStorage``: the length (TorchRL's count in indexed mode,
the steps held in stream mode), the mutation revision that TorchRL's samplers
read to drop their caches, and the last cursor.  With ``compilable=True``
they stay in the process, as TorchRL keeps them (``torch.compile`` traces
plain attributes, not shared words).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from torchrl.data.replay_buffers.storages import Storage

from ._control import CURSOR, LEN, MODE, STREAMS, WRITTEN, Control
from ._segments import schema_batch

if TYPE_CHECKING:  # annotations only
    from ...store.buffer import Buffer


class _Cursor:
    """TorchRL's ``_last_cursor_index_value`` (an ``mp.Value``), kept in the control block."""

    def __init__(self, ctl: Control):
        self._ctl = ctl

    @property
    def value(self) -> int:
        return self._ctl[CURSOR] - 1

    @value.setter
    def value(self, value: int) -> None:
        self._ctl[CURSOR] = int(value) + 1

    def get_lock(self):
        return _NoLock()


class _NoLock:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class SharedCounters:
    """TorchRL's per-process counters, shared (see the module docstring)."""

    _ctl: Control
    _compilable: bool
    _schema_cache: dict
    ndim: int
    if TYPE_CHECKING:  # DataSegments'
        def _data_buffer(self) -> Buffer | None: ...

    @property
    def _len(self) -> int:
        if self._compilable:
            return self.__dict__["_local_len"]
        ctl = self._ctl
        if ctl[MODE] != STREAMS:
            return ctl[LEN]
        buf = self._data_buffer()
        if buf is None:
            return 0
        return len(buf) * self._per_row()

    @_len.setter
    def _len(self, value) -> None:
        if self._compilable:
            self.__dict__["_local_len"] = value
        elif self._ctl[MODE] != STREAMS:
            self._ctl[LEN] = int(value)

    def _steps_written(self) -> int:
        """Steps ``ShmWriter`` wrote, in every process: this generation's and those an
        ``empty()`` kept in the count (``_restart_count`` drops them)."""
        buf = self._data_buffer()
        return self._ctl[WRITTEN] + (0 if buf is None else buf.stats().steps_written)

    def _restart_count(self) -> None:
        """``ShmWriter``'s write count starts again from 0 (``empty(empty_write_count=True)``)."""
        buf = self._data_buffer()
        self._ctl[WRITTEN] = -(0 if buf is None else buf.stats().steps_written)

    def _per_row(self) -> int:
        if self.ndim == 1:
            return 1
        return int(np.prod(schema_batch(self._schema_cache)[: self.ndim - 1]))

    @property
    def _mutation_revision(self) -> int:
        if self._compilable:
            return Storage._mutation_revision.fget(self)
        return self._ctl.revision()

    def _bump_mutation_revision(self) -> None:
        if self._compilable:
            return Storage._bump_mutation_revision(self)
        self._ctl.bump_revision()
        return None

    @property
    def _last_cursor_index_value(self):
        return self.__dict__["_local_cursor"] if self._compilable else _Cursor(self._ctl)

    @_last_cursor_index_value.setter
    def _last_cursor_index_value(self, value) -> None:
        if self._compilable:
            self.__dict__["_local_cursor"] = value

    @property
    def _mutation_revision_value(self):
        return self.__dict__["_local_revision"] if self._compilable else None

    @_mutation_revision_value.setter
    def _mutation_revision_value(self, value) -> None:
        if self._compilable:
            self.__dict__["_local_revision"] = value
