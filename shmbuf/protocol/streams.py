"""A writer's side of the ring: its slot, its streams' chunk claims, rows and publishes.

The slot's own counters are this module's words; every chunk-table word (claims,
links, seals, counts, starts) is stored through the ``Ring``'s calls.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from . import _atomic as atomic
from .layout import STARTS_BITS, STARTS_UNTRACKED
from .words import _STARTS_MAX, _U32

if TYPE_CHECKING:  # annotations only
    from .ring import Ring


def claim_slot(ring: Ring) -> "Slot":
    """A writer's claim on a free slot of ``ring``, or on the slot of a dead process.

    Raises:
        NoFreeWriterSlotError: every slot is held by a live process.
    """
    return Slot(ring, *ring.take_slot())


class Slot:
    """A writer's claim on one slot: its lease and its cumulative counters."""

    def __init__(self, ring: Ring, slot: int, lease: int):
        self.ring, self.slot, self.lease = ring, slot, lease
        lay, mm = ring.layout, ring.mm
        self._steps_off = self.steps_off = lay.slot_field(slot, "steps")
        self._episodes_off = lay.slot_field(slot, "episodes")
        self._streams_off = lay.slot_field(slot, "streams")
        # The slot's counters are cumulative over its holders: continue them.
        self._episodes = atomic.load_acquire(mm, self._episodes_off)

    def open_streams(self, n: int, on_claim=None, limit=None) -> "Streams":
        """``n`` new streams, with buffer-wide ids, written through this slot.

        ``on_claim(chunk)`` runs after each chunk claim, before its first row
        is written (the writer maps the chunk's pages there).  ``limit``: the
        rate limiter that admits this writer's steps (``ratelimit.Limiter``:
        ``insert(n)`` waits and reserves, ``words.gate`` is its C admission),
        or None.
        """
        first = self.ring.bump("next_stream", n)
        atomic.fetch_add(self.ring.mm, self._streams_off, n)
        return Streams(self, np.arange(first, first + n, dtype=np.int64), on_claim, limit)

    def count_steps(self, n: int) -> None:
        # The slot's holder is the word's only writer; the C fast path
        # (``Streams.appender``) adds to the same word, so no private copy.
        atomic.fetch_add(self.ring.mm, self._steps_off, n)

    def count_episodes(self, n: int) -> None:
        self._episodes += n
        atomic.store_release(self.ring.mm, self._episodes_off, self._episodes)

    def release(self, streams=()) -> None:
        """Seal the chunks of ``streams`` and free the slot (unless taken over)."""
        for s in streams:
            for i in np.flatnonzero(s.chunk >= 0):
                self.ring.seal(int(s.chunk[i]), int(s.seq[i]), self.slot, self.lease)
        mm, off = self.ring.mm, self.ring.layout.slot_field(self.slot, "state")
        state = atomic.load_acquire(mm, off)
        if state >> 32 != self.lease or not state & _U32:
            return  # taken over already: someone judged us dead
        atomic.store_release(mm, self.ring.layout.slot_field(self.slot, "start_time"), 0)
        atomic.compare_exchange(mm, off, state, self.lease << 32)


