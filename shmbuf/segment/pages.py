"""Mapping a chunk's pages into this process before its first write here.

A prefaulting owner maps everything at create; an attached writer would
otherwise take a minor fault per page on its first pass over the ring.  One
madvise per column instead of one fault per page, once per chunk: the pages
stay mapped in this process after that.
"""
from __future__ import annotations

import numpy as np

from ..protocol.layout import PAGE, Layout

MADV_POPULATE_WRITE = 23  # Linux >= 5.14; not among Python 3.11's mmap constants


class ChunkPages:
    """Which chunks of one mapping this process has populated."""

    def __init__(self, mm, layout: Layout, mapped: bool):
        self._mm, self._layout = mm, layout
        # None: everything is mapped already (the owner prefaulted).
        self._unmapped = None if mapped else np.ones(layout.n_chunks, np.bool_)

    def populate(self, chunk: int) -> None:
        """Map ``chunk``'s rows of every column, unless done before in this process."""
        if self._unmapped is None or not self._unmapped[chunk]:
            return
        self._unmapped[chunk] = False
        lay = self._layout
        first = chunk * lay.chunk_size
        rows = min(lay.chunk_size, lay.capacity - first)
        for col in lay.columns:
            start = col.offset + first * col.row_bytes
            aligned = start - start % PAGE
            try:
                self._mm.madvise(MADV_POPULATE_WRITE, aligned,
                                 start + rows * col.row_bytes - aligned)
            except OSError:
                self._unmapped = None  # kernels before 5.14: pages fault in as written
                return
