"""Every reach below shmbuf's public API that the TorchRL facade needs, in one place.

TorchRL names a step by its storage index (a row), so the facade must know
which rows a writer's ``extend`` filled and which step ids rows hold;
shmbuf's public API speaks step ids only through sampling.  Each function
here is one such need, kept small so that a public door can replace it:

- ``append_rows``: ``Writer.extend`` that also says which rows it wrote
  (reads ``Writer._room()`` and the stream cursor ``Writer._solo``);
- ``ids_of_rows``: the step ids of rows (``Buffer._parts.ring.prio().ids``);
- ``rows_of_ids``: the rows step ids name (the ring's id numbering,
  ``ticket * chunk_size + offset``);
- ``remove_segment``: remove a segment another process created and kept
  (``shmbuf.segment.segment.unlink``, as ``shmbuf rm --force``).

(The registry's way in, ``Buffer._open_segment``, is the one every facade uses.)
"""
from __future__ import annotations

import numpy as np

from ...segment import segment as _segment


def append_rows(writer, columns: dict, n: int) -> np.ndarray:
    """``writer.extend(**columns)`` (a run of ``n`` steps), returning the rows it filled.

    The run is written in pieces that each fit the stream's current chunk,
    so each piece's rows are the ones just before the chunk's fill mark.
    """
    rows = np.empty(n, np.int64)
    at = 0
    while at < n:
        room = writer._room()
        k = 1 if room == 0 else min(room, n - at)
        writer.extend(**{c: v[at:at + k] for c, v in columns.items()})
        s = writer._solo
        end = int(s.base[0] + s.fill[0])
        rows[at:at + k] = np.arange(end - k, end)
        at += k
    return rows


def ids_of_rows(buffer, rows: np.ndarray) -> np.ndarray:
    """The step ids of the steps the rows hold now (a stale one is refused by its user)."""
    rows = np.ascontiguousarray(rows, np.int64)
    return buffer._parts.ring.prio().ids(rows)


def rows_of_ids(buffer, ids: np.ndarray) -> np.ndarray:
    """The rows that step ids name (ticket * chunk_size + offset, the ring's numbering)."""
    k = buffer.chunk_size
    n_chunks = -(-buffer.capacity // k)
    return ids // k % n_chunks * k + ids % k


def remove_segment(name: str) -> None:
    """Mark segment ``name`` closed and remove it, whoever created it (quiet if it is gone).

    A data segment that a worker created (and ``keep()``s) is removed by the
    storage's constructing process, as ``shmbuf rm --force`` would.
    """
    try:
        _segment.unlink(name)
    except FileNotFoundError:
        pass