class Streams:
    """Cursors of one writer's streams, as arrays indexed by stream.

    The writer copies a step's columns into the row(s) that ``row``,
    ``rows_all`` or ``room`` hand out (claiming a chunk when one is full),
    then calls ``publish``, ``publish_all`` or ``publish_run``; the C fast
    path (``appender``) moves the same cursors in the same order.  Nothing
    else moves a cursor.
    Each stream also remembers where its current episode began, so that
    ending it logs the episode in the index.
    """

    def __init__(self, slot: Slot, ids: np.ndarray, on_claim=None, limit=None):
        n = len(ids)
        self.slot, self.ring, self.id, self._on_claim = slot, slot.ring, ids, on_claim
        self._limit = limit
        self._take = None if limit is None else limit.insert   # n -> clock before (waits)
        self.chunk = np.full(n, -1, np.int64)
        self.seq = np.zeros(n, np.int64)
        self.base = np.zeros(n, np.int64)     # first row of the chunk
        self.fill = np.zeros(n, np.int64)     # rows written into the chunk
        self.rows = np.zeros(n, np.int64)     # rows the chunk can hold
        self.ep = np.zeros(n, np.int64)       # episode number within the stream
        self.count_off = np.zeros(n, np.int64)
        # publish_all calls before some chunk is full; an array, so that the
        # C fast path (``appender``) counts it down too
        self.left = np.zeros(1, np.int64)
        self.pos0 = np.zeros(n, np.int64)     # stream steps before the current chunk
        self.ep_pos = np.zeros(n, np.int64)   # stream step where the episode began
        self.ep_at = np.zeros((n, 3), np.int64)  # its (chunk, seq, offset)
        self.ep_next_chunk = np.ones(n, np.bool_)  # it begins at the next chunk's row 0
        self.starts = np.zeros(n, np.uint64)  # the starts word of the current chunk, as stored

    def __len__(self) -> int:
        return len(self.id)

    def advance(self, i: int, unwritten: frozenset = frozenset()) -> None:
        """Give stream ``i`` a fresh chunk, linked after its current one.

        ``unwritten``: columns whose rows of the new chunk will not be written
        (a load puts them in compressed): their pages are neither reserved
        (``Ring.claim_chunk``) nor mapped here.
        """
        ring, slot = self.ring, self.slot
        chunk, seq = ring.claim_chunk(slot.slot, slot.lease, int(self.id[i]), unwritten)
        old = int(self.chunk[i])
        if old >= 0:
            ring.link(old, chunk, seq, int(self.seq[i]))
            ring.seal(old, int(self.seq[i]), slot.slot, slot.lease)
            self.pos0[i] += self.fill[i]
        self.chunk[i], self.seq[i], self.fill[i] = chunk, seq, 0
        self.base[i] = ring.chunk_base[chunk]
        self.rows[i] = ring.chunk_rows[chunk]
        self.count_off[i] = ring.count_off[chunk]
        self.starts[i] = ring.starts_reset
        if self._on_claim is not None and not unwritten:   # mapping would take their pages
            self._on_claim(chunk)
        if self.ep_next_chunk[i]:
            self.ep_at[i] = chunk, seq, 0
            self.ep_next_chunk[i] = False
            if old >= 0:
                self._mark_start(i, 0)  # the stream's previous step ended an episode

    def row(self, i: int) -> int:
        """The row stream ``i``'s next step goes to (claims a chunk when full)."""
        if self.fill[i] == self.rows[i]:
            self.advance(i)
        return int(self.base[i] + self.fill[i])

    def publish(self, i: int, terminal: bool) -> None:
        """Make stream ``i``'s written row visible; a terminal one ends the episode."""
        fill = int(self.fill[i]) + 1
        # Numbered (and, rate-limited, admitted: it may wait or raise) before the
        # cursor moves, so a raise leaves the row unpublished and to be rewritten.
        self.ring.stamp(int(self.base[i]) + fill - 1, 1, self._take)
        self.fill[i] = fill
        # Counted before it is published: a writer killed in between leaves
        # steps_written one ahead, never behind what readers can see.
        self.slot.count_steps(1)
        self.ring.publish_count(int(self.count_off[i]), fill)
        if terminal:
            self.end(i, True)

    def appender(self, names: tuple, views: tuple, ep_view: np.ndarray, done: int):
        """The C fast path that appends one step to each of these streams (``appender.c``).

        It checks that every value already fits its column exactly, copies,
        numbers (``stamp``), counts and publishes in ``publish``'s order, and shares this object's
        cursors.  None when the columns do not suit it (a done column that is
        not a plain numeric scalar): the caller keeps the Python path.
        """
        try:
            return atomic.Appender(
                self.ring.mm, self.ring.geometry, names=names, views=views, ep_view=ep_view,
                t_view=self.ring.clock_rows, done=done, fill=self.fill, base=self.base,
                rows=self.rows, count_off=self.count_off, ep=self.ep, left=self.left,
                steps_off=self.slot.steps_off,
                gate=None if self._limit is None else self._limit.words.gate)
        except ValueError:
            return None

    def room(self, i: int) -> tuple[int, int]:
        """(row, n): stream ``i``'s next step goes to ``row``, and ``n`` steps fit from there.

        The ``n`` rows are contiguous (one chunk); a full chunk is replaced first.
        """
        if self.fill[i] == self.rows[i]:
            self.advance(i)
        return int(self.base[i] + self.fill[i]), int(self.rows[i] - self.fill[i])

    def publish_run(self, i: int, n: int, ends: np.ndarray) -> None:
        """Make the next ``n`` written rows of stream ``i`` visible with one count store.

        ``ends`` are the offsets in the run (ascending, below ``n``) of its
        terminal steps.  The episode starts after them are recorded before
        the count, and the episodes are logged after it, as ``publish`` does.
        """
        start = int(self.fill[i])
        self.ring.stamp(int(self.base[i]) + start, n, self._take)   # first: it may raise
        for t in ends:
            if start + t + 1 < self.rows[i]:
                self._mark_start(i, start + int(t) + 1)
        self.fill[i] = start + n
        self.slot.count_steps(n)
        self.ring.publish_count(int(self.count_off[i]), start + n)
        for t in ends:
            self._end_at(i, start + int(t) + 1, True, mark=False)

    def rows_all(self) -> np.ndarray:
        """The rows every stream's next step goes to (one call per vectorised step)."""
        if not self.left[0]:   # every stream gains a row per call: chunks fill in lockstep
            for i in np.flatnonzero(self.fill == self.rows):
                self.advance(int(i))
            self.left[0] = (self.rows - self.fill).min()
        return self.base + self.fill

    def publish_all(self, terminal: np.ndarray | None) -> None:
        """Make every stream's written row visible; ``terminal`` rows end episodes."""
        self.ring.stamp_rows(self.base + self.fill, self._take)
        self.fill += 1
        self.left[0] -= 1
        self.slot.count_steps(len(self.id))
        self.ring.publish_counts(self.count_off, self.fill)
        if terminal is not None:
            for i in np.flatnonzero(terminal):
                self.end(int(i), True)

    def end(self, i: int, terminal: bool) -> None:
        """End stream ``i``'s episode: log it, and start the next one after it."""
        self._end_at(i, int(self.fill[i]), terminal)

    def _end_at(self, i: int, fill: int, terminal: bool, mark: bool = True) -> None:
        """End stream ``i``'s episode after its first ``fill`` rows in the current chunk."""
        pos = int(self.pos0[i]) + fill
        length = pos - int(self.ep_pos[i])
        if length > 0:
            chunk, seq, offset = (int(v) for v in self.ep_at[i])
            self.ring.log_episode(int(self.id[i]), chunk, seq, offset, length,
                                  int(self.ep[i]), terminal)
        if terminal:
            self.slot.count_episodes(1)
        self.ep[i] += 1
        self.ep_pos[i] = pos
        if self.chunk[i] >= 0 and fill < self.rows[i]:
            self.ep_at[i] = self.chunk[i], self.seq[i], fill
            if pos and mark:
                self._mark_start(i, fill)
        else:
            self.ep_next_chunk[i] = True

    def _mark_start(self, i: int, row: int) -> None:
        """Record in the chunk entry that an episode starts at ``row`` of stream ``i``'s chunk.

        Stored with release before the count that publishes ``row``, so a
        reader that sees the row committed sees the start (_layout: ``starts``).
        """
        word = int(self.starts[i])
        if word == STARTS_UNTRACKED:
            return
        n, first, last = word >> 62, word & _STARTS_MAX, (word >> STARTS_BITS) & _STARTS_MAX
        if n and last == row:
            return  # a second end at the same row (e.g. end_episode after a terminal)
        word = (min(n + 1, 3) << 62) | (row << STARTS_BITS) | (first if n else row)
        self.starts[i] = word
        self.ring.store_starts(int(self.chunk[i]), word)
