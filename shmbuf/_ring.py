"""The index protocol of a step store: the one owner of its shared words.

Every load and store of a header word of a step store is in this file:
the magic, the counters, the writer slots, the chunk table (claims, links,
seals, counts) and the episode index.  Writers, samplers, checkpoints, the
CLI and the facades call the small API below; C code (``_windows.c``) gets
its geometry from ``Ring.geometry``.  docs/design.md states the invariants;
the byte layout is in _layout.py.

Everything is lock-free.  A writer claims a slot (one per writer object)
and then chunks, each with a compare-and-swap on one 64-bit word; a process
that dies at any instant leaves words that the next claimant recognises as
dead (pid + start time) and takes over.

Where a step becomes visible: ``Streams.publish`` stores the chunk's new row
count with release order after every column of the row was written, so a
reader that sees the count sees the row.

Where pages are reserved (``_space``): the claimant of chunk ticket ``t``
of the first lap reserves chunk ``t``'s entry and rows before its CAS moves
the ticket past ``t``, and the writer of episode entry ``i`` reserves it
before the episode ticket moves past ``i``.  So every chunk entry, chunk row
and episode entry that a reader may look at (below the tickets it loaded)
is reserved: readers never touch a page that could raise SIGBUS.
"""
from __future__ import annotations

import dataclasses
import os
import struct

import numpy as np

from . import _atomic as atomic
from . import _prio
from ._errors import BufferClosedError, NoFreeChunkError, NoFreeWriterSlotError, SharedMemoryFullError
from ._layout import (CHUNK_ENTRY, CHUNK_FIELDS, CLOSED_BY, COUNTERS, EP_COLUMN, EPISODE_ENTRY,
                      EPISODE_FIELDS, LAYOUT_VERSION, MAGIC, NO_SLOT, NO_TIMEOUT,
                      PRIORITY_COLUMN, RATE_FIELDS, SEALED, SLOT_ENTRY, SLOT_FIELDS,
                      STARTS_BITS, STARTS_UNTRACKED, TERMINAL, Layout, pack_chunk_state,
                      read_field, tag_of, unpack_chunk_state, T_COLUMN)
from ._procs import is_alive, my_start_time
from ._space import Space

