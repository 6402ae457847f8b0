"""The keyed-ring protocol: the one owner of keyed rings' shared words.

Keyed rings (``keyed.py``) lay ``n_keys`` rings of ``ring_len`` slots out
as a step store with ``capacity = n_keys * ring_len`` and ``chunk_size =
ring_len``: key ``k`` owns chunk ``k``'s rows.  Two words of chunk ``k``'s
entry in the chunk table are its key's state; every load and store of them
is in this file:

  count  entries ever appended to key k (monotonic); entry p lives in slot p % ring_len
  next   first live position after the last reset (0 until then)

Entry ``p`` of key ``k`` is live iff ``max(next, count - max_len) <= p < count``.
Chunk ``state`` words, writer slots, counters, the episode index and the
``_ep`` column are unused.

Protocol, a seqlock on the monotonic ``count``:

- ``append(keys, write)``: one release fence, then the row data at slot
  ``count % ring_len`` of each key (``write``), then ``count + 1`` for all
  keys with ``store_many`` (a release fence and relaxed stores).  The first
  fence orders the previous append's count before this append's data, so a
  reader that sees any byte of entry ``c`` also sees a count of at least ``c``.
- ``read(keys, select, columns)``: load the counts (relaxed loads + acquire
  fence), then the ``next`` words, then in C (``_atomic.keyed_take``, without
  the GIL) copy the rows of the ages ``select`` picks, acquire fence, load the
  counts again (``after``).  Position ``q`` is intact iff
  ``q >= after - ring_len + 1``: the writer of position ``after`` may be
  clobbering position ``after - ring_len`` right now.  Keys that fail are
  copied again from a fresh snapshot, a bounded number of times.  With
  ``spare = ring_len - max_len`` slots, a read of the whole window survives
  ``spare - 1`` appends to the same key during its copy.
- ``reset(keys)``: raise ``next`` to the current ``count`` with a CAS loop
  (``next`` never goes back, so concurrent resets compose).

One writer per key at a time: two processes appending to the same key at
once would write the same slot and publish the same count.  Any number of
processes may read, and reset is safe against a concurrent append.

The closed mark (the header's closed word, set by every unlink through
``header.mark_closed``): ``check_open`` is one relaxed load, made by
``KeyedRings`` on every call, so a worker whose owner closed the rings
stops with BufferClosedError instead of writing on into unlinked memory.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from .._errors import SampleRetryError
from . import _atomic as atomic
from . import cells
from .header import ClosedMark
from .layout import CHUNK_ENTRY, CHUNK_FIELDS, Layout

MAX_ATTEMPTS = 100

# select(lengths) -> ages: an (E, m) int array, age 0 being each key's newest entry
Select = Callable[[np.ndarray], np.ndarray]
# (name, the column's (capacity, ...) view, which of the m ages it reads)
Column = tuple[str, np.ndarray, slice]


class KeyWords:
    """The ``count`` and ``next`` words of every key of one mapping.

    ``keys`` arguments are int64 arrays of valid keys (the caller checks
    them), or ``self.all`` itself, which skips the fancy indexing.
    """

    def __init__(self, mm, layout: Layout, max_len: int, name: str):
        self._mm = mm
        self.n_keys, self.ring_len, self.max_len = layout.n_chunks, layout.chunk_size, max_len
        self._name = name
        self._label = f"keyed rings {name!r}"
        self.mark = ClosedMark(mm, name)   # this handle's: see header.ClosedMark
        self.check_open = self.mark.check   # check_open(): see header.ClosedMark
        self.all = np.arange(self.n_keys, dtype=np.int64)
        base = layout.chunks_offset + self.all * CHUNK_ENTRY
        self._count = base + CHUNK_FIELDS["count"]
        self._next = base + CHUNK_FIELDS["next"]
        self._first_row = self.all * self.ring_len   # each key's ring starts at this row

    def _load(self, table: np.ndarray, keys: np.ndarray) -> np.ndarray:
        offsets = table if keys is self.all else table[keys]
        out = np.empty(len(offsets), np.int64)
        atomic.load_many(self._mm, offsets, out)
        return out

    def counts(self, keys: np.ndarray) -> np.ndarray:
        """Entries ever appended per key."""
        return self._load(self._count, keys)

    def bounds(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(start, count)`` per key; ``start`` may exceed ``count`` after a racing reset."""
        counts = self._load(self._count, keys)
        nexts = self._load(self._next, keys)  # after the counts' fence
        return np.maximum(nexts, counts - self.max_len), counts

    def bounds_of(self, key: int) -> tuple[int, int]:
        """``bounds`` of one key, as ints."""
        count = atomic.load_acquire(self._mm, int(self._count[key]))
        nxt = atomic.load_acquire(self._mm, int(self._next[key]))
        return max(nxt, count - self.max_len), count

    def append(self, keys: np.ndarray, write: Callable[[np.ndarray], None]) -> None:
        """Publish one entry per (distinct) key; ``write(rows)`` stores them first.

        ``rows[i]`` is the physical row (``key * ring_len + slot``) of key
        ``keys[i]``'s new entry.  One writer per key at a time.
        """
        offsets = self._count[keys]
        counts = np.empty(len(offsets), np.int64)
        atomic.load_many(self._mm, offsets, counts)
        # Order the previous append's published count before this one's data.
        atomic.fence_release()
        write(keys * self.ring_len + counts % self.ring_len)
        atomic.store_many(self._mm, offsets, counts + 1)

    def reset(self, keys: np.ndarray) -> None:
        """Forget every entry of ``keys``: raise ``next`` to ``count``, never lowering it."""
        for key in keys.tolist():
            count = cells.load(self._mm, int(self._count[key]))
            cells.raise_to(self._mm, int(self._next[key]), count)

    def read(self, keys: np.ndarray, select: Select,
             columns: list[Column]) -> tuple[dict, np.ndarray]:
        """Copies of ``keys``' entries, validated against concurrent appends.

        ``select(lengths)`` gets the live entry count of each key of a
        snapshot and returns the ages to copy, an ``(E, m)`` int array (age 0
        is the newest entry; ages outside ``[0, length)`` give zero rows).
        Each column copies the ages of its slice.  Returns ``({name: array
        (len(keys), len(slice), ...)}, lengths)``, each row copied from the
        snapshot its ``lengths`` entry describes.

        Raises:
            SampleRetryError: appends lapped a key on each of ``MAX_ATTEMPTS`` tries.
        """
        sub, pending = keys, None
        for _ in range(MAX_ATTEMPTS):
            start, count = self.bounds(sub)
            lengths = count - start
            np.maximum(lengths, 0, out=lengths)
            ages = np.ascontiguousarray(select(lengths), np.int64)
            got, parts = {}, []
            for name, view, part in columns:
                lo, hi, _ = part.indices(ages.shape[1])
                dest = got[name] = np.empty((len(sub), max(0, hi - lo)) + view.shape[1:],
                                            view.dtype)
                parts.append((view, lo, max(lo, hi), dest))
            stale = np.zeros(len(sub), np.bool_)
            if len(sub):
                every = sub is self.all
                atomic.keyed_take(self._mm, self._count if every else self._count[sub],
                                  self._first_row if every else self._first_row[sub],
                                  count, lengths, ages, self.ring_len, tuple(parts), stale)
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
            f"{self._label}: writers lapped the rings of keys {sorted(set(sub.tolist()))} "
            f"during {MAX_ATTEMPTS} reads in a row; give them more spare slots "
            f"(spare={self.ring_len - self.max_len}) or read fewer entries")
