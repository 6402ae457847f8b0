"""Which rows a streams-mode ``storage[index]`` reads, and reading them from a compressing one.

In streams mode a slice along dim 0 selects the rows that hold a step now
(``rb[:]`` is the steps held), and a compressing storage cannot index its raw
column views at all (a packed chunk's raw pages read as zeros).  Both read a
few rows into a storage of their own (a *compact* one) and index that
instead, so ``plan`` splits an index into the sorted distinct rows to read
and the same index remapped onto them: the result has the shape and type
that indexing the whole storage gives.  ``read`` reads them through the
store's door (``StorePort.read_rows``: each row whole, decoded) and builds
the compact storage with ``_schema.build``.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np
import torch

from . import _schema

_FORMS = ("an int, an integer or boolean tensor / array / list, a slice, or a tuple whose "
          "first item is one of them")


@dataclasses.dataclass
class Plan:
    """The rows an index reads along dim 0, and the index onto them once read."""

    rows: np.ndarray        # (n,) int64 rows to read, sorted and distinct
    local: Any              # the dim-0 index onto those rows, in the index's form
    rest: tuple | None      # the other dims' indices; None when the index was no tuple
    sliced: bool            # dim 0 was a slice: rows that hold no step by then are left out

    def index(self):
        """The index onto the rows read (after ``drop`` for a slice)."""
        return self.local if self.rest is None else (self.local,) + self.rest


def held_in(part: slice, committed: np.ndarray, capacity: int) -> np.ndarray:
    """The ``committed`` rows (any order) that slice ``part`` of ``capacity`` rows selects,
    sorted."""
    rows = np.sort(committed)
    lo, hi, step = part.indices(capacity)
    if step == 1:
        return rows[(rows >= lo) & (rows < hi)]
    return np.intersect1d(rows, np.arange(lo, hi, step))


def plan(index, capacity: int, committed: Callable[[], np.ndarray]) -> Plan:
    """Split ``index`` (what ``storage.get`` takes) into rows and an index onto them.

    ``committed()`` gives the rows that hold a step now (read only for a slice).

    Raises:
        IndexError: a row outside the storage, or a boolean mask of another length.
        TypeError: an index of another form.
    """
    first, rest = (index[0], index[1:]) if isinstance(index, tuple) and index else (index, None)
    if isinstance(first, slice):
        return Plan(held_in(first, committed(), capacity), slice(None), rest, True)
    if isinstance(first, (bool, np.bool_)):
        raise TypeError(f"index: {index!r} is not a row index; pass {_FORMS}")
    if isinstance(first, (int, np.integer)):
        row = _in_range(np.array([int(first)], np.int64), capacity)
        return Plan(row, 0, rest, False)
    if isinstance(first, (torch.Tensor, np.ndarray, list)):
        values = _as_numpy(first, index)
        if values.dtype == np.bool_:
            return _masked(values, rest, capacity)
        rows, inverse = np.unique(_in_range(values.reshape(-1), capacity), return_inverse=True)
        local = torch.from_numpy(inverse.reshape(values.shape).astype(np.int64))
        return Plan(rows, local, rest, False)
    raise TypeError(f"index: {index!r} is not a row index; pass {_FORMS}")


def _as_numpy(first, index) -> np.ndarray:
    values = first.detach().cpu().numpy() if isinstance(first, torch.Tensor) else np.asarray(
        first)
    if values.dtype != np.bool_ and values.dtype.kind not in "iu":
        if values.size or values.dtype.kind != "f":
            raise TypeError(f"index: rows of dtype {values.dtype} in {index!r}; pass {_FORMS}")
        values = values.astype(np.int64)   # an empty list is float to numpy
    return values.astype(np.int64) if values.dtype != np.bool_ else values


def _masked(mask: np.ndarray, rest: tuple | None, capacity: int) -> Plan:
    """A boolean mask over the first ``mask.ndim`` dims: its true places, as row indices."""
    if mask.ndim == 0 or mask.shape[0] != capacity:
        raise IndexError(f"index: a boolean mask of shape {mask.shape} where dim 0 of the "
                         f"storage has {capacity} rows")
    where = np.nonzero(mask)
    rows, inverse = np.unique(where[0], return_inverse=True)
    local = torch.from_numpy(inverse.reshape(-1).astype(np.int64))
    others = tuple(torch.from_numpy(w.astype(np.int64)) for w in where[1:])
    if rest is None and not others:
        return Plan(rows, local, None, False)
    return Plan(rows, local, others + (rest or ()), False)


def _in_range(rows: np.ndarray, capacity: int) -> np.ndarray:
    """``rows`` with negative ones counted from the end; IndexError for any outside."""
    bad = (rows < -capacity) | (rows >= capacity)
    if bad.any():
        raise IndexError(f"index: row {int(rows[bad][0])} is out of range: the storage has "
                         f"{capacity} rows along dim 0")
    return np.where(rows < 0, rows + capacity, rows)


def get(buf, schema: dict, views, index, *, compressed: bool):
    """``storage.get(index)`` in streams mode, over data buffer ``buf`` whose columns
    ``views`` (storage-shaped) are built from ``schema``."""
    if compressed:
        return read(buf, schema, views, index)
    first = index[0] if isinstance(index, tuple) and index else index
    if not isinstance(first, slice):
        return _schema.index(views, index)   # zero-copy, as LazyTensorStorage
    plan_ = plan(index, buf.capacity, buf.committed_rows)
    return _schema.index(_schema.index(views, torch.from_numpy(plan_.rows)), plan_.index())


def read(buf, schema: dict, views, index):
    """``views[index]`` of a compressing storage, read through ``buf``'s port: each row
    the step it holds when read, whole and decoded; zeros where a row holds no step then,
    which a slice leaves out (see ``LazyShmStorage.get``)."""
    plan_ = plan(index, buf.capacity, buf.committed_rows)
    arrays, held = buf.port.read_rows([col for _, col, _, _ in schema["leaves"]], plan_.rows)
    rows = torch.from_numpy(plan_.rows)
    if plan_.sliced and not held.all():
        arrays = {col: a[held] for col, a in arrays.items()}
        rows = rows[torch.from_numpy(held)]
    compact = _schema.build(schema, arrays, len(rows))
    local = _schema.take_local(schema, views)   # non-tensor entries, kept per process
    _schema.merge_local(compact, None if local is None else local[rows])
    return _schema.index(compact, plan_.index())