_U32 = 0xFFFFFFFF
_U64 = (1 << 64) - 1
_STATE, _COUNT = CHUNK_FIELDS["state"] // 8, CHUNK_FIELDS["count"] // 8
_STREAM, _TICKET = CHUNK_FIELDS["stream"] // 8, CHUNK_FIELDS["ticket"] // 8
_NEXT, _NEXT_SEQ = CHUNK_FIELDS["next"] // 8, CHUNK_FIELDS["next_seq"] // 8
_STARTS = CHUNK_FIELDS["starts"] // 8
_STARTS_MAX = (1 << STARTS_BITS) - 1
_EPISODE_GRANULE = 1024  # episode-index entries reserved at a time (64 KiB)
# Fields of an episode entry after its seq, in the order a writer stores them.
_EPISODE_BODY = ("stream", "chunk", "chunk_seq", "offset", "length", "ep", "flags")
(_E_SEQ, _E_STREAM, _E_CHUNK, _E_CHUNK_SEQ, _E_OFFSET, _E_LENGTH, _E_EP,
 _E_FLAGS) = (EPISODE_FIELDS[f] // 8 for f in ("seq",) + _EPISODE_BODY)


# -- the header ------------------------------------------------------------------
def publish_header(mm, header: bytes) -> None:
    """Copy ``header`` to offset 0 with the magic word stored last, with release order.

    An attacher that loads the magic with acquire order sees every other
    byte of the header, so a creator's name may exist before its header does.
    """
    mm[8:len(header)] = header[8:]
    atomic.store_release(mm, 0, int.from_bytes(header[:8], "little"))


def header_published(mm) -> bool:
    """True once ``publish_header`` has stored the magic."""
    return atomic.load_acquire(mm, 0) == MAGIC


def header_written(mm) -> bool:
    """True once the first word is set: by ``publish_header``, or by something not shmbuf.

    A creator stores the magic last, so a zero word means "not yet"; any
    other word is final, and decoding the header tells a buffer from a
    foreign segment (a wrong magic) at once instead of waiting for it.
    """
    return atomic.load_acquire(mm, 0) != 0


# -- the closed mark and the owner record (segments of every kind) -----------------
_CLOSED, _OWNER, _OWNER_STAMP = COUNTERS["closed"], COUNTERS["owner"], COUNTERS["owner_stamp"]
_CLOCK = COUNTERS["clock"]
_REPLAYED, _RATE = COUNTERS["replayed"], COUNTERS["rate"]


def mark_closed(mm, reason: int, pid: int) -> bool:
    """Set the closed word to ``reason << 32 | pid`` unless it is set; True if this call set it.

    Only a whole header of this layout version is marked: the word of a
    foreign or older segment may mean something else.
    """
    if not header_published(mm) or read_field(mm, "version") != LAYOUT_VERSION:
        return False
    return atomic.compare_exchange(mm, _CLOSED, 0, reason << 32 | pid)


def closed_word(mm) -> int:
    """0 while the buffer is open, else ``reason << 32 | pid`` of who closed it."""
    return atomic.load_acquire(mm, _CLOSED)


class ClosedMark:
    """The closed word of one handle's mapping, checked with one relaxed load (both store kinds).

    A memoryview read is a plain aligned load, half the cost of a numpy
    scalar read.  ``check(pid)`` raises BufferClosedError once the word is
    set, for every handle but the one that set it through ``close_here``
    (and only in the process that did: a forked copy of that handle is
    another handle): after ``unlink()`` an owner may keep using its
    mapping, while a second handle in the same process (a collector
    thread's, say) stops like any other process's.
    """

    exempt_pid: int | None = None   # the pid in which this handle set the word

    def __init__(self, mm, name):
        self._mm = mm
        self.view = memoryview(mm)[_CLOSED:_CLOSED + 8].cast("Q")
        self.name = name

    def close_here(self, reason: int) -> bool:
        """Set the word through this mapping (before the name goes); True if this call set it.

        Only then is this handle exempt from ``check`` afterwards.
        """
        pid = os.getpid()
        if mark_closed(self._mm, reason, pid):
            self.exempt_pid = pid
            return True
        return False

    def check(self, pid: int | None = None) -> None:
        """Raise BufferClosedError if the word is set, unless this handle set it in ``pid``.

        ``pid``: this process's id, if the caller has it at hand (else ``os.getpid()``).
        """
        word = self.view[0]
        if word and self.exempt_pid != (os.getpid() if pid is None else pid):
            raise BufferClosedError(closed_message(self.name, word))


class RateWords:
    """The rate limiter's words of one step store: the ``replayed`` line and the ``rate`` line.

    The admissions themselves (a CAS on ``clock`` for writers, on
    ``replayed`` for samplers, each checking the band first) are one C call
    each (``_atomic.RateGate``), which the writer's C fast path shares; this
    class holds every other load and store of the limiter's words.  Waiting,
    timeouts and messages are ``shmbuf.ratelimit``'s.
    """

    def __init__(self, mm):
        self.mm = mm
        off = self.off = {f: _RATE + o for f, o in RATE_FIELDS.items()}
        self.gate = atomic.RateGate(mm, (_CLOCK, _REPLAYED, off["flags"], off["ratio"],
                                         off["min_steps"], off["tolerance"], off["base"]))
        self.take_insert = self.gate.insert   # n -> the clock before, or -1: the band refuses
        self.take_replay = self.gate.replay   # n -> 1 taken, 0 min_steps not met, 2 past the edge

    def _load(self, field: str) -> int:
        return atomic.load_acquire(self.mm, self.off[field])

    def config(self) -> tuple[int, float, int, float | None]:
        """(flags, train ratio, min_steps, writer timeout or None): constants since create."""
        timeout = self._load("writer_timeout")
        return (self._load("flags"), _double(self._load("ratio")), self._load("min_steps"),
                None if timeout == NO_TIMEOUT else _double(timeout))

    def tolerance(self) -> float:
        return _double(self._load("tolerance"))

    def widen(self, tolerance: float) -> float:
        """Raise the tolerance to at least ``tolerance`` (a CAS loop; it never shrinks); return it.

        Widening only moves the band's edges outwards, so a state inside the
        old band is inside the new one.
        """
        off = self.off["tolerance"]
        while True:
            bits = atomic.load_acquire(self.mm, off)
            if _double(bits) >= tolerance or atomic.compare_exchange(
                    self.mm, off, bits, _bits(tolerance)):
                return max(_double(bits), tolerance)

    def refund(self, n: int) -> None:
        """Give back ``n`` replayed steps a sample took but did not deliver."""
        atomic.fetch_add(self.mm, _REPLAYED, (1 << 64) - n)

    def add_wait(self, side: str, ns: int) -> None:
        """Count ``ns`` nanoseconds waited by ``side`` ("sample" or "insert")."""
        atomic.fetch_add(self.mm, self.off[side + "_wait_ns"], ns)

    def counts(self) -> tuple[int, int, int, int]:
        """(inserted, replayed, sample wait ns, insert wait ns); inserted is clock + base.

        The clock is read before and after ``replayed``, until it did not move
        (a bounded number of tries): then the pair is one instant's, which the
        band holds at (both words only grow).
        """
        for _ in range(64):
            clock = atomic.load_acquire(self.mm, _CLOCK)
            replayed = atomic.load_acquire(self.mm, _REPLAYED)
            if atomic.load_acquire(self.mm, _CLOCK) == clock:
                break
        inserted = (clock + self._load("base")) & _U64
        return (inserted, replayed, self._load("sample_wait_ns"), self._load("insert_wait_ns"))

    def set_counts(self, inserted: int, replayed: int) -> None:
        """Continue from a checkpoint's counts: inserted (through ``base``) and replayed.

        Plain stores: a restore is not concurrent with sampling, and steps
        published meanwhile would only be counted from now on.
        """
        base = (inserted - atomic.load_acquire(self.mm, _CLOCK)) & _U64
        atomic.store_release(self.mm, self.off["base"], base)
        atomic.store_release(self.mm, _REPLAYED, replayed)


def _double(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<Q", bits))[0]


def _bits(value: float) -> int:
    return struct.unpack("<Q", struct.pack("<d", value))[0]


def rate_words(limit: tuple[int, float, int, float | None, float]) -> dict[str, int]:
    """The rate line's words for ``encode_header``: (flags, ratio, min_steps, writer timeout
    or None, tolerance)."""
    flags, ratio, min_steps, timeout, tolerance = limit
    return {"flags": flags, "ratio": _bits(ratio), "min_steps": min_steps,
            "writer_timeout": NO_TIMEOUT if timeout is None else _bits(timeout),
            "tolerance": _bits(tolerance)}


def closed_message(name, word: int) -> str:
    reason, pid = word >> 32, word & _U32
    return (f"buffer {name!r} was closed by {CLOSED_BY.get(reason, 'its owner')} (pid {pid}) "
            "and its name removed; no more steps can be added or sampled. A worker "
            "stops here; attach to a new buffer to continue")


def _owner(mm) -> tuple[int, int]:
    """The owner word and the start time that goes with its lease (0: not recorded yet)."""
    state = atomic.load_acquire(mm, _OWNER)
    stamp = atomic.load_acquire(mm, _OWNER_STAMP)
    start = stamp >> 16 if (stamp & 0xFFFF) == ((state >> 32) & 0xFFFF) else 0
    return state, start


def owner_record(mm) -> tuple[int, int]:
    """(pid, start time or 0 if not yet recorded) of the segment's owner now."""
    state, start = _owner(mm)
    return state & _U32, start


def owner_alive(mm) -> bool:
    return is_alive(*owner_record(mm))


def take_ownership(mm, pid: int, start: int) -> int:
    """Make ``pid`` the owner if the recorded owner is dead; return 0, or the live owner's pid.

    One compare-and-swap on the owner word decides between rivals, like a
    writer slot's claim: the loser reads the winner's pid.  The start time
    is stored after the CAS, tagged with the new lease, so a reader never
    pairs the new pid with the old start time.
    """
    state, seen = _owner(mm)
    holder = state & _U32
    if holder and is_alive(holder, seen):
        return holder
    lease = ((state >> 32) + 1) & _U32 or 1
    if not atomic.compare_exchange(mm, _OWNER, state, lease << 32 | pid):
        return owner_record(mm)[0]  # a rival won
    atomic.store_release(mm, _OWNER_STAMP, start << 16 | (lease & 0xFFFF))
    return 0


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
        self.rate = RateWords(mm)      # the rate limiter's words (unused without a limit)
        # None or full: every page is reserved already (prefault, keyed rings, the CLI)
        self.space = None if space is None or space.full else space
        self._episodes_reserved = 0  # index entries below it are known to be reserved
        self.mark = mark = ClosedMark(mm, name)   # this handle's: see ClosedMark
        self.closed_view = mark.view   # the writer's C fast path reads it too
        self.check_open = mark.check   # check_open(pid): see ClosedMark
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
        # The geometry _windows.c works with: sizes, then the chunk fields it
        # reads (its FIELDS), all taken from _layout.
        self.geometry = (layout.chunks_offset, n, k, layout.capacity,
                         layout.column(EP_COLUMN).offset, CHUNK_ENTRY,
                         CHUNK_FIELDS["state"], CHUNK_FIELDS["count"], CHUNK_FIELDS["next"],
                         CHUNK_FIELDS["next_seq"], CHUNK_FIELDS["starts"], STARTS_BITS)
        # Chunks of 2**31 rows or more do not fit the starts word: readers use _ep.
        self.starts_reset = 0 if k <= _STARTS_MAX else STARTS_UNTRACKED
        self.priorities = Priorities(self) if layout.priorities else None

    # -- reserving pages before a ticket makes them readable (see _space) -----------
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

    def _reserve_chunk(self, ticket: int) -> None:
        """Before ``ticket``'s claim: a chunk of the first lap gets its entry and rows
        reserved, and the episode index room for one episode end per row."""
        lay, chunk, space = self.layout, ticket, self.space
        assert space is not None  # _take prepares only with a space
        rows = int(self.chunk_rows[chunk % lay.n_chunks])
        if chunk < lay.n_chunks:
            first = int(self.chunk_base[chunk])
            what = (f"chunk {chunk} ({rows} steps, {rows * sum(c.row_bytes for c in lay.columns)}"
                    " bytes over all columns)")
            space.reserve(lay.chunk_field(chunk, "state"), CHUNK_ENTRY, what)
            for col in lay.columns:
                space.reserve(col.offset + first * col.row_bytes, rows * col.row_bytes, what)
        self._reserve_episodes(self.counter("episode_ticket") + rows)

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
        self.bump("samples")
        self.bump("sampled_rows", rows)

    def claimed_rows(self) -> int:
        """Rows of the chunks claimed so far: every committed row lies below it."""
        claimed = min(self.counter("ticket"), self.layout.n_chunks)
        return int(self.chunk_base[claimed - 1] + self.chunk_rows[claimed - 1]) if claimed else 0

    # -- writer slots -----------------------------------------------------------
    def claim_slot(self) -> "Slot":
        """Take a free slot, or the slot of a dead process."""
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
                    return Slot(self, slot, lease)
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
    def claim_chunk(self, slot: int, lease: int, stream: int) -> tuple[int, int]:
        """Recycle the oldest chunk no live writer is filling; return (chunk, seq).

        Round-robin tickets make the chunk claimed longest ago the next one
        recycled: FIFO eviction across all writers.

        Raises:
            SharedMemoryFullError: /dev/shm cannot hold the chunk's pages;
                nothing changed, and a later claim may succeed.
        """
        n = self.layout.n_chunks
        for _ in range(2 * n + 2):
            ticket = self._take("ticket", self._reserve_chunk)
            seq = self.recycle(ticket % n, slot, lease, stream, ticket)
            if seq is not None:
                return ticket % n, seq
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
        if not atomic.compare_exchange(self.mm, off, state,
                                       pack_chunk_state(odd, False, slot, lease)):
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
        seq = (table[:, _STATE] >> np.uint64(32)).astype(np.int64)
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
        seq[:claimed] = self.chunk_table[:claimed, _STATE] >> np.uint64(32)
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
        seq = (state >> np.uint64(32)).astype(np.int64)
        final = (state & np.uint64(SEALED)) != 0
        for chunk in np.flatnonzero(~final & (counts > 0) & (seq & 1 == 0)):
            _, _, slot, lease = unpack_chunk_state(int(state[chunk]))
            final[chunk] = slot == NO_SLOT or not self.slot_alive(slot, lease)
        order = np.argsort(table[:, _TICKET], kind="stable")
        order = order[final[order] & (counts[order] > 0) & (seq[order] & 1 == 0)]
        return Chunks(order.astype(np.int64), seq[order], counts[order],
                      table[order, _STREAM].astype(np.int64), self.chunk_base[order],
                      table[order, _TICKET].astype(np.int64))

    def links(self, chunks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(successor chunk or -1, the successor's seq) of each of ``chunks``, as linked now.

        ``link`` stores next_seq before next, so next is loaded first.
        """
        nxt = self.chunk_table[chunks, _NEXT].astype(np.int64) - 1
        atomic.fence_acquire()
        return nxt, self.chunk_table[chunks, _NEXT_SEQ].astype(np.int64)

    def unchanged(self, chunks: np.ndarray, seqs: np.ndarray) -> np.ndarray:
        """After reading rows: True where each (chunk, seq) still holds (acquire first)."""
        atomic.fence_acquire()
        now = (self.chunk_table[chunks, _STATE] >> np.uint64(32)).astype(np.int64)
        return now == seqs

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
        ok &= ((self.chunk_table[chunk, _STATE] >> np.uint64(32)).astype(np.int64)
               == body[:, _E_CHUNK_SEQ])
        return Episodes(indices, length, (body[:, _E_FLAGS] & TERMINAL) != 0,
                        body[:, _E_STREAM], body[:, _E_EP], chunk, body[:, _E_CHUNK_SEQ],
                        body[:, _E_OFFSET]).take(ok)


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
        # The geometry _prio.c works with, all from _layout.
        self.geometry = (lay.chunks_offset, lay.n_chunks, lay.chunk_size, lay.capacity,
                         CHUNK_ENTRY, CHUNK_FIELDS["state"], CHUNK_FIELDS["count"],
                         CHUNK_FIELDS["next"], CHUNK_FIELDS["next_seq"], CHUNK_FIELDS["ticket"],
                         16, NO_SLOT, lay.column(PRIORITY_COLUMN).offset,
                         lay.priority_blocks_offset, lay.priority_prev_offset, lay.priority_block,
                         lay.blocks_per_chunk, lay.n_chunks * lay.blocks_per_chunk,
                         self._max_off, COUNTERS["ticket"], lay.priority_trees)
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
        value, _ = self.values(np.where(held, chunk * k + off, 0))
        atomic.fence_acquire()
        held &= table[chunk, _STATE] == state
        return np.where(held, value, np.float32(np.nan)).reshape(ids.shape)

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
                    tree: int) -> tuple[np.ndarray, np.ndarray]:
        """(score, score / proposal bound) of each located window (``tree`` -1: uniform
        proposals); see ``_prio.score_ratio``."""
        score = np.empty(len(rows), np.float64)
        ratio = np.empty(len(rows), np.float64)
        _prio.score_ratio(self.mm, self.geometry, np.ascontiguousarray(rows, np.int64),
                          exponent, maxfrac, largest, tree, score, ratio)
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

    def advance(self, i: int) -> None:
        """Give stream ``i`` a fresh chunk, linked after its current one."""
        ring, slot = self.ring, self.slot
        chunk, seq = ring.claim_chunk(slot.slot, slot.lease, int(self.id[i]))
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
        if self._on_claim is not None:
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
        atomic.store_release(self.ring.mm, int(self.count_off[i]), fill)
        if terminal:
            self.end(i, True)

    def appender(self, names: tuple, views: tuple, ep_view: np.ndarray, done: int):
        """The C fast path that appends one step to each of these streams (``_atomic.c``).

        It checks that every value already fits its column exactly, copies,
        numbers (``stamp``), counts and publishes in ``publish``'s order, and shares this object's
        cursors.  None when the columns do not suit it (a done column that is
        not a plain numeric scalar): the caller keeps the Python path.
        """
        try:
            return atomic.Appender(self.ring.mm, names, views, ep_view, self.ring.clock_rows,
                                   done, self.fill, self.base, self.rows, self.count_off,
                                   self.ep, self.left, self.slot.steps_off, _CLOCK, _CLOSED,
                                   None if self._limit is None else self._limit.words.gate)
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
        atomic.store_release(self.ring.mm, int(self.count_off[i]), start + n)
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
        atomic.store_many(self.ring.mm, self.count_off, self.fill)
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
        atomic.store_release(self.ring.mm, int(self.count_off[i]) - CHUNK_FIELDS["count"]
                             + CHUNK_FIELDS["starts"], word)
