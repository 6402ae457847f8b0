"""Step ids: which buffer issued an id, and which step it names.

A step id (``sample_sequences(..., ids=True)``) is an int64 >= 0:

  bits    field  meaning
  47..62  tag    the issuing buffer's tag: 16 random bits, never 0, drawn at ``create``
                 (0: a buffer made before ids had tags)
   0..46  local  ``(ticket + base) * chunk_size + offset``: the claim ticket of the
                 step's chunk and its row in the chunk; ``base`` is 0 but in a buffer
                 made by ``shmbuf.load``, whose tickets continue the saved buffer's

Tickets only grow, so a local id never names another step of its buffer
(``protocol.priorities``).  A buffer accepts its own tag, refuses any other
(``ForeignStepIdsError``), and, when ``shmbuf.load`` made it, also accepts
the tags of the buffers it descends from for the local ids their saves
held (``accept``): those ids name the same steps here (``disk.checkpoint``
puts each saved chunk back under its own ticket), or none (stale) where a
load could not keep the tickets.  A loaded buffer draws a tag of its own for
what it samples, so the saved buffer, which may run on, and the loaded one
never issue the same id for different steps.

Kept in the buffer's metadata under ``META_KEY`` (priorities buffers only),
so every attached process, and every save, has it.
"""
from __future__ import annotations

import dataclasses
import random

import numpy as np

from .._errors import ForeignStepIdsError
from . import _rows

TAG_SHIFT = 47
TAG_MASK = (1 << 16) - 1
LOCAL_MASK = (1 << TAG_SHIFT) - 1
META_KEY = "step_ids"
MAX_ACCEPTED = 8   # ancestors whose ids a loaded buffer accepts (the newest ones)


