"""Keyed rings: a fixed set of keys, each keeping its own newest entries.

The step store evicts globally (the oldest chunk goes first, whoever wrote
it).  Per-env history needs the opposite: env 3 keeps its last ``max_len``
entries however fast env 5 appends.  Keyed rings give that with the same
segment, header and column machinery, laid out by ``_layout.plan`` with
``capacity = n_keys * ring_len`` and ``chunk_size = ring_len``: key ``k``
owns chunk ``k``'s rows as a ring of ``ring_len = max_len + spare`` slots.
The header's ``kind`` is ``KIND_KEYED`` and its JSON metadata holds
``max_len``.  The chunk table's words are reused per key:

  count  entries ever appended to key k (monotonic); entry p lives in slot p % ring_len
  next   first live position after the last reset (0 until then)

Entry ``p`` of key ``k`` is live iff ``max(next, count - max_len) <= p < count``.
Chunk ``state`` words, writer slots, counters and the ``_ep`` column are unused.

Protocol, a seqlock on the monotonic ``count``:

- ``append(keys, rows)``: one release fence, then the row data at slot
  ``count % ring_len`` of each key, then ``count + 1`` for all keys with
  ``store_many`` (a release fence and relaxed stores).  The first fence
  orders the previous append's count before this append's data, so a reader
  that sees any byte of entry ``c`` also sees a count of at least ``c``.
- ``read(keys, select)``: load the counts (relaxed loads + acquire fence),
  then the ``next`` words, gather the selected rows, acquire fence, load the
  counts again (``after``).  Position ``q`` is intact iff
  ``q >= after - ring_len + 1``: the writer of position ``after`` may be
  clobbering position ``after - ring_len`` right now.  Keys that fail are
  re-read from a fresh snapshot, a bounded number of times.  With ``spare``
  slots beyond ``max_len``, a read of the whole window survives ``spare - 1``
  appends to the same key during its copy.
- ``reset(keys)``: raise ``next`` to the current ``count`` with a CAS loop
  (``next`` never goes back, so concurrent resets compose).

One writer per key at a time: two processes appending to the same key at
once would write the same slot and publish the same count.  Any number of
processes may read, and reset is safe against a concurrent append.
"""
from __future__ import annotations

import json
import os
import time

import numpy as np

from . import _atomic as atomic
from ._errors import CorruptSegmentError, SampleRetryError
from ._args import check_int
from ._cast import coerce
from ._layout import (CHUNK_ENTRY, CHUNK_FIELDS, COLUMN_TABLE, KIND_KEYED, MAGIC, Layout,
                      encode_header, encode_meta, plan)
from ._procs import my_start_time
from ._segment import Mapped, Segment, column_views, generate_name, validate_name

DEFAULT_SPARE = 4
MAX_ATTEMPTS = 100
_NOT_STALE = np.iinfo(np.int64).max


