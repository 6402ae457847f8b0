"""Keyed rings: a store kind with a fixed set of keys, each keeping its own newest entries.

The step store evicts globally (the oldest chunk goes first, whoever wrote
it).  Per-env history needs the opposite: env 3 keeps its last ``max_len``
entries however fast env 5 appends.  Keyed rings give that with the same
segment, header and column machinery, laid out by ``protocol.layout.plan`` with
``capacity = n_keys * ring_len`` and ``chunk_size = ring_len``: key ``k``
owns chunk ``k``'s rows as a ring of ``ring_len = max_len + spare`` slots.
The header's ``kind`` is ``KIND_KEYED`` and its JSON metadata holds
``max_len`` and the caller's ``meta``.

The protocol (which words, in which order, who may write) lives in
``protocol.keyed``; this module checks arguments, moves the column data, and
gives keyed rings the lifecycle every shmbuf object has (``segment.lifecycle.Shared``), with
the step store's rules for stopping and crashing: every call checks the
closed mark (a worker whose owner closed the rings gets BufferClosedError),
``attach`` refuses closed rings, and ``attach(name, own=True)`` takes over
rings whose owner died.  HistoryBuffer is built on them.
"""
from __future__ import annotations

import json
import os
import time

import numpy as np

from .._args import check_int
from .._errors import CorruptSegmentError
from ..posix import signals as _signals
from ..posix.procs import my_start_time
from ..protocol.keyed import KeyWords
from ..protocol.layout import KIND_KEYED, Layout, encode_header, encode_meta, plan
from ..segment.lifecycle import Shared
from ..segment.segment import ATTACH_TIMEOUT, Reservation, Segment, column_views, generate_name
from ..writing.cast import coerce

DEFAULT_SPARE = 4