@dataclasses.dataclass(frozen=True)
class StepIds:
    """One buffer's step-id rules (see the module docstring).

    ``accept``: ``(tag, lo, hi)`` per ancestor, newest first: its ids whose local
    part is in ``[lo, hi)`` may name steps held here; its others are stale.
    """

    tag: int
    chunk_size: int
    base: int = 0
    accept: tuple[tuple[int, int, int], ...] = ()

    @classmethod
    def of_meta(cls, meta: dict, chunk_size: int) -> "StepIds":
        """A buffer's rules from its metadata (tag 0 if it predates tagged ids)."""
        entry = meta.get(META_KEY) if isinstance(meta, dict) else None
        if not isinstance(entry, dict):
            return cls(0, chunk_size)
        accept = tuple((int(t), int(lo), int(hi)) for t, lo, hi in entry.get("accept", ()))
        return cls(int(entry["tag"]), chunk_size, int(entry.get("base", 0)), accept)

    # -- ids out -----------------------------------------------------------------------
    def of_rows(self, ring, rows: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """The ids of the steps at ``rows`` of ``ring``, tagged as this buffer's, in one
        pass in C (``_rows.step_ids``).

        ``out``: where they go instead of a new int64 array of the rows' shape: a
        C-contiguous array with one record per row, each id in the first 8 bytes
        (native order) of its record, whose other bytes are left as they are.

        Raises:
            OverflowError: the local part has outgrown its bits.
        """
        rows = np.ascontiguousarray(rows, np.int64)
        if out is None:
            out = np.empty(rows.shape, np.int64)
        top = _rows.step_ids(ring.mm, ring.geometry, rows, out, self.base * self.chunk_size,
                             self.tag << TAG_SHIFT)   # tickets loaded with acquire
        if top > LOCAL_MASK:
            raise OverflowError(f"step ids of this buffer have outgrown {TAG_SHIFT} bits "
                                f"(chunk claims * chunk_size reach {top}); "
                                "save it and load the save to start a new buffer")
        return out

    # -- ids in ------------------------------------------------------------------------
    def decode(self, ids: np.ndarray, what: str = "ids", owner: str = "") -> np.ndarray:
        """``ticket * chunk_size + offset`` of each id (int64 >= 0, checked), -1 where it
        is stale for sure (an ancestor's id outside its saved range).

        Raises:
            ForeignStepIdsError: an id of any other buffer; it names the first one.
        """
        flat = ids.reshape(-1)
        tag = flat >> TAG_SHIFT
        local = flat & LOCAL_MASK
        known, held = self._known(tag, local)
        if not known.all():
            at = int(np.argmin(known))
            pos = [int(i) for i in np.unravel_index(at, ids.shape)] if ids.ndim else []
            raise ForeignStepIdsError(
                f"{what}{pos} is {int(flat[at])}, a step id of another buffer (id tag "
                f"{int(tag[at])}; buffer {owner!r} issues tag {self.tag}"
                f"{' and accepts its ancestors' if self.accept else ''}): ids belong to the "
                "buffer whose sample returned them; nothing was written")
        local = local - self.base * self.chunk_size
        return np.where(held & (local >= 0), local, -1).reshape(ids.shape)

    def first_foreign(self, ids: np.ndarray) -> int | None:
        """The flat index of the first id of ``ids`` that ``decode`` would refuse, or None."""
        flat = ids.reshape(-1)
        known, _ = self._known(flat >> TAG_SHIFT, flat & LOCAL_MASK)
        return None if known.all() else int(np.argmin(known))

    def _known(self, tag: np.ndarray, local: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(issued by this buffer or an ancestor, and may name a step held here)."""
        known = tag == self.tag
        held = known.copy()
        for other, lo, hi in self.accept:
            theirs = tag == other
            known |= theirs
            held |= theirs & (local >= lo) & (local < hi)
        return known, held

    # -- a load --------------------------------------------------------------------------
    def for_load(self, tickets: np.ndarray | None, n_chunks: int,
                 placeable: bool) -> tuple[dict, bool]:
        """The ``META_KEY`` entry of a buffer loaded from a save of this buffer, and
        whether the load puts each saved chunk back under its own ticket
        (``placeable``: the saved geometry is kept and ``tickets``, the saved chunks'
        id tickets in order, are there).  Placed, the new buffer's tickets continue
        these (its ``base``, a multiple of ``n_chunks`` so that each chunk lands where
        it was) and the saved ids name their steps; else they are all stale there."""
        keep = placeable and tickets is not None and _placeable(tickets, n_chunks)
        k = self.chunk_size
        if keep and tickets is not None:
            first, end = int(tickets[0]) * k, (int(tickets[-1]) + 1) * k
            base = int(tickets[0]) - int(tickets[0]) % n_chunks
            mine = (self.tag, first, end)
            # An ancestor's ids beyond the save would name the new buffer's own steps.
            older = tuple((t, max(lo, first), min(hi, end)) for t, lo, hi in self.accept)
        else:
            base, mine = 0, (self.tag, 0, 0)
            older = tuple((t, 0, 0) for t, _, _ in self.accept)
        return fresh_meta(base, ((mine,) + older)[:MAX_ACCEPTED]), keep


def fresh_meta(base: int = 0, accept=()) -> dict:
    """A new buffer's ``META_KEY`` entry: a fresh random tag, unlike any in ``accept``
    (an ancestor's), the ticket ``base`` and the ``accept`` list."""
    taken = {int(a[0]) for a in accept}
    draw = random.SystemRandom()
    tag = draw.randint(1, TAG_MASK)
    while tag in taken:
        tag = draw.randint(1, TAG_MASK)
    return {"tag": tag, "base": int(base), "accept": [[int(v) for v in a] for a in accept]}


def _placeable(tickets: np.ndarray, n_chunks: int) -> bool:
    """Saved chunks can go back under their own tickets: ascending, and each in a chunk
    of its own (as live chunks always are; a following save that kept recycled ones is
    not)."""
    t = np.asarray(tickets, np.int64)
    return bool(len(t)) and bool((np.diff(t) > 0).all()) and \
        len(np.unique(t % n_chunks)) == len(t)
