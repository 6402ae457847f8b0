"""Shared priorities: the claim-tagged row words, block bounds and sum trees, driven from Python.

The words themselves are loaded and stored in ``_prio.c``; docs/design.md
("Priorities") states the protocol.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from . import _atomic as atomic
from . import _prio
from .layout import COUNTERS
from .words import _COUNT, _STATE, _TICKET, _U32

if TYPE_CHECKING:  # annotations only: the ring builds these objects
    from .ring import Ring

class Priorities:
    """The shared priorities of a step store (``create(..., priorities=True)``): every
    load and store of their words, through ``_prio.c``.

    Ids: step ``offset`` of the chunk claimed with ticket ``t`` is ``t *
    chunk_size + offset``.  Tickets only grow, so an id never names another
    step; it is stale once its chunk's ticket changed (or the chunk is being
    recycled).  docs/design.md ("Priorities") has the protocol.
    """

    def __init__(self, ring: "Ring"):
        lay = ring.layout
        self.ring, self.mm, self.k = ring, ring.mm, lay.chunk_size
        self.block = lay.priority_block
        self._max_off = COUNTERS["max_priority"]
        self._prev_off = lay.priority_prev_offset
        # The geometry _prio.c works with: the ring's (protocol.geometry), priority fields included.
        self.geometry = ring.geometry
        self.exponents = tuple(e for e, _ in lay.priority_trees)

    # -- writers (once per chunk) --------------------------------------------------
    def reset(self, chunk: int, ticket: int) -> None:
        _prio.reset(self.mm, self.geometry, chunk, ticket)

    def link_back(self, successor: int, chunk: int, chunk_seq: int) -> None:
        off = self._prev_off + 16 * successor
        atomic.store_release(self.mm, off + 8, chunk_seq)
        atomic.store_release(self.mm, off, chunk + 1)

    # -- ids -------------------------------------------------------------------------
    def ids(self, rows: np.ndarray) -> np.ndarray:
        """The ids of the steps at physical ``rows`` (the caller re-checks the seqs after)."""
        chunk = rows // self.k
        tickets = self.ring.chunk_table[chunk, _TICKET].view(np.int64)
        atomic.fence_acquire()
        return tickets * self.k + (rows - chunk * self.k)

    def of_ids(self, ids: np.ndarray) -> np.ndarray:
        """Priorities (float32) of the steps ``ids`` names now; NaN where an id is stale."""
        rows, held, chunk, state = self.held_rows(ids)
        value, _ = self.values(np.where(held, rows, 0))
        held &= self.unchanged(chunk, state)
        return np.where(held, value, np.float32(np.nan)).reshape(ids.shape)

    def held_rows(self, ids: np.ndarray):
        """``(rows, held, chunk, state)`` of the flat int64 ``ids`` now: the row each id
        names, whether its step is held there, and the chunk and state word to check
        with ``unchanged`` after the row was read or written."""
        flat = np.ascontiguousarray(ids.reshape(-1), np.int64)
        k, table = self.k, self.ring.chunk_table
        ticket, off = np.divmod(np.maximum(flat, 0), k)
        chunk = ticket % self.ring.layout.n_chunks
        claimed = chunk < self.ring.claimed_chunks()   # no entry above it is read
        chunk = np.where(claimed, chunk, 0)
        state = table[chunk, _STATE].copy()
        atomic.fence_acquire()
        held = (claimed & (flat >= 0) & (off < self.ring.chunk_rows[chunk])
                & (state >> np.uint64(32) & np.uint64(1) == 0)
                & (table[chunk, _TICKET].view(np.int64) == ticket)
                & (table[chunk, _COUNT].view(np.int64) > off))
        return chunk * k + off, held, chunk, state

    def unchanged(self, chunk: np.ndarray, state: np.ndarray) -> np.ndarray:
        """True where ``chunk`` still has the ``state`` word ``held_rows`` read."""
        atomic.fence_acquire()
        return self.ring.chunk_table[chunk, _STATE] == state

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

    def restore(self, rows: np.ndarray, saved: np.ndarray) -> None:
        """Set the steps at committed ``rows`` to ``saved`` (a checkpoint's; NaN: never set)."""
        keep = ~np.isnan(saved)
        self.update(np.ascontiguousarray(self.ids(rows[keep])),
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

    # -- upkeep ----------------------------------------------------------------------
    def repair(self) -> None:
        """Recompute the whole tree from the block words (after a process died mid-update)."""
        _prio.repair(self.mm, self.geometry)

    def leaf_bounds(self, tree: int) -> np.ndarray:
        """Each block's bound as tree ``tree``'s leaves hold it now (float64; tests)."""
        exponent, levels = self.ring.layout.priority_trees[tree]
        at, n = levels[0]
        leaves = np.frombuffer(self.mm, np.uint64, n, at).copy()
        atomic.fence_acquire()
        value = (leaves & np.uint64(_U32)).astype(np.uint32).view(np.float32).astype(np.float64)
        default = (leaves >> np.uint64(40)) != 0
        return np.where(default, self.largest() ** exponent, value)

    def stale_nodes(self) -> tuple[int, int]:
        """(leaves, nodes) that disagree with what they summarise right now."""
        return _prio.stale_nodes(self.mm, self.geometry)