class KeyedRings(Mapped):
    """``n_keys`` rings of entries in one shared segment; see the module docstring.

    Make one with ``create`` or ``attach``.  Pickling sends the name: the
    receiving process attaches and never unlinks.
    """

    KIND_NAME = "keyed rings"

    def __init__(self, segment: Segment, layout: Layout, meta: dict):
        self._layout = layout
        self._meta = meta
        self._mm = segment.mmap
        self.n_keys, self.ring_len = layout.n_chunks, layout.chunk_size
        self.max_len = int(meta["max_len"])
        base = layout.chunks_offset + np.arange(self.n_keys, dtype=np.int64) * CHUNK_ENTRY
        self._count_off = base + CHUNK_FIELDS["count"]
        self._next_off = base + CHUNK_FIELDS["next"]
        self._views = column_views(segment, layout, layout.user_columns)
        self._all = np.arange(self.n_keys, dtype=np.int64)
        self._base = self._all * self.ring_len  # first row of each key's ring
        self._open(segment)

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
    def _keys(self, keys, verb: str, distinct: bool) -> np.ndarray:
        if keys is None:
            return self._all
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

    def _load(self, offsets: np.ndarray) -> np.ndarray:
        out = np.empty(len(offsets), np.int64)
        atomic.load_many(self._mm, offsets, out)
        return out

    def _offsets(self, table: np.ndarray, keys: np.ndarray) -> np.ndarray:
        return table if keys is self._all else table[keys]

    def _snapshot(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        counts = self._load(self._offsets(self._count_off, keys))
        nexts = self._load(self._offsets(self._next_off, keys))  # after the counts' fence
        return np.maximum(nexts, counts - self.max_len), counts

    def bounds(self, keys=None) -> tuple[np.ndarray, np.ndarray]:
        """``(start, count)`` per key: live positions are ``start <= p < count``.

        ``start`` may exceed ``count`` for a key reset after its count was read.
        """
        self._check_open()
        return self._snapshot(self._keys(keys, "bounds", False))

    def bounds_of(self, key: int) -> tuple[int, int]:
        """``bounds`` of one key, as ints (cheaper than the array form)."""
        self._check_open()
        if isinstance(key, bool) or not isinstance(key, (int, np.integer)) \
                or not 0 <= key < self.n_keys:
            raise IndexError(f"bounds_of: key {key!r} is not an int in [0, {self.n_keys})")
        count = atomic.load_acquire(self._mm, int(self._count_off[key]))
        nxt = atomic.load_acquire(self._mm, int(self._next_off[key]))
        return max(nxt, count - self.max_len), count

    def counts(self, keys=None) -> np.ndarray:
        """Entries ever appended per key (monotonic; resets do not lower it)."""
        self._check_open()
        return self._load(self._count_off[self._keys(keys, "counts", False)])

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
            BufferClosedError: closed.

        Example:
            >>> rings.append([0, 3], {"x": np.zeros((2, 4), np.float32)})
        """
        self._check_open()
        keys = self._keys(keys, "append", True)
        values = self._coerce(rows, len(keys))
        if not len(keys):
            return
        offsets = self._count_off[keys]
        counts = self._load(offsets)
        # Order the previous append's published count before this one's data.
        atomic.fence_release()
        rows_at = keys * self.ring_len + counts % self.ring_len
        for view, value in values:
            view[rows_at] = value
        atomic.store_many(self._mm, offsets, counts + 1)

    def reset(self, keys=None) -> None:
        """Forget every entry of ``keys`` (all if None); counts keep counting.

        Example:
            >>> rings.reset([2])
        """
        self._check_open()
        for key in self._keys(keys, "reset", False).tolist():
            next_off, count_off = int(self._next_off[key]), int(self._count_off[key])
            while True:
                old = atomic.load_acquire(self._mm, next_off)
                count = atomic.load_acquire(self._mm, count_off)
                if count <= old or atomic.compare_exchange(self._mm, next_off, old, count):
                    break

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
                ``MAX_ATTEMPTS`` tries (the ring is too short for the ingest rate).

        Example:
            >>> out, n = rings.read(None, lambda L: np.zeros((len(L), 1), int))  # newest
        """
        self._check_open()
        keys = self._keys(keys, "read", False)
        if columns is None:
            columns = dict.fromkeys(self._views, slice(None))
        sub, pending = keys, None
        for _ in range(MAX_ATTEMPTS):
            start, count = self._snapshot(sub)
            lengths = count - start
            np.maximum(lengths, 0, out=lengths)
            got, oldest = self._gather(sub, count, lengths, select(lengths), columns)
            atomic.fence_acquire()  # the data reads above happen before the re-read below
            intact_from = self._load(self._offsets(self._count_off, sub)) - (self.ring_len - 1)
            stale = oldest < intact_from
            if pending is None:
                out, final = got, lengths
            else:
                ok = ~stale
                for name, arr in got.items():
                    out[name][pending[ok]] = arr[ok]
                final[pending[ok]] = lengths[ok]
            if not np.count_nonzero(stale):
                return out, final
            pending = np.flatnonzero(stale) if pending is None else pending[stale]
            sub = keys[pending]
        raise SampleRetryError(
            f"keyed rings {self.name!r}: writers lapped the rings of keys "
            f"{sorted(set(sub.tolist()))} during {MAX_ATTEMPTS} reads in a row; "
            f"give them more spare slots (spare={self.spare}) or read fewer entries")

    def _gather(self, keys, count, lengths, ages, columns: dict):
        """Take the rows of ``ages``; return them and each key's oldest position read."""
        age = np.ascontiguousarray(ages, np.int64)
        invalid = age.view(np.uint64) >= lengths.astype(np.uint64)[:, None]  # -1 wraps to huge
        pos = (count - 1)[:, None] - age
        if not np.count_nonzero(invalid):
            invalid = None
        if age.shape[1]:
            read = pos if invalid is None else np.where(invalid, _NOT_STALE, pos)
            oldest = np.minimum.reduce(read, axis=1)
        else:
            oldest = np.full(len(keys), _NOT_STALE, np.int64)
        rows = pos % self.ring_len  # in range even where invalid (zeroed below)
        rows += self._offsets(self._base, keys)[:, None]
        out = {}
        for name, part in columns.items():
            arr = self._views[name].take(rows[:, part], axis=0)
            if invalid is not None:
                arr[invalid[:, part]] = 0
            out[name] = arr
        return out, oldest

    # -- lifecycle --------------------------------------------------------------
    def _release(self) -> None:
        self._views = None

    def __reduce__(self):
        return attach, (self.name,)

    def __repr__(self):
        state = "closed" if self._closed else f"n_keys={self.n_keys} max_len={self.max_len}"
        return f"<shmbuf.KeyedRings {self._segment.name!r} {state}{' owner' if self.owner else ''}>"


def create(spec: dict, n_keys: int, max_len: int, *, spare: int = DEFAULT_SPARE,
           name: str | None = None, meta: dict | None = None,
           prefault: bool = True) -> KeyedRings:
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
    layout = plan(spec, n_keys * ring_len, chunk_size=ring_len, max_writers=1, done_key=None)
    raw_meta = encode_meta({"max_len": max_len, "user": meta if meta is not None else {}})
    name = generate_name() if name is None else validate_name(name)
    segment = Segment.create(name, layout.total_bytes, populate=prefault)
    try:
        header = bytearray(encode_header(layout, os.getpid(), my_start_time(), time.time_ns(),
                                         KIND_KEYED, raw_meta))
        header[:8] = bytes(8)  # magic last: attachers wait for a whole header
        segment.mmap[:len(header)] = header
        atomic.store_release(segment.mmap, 0, MAGIC)
        return KeyedRings(segment, layout, json.loads(raw_meta))
    except BaseException:
        segment.unlink()
        segment.close()
        raise


def _attach_once(name: str) -> KeyedRings | None:
    """Attach, or None while the creator has not finished the header."""
    segment = Segment.attach(name)
    try:
        mm = segment.mmap
        if mm is None or segment.size < COLUMN_TABLE or atomic.load_acquire(mm, 0) == 0:
            segment.close()
            return None
        layout, owner = segment.header(KIND_KEYED)
        meta = owner["meta"]
        max_len = meta.get("max_len")
        if (not isinstance(max_len, int) or not 1 <= max_len < layout.chunk_size
                or layout.capacity != layout.n_chunks * layout.chunk_size):
            raise CorruptSegmentError(f"segment {name!r} has an inconsistent keyed layout "
                                      f"(max_len {max_len!r}, ring {layout.chunk_size})")
        return KeyedRings(segment, layout, meta)
    except BaseException:
        segment.close()
        raise


def attach(name: str, *, timeout: float = 5.0) -> KeyedRings:
    """Attach to existing keyed rings by name; the result never unlinks them.

    Waits up to ``timeout`` seconds for a creator that is still writing the
    header (its name exists before its header does).

    Raises:
        SegmentNotFoundError: no segment has that name.
        CorruptSegmentError: it is not keyed rings (or never got a header).

    Example:
        >>> rings = attach("shmbuf-1a2b3c4d5e6f")
    """
    deadline = time.monotonic() + timeout
    pause = 1e-4
    while True:
        rings = _attach_once(name)
        if rings is not None:
            return rings
        if time.monotonic() >= deadline:
            raise CorruptSegmentError(f"segment {name!r} has no complete shmbuf header after "
                                      f"{timeout} s; is it a shmbuf buffer?")
        time.sleep(pause)
        pause = min(pause * 2, 0.02)
