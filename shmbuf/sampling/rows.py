"""Columns at given rows of located windows, decoded where a chunk is packed.

``Buffer``'s samplers gather into their output targets themselves
(``sampling.gather``); a facade that keeps its own index of windows (its
episodes, its clips) reads the rows it picked with ``take_rows`` instead of
indexing the column views, which would read a packed chunk's given-back
pages as zeros.  As every read, it is followed by the caller's seq re-check
(``WindowFinder.still_valid`` on the same windows): a row whose chunk was
recycled meanwhile comes back zero, and only that re-check tells.
``read_rows`` is that whole loop for rows named one by one (an index-addressed
storage's ``storage[index]``): locate, copy, re-check, read again.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .._errors import SampleRetryError

if TYPE_CHECKING:  # annotations only
    from .unpack import Unpacker

# Windows per pass: the packed read's flags cost a few (B, L, H) temporaries, so a read
# of a whole column (millions of rows) goes in pieces of about this many rows.
PIECE_ROWS = 1 << 16
MAX_REREADS = 64   # reads of one row whose chunk writers keep recycling under the copy


def take_rows(unpack: Unpacker | None, views: dict[str, np.ndarray], columns,
              rows: np.ndarray, chunks: np.ndarray, seqs: np.ndarray) -> dict[str, np.ndarray]:
    """``{column: views[column][rows]}``, copied, with packed rows decoded.

    Args:
        unpack: the buffer's reader of packed rows (``StorePort.unpacker``), None
            unless it compresses.
        views: the buffer's column views (``StorePort.views``).
        columns: the column names to read.
        rows: ``(B, L)`` int64 physical rows, window after window.
        chunks: ``(B, H)`` the chunks each window's rows lie in (its hops
            when it was located), as ``Windows`` holds.
        seqs: ``(B, H)`` those chunks' seqs then, as ``Windows`` holds.

    Returns:
        ``{column: (B, L, *shape)}`` arrays of the column's dtype.  Rows of a
        chunk recycled since its window was located may read as zeros or as
        newer data: re-check the windows' seqs after the copy and drop those
        that changed.

    Example:
        >>> got = take_rows(port.unpacker, port.views, ["obs"], w.rows, w.chunks, w.seqs)
        >>> ok = port.still_valid(w)   # after the copy
    """
    if unpack is None:
        return {c: np.take(views[c], rows, axis=0) for c in columns}
    b, length = rows.shape
    out = {c: np.empty((b, length) + views[c].shape[1:], views[c].dtype) for c in columns}
    step = max(1, PIECE_ROWS // max(1, length))
    for a in range(0, b, step):
        part = slice(a, min(b, a + step))
        idx = rows[part]
        with unpack.reading():   # no raw page this copies is punched meanwhile
            flags = unpack.flags(idx, chunks[part], seqs[part])
            for c in columns:
                unpack.take(c, views[c], idx, flags, out=out[c][part])
    return out


def read_rows(port, columns, rows: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """``{column: (n, *shape)}`` at ``rows``, each row whole, and which rows held a step.

    Each row that holds a committed step is read as one window of one step
    (``port.locate``), copied with packed rows decoded (``port.take_rows``)
    and re-checked (``port.still_valid``); a row whose chunk a writer recycled
    during the copy is located and read again, so it comes back as the step it
    holds at that second read, never torn.  A row that holds no step when it
    is located (never written, or in a chunk a writer is refilling) reads as
    zeros and is False in the mask.

    Args:
        port: the buffer's ``StorePort``.
        columns: the column names to read.
        rows: ``(n,)`` int64 physical rows, sorted and distinct.

    Returns:
        ``(columns, held)``: arrays of each column's dtype, and ``(n,)`` bool.

    Raises:
        SampleRetryError: writers recycled a row's chunk during each of
            ``MAX_REREADS`` reads in a row.

    Example:
        >>> got, held = read_rows(buf.port, ["obs"], np.array([3, 9]))
    """
    views = port.views
    out = {c: np.zeros((len(rows),) + views[c].shape[1:], views[c].dtype) for c in columns}
    held = np.zeros(len(rows), np.bool_)
    todo = np.arange(len(rows))
    for _ in range(MAX_REREADS):
        if not len(todo):
            return out, held
        wanted = rows[todo]
        windows = port.locate(wanted, 1)
        # locate keeps the order of its candidates: the rows are sorted, so each found
        # window's row maps back to its one place.
        at = todo[np.searchsorted(wanted, windows.rows[:, 0])]
        got = port.take_rows(columns, windows.rows, windows.chunks, windows.seqs)
        fresh = port.still_valid(windows)
        for c in columns:
            out[c][at[fresh]] = got[c][fresh, 0]
        held[at] = fresh
        todo = at[~fresh]
    if not len(todo):
        return out, held
    raise SampleRetryError(
        f"writers recycled the chunks of rows {rows[todo][:8].tolist()} during each of "
        f"{MAX_REREADS} reads in a row; the buffer (capacity {port.capacity}) is too small "
        "for its ingest rate")
