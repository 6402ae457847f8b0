"""The index protocol of a step store: the one owner of its shared words.

Every load and store of a header word of a step store is in this file:
the magic, the counters, the writer slots, the chunk table (claims, links,
seals, counts) and the episode index.  Writers, samplers, checkpoints, the
CLI and the facades call the small API below; the C extensions get
their geometry from ``Ring.geometry`` (``protocol.geometry``).  docs/design.md
states the invariants; the byte layout is in protocol/layout.py.

Everything is lock-free.  A writer claims a slot (one per writer object)
and then chunks, each with a compare-and-swap on one 64-bit word; a process
that dies at any instant leaves words that the next claimant recognises as
dead (pid + start time) and takes over.

Where a step becomes visible: ``Streams.publish`` stores the chunk's new row
count with release order after every column of the row was written, so a
reader that sees the count sees the row.

Where pages are reserved (``posix.space``): the claimant of chunk ticket ``t``
of the first lap reserves chunk ``t``'s entry and rows before its CAS moves
the ticket past ``t``, and the writer of episode entry ``i`` reserves it
before the episode ticket moves past ``i``.  So every chunk entry, chunk row
and episode entry that a reader may look at (below the tickets it loaded)
is reserved: readers never touch a page that could raise SIGBUS.
"""
from __future__ import annotations

import dataclasses
import os
import time
from typing import Callable

import numpy as np

from .._errors import NoFreeChunkError, NoFreeWriterSlotError, SharedMemoryFullError
from ..posix.procs import is_alive, my_start_time
from ..posix.space import Space
from . import _atomic as atomic
from . import _rows
from .geometry import geometry_of
from .geometry import pack as pack_geometry
from .header import ClosedMark, StopMark, closed_word
from .layout import (
    CHUNK_ENTRY,
    CHUNK_FIELDS,
    COUNTERS,
    EPISODE_ENTRY,
    NO_SLOT,
    SLOT_ENTRY,
    SLOT_FIELDS,
    STARTS_BITS,
    STARTS_UNTRACKED,
    T_COLUMN,
    TERMINAL,
    Layout,
    chunk_seqs,
    chunks_sealed,
    pack_chunk_state,
    unpack_chunk_state,
)
from .pins import PIN_WAIT, Pins
from .priorities import Priorities
from .rate import RateWords
from .words import (
    _CLOCK,
    _COUNT,
    _E_CHUNK,
    _E_CHUNK_SEQ,
    _E_EP,
    _E_FLAGS,
    _E_LENGTH,
    _E_OFFSET,
    _E_SEQ,
    _E_STREAM,
    _EPISODE_BODY,
    _EPISODE_GRANULE,
    _NEXT,
    _NEXT_SEQ,
    _STARTS,
    _STARTS_MAX,
    _STATE,
    _STREAM,
    _TICKET,
    _U32,
)

_SAMPLES, _SAMPLED_ROWS = COUNTERS["samples"], COUNTERS["sampled_rows"]

# Copy rows of step data into the segment (same bytes as a numpy assignment,
# with streaming stores for big rows, then a store fence), so that the
# publish that follows (a store-release) orders them: Writer.extend's copies.
copy_rows = atomic.stream_copy


@dataclasses.dataclass(frozen=True)
class Counts:
    """Counters read in the one order that keeps them consistent (see ``Ring.counts``)."""

    evicted: int
    live: int
    written: int
    episodes: int
    chunks_in_use: int
    streams: int
    samples: int
    sampled_rows: int
    episodes_logged: int


@dataclasses.dataclass(frozen=True)
class Chunks:
    """Chunks with committed rows, oldest claim first, as they were when read."""

    chunk: np.ndarray   # int64 chunk indices
    seq: np.ndarray     # int64 state seq (even) at the read
    count: np.ndarray   # int64 committed rows
    stream: np.ndarray  # int64 stream that filled it
    base: np.ndarray    # int64 first physical row
    ticket: np.ndarray | None = None  # int64 claim ticket (unique, grows with every claim)


@dataclasses.dataclass(frozen=True)
class Episodes:
    """Finished episodes from the episode index, in the order they ended.

    Each array has one entry per episode.  ``index`` counts episodes ended
    in the buffer's life (0, 1, 2, ...); ``chunk``/``seq``/``offset`` say
    where the first step was written.
    """

    index: np.ndarray     # int64
    length: np.ndarray    # int64 steps
    terminal: np.ndarray  # bool: ended on a terminal step (else cut by end_episode)
    stream: np.ndarray    # int64
    ep: np.ndarray        # int64 episode number within its stream (the _ep column)
    chunk: np.ndarray     # int64
    seq: np.ndarray       # int64
    offset: np.ndarray    # int64

    def __len__(self) -> int:
        return len(self.index)

    def take(self, keep) -> "Episodes":
        return Episodes(self.index[keep], self.length[keep], self.terminal[keep],
                        self.stream[keep], self.ep[keep], self.chunk[keep], self.seq[keep],
                        self.offset[keep])


