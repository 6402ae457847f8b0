"""Shared priorities: the claim-tagged row words, block bounds and sum trees, driven from Python.

The words themselves are loaded and stored in ``_prio.c``; docs/design.md
("Priorities") states the protocol.
"""
from __future__ import annotations

import numpy as np

from . import _atomic as atomic
from . import _prio
from .layout import COUNTERS, Layout
from .words import _U32


class Priorities:
    """The shared priorities of a step store (``create(..., priorities=True)``): every
    load and store of their words, through ``_prio.c``.

    Steps are named by id (``Ring.step_ids``); ``_prio.c`` maps an id to its row
    and checks its chunk's claim itself.  The chunk table's words are the ring's:
    this class touches only the priority regions.  docs/design.md ("Priorities")
    has the protocol.
    """

    def __init__(self, mm, layout: Layout, geometry):
        self.mm, self.layout, self.k = mm, layout, layout.chunk_size
        self.block = layout.priority_block
        self._max_off = COUNTERS["max_priority"]
        self._prev_off = layout.priority_prev_offset
        # The geometry _prio.c works with: the ring's (protocol.geometry), priority fields included.
        self.geometry = geometry
        self.exponents = tuple(e for e, _ in layout.priority_trees)

    # -- writers (once per chunk) --------------------------------------------------
    def reset(self, chunk: int, ticket: int) -> None:
        _prio.reset(self.mm, self.geometry, chunk, ticket)

    def link_back(self, successor: int, chunk: int, chunk_seq: int) -> None:
        off = self._prev_off + 16 * successor
        atomic.store_release(self.mm, off + 8, chunk_seq)
        atomic.store_release(self.mm, off, chunk + 1)

    # -- values ----------------------------------------------------------------------
    def largest(self) -> float:
        """The largest priority ever set, or 1.0 before any."""
        top = self.largest_set()
        return 1.0 if top is None else top

    def largest_set(self) -> float | None:
        """The largest priority ever set, or None before any."""
        word = atomic.load_acquire(self.mm, self._max_off)
        return float(np.uint32(word & _U32).view(np.float32)) if word >> 32 & 1 else None

    def raise_largest(self, value: float) -> None:
        """Make the largest-ever priority at least ``value`` (restoring a checkpoint)."""
        want = 1 << 32 | int(np.float32(value).view(np.uint32))
        while True:
            old = atomic.load_acquire(self.mm, self._max_off)
            if old >= want or atomic.compare_exchange(self.mm, self._max_off, old, want):
                return

    def update(self, ids: np.ndarray, values: np.ndarray) -> int:
        """Set the priorities of the held steps among ``ids`` (int64) to ``values``
        (float32, finite, >= 0); return how many were held."""
        return _prio.update(self.mm, self.geometry, ids, values)

    def values(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(priority float32, set-in-this-claim bool) of the steps at committed ``rows``."""
        out = np.empty(len(rows), np.float32)
        explicit = np.empty(len(rows), np.uint8)
        _prio.values(self.mm, self.geometry, np.ascontiguousarray(rows, np.int64), out, explicit)
        return out, explicit.astype(bool)

    def saved(self, base: int, count: int) -> np.ndarray:
        """Rows ``[base, base + count)`` of one chunk for a checkpoint: the priority set
        in this claim, NaN where none was (float32)."""
        value, explicit = self.values(np.arange(base, base + count, dtype=np.int64))
        value[~explicit] = np.nan
        return value

    def restore(self, ids: np.ndarray, saved: np.ndarray) -> None:
        """Set the steps ``ids`` (int64) to ``saved`` (a checkpoint's; NaN: never set)."""
        keep = ~np.isnan(saved)
        self.update(np.ascontiguousarray(ids[keep], np.int64),
                    np.ascontiguousarray(saved[keep], np.float32))

    # -- the draw --------------------------------------------------------------------
    def tree_for(self, exponent: float) -> int:
        """The tree a draw with ``exponent`` proposes from (largest exponent <= it), or -1."""
        fits = [i for i, e in enumerate(self.exponents) if e <= exponent]
        return fits[-1] if fits else -1

    def mass(self, tree: int, largest: float) -> float:
        """Tree ``tree``'s total weight with never-set blocks bounded by ``largest``."""
        return _prio.mass(self.mm, self.geometry, tree, largest)

    def propose(self, raw: np.ndarray, length: int, tree: int, largest: float) -> np.ndarray:
        """Candidate start rows (-1: none) from ``2 n`` raw words; see ``_prio.propose``."""
        starts = np.empty(len(raw) // 2, np.int64)
        _prio.propose(self.mm, self.geometry, raw, length, tree, largest, starts)
        return starts

    def score_ratio(self, rows: np.ndarray, exponent: float, maxfrac: float, largest: float,
                    tree: int, unset: float | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(score, score / proposal bound) of each located window (``tree`` -1: uniform
        proposals); never-set steps count as ``unset`` (None: ``largest``), and
        ``largest`` must bound every priority, ``unset`` included; see
        ``_prio.score_ratio``."""
        score = np.empty(len(rows), np.float64)
        ratio = np.empty(len(rows), np.float64)
        _prio.score_ratio(self.mm, self.geometry, np.ascontiguousarray(rows, np.int64),
                          exponent, maxfrac, largest, largest if unset is None else unset,
                          tree, score, ratio)
        return score, ratio

    def accept(self, rows: np.ndarray, uniforms: np.ndarray, need: int, exponent: float,
               maxfrac: float, largest: float, tree: int,
               unset: float | None = None) -> tuple[np.ndarray, int]:
        """(indices of the first ``need`` windows with ``uniforms[i] < ratio[i]``, how
        many windows were scored to find them): ``score_ratio``'s acceptance, stopped
        once it has enough; see ``_prio.accept``."""
        picked = np.empty(need, np.int64)
        accepted, scored = _prio.accept(self.mm, self.geometry,
                                        np.ascontiguousarray(rows, np.int64), exponent, maxfrac,
                                        largest, largest if unset is None else unset, tree,
                                        np.ascontiguousarray(uniforms, np.float64), need, picked)
        return picked[:accepted], scored

    # -- upkeep ----------------------------------------------------------------------
    def repair(self) -> None:
        """Recompute the whole tree from the block words (after a process died mid-update)."""
        _prio.repair(self.mm, self.geometry)

    def leaf_bounds(self, tree: int) -> np.ndarray:
        """Each block's bound as tree ``tree``'s leaves hold it now (float64; tests)."""
        exponent, levels = self.layout.priority_trees[tree]
        at, n = levels[0]
        leaves = np.frombuffer(self.mm, np.uint64, n, at).copy()
        atomic.fence_acquire()
        value = (leaves & np.uint64(_U32)).astype(np.uint32).view(np.float32).astype(np.float64)
        default = (leaves >> np.uint64(40)) != 0
        return np.where(default, self.largest() ** exponent, value)

    def stale_nodes(self) -> tuple[int, int]:
        """(leaves, nodes) that disagree with what they summarise right now."""
        return _prio.stale_nodes(self.mm, self.geometry)
