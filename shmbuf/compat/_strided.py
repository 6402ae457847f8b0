"""Strided history index math: which entries a history window reads.  Pure, vectorised.

Ages count back from an env's newest entry (age 0).  With stride ``ab``
(the action block) and ``L`` entries, ``k = min(n, (L-1)//ab + 1)`` of the
``n`` strided frames are real; the others repeat the oldest real one.
"""
from __future__ import annotations

import numpy as np


def real_frames(n: int, ab: int, lengths: np.ndarray) -> np.ndarray:
    """``k`` per env: real strided frames among ``n`` (0 for an empty env)."""
    return np.minimum(n, (np.asarray(lengths) - 1) // ab + 1)


def frame_ages(n: int, ab: int, lengths: np.ndarray) -> np.ndarray:
    """``(E, n)`` ages of the strided frames, oldest first, padded with the oldest strided.

    Frame ``j`` sits ``min(n-1-j, k-1) * ab`` entries before the newest; an
    empty env gets negative ages (nothing to read).
    """
    k = real_frames(n, ab, lengths)
    return np.minimum(np.arange(n - 1, -1, -1), (k - 1)[:, None]) * ab


def block_ages(n: int, ab: int, lengths: np.ndarray) -> np.ndarray:
    """``(E, (n-1)*ab)`` ages of the raw entries of the ``n-1`` blocks; -1 for zero padding.

    Block ``i`` holds the ``ab`` entries after frame ``i`` up to and including
    frame ``i+1``: flattened, the ``(n-1)*ab`` newest entries, oldest first.
    Only the blocks between real frames (the last ``k-1``) hold data.
    """
    k = real_frames(n, ab, lengths)
    ages = np.arange((n - 1) * ab - 1, -1, -1)
    return np.where(ages < ((k - 1) * ab)[:, None], ages, -1)


class AgeTables:
    """``frame_ages`` then ``block_ages``, side by side, for every ``k`` in 0..n, per ``n``.

    A lookup is one fancy index by ``k`` (or none, when the lengths are as
    last time).  Columns ``[:n]`` are the frames, ``[n:]`` the raw entries of the
    blocks.  Returned arrays are shared between calls: never modify them.
    """

    def __init__(self, ab: int, limit: int = 16):
        self.ab, self.limit = ab, limit
        self._tables: dict[int, np.ndarray] = {}
        self._last_key: tuple[int, bytes] | None = None   # (n, lengths) of the last lookup
        self._last: np.ndarray = None  # type: ignore[assignment]  # set by the first lookup

    def lookup(self, n: int, lengths: np.ndarray) -> np.ndarray:
        """``(E, n + (n-1)*ab)`` ages for envs holding ``lengths`` entries."""
        table = self._tables.get(n)
        if table is None:
            if len(self._tables) >= self.limit:
                self._tables.clear()
            shortest = (np.arange(n + 1) - 1) * self.ab + 1   # the fewest entries with k frames
            table = self._tables[n] = np.concatenate(
                [frame_ages(n, self.ab, shortest), block_ages(n, self.ab, shortest)], axis=1)
        key = (n, lengths.tobytes())
        if key != self._last_key:   # warmed-up envs: the same lengths call after call
            k = (lengths - 1) // self.ab
            k += 1
            np.minimum(k, n, out=k)
            self._last_key, self._last = key, table[k]
        return self._last


def contiguous_window(n: int, ab: int, start: int, count: int, ring_len: int):
    """Slots ``(first, last)`` of the newest strided window if it is one unwrapped run.

    None when the env holds fewer than ``(n-1)*ab + 1`` entries (the window
    would need padding) or the run wraps past the end of the ring.
    """
    span = (n - 1) * ab
    if count - start < span + 1:
        return None
    last = (count - 1) % ring_len
    return (last - span, last) if last >= span else None