class KeyedRings(Shared):
    """``n_keys`` rings of entries in one shared segment; see the module docstring.

    Make one with ``create`` or ``attach``.  Pickling sends the name: the
    receiving process attaches and never unlinks.
    """

    KIND_NAME = "keyed rings"

    def __init__(self, segment: Segment, layout: Layout, meta: dict):
        self._layout = layout
        self._meta = meta
        self.n_keys, self.ring_len = layout.n_chunks, layout.chunk_size
        self.max_len = int(meta["max_len"])
        self._words = KeyWords(segment.mmap, layout, self.max_len, segment.name)
        self._views = column_views(segment, layout, layout.user_columns)
        self._open(segment)

    @classmethod
    def attach(cls, name: str, *, timeout: float = ATTACH_TIMEOUT, own: bool = False,
               handle_signals: bool | None = None) -> "KeyedRings":
        """``keyed.attach``; what a pickled copy calls."""
        return attach(name, timeout=timeout, own=own, handle_signals=handle_signals)

    # -- identity ---------------------------------------------------------------
    @property
    def spare(self) -> int:
        """Slots per ring beyond ``max_len`` (tolerance to appends during a read)."""
        return self.ring_len - self.max_len

    @property
    def spec(self) -> dict:
        """``{column: (per-entry shape, dtype)}``, as given to ``create``."""
        return {c.name: (c.shape, c.dtype) for c in self._layout.user_columns}

    @property
    def meta(self) -> dict:
        """The caller's JSON metadata given to ``create``."""
        return dict(self._meta.get("user", {}))

    @property
    def views(self) -> dict[str, np.ndarray]:
        """Zero-copy views ``{column: (n_keys, ring_len, *shape)}``; entry p is slot p % ring_len.

        Writers overwrite slots in place: copy what you keep.
        """
        self._check_open()
        return {k: v.reshape((self.n_keys, self.ring_len) + v.shape[1:])
                for k, v in self._views.items()}

    # -- indexes ----------------------------------------------------------------
    def _check_live(self) -> None:
        """Closed here, or by the owner (or ``shmbuf rm``) in another process: raise."""
        self._check_open()
        self._words.check_open()

    def _keys(self, keys, verb: str, distinct: bool) -> np.ndarray:
        self._check_live()
        if keys is None:
            return self._words.all
        arr = np.asarray(keys)
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
            raise TypeError(f"{verb}: keys must be a 1-d sequence of ints, got {keys!r}")
        arr = arr.astype(np.int64, copy=False)
        if arr.size and (arr.min() < 0 or arr.max() >= self.n_keys):
            bad = arr[(arr < 0) | (arr >= self.n_keys)][0]
            raise IndexError(f"{verb}: key {bad} is out of range for {self.n_keys} keys")
        if distinct and arr.size > 1 and np.unique(arr).size != arr.size:
            raise ValueError(f"{verb}: keys must be distinct, got {arr.tolist()}")
        return arr

    def bounds(self, keys=None) -> tuple[np.ndarray, np.ndarray]:
        """``(start, count)`` per key: live positions are ``start <= p < count``.

        ``start`` may exceed ``count`` for a key reset after its count was read.
        """
        keys = self._keys(keys, "bounds", False)
        return self._words.bounds(keys)

    def bounds_of(self, key: int) -> tuple[int, int]:
        """``bounds`` of one key, as ints (cheaper than the array form)."""
        self._check_live()
        if isinstance(key, bool) or not isinstance(key, (int, np.integer)) \
                or not 0 <= key < self.n_keys:
            raise IndexError(f"bounds_of: key {key!r} is not an int in [0, {self.n_keys})")
        return self._words.bounds_of(int(key))

    def counts(self, keys=None) -> np.ndarray:
        """Entries ever appended per key (monotonic; resets do not lower it)."""
        keys = self._keys(keys, "counts", False)
        return self._words.counts(keys)

    def lengths(self, keys=None) -> np.ndarray:
        """Live entries per key, at most ``max_len``."""
        start, count = self.bounds(keys)
        return np.maximum(count - start, 0)

    # -- writing ----------------------------------------------------------------
    def _coerce(self, rows, n: int) -> list:
        if not isinstance(rows, dict) or rows.keys() != self._views.keys():
            got = sorted(rows) if isinstance(rows, dict) else type(rows).__name__
            raise KeyError(f"append: rows must be a dict with exactly the columns "
                           f"{sorted(self._views)}, got {got}")
        out = []
        for name, (shape, dtype) in self.spec.items():
            v = rows[name]
            if not (type(v) is np.ndarray and v.dtype == dtype and v.shape == (n,) + shape):
                v = coerce(f"append(rows[{name!r}])", v, dtype, (n,) + shape)
            out.append((self._views[name], v))
        return out

    def append(self, keys, rows: dict) -> None:
        """Append one entry to each of ``keys`` (distinct), row ``i`` to ``keys[i]``.

        Args:
            keys: 1-d ints in ``[0, n_keys)``, no duplicates.
            rows: ``{column: array (len(keys), *shape)}``, every column of the
                spec, each losslessly castable to its dtype.

        Raises:
            KeyError / ValueError / TypeError / IndexError: a bad key, column,
                shape or dtype; nothing is written.
            BufferClosedError: closed, here or by the owner in another process.

        Example:
            >>> rings.append([0, 3], {"x": np.zeros((2, 4), np.float32)})
        """
        keys = self._keys(keys, "append", True)
        values = self._coerce(rows, len(keys))
        def write(rows):
            for view, value in values:
                view[rows] = value

        if len(keys):
            self._words.append(keys, write)

    def reset(self, keys=None) -> None:
        """Forget every entry of ``keys`` (all if None); counts keep counting.

        Example:
            >>> rings.reset([2])
        """
        keys = self._keys(keys, "reset", False)
        self._words.reset(keys)

    # -- reading ----------------------------------------------------------------
    def read(self, keys, select, columns: dict | None = None
             ) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """Copy selected entries of ``keys`` out, validated against concurrent appends.

        Args:
            keys: 1-d ints in ``[0, n_keys)``; duplicates allowed; None: all.
            select: ``select(lengths) -> ages``, an ``(len(lengths), m)`` int
                array, called with the live entry count of each key of a
                snapshot; age 0 is the newest entry.  Ages outside
                ``[0, length)`` give zero rows.  ``m`` must not depend on
                ``lengths``.
            columns: ``{column: slice}``: which of the ``m`` ages each column
                reads; default every column, every age.

        Returns:
            ``({column: array (len(keys), len(slice), *shape)}, lengths)``;
            each row's entries are those its ``lengths`` entry was computed from.

        Raises:
            SampleRetryError: appends lapped a key's ring on every one of
                ``protocol.keyed.MAX_ATTEMPTS`` tries (the ring is too short for
                the ingest rate).

        Example:
            >>> out, n = rings.read(None, lambda L: np.zeros((len(L), 1), int))  # newest
        """
        keys = self._keys(keys, "read", False)
        if columns is None:
            columns = dict.fromkeys(self._views, slice(None))
        for name, part in columns.items():
            if name not in self._views:
                raise KeyError(f"read: columns names {name!r}, which is not one of "
                               f"{sorted(self._views)}")
            if not isinstance(part, slice) or part.step not in (None, 1):
                raise TypeError(f"read: columns[{name!r}] must be a slice of the ages with "
                                f"step 1, got {part!r}")
        return self._words.read(keys, select, [(name, self._views[name], part)
                                               for name, part in columns.items()])

    # -- checkpoints ------------------------------------------------------------
    def snapshot(self, keys=None) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Copies of the live entries of ``keys`` (all if None): ``(lengths, {column: entries})``.

        ``entries`` concatenates the keys' entries in the order of ``keys``
        (key 0 first by default), each key oldest first; ``lengths[i]`` says
        how many belong to ``keys[i]``.  Each key's entries are validated
        against concurrent appends, as ``read``'s.

        Example:
            >>> lengths, entries = rings.snapshot()
        """
        arrays, lengths = self.read(
            keys, lambda lens: lens[:, None] - 1 - np.arange(self.max_len))
        live = np.arange(self.max_len) < lengths[:, None]
        return lengths, {name: arr[live] for name, arr in arrays.items()}

    def restore(self, lengths, entries: dict) -> None:
        """Reset every key, then append ``snapshot()``-style entries, in order.

        A key with more than ``max_len`` entries keeps its newest.  Restore
        while nobody appends.

        Raises:
            ValueError / KeyError / TypeError: lengths or entries that do not
                fit the keys and columns; nothing is changed.
        """
        lengths = np.asarray(lengths, np.int64)
        if lengths.shape != (self.n_keys,) or (lengths < 0).any():
            raise ValueError(f"restore: expected {self.n_keys} non-negative lengths, "
                             f"got {lengths.tolist()}")
        total = int(lengths.sum())
        values = [value for _, value in self._coerce(entries, total)]  # checked before any change
        kept = np.minimum(lengths, self.max_len)
        first = np.cumsum(lengths) - kept
        self.reset(None)
        for t in range(int(kept.max(initial=0))):
            keys = np.flatnonzero(kept > t)
            at = first[keys] + t
            self.append(keys, {name: value[at] for name, value in zip(self.spec, values)})

    # -- lifecycle --------------------------------------------------------------
    def _closed_mark(self):
        words = getattr(self, "_words", None)
        return None if words is None else words.mark

    def _release(self) -> None:
        _signals.forget(self)
        # Closed: every method raises before it reads them, and the mapping can go.
        self._views = self._words = None  # type: ignore[assignment]

    def __repr__(self):
        state = "closed" if self._closed else f"n_keys={self.n_keys} max_len={self.max_len}"
        return f"<shmbuf.KeyedRings {self._name!r} {state}{' owner' if self.owner else ''}>"


def create(spec: dict, n_keys: int, max_len: int, *, spare: int = DEFAULT_SPARE,
           name: str | None = None, meta: dict | None = None, prefault: bool = True,
           reservation: Reservation | None = None) -> KeyedRings:
    """Create keyed rings in a new segment; the caller owns (and finally unlinks) it.

    Args:
        spec: ``{column: (per-entry shape, numpy dtype)}``.
        n_keys: number of keys (rings).
        max_len: newest entries each key keeps.
        spare: extra slots per ring, >= 1; a read of a whole window survives
            ``spare - 1`` appends to that key during its copy.
        name: segment name; generated if None.
        meta: small JSON-serialisable dict kept in the header (``.meta``).
        prefault: map every page now.
        reservation: a name taken earlier (``segment.segment.Reservation``) to size
            instead of creating one; ``name`` is then ignored.

    Raises:
        ValueError / TypeError: a bad argument, before any system call.
        SegmentExistsError / SharedMemoryFullError: as ``shmbuf.create``.

    Example:
        >>> rings = create({"x": ((4,), np.float32)}, n_keys=16, max_len=100)
    """
    n_keys = check_int("n_keys", n_keys)
    max_len = check_int("max_len", max_len)
    spare = check_int("spare", spare)
    ring_len = max_len + spare
    raw_meta = encode_meta({"max_len": max_len, "user": meta if meta is not None else {}})
    layout = plan(spec, n_keys * ring_len, chunk_size=ring_len, max_writers=1, done_key=None,
                  episode_slots=1, meta_bytes=len(raw_meta))
    if reservation is None:
        segment = Segment.create(generate_name() if name is None else name,
                                 layout.total_bytes, populate=prefault)
    else:
        segment = reservation.allocate(layout.total_bytes, populate=prefault)
    try:
        segment.write_meta(layout, raw_meta)
        segment.publish(encode_header(layout, os.getpid(), my_start_time(), time.time_ns(),
                                      KIND_KEYED, raw_meta))
        return KeyedRings(segment, layout, json.loads(raw_meta))
    except BaseException:
        segment.unlink()
        segment.close()
        raise


def open_segment(segment: Segment, layout: Layout, owner: dict, *, own: bool = False,
                 handle_signals: bool | None = None, made_by: str | None = None) -> KeyedRings:
    """Keyed rings over an attached ``segment`` whose header was decoded as ``(layout, owner)``.

    Refuses rings their owner closed; with ``own``, adopts them first (see
    ``attach``).  ``made_by``: refuse, before adopting, rings whose meta
    names another ``facade``.  Closes ``segment`` and raises on any refusal.
    """
    try:
        meta = owner["meta"]
        max_len = meta.get("max_len")
        if (owner["kind"] != KIND_KEYED or not isinstance(max_len, int)
                or not 1 <= max_len < layout.chunk_size
                or layout.capacity != layout.n_chunks * layout.chunk_size):
            raise CorruptSegmentError(f"segment {segment.name!r} has an inconsistent keyed "
                                      f"layout (max_len {max_len!r}, ring {layout.chunk_size})")
        theirs = meta.get("user", {}).get("facade")
        if made_by is not None and theirs != made_by:
            raise CorruptSegmentError(f"segment {segment.name!r} holds keyed rings that were "
                                      f"not made by a {made_by} (made by "
                                      f"{theirs or 'keyed.create'})")
        segment.admit(own)
        rings = KeyedRings(segment, layout, meta)
    except BaseException:
        segment.close()
        raise
    return _signals.watch_or_close(rings, handle_signals) if own else rings


def attach(name: str, *, timeout: float = ATTACH_TIMEOUT, own: bool = False,
           handle_signals: bool | None = None, made_by: str | None = None) -> KeyedRings:
    """Attach to existing keyed rings by name; the result never unlinks them, unless ``own``.

    Waits up to ``timeout`` seconds for a creator that is still writing the
    header (its name exists before its header does).

    Args:
        own: take the rings over from an owner that died (SIGKILL, a crash):
            this process becomes the owner, unlinks them at close and answers
            for SIGTERM (``handle_signals`` as in ``shmbuf.create``).  The
            entries and the workers attached before the crash carry on.  One
            compare-and-swap on the header's owner record decides, so of two
            rivals exactly one wins.
        made_by: refuse (CorruptSegmentError, before adopting anything) rings
            whose ``meta`` names another ``facade``.

    Raises:
        SegmentNotFoundError: no segment has that name.
        CorruptSegmentError: it is not keyed rings (or never got a header).
        BufferClosedError: their owner closed them (they are being removed).
        OwnerAliveError: ``own=True`` and the recorded owner is alive (the
            message names its pid), or a rival took them over first.

    Example:
        >>> rings = attach("shmbuf-1a2b3c4d5e6f")
        >>> rings = attach("shmbuf-1a2b3c4d5e6f", own=True)  # after the owner crashed
    """
    _signals.check(handle_signals)
    return _attached(Segment.attach(name), timeout, own=own, handle_signals=handle_signals,
                     made_by=made_by)


def attach_if_published(name: str, made_by: str | None = None) -> KeyedRings | None:
    """``attach`` without waiting: None while the creator has not published the header.

    Raises SegmentNotFoundError (the name is gone), CorruptSegmentError and
    BufferClosedError as ``attach``.
    """
    segment = Segment.attach(name)
    if not segment.published():
        segment.close()
        return None
    return _attached(segment, ATTACH_TIMEOUT, made_by=made_by)


def _attached(segment: Segment, timeout: float, **options) -> KeyedRings:
    try:
        layout, owner = segment.header(KIND_KEYED, timeout)
    except BaseException:
        segment.close()
        raise
    return open_segment(segment, layout, owner, **options)