class Ring:
    """The header of one mapped step store, seen through its atomic words."""

    def __init__(self, mm, layout: Layout, name: str | None = None, space: Space | None = None):
        self.mm = mm
        self.layout = layout
        self.name = name
        # The geometry every C extension reads (shmbuf_words.h), packed by name from the layout.
        self.geometry = pack_geometry(geometry_of(layout))
        self.rate = RateWords(mm, self.geometry)   # the limiter's words (unused without a limit)
        # None or full: every page is reserved already (prefault, keyed rings, the CLI)
        self.space = None if space is None or space.full else space
        self._episodes_reserved = 0  # index entries below it are known to be reserved
        self.mark = mark = ClosedMark(mm, name)   # this handle's: see ClosedMark
        self.closed_view = mark.view   # the writer's C fast path reads it too
        self.check_open = mark.check   # check_open(pid): see ClosedMark
        self.stop_mark = StopMark(mm, name)   # writers_stopped: writers check it beside closed
        n, k = layout.n_chunks, layout.chunk_size
        self.chunk_table = np.frombuffer(mm, dtype="<u8", count=n * CHUNK_ENTRY // 8,
                                         offset=layout.chunks_offset).reshape(n, -1)
        self.count = self.chunk_table[:, _COUNT]
        self.chunk_base = np.arange(n, dtype=np.int64) * k
        self.chunk_rows = np.minimum(k, layout.capacity - self.chunk_base)
        self.count_off = layout.chunks_offset + np.arange(n, dtype=np.int64) * CHUNK_ENTRY \
            + CHUNK_FIELDS["count"]
        # Each row's clock number (_t): written here, by the publish paths below.
        self.clock_rows = np.frombuffer(mm, dtype="<i8", count=layout.capacity,
                                        offset=layout.column(T_COLUMN).offset)
        self.slot_table = np.frombuffer(mm, dtype="<u8", count=layout.max_writers * SLOT_ENTRY // 8,
                                        offset=layout.slots_offset).reshape(-1, SLOT_ENTRY // 8)
        self.slot_steps = self.slot_table[:, SLOT_FIELDS["steps"] // 8]
        self.episode_table = np.frombuffer(
            mm, dtype="<u8", count=layout.episode_slots * EPISODE_ENTRY // 8,
            offset=layout.episodes_offset).reshape(layout.episode_slots, -1)
        # Chunks of 2**31 rows or more do not fit the starts word: readers use _ep.
        self.starts_reset = 0 if k <= _STARTS_MAX else STARTS_UNTRACKED
        self.priorities = Priorities(mm, layout, self.geometry) if layout.priorities else None
        self.pins = Pins(mm, layout.chunks_offset)   # write_steps' pins (protocol.pins)
        self._pin_seen = False   # claim_chunk: a chunk was skipped for its pin this lap
        # A compressing buffer's recycle hook (``PackWords.on_recycle``, set by its Buffer):
        # a packed chunk gets its raw pages back before it is written again.
        self.on_recycle: Callable[[int], bool] | None = None
        # ... and its hook before a later lap's ticket moves (``PackWords.reserve_raw``):
        # the chunk's raw pages reserved while the claim can still stop in FIFO order.
        self.before_claim: Callable[[int], object] | None = None

    # -- reserving pages before a ticket makes them readable (posix.space) ------------
    def _take(self, name: str, prepare) -> int:
        """Add 1 to counter ``name`` and return its value before, calling
        ``prepare(value)`` first, so that the pages ``value`` makes readable are
        reserved before anyone can see it.  A ``prepare`` that raises leaves the
        counter as it was."""
        if self.space is None:
            return self.bump(name)
        off = COUNTERS[name]
        value = atomic.load_acquire(self.mm, off)
        while True:
            prepare(value)
            if atomic.compare_exchange(self.mm, off, value, value + 1):
                return value
            value = atomic.load_acquire(self.mm, off)

    def _reserve_chunk(self, ticket: int, unreserved: frozenset = frozenset()) -> None:
        """Before ``ticket``'s claim: a chunk of the first lap gets its entry and rows
        reserved (but for the columns ``unreserved``: see ``claim_chunk``), and the
        episode index room for one episode end per row.  So does a chunk of a later lap
        that was never claimed (a load skipped its first-lap ticket: ``skip_tickets``)."""
        lay, space = self.layout, self.space
        assert space is not None  # _take prepares only with a space
        chunk = ticket % lay.n_chunks
        rows = int(self.chunk_rows[chunk])
        if ticket < lay.n_chunks or self._never_claimed(chunk):
            first = int(self.chunk_base[chunk])
            what = (f"chunk {chunk} ({rows} steps, {rows * sum(c.row_bytes for c in lay.columns)}"
                    " bytes over all columns)")
            if ticket < lay.n_chunks:
                self._reserve_entry(chunk, what)
            for col in lay.columns:
                if col.name not in unreserved:
                    space.reserve(col.offset + first * col.row_bytes, rows * col.row_bytes, what)
        elif self.before_claim is not None:
            # A packed chunk's raw pages, before the ticket moves: a full /dev/shm then
            # leaves this chunk next in FIFO order instead of skipping it for a lap with its
            # old steps (recycle reserves them again; a no-op unless punched meanwhile).
            self.before_claim(chunk)
        self._reserve_episodes(self.counter("episode_ticket") + rows)

    def _reserve_entry(self, chunk: int, what: str = "") -> None:
        assert self.space is not None
        self.space.reserve(self.layout.chunk_field(chunk, "state"), CHUNK_ENTRY,
                           what or f"chunk {chunk}'s entry")

    def _never_claimed(self, chunk: int) -> bool:
        return atomic.load_acquire(self.mm, self.layout.chunk_field(chunk, "state")) == 0

    def reserve_rows(self, chunk: int, names) -> None:
        """Reserve ``chunk``'s rows of the columns ``names`` (a claim that left them
        unreserved, whose claimant now writes them after all).

        Raises:
            SharedMemoryFullError: /dev/shm cannot hold them.
        """
        if self.space is None:
            return
        first, rows = int(self.chunk_base[chunk]), int(self.chunk_rows[chunk])
        for name in names:
            col = self.layout.column(name)
            self.space.reserve(col.offset + first * col.row_bytes, rows * col.row_bytes,
                               f"chunk {chunk}'s rows of {name!r}")

    def skip_tickets(self, upto: int) -> None:
        """Take the tickets below ``upto`` without claiming their chunks, as a claim that
        finds its chunk held does (a load that puts each saved chunk back under its saved
        ticket, ``disk.checkpoint.restore``); a first-lap ticket reserves its entry."""
        n = self.layout.n_chunks
        while self.counter("ticket") < upto:
            # Only the entry: its first claim, in a later lap, reserves the rows it writes.
            self._take("ticket", lambda t: self._reserve_entry(t) if t < n else None)

    def next_claim(self) -> int:
        """The chunk the next claim will most likely get (the next ticket's), as of now."""
        return self.counter("ticket") % self.layout.n_chunks

    def _reserve_episodes(self, upto: int) -> None:
        """Reserve episode-index entries below ``upto`` (whole granules), unless known done."""
        slots, space = self.layout.episode_slots, self.space
        upto = min(upto, slots)
        if upto <= self._episodes_reserved or space is None:
            return
        lo = self._episodes_reserved - self._episodes_reserved % _EPISODE_GRANULE
        hi = min(slots, -(-upto // _EPISODE_GRANULE) * _EPISODE_GRANULE)
        space.reserve(self.layout.episode_field(lo, "seq"), (hi - lo) * EPISODE_ENTRY,
                      f"episode index entries {lo}-{hi - 1}")
        self._episodes_reserved = hi

    def _reserve_episode(self, i: int) -> None:
        # Entries below a ticket someone took are reserved: that taker did it.
        self._episodes_reserved = max(self._episodes_reserved, min(i, self.layout.episode_slots))
        self._reserve_episodes(i + 1)

    def claimed_chunks(self) -> int:
        """Chunks claimed so far (at most all): readers look at no entry at or above it."""
        return min(self.counter("ticket"), self.layout.n_chunks)

    def prio(self) -> "Priorities":
        """The priorities of a buffer made with ``priorities=True`` (the caller checked)."""
        if self.priorities is None:
            raise ValueError(f"buffer {self.name!r} keeps no priorities")
        return self.priorities

    # -- the closed mark ----------------------------------------------------------
    def closed(self) -> int:
        return closed_word(self.mm)

    # -- counters -------------------------------------------------------------
    def counter(self, name: str) -> int:
        return atomic.load_acquire(self.mm, COUNTERS[name])

    def bump(self, name: str, delta: int = 1) -> int:
        """Add ``delta`` to a counter; return its value before."""
        return atomic.fetch_add(self.mm, COUNTERS[name], delta)

    # -- the step clock ---------------------------------------------------------
    def clock(self) -> int:
        """Steps ever published in this buffer (a step is numbered before its publish)."""
        return atomic.load_acquire(self.mm, _CLOCK)

    def stamp(self, row: int, n: int = 1, take=None) -> None:
        """Number the ``n`` contiguous rows from ``row`` in the buffer's publish order.

        A fetch-add on ``clock`` then the rows' ``_t``; called before the
        count store that publishes them, so a reader that sees a row
        committed sees its number.  A rate-limited writer passes ``take``
        (``n -> the clock before``), which reserves the numbers by CAS once
        the limiter admits them (``RateWords.take_insert``), waiting if need be.
        """
        t = self._numbers(n, take)
        if n == 1:
            self.clock_rows[row] = t
        else:
            self.clock_rows[row:row + n] = np.arange(t, t + n)

    def stamp_rows(self, rows: np.ndarray, take=None) -> None:
        """``stamp`` for scattered rows (one step of every stream of ``add_batch``)."""
        t = self._numbers(len(rows), take)
        self.clock_rows[rows] = np.arange(t, t + len(rows))

    def _numbers(self, n: int, take) -> int:
        """The first of ``n`` new clock numbers: a fetch-add, or the limiter's ``take``."""
        return atomic.fetch_add(self.mm, _CLOCK, n) if take is None else take(n)

    # The sums are relaxed loads; the fence orders them before any later load.
    def live_steps(self) -> int:
        total = int(self.count[:self.claimed_chunks()].sum())
        atomic.fence_acquire()
        return total

    def steps_written(self) -> int:
        total = int(self.slot_steps.sum())
        atomic.fence_acquire()
        return total

    def counts(self) -> Counts:
        """Every counter, in the one safe order.

        A step is counted as written before it is published, and published
        before it can be evicted; the written and evicted counts only grow.
        Reading evicted, then live, then written keeps ``evicted <= written``
        and ``live <= written`` however long the reader is descheduled.
        """
        evicted = self.counter("evicted")
        live = self.live_steps()
        written = self.steps_written()
        episodes = int(self.slot_table[:, SLOT_FIELDS["episodes"] // 8].sum())
        in_use = int(np.count_nonzero(self.count[:self.claimed_chunks()]))
        return Counts(evicted, live, written, episodes, in_use,
                      self.counter("next_stream"), self.counter("samples"),
                      self.counter("sampled_rows"), self.counter("episode_ticket"))

    def count_sample(self, rows: int) -> None:
        """One sample call served, returning ``rows`` steps."""
        mm = self.mm
        atomic.fetch_add(mm, _SAMPLES, 1)
        atomic.fetch_add(mm, _SAMPLED_ROWS, rows)

    def claimed_rows(self) -> int:
        """Rows of the chunks claimed so far: every committed row lies below it."""
        claimed = min(self.counter("ticket"), self.layout.n_chunks)
        return int(self.chunk_base[claimed - 1] + self.chunk_rows[claimed - 1]) if claimed else 0

    # -- writer slots -----------------------------------------------------------
    def take_slot(self) -> tuple[int, int]:
        """Take a free slot, or the slot of a dead process: ``(slot, lease)``
        (``streams.claim_slot`` makes the writer's ``Slot`` of it)."""
        pid, start = os.getpid(), my_start_time()
        for steal in (False, True):
            for slot in range(self.layout.max_writers):
                off = self.layout.slot_field(slot, "state")
                state = atomic.load_acquire(self.mm, off)
                holder = state & _U32
                if holder and (not steal or self.slot_alive(slot)):
                    continue
                lease = ((state >> 32) + 1) & _U32
                if atomic.compare_exchange(self.mm, off, state, (lease << 32) | pid):
                    atomic.store_release(self.mm, self.layout.slot_field(slot, "start_time"),
                                         (start << 16) | (lease & 0xFFFF))
                    return slot, lease
        raise NoFreeWriterSlotError(
            f"all {self.layout.max_writers} writer slots are held by live processes; "
            "close unused writers or create the buffer with a larger max_writers")

    def live_writers(self) -> list[tuple[int, int, int]]:
        """(slot, pid, steps counted by the slot) of every slot held by a live process."""
        held = np.flatnonzero(self.slot_table[:, 0] & np.uint64(_U32))
        return [(int(s), self.slot_holder(int(s))[0], int(self.slot_steps[s]))
                for s in held if self.slot_alive(int(s))]

    def slot_holder(self, slot: int) -> tuple[int, int, int]:
        """(pid, lease, start time or 0 if not yet recorded) of ``slot``."""
        state = atomic.load_acquire(self.mm, self.layout.slot_field(slot, "state"))
        stamp = atomic.load_acquire(self.mm, self.layout.slot_field(slot, "start_time"))
        lease = state >> 32
        start = stamp >> 16 if (stamp & 0xFFFF) == (lease & 0xFFFF) else 0
        return state & _U32, lease, start

    def slot_alive(self, slot: int, lease16: int | None = None) -> bool:
        pid, lease, start = self.slot_holder(slot)
        if pid == 0 or (lease16 is not None and (lease & 0xFFFF) != lease16):
            return False
        return is_alive(pid, start)

    # -- chunks -------------------------------------------------------------------
    def claim_chunk(self, slot: int, lease: int, stream: int,
                    unreserved: frozenset = frozenset()) -> tuple[int, int]:
        """Recycle the oldest chunk no live writer is filling; return (chunk, seq).

        Round-robin tickets make the chunk claimed longest ago the next one
        recycled: FIFO eviction across all writers.  ``unreserved``: columns
        whose rows of the chunk the claimant will not write (a load puts
        them in compressed, ``PackWords.put_packed``), so their pages are
        not reserved on the first lap; no reader touches them (their rows
        are read packed, or ``reserve_rows`` reserves them before they are
        written after all).

        Raises:
            SharedMemoryFullError: /dev/shm cannot hold the chunk's pages;
                nothing changed, and a later claim may succeed.
        """
        n = self.layout.n_chunks
        deadline = None
        take = (lambda t: self._reserve_chunk(t, unreserved)) if unreserved \
            else self._reserve_chunk
        while True:
            self._pin_seen = False
            for _ in range(2 * n + 2):
                ticket = self._take("ticket", take)
                seq = self.recycle(ticket % n, slot, lease, stream, ticket)
                if seq is not None:
                    return ticket % n, seq
            if not self._pin_seen:
                break
            # Some were pinned by write_steps, which holds a pin for one write: go round
            # again shortly (a tiny ring can be pinned whole for that long).
            now = time.monotonic()
            deadline = deadline or now + PIN_WAIT
            if now >= deadline:
                break
            time.sleep(1e-4)
        hint = ("create the buffer with a smaller chunk_size or a larger capacity"
                if self.layout.chunk_size > 1 else "create the buffer with a larger capacity")
        raise NoFreeChunkError(
            f"all {n} chunks of {self.layout.chunk_size} steps are held by live writer "
            f"streams; {hint}, or use fewer writer streams")

    def recycle(self, chunk: int, slot: int, lease: int, stream: int, ticket: int) -> int | None:
        """Empty ``chunk`` for ``slot`` unless a live writer holds it; return its new seq.

        The seq goes odd (claimed, being reset) and then even again with count
        0, so a reader that saw the old seq fails validation.  With ``slot ==
        NO_SLOT`` the chunk ends up sealed and ownerless: free, and empty.
        """
        off = self.layout.chunk_field(chunk, "state")
        state = atomic.load_acquire(self.mm, off)
        seq, sealed, owner, owner_lease = unpack_chunk_state(state)
        busy = state and (seq & 1 or not sealed)  # state 0: never claimed
        if busy and owner != NO_SLOT and self.slot_alive(owner, owner_lease):
            return None  # a live writer is still filling (or resetting) it
        odd = (seq + 1 + (seq & 1)) & _U32
        claimed = pack_chunk_state(odd, False, slot, lease)
        if not atomic.compare_exchange(self.mm, off, state, claimed):
            return None
        atomic.fence_seq_cst()   # the claim before the pin's load (protocol.pins)
        if self.pins.held(chunk):
            # A write_steps is writing into its held steps: leave the chunk to it, as one
            # a live writer fills.  Nothing was written, so the undo is exact.
            atomic.compare_exchange(self.mm, off, claimed, state)
            self._pin_seen = True
            return None
        if self.on_recycle is not None:
            # A packed chunk gets its raw pages back before anything is written; one a
            # live compressor holds is left to it.  Either way nothing was written yet,
            # so undoing the claim restores exactly what readers validated against.
            try:
                kept = self.on_recycle(chunk)
            except BaseException:
                atomic.compare_exchange(self.mm, off, claimed, state)
                raise
            if not kept:
                atomic.compare_exchange(self.mm, off, claimed, state)
                return None
        self._evict(chunk)
        for field, value in (("next", 0), ("next_seq", 0), ("stream", stream),
                             ("ticket", ticket), ("starts", self.starts_reset)):
            atomic.store_release(self.mm, self.layout.chunk_field(chunk, field), value)
        even = (odd + 1) & _U32
        atomic.store_release(self.mm, off, pack_chunk_state(even, slot == NO_SLOT, slot, lease))
        if self.priorities is not None:
            # Before the claimant writes a row: the claim starts with nothing set.
            self.priorities.reset(chunk, ticket)
        return even

    def _evict(self, chunk: int) -> None:
        off = self.layout.chunk_field(chunk, "count")
        while True:
            old = atomic.load_acquire(self.mm, off)
            if atomic.compare_exchange(self.mm, off, old, 0):
                break
        if old:
            self.bump("evicted", old)

    def link(self, chunk: int, successor: int, successor_seq: int, chunk_seq: int) -> None:
        """Publish ``successor`` as the continuation of ``chunk`` (whose seq is ``chunk_seq``).

        With priorities the successor's back link is stored first, so a
        sampler that reaches it by ``next`` can also walk back.
        """
        if self.priorities is not None:
            self.priorities.link_back(successor, chunk, chunk_seq)
        atomic.store_release(self.mm, self.layout.chunk_field(chunk, "next_seq"), successor_seq)
        atomic.store_release(self.mm, self.layout.chunk_field(chunk, "next"), successor + 1)

    def seal(self, chunk: int, seq: int, slot: int, lease: int) -> None:
        """Mark ``chunk`` as done by its owner, so it may be recycled."""
        atomic.compare_exchange(self.mm, self.layout.chunk_field(chunk, "state"),
                                pack_chunk_state(seq, False, slot, lease),
                                pack_chunk_state(seq, True, slot, lease))

    def clear(self) -> None:
        """Empty every chunk that no live writer is filling (restore's first step).

        Only claimed chunks hold anything; each keeps its ticket, so the
        tickets still say which chunks are reserved.
        """
        for chunk in range(self.claimed_chunks()):
            if not self._never_claimed(chunk):   # (one a load skipped stays unclaimed)
                self.recycle(chunk, NO_SLOT, 0, 0, int(self.chunk_table[chunk, _TICKET]))

    # -- reading the chunk table ----------------------------------------------------
    def committed_counts(self, claimed: int | None = None) -> np.ndarray:
        """Committed rows per chunk (of the first ``claimed``), clipped to the chunk size.

        Clipped: a corrupt count must never make a reader index past a chunk.
        """
        n = self.claimed_chunks() if claimed is None else claimed
        counts = np.clip(self.count[:n].view(np.int64), 0, self.chunk_rows[:n])
        atomic.fence_acquire()
        return counts

    def committed_rows(self, claimed: int | None = None) -> np.ndarray:
        """Every committed physical row, chunk by chunk (int64)."""
        counts = self.committed_counts(claimed)
        starts = np.repeat(self.chunk_base[:len(counts)], counts)
        starts += np.arange(len(starts)) - np.repeat(np.cumsum(counts) - counts, counts)
        return starts

    def live_chunks(self) -> Chunks:
        """Chunks with committed rows and a stable seq, oldest claim first.

        The seqs are loaded before the counts (acquire), so a caller that
        copies the rows and then finds ``unchanged`` true holds whole steps.
        """
        claimed = self.claimed_chunks()
        table = self.chunk_table[:claimed]
        seq = chunk_seqs(table[:, _STATE])
        atomic.fence_acquire()
        counts = np.clip(table[:, _COUNT].view(np.int64), 0, self.chunk_rows[:claimed])
        order = np.argsort(table[:, _TICKET], kind="stable")
        order = order[(counts[order] > 0) & (seq[order] & 1 == 0)]
        return Chunks(order.astype(np.int64), seq[order], counts[order],
                      table[order, _STREAM].astype(np.int64), self.chunk_base[order],
                      table[order, _TICKET].astype(np.int64))

    def chunk_snapshot(self) -> tuple[np.ndarray, np.ndarray, int]:
        """``(seq, committed count)`` of every chunk, then the clock: in that order.

        States before counts (acquire), as ``live_chunks``; the clock after
        the counts (acquire), so every counted row's ``_t`` lies below it.
        Recency sampling reads chunks this way.  Chunks not claimed yet read
        as seq 0, count 0, without a look at their (unreserved) entries.
        """
        claimed, n = self.claimed_chunks(), self.layout.n_chunks
        seq, counts = np.zeros(n, np.int64), np.zeros(n, np.int64)  # unclaimed: empty
        seq[:claimed] = chunk_seqs(self.chunk_table[:claimed, _STATE])
        atomic.fence_acquire()
        counts[:claimed] = np.clip(self.count[:claimed].view(np.int64), 0,
                                   self.chunk_rows[:claimed])
        atomic.fence_acquire()
        return seq, counts, self.clock()

    def last_starts(self, chunks: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """Per chunk, a row below its count ``counts`` where an episode of its stream
        begins (the last such row the ``starts`` word names), or -1 if it names none.

        Read after the counts (a start the writer recorded after them lies at or
        above them and is not used); untracked chunks give -1.
        """
        word = self.chunk_table[chunks, _STARTS]
        atomic.fence_acquire()
        n = (word >> np.uint64(62)).astype(np.int64)
        mask = np.uint64(_STARTS_MAX)
        first = (word & mask).astype(np.int64)
        last = ((word >> np.uint64(STARTS_BITS)) & mask).astype(np.int64)
        pick = np.where(last < counts, last, np.where(first < counts, first, -1))
        return np.where((n > 0) & (word != np.uint64(STARTS_UNTRACKED)), pick, -1)

    def final_chunks(self) -> Chunks:
        """Live chunks that no writer will add to any more, oldest claim first.

        A chunk is final once its stream sealed it (moved on, or the writer
        closed) or its writer died.  The state is loaded before the count
        (acquire), so a sealed chunk's count is its last.
        """
        claimed = self.claimed_chunks()
        table = self.chunk_table[:claimed]
        state = table[:, _STATE].copy()
        atomic.fence_acquire()
        counts = np.clip(table[:, _COUNT].view(np.int64), 0, self.chunk_rows[:claimed])
        seq = chunk_seqs(state)
        final = chunks_sealed(state)
        for chunk in np.flatnonzero(~final & (counts > 0) & (seq & 1 == 0)):
            _, _, slot, lease = unpack_chunk_state(int(state[chunk]))
            final[chunk] = slot == NO_SLOT or not self.slot_alive(slot, lease)
        order = np.argsort(table[:, _TICKET], kind="stable")
        order = order[final[order] & (counts[order] > 0) & (seq[order] & 1 == 0)]
        return Chunks(order.astype(np.int64), seq[order], counts[order],
                      table[order, _STREAM].astype(np.int64), self.chunk_base[order],
                      table[order, _TICKET].astype(np.int64))

    def chunk_states(self) -> tuple[np.ndarray, np.ndarray]:
        """``(state word, committed count)`` of every claimed chunk: states first (acquire),
        as ``live_chunks`` (the compressor picks chunks by them)."""
        claimed = self.claimed_chunks()
        state = self.chunk_table[:claimed, _STATE].copy()
        atomic.fence_acquire()
        counts = np.clip(self.count[:claimed].view(np.int64), 0, self.chunk_rows[:claimed])
        atomic.fence_acquire()
        return state, counts

    def chunk_state(self, chunk: int) -> tuple[int, bool, int]:
        """``(seq, sealed, committed count)`` of one chunk, state first (acquire each)."""
        seq, sealed, _, _ = unpack_chunk_state(atomic.load_acquire(
            self.mm, self.layout.chunk_field(chunk, "state")))
        return seq, sealed, atomic.load_acquire(self.mm, self.layout.chunk_field(chunk, "count"))

    def links(self, chunks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(successor chunk or -1, the successor's seq) of each of ``chunks``, as linked now.

        ``link`` stores next_seq before next, so next is loaded first.
        """
        nxt = self.chunk_table[chunks, _NEXT].astype(np.int64) - 1
        atomic.fence_acquire()
        return nxt, self.chunk_table[chunks, _NEXT_SEQ].astype(np.int64)

    def seqs_of(self, chunks: np.ndarray) -> np.ndarray:
        """Each of ``chunks``' seq now (int64; odd while it is being recycled), loaded
        before whatever the caller reads next (acquire after), as ``live_chunks``'."""
        seqs = chunk_seqs(self.chunk_table[chunks, _STATE])
        atomic.fence_acquire()
        return seqs

    def unchanged(self, chunks: np.ndarray, seqs: np.ndarray) -> np.ndarray:
        """After reading rows: True where each (chunk, seq) still holds (acquire first)."""
        atomic.fence_acquire()
        now = chunk_seqs(self.chunk_table[chunks, _STATE])
        return now == seqs

    # -- step ids: the claim's ticket and the row's offset in its chunk -----------------
    def step_ids(self, rows: np.ndarray) -> np.ndarray:
        """The untagged ids of the steps at physical ``rows`` (any shape; the caller
        re-checks the chunks' seqs after, as for the rows it read with them).

        Step ``offset`` of the chunk claimed with ticket ``t`` is ``t * chunk_size +
        offset``.  Tickets only grow, so an id never names another step; it is
        stale once its chunk's ticket changed (or the chunk is being recycled).
        The ids a buffer hands out are these, tagged (``stepids.StepIds.of_rows``).
        """
        rows = np.ascontiguousarray(rows, np.int64)
        out = np.empty(rows.shape, np.int64)
        _rows.step_ids(self.mm, self.geometry, rows, out)   # tickets with acquire
        return out

    def held_rows(self, ids: np.ndarray):
        """``(rows, held, chunk, state)`` of the flat int64 ``ids`` now: the row each id
        names, whether its step is held there, and the chunk and state word to check
        with ``states_unchanged`` after the row was read or written."""
        flat = np.ascontiguousarray(ids.reshape(-1), np.int64)
        k, table = self.layout.chunk_size, self.chunk_table
        ticket, off = np.divmod(np.maximum(flat, 0), k)
        chunk = ticket % self.layout.n_chunks
        claimed = chunk < self.claimed_chunks()   # no entry above it is read
        chunk = np.where(claimed, chunk, 0)
        state = table[chunk, _STATE].copy()
        atomic.fence_acquire()
        held = (claimed & (flat >= 0) & (off < self.chunk_rows[chunk])
                & (chunk_seqs(state) & 1 == 0)
                & (table[chunk, _TICKET].view(np.int64) == ticket)
                & (table[chunk, _COUNT].view(np.int64) > off))
        return chunk * k + off, held, chunk, state

    def states_unchanged(self, chunk: np.ndarray, state: np.ndarray) -> np.ndarray:
        """True where ``chunk`` still has the ``state`` word ``held_rows`` read."""
        atomic.fence_acquire()
        return self.chunk_table[chunk, _STATE] == state

    def priorities_of(self, ids: np.ndarray) -> np.ndarray:
        """Priorities (float32) of the steps ``ids`` names now; NaN where an id is stale."""
        rows, held, chunk, state = self.held_rows(ids)
        value, _ = self.prio().values(np.where(held, rows, 0))
        held &= self.states_unchanged(chunk, state)
        return np.where(held, value, np.float32(np.nan)).reshape(ids.shape)

    # -- a writer's publishes (streams.Streams moves the cursors) ---------------------
    def publish_count(self, count_off: int, fill: int) -> None:
        """Store a chunk's committed row count (release): its rows become visible."""
        atomic.store_release(self.mm, count_off, fill)

    def publish_counts(self, count_offs: np.ndarray, fills: np.ndarray) -> None:
        """``publish_count`` for several chunks, one store each (release)."""
        atomic.store_many(self.mm, count_offs, fills)

    def store_starts(self, chunk: int, word: int) -> None:
        """Store ``chunk``'s starts word (release; before the count that publishes the
        row it names, see layout: ``starts``)."""
        atomic.store_release(self.mm, self.layout.chunk_field(chunk, "starts"), word)

    # -- the episode index ---------------------------------------------------------
    def log_episode(self, stream: int, chunk: int, chunk_seq: int, offset: int, length: int,
                    ep: int, terminal: bool) -> None:
        """Record a finished episode as entry ``i`` (the next ticket) of the index.

        The entry's seq goes to 2i+1 by CAS, then the body is stored and the
        seq set to 2i+2 by CAS: readers accept an entry only when its seq is
        2i+2 before and after they read the body.  An entry a later lap has
        already claimed is left alone (this episode is too old to index).
        Chunk claims reserve the index ahead; if /dev/shm filled up since, the
        episode is not indexed rather than the finished step reported failed.
        """
        try:
            i = self._take("episode_ticket", self._reserve_episode)
        except SharedMemoryFullError:
            return  # /dev/shm is full: the episode stays out of the index (claims raise)
        entry = i % self.layout.episode_slots
        seq_off = self.layout.episode_field(entry, "seq")
        old = atomic.load_acquire(self.mm, seq_off)
        if old >= 2 * i + 1 or not atomic.compare_exchange(self.mm, seq_off, old, 2 * i + 1):
            return
        offsets = np.array([self.layout.episode_field(entry, f) for f in _EPISODE_BODY],
                           np.int64)
        body = np.array([stream, chunk, chunk_seq, offset, length, ep,
                         TERMINAL if terminal else 0], np.int64)
        atomic.store_many(self.mm, offsets, body)
        atomic.compare_exchange(self.mm, seq_off, 2 * i + 1, 2 * i + 2)

    def episodes_logged(self) -> int:
        """Episodes ended so far (entries ever logged)."""
        return self.counter("episode_ticket")

    def first_unpublished(self, lo: int, hi: int) -> int:
        """The first episode index in ``[lo, hi)`` whose entry is logged but not yet
        published (its writer is between taking the index and publishing it), else
        ``hi``: a reader that keeps what it read must read from there again."""
        indices = np.arange(lo, hi, dtype=np.int64)
        seqs = self.episode_table[indices % self.layout.episode_slots, _E_SEQ].view(np.int64)
        atomic.fence_acquire()
        # A published entry's seq is 2 * index + 2; a later one's (its slot reused) is
        # higher, and such an entry is gone for good: only a lower seq is pending.
        pending = np.flatnonzero(seqs < 2 * indices + 2)
        return int(indices[pending[0]]) if len(pending) else hi

    def read_episodes(self, indices: np.ndarray) -> Episodes:
        """The published entries among episode ``indices`` whose first chunk is intact."""
        indices = np.asarray(indices, np.int64)
        # Only entries below the ticket are reserved pages (and only they can be published).
        indices = indices[(indices >= 0) & (indices < self.episodes_logged())]
        entries = indices % self.layout.episode_slots
        table = self.episode_table
        # A seqlock read: seq, body, seq again, each step ordered by a fence.
        # Aligned 8-byte loads are single-copy atomic, as in live_chunks.
        before = table[entries, _E_SEQ].view(np.int64)
        atomic.fence_acquire()
        body = table[entries].view(np.int64)
        atomic.fence_acquire()
        after = table[entries, _E_SEQ].view(np.int64)
        want = 2 * indices + 2
        ok = (before == want) & (after == want)
        chunk, length = body[:, _E_CHUNK], body[:, _E_LENGTH]
        ok &= (chunk >= 0) & (chunk < self.claimed_chunks()) & (length > 0)
        chunk = np.where(ok, chunk, 0)
        ok &= chunk_seqs(self.chunk_table[chunk, _STATE]) == body[:, _E_CHUNK_SEQ]
        return Episodes(indices, length, (body[:, _E_FLAGS] & TERMINAL) != 0,
                        body[:, _E_STREAM], body[:, _E_EP], chunk, body[:, _E_CHUNK_SEQ],
                        body[:, _E_OFFSET]).take(ok)
