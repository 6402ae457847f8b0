"""Whole episodes in a step store: which are held, and drawing them per episode.

The PlaNet facade writes an episode of ``T`` steps as ``T + 1`` consecutive
rows of one stream and repeats two values on each row: the episode's serial
(buffer-wide, in the order appends began) and ``T``.  Everything here works
from those two columns; nothing touches shared memory except
``committed_rows``.

Per-episode draws: the core draws windows uniformly per valid start row, so
an episode with ``n_e = T_e - L + 1`` starts turns up ``n_e`` times as often
as one start.  Keeping a window of episode ``e`` with probability
``c / n_e`` (``c`` the smallest ``n_e`` among the eligible episodes) makes
every eligible episode equally likely, and every start within it.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from .._errors import NotEnoughDataError

HIDDEN = ("serial", "length")


@dataclasses.dataclass(frozen=True)
class Census:
    """The held episodes (the newest complete ones), oldest first."""

    serials: np.ndarray    # held episodes' serials, ascending
    lengths: np.ndarray    # their T
    present: np.ndarray    # rows of every episode present, held or not

    def total_starts(self, tracelen: int) -> int:
        """Valid starts of windows of ``tracelen + 1`` rows over every present episode."""
        return int(np.maximum(self.present - tracelen, 0).sum())


def census(serial: np.ndarray, length: np.ndarray, keep: int) -> Census:
    """The newest ``keep`` complete episodes among rows carrying these hidden values.

    An episode is complete when all its ``T + 1`` rows are there: one still
    being appended, or one whose first rows the store has recycled, is not held.
    """
    if not len(serial):
        empty = np.empty(0, np.int64)
        return Census(empty, empty, empty)
    lo = int(serial.min())
    at = serial - lo
    rows = np.bincount(at)
    lengths = np.zeros(len(rows), np.int64)
    lengths[at] = length
    present = np.flatnonzero(rows)
    held = present[rows[present] == lengths[present] + 1][-keep:]
    return Census(held + lo, lengths[held], rows[present])


def committed_rows(buffer) -> np.ndarray:
    """Indices of every committed row of a core buffer, chunk by chunk."""
    # The core has no public accessor for this (wanted: Buffer.committed_rows());
    # read the chunk table's counts, as Buffer.snapshot() does.
    ring = buffer._ring
    counts = ring.count.astype(np.int64)
    starts = np.repeat(ring.chunk_base, counts)
    return starts + np.arange(len(starts)) - np.repeat(np.cumsum(counts) - counts, counts)


@dataclasses.dataclass(frozen=True)
class Draw:
    """How to keep candidate windows of ``tracelen + 1`` rows so episodes come out uniform."""

    tracelen: int
    serials: np.ndarray    # eligible held episodes, ascending
    least: int             # the smallest number of starts among them
    rate: float            # expected fraction of candidates kept

    @classmethod
    def plan(cls, held: Census, tracelen: int) -> "Draw":
        """The draw over ``held``; NotEnoughDataError if no episode qualifies."""
        if not len(held.serials):
            raise NotEnoughDataError("Memory is empty; cannot sample.")
        eligible = held.lengths >= tracelen
        if not eligible.any():
            raise NotEnoughDataError(
                f"No episodes with length >= {tracelen} available to sample: the "
                f"{len(held.serials)} held episodes have at most {held.lengths.max()} steps")
        least = int(held.lengths[eligible].min()) - tracelen + 1
        rate = eligible.sum() * least / max(held.total_starts(tracelen), 1)
        return cls(tracelen, held.serials[eligible], least, float(rate))

    def keep(self, rng, serial: np.ndarray, length: np.ndarray) -> np.ndarray:
        """Which candidates (given by their first row's hidden values) to keep."""
        at = np.minimum(np.searchsorted(self.serials, serial), len(self.serials) - 1)
        starts = np.maximum(length - self.tracelen + 1, 1)
        p = np.where(self.serials[at] == serial, self.least / starts, 0.0)
        return rng.random(len(serial)) < p


class Batch:
    """The windows a sample returns, every column, in the caller's axis order.

    The first round of candidates lands here directly; ``holes`` are the
    slots whose candidate was rejected, refilled by later rounds.  Which slot
    a kept window lands in depends only on which were kept, so every slot
    ends up an independent draw.
    """

    def __init__(self, spec: dict, batch: int, tracelen: int, time_first: bool):
        self.tracelen, self.time_first = tracelen, time_first
        lead = (tracelen + 1, batch) if time_first else (batch, tracelen + 1)
        self.columns = {name: np.empty(lead + shape, dtype)
                        for name, (shape, dtype) in spec.items()}
        self.holes = np.arange(batch)

    def first_step(self, column: np.ndarray) -> np.ndarray:
        """A scalar column's value at each window's first step."""
        return column[0] if self.time_first else column[:, 0]

    def fill(self, cand: dict, keep: np.ndarray) -> None:
        """Copy candidate windows ``keep`` (laid out like ours) into the first holes."""
        keep = keep[:len(self.holes)]
        slots, self.holes = self.holes[:len(keep)], self.holes[len(keep):]
        for name, arr in self.columns.items():
            if self.time_first:
                arr[:, slots] = cand[name][:, keep]
            else:
                arr[slots] = cand[name][keep]

    def result(self) -> tuple[list, np.ndarray]:
        """``([x, u, r, t], lengths)``; u, r and t drop each window's last row."""
        n, c = self.tracelen, self.columns
        if self.time_first:
            steps = [c[k][:n] for k in ("u", "r", "t")]
        else:
            steps = [np.ascontiguousarray(c[k][:, :n]) for k in ("u", "r", "t")]
        return [c["x"]] + steps, self.first_step(c["length"]).copy()


def row_bytes(spec: dict, names=None) -> int:
    """Bytes of one stored row over the columns ``names`` (default: all)."""
    return sum(int(np.prod(spec[n][0], dtype=np.int64)) * np.dtype(spec[n][1]).itemsize
               for n in (spec if names is None else names))


def capacity(size: int, steps_per_episode: int) -> tuple[int, int]:
    """(rows, chunk_size) for ``size`` episodes of ``steps_per_episode`` steps, plus 25%.

    Chunks are at most 1/64 of the store, so the headroom is at least 16
    chunks: room for the partly filled chunks of a dozen concurrent writers.
    """
    rows = -(-size * (steps_per_episode + 1) * 5 // 4)
    return rows, max(1, min(512, rows // 64))
