"""The index protocol: writer slots, chunk claims, links, seals, counters.

Everything here is lock-free.  Writers claim a slot (one per writer object)
and then chunks, each with a compare-and-swap on one 64-bit word; a process
that dies at any instant leaves words that the next claimant recognises as
dead (pid + start time) and takes over.  docs/design.md states the
invariants; the byte layout is in _layout.py.
"""
from __future__ import annotations

import os

import numpy as np

from . import _atomic as atomic
from ._errors import NoFreeChunkError, NoFreeWriterSlotError
from ._layout import (CHUNK_ENTRY, CHUNK_FIELDS, COUNTERS, NO_SLOT, SLOT_ENTRY, SLOT_FIELDS,
                      Layout, pack_chunk_state, unpack_chunk_state)
from ._procs import is_alive, my_start_time

_U32 = 0xFFFFFFFF


class Ring:
    """The header of one mapped segment, seen through its atomic words."""

    def __init__(self, mm, layout: Layout):
        self.mm = mm
        self.layout = layout
        n, k = layout.n_chunks, layout.chunk_size
        table = np.frombuffer(mm, dtype="<u8", count=n * CHUNK_ENTRY // 8,
                              offset=layout.chunks_offset).reshape(n, CHUNK_ENTRY // 8)
        self.chunk_table = table
        self.count = table[:, CHUNK_FIELDS["count"] // 8]
        self.chunk_base = np.arange(n, dtype=np.int64) * k
        self.chunk_rows = np.minimum(k, layout.capacity - self.chunk_base)
        off = layout.chunks_offset + np.arange(n, dtype=np.int64) * CHUNK_ENTRY
        self.state_off, self.count_off = off, off + CHUNK_FIELDS["count"]
        self.slot_table = np.frombuffer(mm, dtype="<u8", count=layout.max_writers * SLOT_ENTRY // 8,
                                        offset=layout.slots_offset).reshape(-1, SLOT_ENTRY // 8)
        self.slot_steps = self.slot_table[:, SLOT_FIELDS["steps"] // 8]

    # -- counters -------------------------------------------------------
    def counter(self, name: str) -> int:
        return atomic.load_acquire(self.mm, COUNTERS[name])

    def bump(self, name: str, delta: int = 1) -> int:
        return atomic.fetch_add(self.mm, COUNTERS[name], delta)

    # The sums are relaxed loads; the fence orders them before any later
    # load, which Buffer.stats relies on for a consistent snapshot.
    def live_steps(self) -> int:
        total = int(self.count.sum())
        atomic.fence_acquire()
        return total

    def steps_written(self) -> int:
        total = int(self.slot_steps.sum())
        atomic.fence_acquire()
        return total

    def episodes_ended(self) -> int:
        return int(self.slot_table[:, SLOT_FIELDS["episodes"] // 8].sum())

    # -- writer slots ---------------------------------------------------
    def claim_slot(self) -> tuple[int, int]:
        """Take a free slot, or the slot of a dead process; return (slot, lease)."""
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

    def release_slot(self, slot: int, lease: int) -> None:
        off = self.layout.slot_field(slot, "state")
        state = atomic.load_acquire(self.mm, off)
        if state >> 32 != lease or not state & _U32:
            return  # taken over already: someone judged us dead
        atomic.store_release(self.mm, self.layout.slot_field(slot, "start_time"), 0)
        atomic.compare_exchange(self.mm, off, state, lease << 32)

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

    # -- chunks -----------------------------------------------------------
    def claim_chunk(self, slot: int, lease: int, stream: int) -> tuple[int, int]:
        """Recycle the oldest chunk no live writer is filling; return (chunk, seq).

        Round-robin tickets make the chunk claimed longest ago the next one
        recycled: FIFO eviction across all writers.
        """
        n = self.layout.n_chunks
        for _ in range(2 * n + 2):
            ticket = self.bump("ticket")
            seq = self.recycle(ticket % n, slot, lease, stream, ticket)
            if seq is not None:
                return ticket % n, seq
        raise NoFreeChunkError(
            f"all {n} chunks of {self.layout.chunk_size} steps are held by live writer "
            "streams; create the buffer with a smaller chunk_size or a larger capacity, "
            "or use fewer writer streams")

    def recycle(self, chunk: int, slot: int, lease: int, stream: int, ticket: int) -> int | None:
        """Empty ``chunk`` for ``slot`` unless a live writer holds it; return its new seq.

        The seq goes odd (claimed, being reset) and then even again with count
        0, so a reader that saw the old seq fails validation.  With ``slot ==
        NO_SLOT`` the chunk ends up sealed and ownerless: free, and empty.
        """
        off = self.layout.chunk_field(chunk, "state")
        state = atomic.load_acquire(self.mm, off)
        seq, sealed, owner, owner_lease = unpack_chunk_state(state)
        busy = seq & 1 or not sealed
        if busy and owner != NO_SLOT and self.slot_alive(owner, owner_lease):
            return None  # a live writer is still filling (or resetting) it
        odd = (seq + 1 + (seq & 1)) & _U32
        if not atomic.compare_exchange(self.mm, off, state,
                                       pack_chunk_state(odd, False, slot, lease)):
            return None
        self._evict(chunk)
        for field, value in (("next", 0), ("next_seq", 0), ("stream", stream),
                             ("ticket", ticket)):
            atomic.store_release(self.mm, self.layout.chunk_field(chunk, field), value)
        even = (odd + 1) & _U32
        atomic.store_release(self.mm, off, pack_chunk_state(even, slot == NO_SLOT, slot, lease))
        return even

    def _evict(self, chunk: int) -> None:
        off = self.layout.chunk_field(chunk, "count")
        while True:
            old = atomic.load_acquire(self.mm, off)
            if atomic.compare_exchange(self.mm, off, old, 0):
                break
        if old:
            self.bump("evicted", old)

    def link(self, chunk: int, successor: int, successor_seq: int) -> None:
        """Publish ``successor`` as the continuation of ``chunk``'s stream."""
        atomic.store_release(self.mm, self.layout.chunk_field(chunk, "next_seq"), successor_seq)
        atomic.store_release(self.mm, self.layout.chunk_field(chunk, "next"), successor + 1)

    def seal(self, chunk: int, seq: int, slot: int, lease: int) -> None:
        """Mark ``chunk`` as done by its owner, so it may be recycled."""
        atomic.compare_exchange(self.mm, self.layout.chunk_field(chunk, "state"),
                                pack_chunk_state(seq, False, slot, lease),
                                pack_chunk_state(seq, True, slot, lease))

    def chunks_in_use(self) -> int:
        return int(np.count_nonzero(self.count))
