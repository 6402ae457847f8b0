"""HistoryBuffer output shaping: ring rows to the arrays ``get`` and ``get_view`` return.

A ``Layout`` is fixed by the schema, ``block_keys`` and ``action_block``:
it says which ages each column reads, reshapes the rows read into frames
(``(E, n*T, ...)``) and macro-blocks (``(E, n-1, ab*D)``, NaN zeroed), and
turns torch keys into tensors.
"""
from __future__ import annotations

import numpy as np

from ._strided import AgeTables


class Layout:
    """The output shapes of one HistoryBuffer schema."""

    def __init__(self, schema, block_keys: frozenset, action_block: int):
        self.schema, self.block_keys, self.action_block = schema, block_keys, action_block
        self.ages = AgeTables(action_block)
        self._part_cache: dict[int, dict] = {}
        self._frame_cols = [s for s in schema if s.key not in block_keys]
        self._block_cols = [s for s in schema if s.key in block_keys]
        self._width = {s.column: int(np.prod(s.shape, dtype=np.int64)) for s in schema}
        # frames with a time dim T > 1 at a stride > 1 are no single strided view
        self.long_steps = any(s.shape and s.shape[0] > 1 for s in self._frame_cols)

    def parts(self, n: int) -> dict:
        """Which ages of ``AgeTables.lookup(n)`` each column reads."""
        parts = self._part_cache.get(n)
        if parts is None:
            frames, blocks = slice(0, n), slice(n, None)
            parts = {s.column: frames for s in self._frame_cols}
            if n > 1:
                parts.update({s.column: blocks for s in self._block_cols})
            if len(self._part_cache) >= 16:
                self._part_cache.clear()
            self._part_cache[n] = parts
        return parts

    def assemble(self, n: int, arrays: dict, empty: bool = False) -> dict:
        """``get``'s output from the ``{column: rows}`` read by ``parts(n)``."""
        ab, out = self.action_block, {}
        for s in self.schema:
            block = s.key in self.block_keys
            if block and n == 1:
                continue
            if empty:
                arr = np.zeros((0, (n - 1) * ab if block else n) + s.shape, s.dtype)
            else:
                arr = arrays[s.column]
            if block:
                arr = arr.reshape(len(arr), n - 1, ab * self._width[s.column])
                if arr.dtype.kind in "fc":
                    nan = np.isnan(arr)
                    if np.count_nonzero(nan):
                        arr[nan] = 0
            elif s.shape:
                arr = arr.reshape((len(arr), n * s.shape[0]) + s.shape[1:])
            if arr.dtype.kind in "US":
                arr = arr.astype((arr.dtype.type, _longest(arr)))   # upstream's width
            out[s.key] = to_output(s, arr)
        return out

    def view(self, ring_views: dict, env: int, n: int, first: int, last: int) -> dict:
        """``get_view``'s output: views of ``env``'s ring slots ``first..last``."""
        ab, out = self.action_block, {}
        for s in self.schema:
            ring = ring_views[s.column][env]
            if s.key not in self.block_keys:
                arr = ring[first:last + 1:ab]
                arr = arr.reshape((n * s.shape[0],) + s.shape[1:]) if s.shape else arr
            elif n > 1:
                arr = ring[first + 1:last + 1].reshape(n - 1, ab * self._width[s.column])
            else:
                continue
            out[s.key] = to_output(s, arr, move=False)
        return out


def _longest(arr: np.ndarray) -> int:
    """Characters (or bytes) of the longest string in ``arr``, at least 1, as ``np.stack``'s."""
    return max(1, int(np.char.str_len(arr).max(initial=0)))


def to_output(s, arr, move: bool = True):
    if not s.torch:
        return arr
    import torch

    t = torch.from_numpy(arr)
    return t.to(s.device) if move and s.device != "cpu" else t
