"""Columns at given rows of located windows, decoded where a chunk is packed.

``Buffer``'s samplers gather into their output targets themselves
(``sampling.gather``); a facade that keeps its own index of windows (its
episodes, its clips) reads the rows it picked with ``take_rows`` instead of
indexing the column views, which would read a packed chunk's given-back
pages as zeros.  As every read, it is followed by the caller's seq re-check
(``WindowFinder.still_valid`` on the same windows): a row whose chunk was
recycled meanwhile comes back zero, and only that re-check tells.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # annotations only
    from .unpack import Unpacker

# Windows per pass: the packed read's flags cost a few (B, L, H) temporaries, so a read
# of a whole column (millions of rows) goes in pieces of about this many rows.
PIECE_ROWS = 1 << 16


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
