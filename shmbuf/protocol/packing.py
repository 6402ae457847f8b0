"""The shared words of compressed chunks: every load and store of them is in this file.

A buffer created with ``compress=Compress(...)`` has a packing area after its
columns (``PackPlan``): one word per reader thread (the reader slots), one
word per chunk (its packing state), and one blob slot per chunk, where that
chunk's compressed columns live.  docs/design.md ("Compressed chunks") states
the protocol and its proofs; in short:

- A chunk's word is ``seq << 32 | phase << 30 | mask << 22 | pid``: the
  chunk's seq when it was packed, the phase (``RAW``, ``BUSY``: a compressor
  holds it, ``PUNCHING``: its blob is complete and its raw pages are being
  given back, ``PACKED``), which columns are packed, and the compressor's pid
  while it holds the word.  Only a compressor that won the word by CAS
  writes the chunk's blob slot or punches its raw pages.
- The word has no room for the holder's start time, so each chunk has a
  second word, its stamp: ``pid << 42 | start time``, stored by a compressor
  before its CAS (and again once it won).  A holder whose pid runs but whose
  stamp names that pid with another start time died and its pid was reused:
  the chunk is adopted at once.  A stamp naming another pid (a racing
  compressor's) proves nothing either way, and the holder counts as alive.
- A reader marks its slot odd (a seq_cst store and fence) before it loads
  chunk words, and even when its copies are done.  A compressor publishes
  ``PUNCHING`` by CAS and then waits until every slot that was odd has
  changed (``quiesce``) before it punches, so no reader ever touches a raw
  page that is a hole: on tmpfs a read fault there allocates a page, and a
  full /dev/shm turns it into SIGBUS.
- Blobs are read with ``pread``, never through the mapping: a hole reads as
  zeros there and allocates nothing, so a recycler may punch a blob slot while
  a reader decodes it (the reader's seq re-check then throws the copy away).
- A writer that recycles a chunk (``Ring.recycle``) calls ``on_recycle``
  after its state CAS: a word held by a live compressor sends it on to the
  next chunk (it undoes its CAS: nothing was written yet); any other non-raw
  word gets the chunk's raw pages reserved again first (ENOSPC:
  ``SharedMemoryFullError``, the CAS undone), then the word reset and the
  blob slot given back.
"""
from __future__ import annotations

import ctypes
import dataclasses
import errno
import math
import os
import threading
import weakref

import numpy as np

from .._errors import SharedMemoryFullError
from ..posix.procs import (
    PID_BITS_MASK,
    STAMP_PID_SHIFT,
    STAMP_START_MASK,
    is_alive,
    my_stamp,
    my_start_time,
    start_time,
)
from ..posix.space import PAGE
from ..posix.wait import poll
from . import _atomic as atomic

RAW, BUSY, PUNCHING, PACKED = 0, 1, 2, 3
MAX_COLUMNS = 8           # mask bits in a chunk word
PID_MASK = PID_BITS_MASK   # Linux pids are below 2**22 (pid_max's ceiling)
READER_SLOTS = 1024       # reader threads attached at once, over all processes
READER_ENTRY = 16         # state word (pid << 32 | generation: odd while reading), start time
DIR_ENTRY = 8             # per block of a packed column: u32 offset in the slot, u32 length
MIN_RATIO = 1.5           # a column kept packed must shrink at least this much
QUIET_WAIT = 10.0         # s a load waits for readers before giving pages back (else keeps them)
_FULL = (errno.ENOSPC, errno.ENOMEM, errno.EFBIG)
_PUNCH = 0x01 | 0x02      # FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE
_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]


def pack_word(seq: int, phase: int, mask: int, pid: int) -> int:
    """A chunk word; ``pid`` is 0 unless a compressor holds the word."""
    return (seq & 0xFFFFFFFF) << 32 | phase << 30 | mask << 22 | (pid & PID_MASK)


def unpack_word(word: int) -> tuple[int, int, int, int]:
    """``(seq, phase, mask, pid)`` of a chunk word."""
    return word >> 32, (word >> 30) & 3, (word >> 22) & 0xFF, word & PID_MASK


def unpack_words(words: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(seq, phase, mask)`` (int64 arrays) of chunk words (uint64): ``unpack_word``
    for many at once."""
    w = np.asarray(words, np.uint64)
    return ((w >> np.uint64(32)).astype(np.int64),
            ((w >> np.uint64(30)) & np.uint64(3)).astype(np.int64),
            ((w >> np.uint64(22)) & np.uint64(0xFF)).astype(np.int64))


def holder_alive(pid: int, stamp: int = 0) -> bool:
    """True if the compressor ``pid`` that a chunk word names may still run: its pid runs,
    and the chunk's ``stamp``, if it names that pid, names its start time too."""
    if pid <= 0:
        return False
    actual = start_time(pid)
    if actual is None:
        return False
    if stamp >> STAMP_PID_SHIFT != pid:
        return True      # no stamp of this holder (a racer's, or none yet): assume it runs
    return stamp & STAMP_START_MASK == actual & STAMP_START_MASK


@dataclasses.dataclass(frozen=True)
class PackedColumn:
    name: str
    offset: int       # the column's offset in the segment
    row_bytes: int
    bit: int          # its bit in a chunk word's mask


@dataclasses.dataclass(frozen=True)
class PackPlan:
    """Where the packing area's parts are, from the layout and the ``Compress`` settings.

    The area starts page-aligned after the columns: ``READER_SLOTS`` reader
    entries, one word and one stamp per chunk, then ``n_chunks`` blob slots of
    ``slot_bytes`` (page multiples).  A slot holds a directory (``DIR_ENTRY``
    per block of each packed column) and the blocks.  A column is kept
    packed only if it shrinks ``MIN_RATIO`` times, so a slot of the
    directory plus ``raw / MIN_RATIO`` bytes always holds what is kept: no
    allocator, nothing to fragment, and a recycled chunk's slot is its own.
    The slots are virtual address space: only the pages a blob fills are
    reserved.
    """

    offset: int
    n_chunks: int
    chunk_size: int
    capacity: int
    block_rows: int
    columns: tuple[PackedColumn, ...]
    readers_offset: int
    words_offset: int
    stamps_offset: int
    slots_offset: int
    slot_bytes: int
    total_bytes: int

    @property
    def n_blocks(self) -> int:
        return -(-self.chunk_size // self.block_rows)

    @property
    def dir_bytes(self) -> int:
        return len(self.columns) * self.n_blocks * DIR_ENTRY

    def slot(self, chunk: int) -> int:
        return self.slots_offset + chunk * self.slot_bytes

    def rows_of(self, chunk: int) -> int:
        return min(self.chunk_size, self.capacity - chunk * self.chunk_size)

    def raw_range(self, col: PackedColumn, chunk: int, inward: bool) -> tuple[int, int]:
        """The page-aligned byte range of ``chunk``'s rows in ``col``: inward (pages only
        this chunk uses, which punching may give back) or outward (every page it touches)."""
        lo = col.offset + chunk * self.chunk_size * col.row_bytes
        hi = lo + self.rows_of(chunk) * col.row_bytes
        if inward:
            return -(-lo // PAGE) * PAGE, hi // PAGE * PAGE
        return lo // PAGE * PAGE, -(-hi // PAGE) * PAGE


def plan_packing(offset: int, n_chunks: int, chunk_size: int, capacity: int, block_rows: int,
                 columns: list[tuple[str, int, int]]) -> PackPlan:
    """The ``PackPlan`` of an area at ``offset`` (page-aligned up) for ``columns``
    (``(name, offset, row_bytes)`` each, in the order of their mask bits)."""
    start = -(-offset // PAGE) * PAGE
    words = start + READER_SLOTS * READER_ENTRY
    stamps = words + n_chunks * 8
    slots = -(-(stamps + n_chunks * 8) // PAGE) * PAGE
    n_blocks = -(-chunk_size // block_rows)
    dir_bytes = len(columns) * n_blocks * DIR_ENTRY
    kept = sum(math.floor(chunk_size * rb / MIN_RATIO) for _, _, rb in columns)
    slot_bytes = -(-(dir_bytes + kept) // PAGE) * PAGE
    cols = tuple(PackedColumn(n, o, rb, i) for i, (n, o, rb) in enumerate(columns))
    return PackPlan(start, n_chunks, chunk_size, capacity, block_rows, cols, start, words,
                    stamps, slots, slot_bytes, slots + n_chunks * slot_bytes)


def punch(fd: int, start: int, end: int) -> None:
    """Give the pages of ``[start, end)`` back to tmpfs (both page-aligned)."""
    if end > start and _libc.fallocate(fd, _PUNCH, start, end - start):
        code = ctypes.get_errno()
        raise OSError(code, f"fallocate(PUNCH_HOLE): {os.strerror(code)}")


class Readers:
    """This handle's reader slots: one per thread that reads, claimed on first use.

    ``enter()`` / ``leave()`` bracket every read of raw column pages that a
    compressor might punch.  A slot is ``pid << 32 | generation``; odd while
    its thread reads.  A slot whose pid (with its start time) is gone is
    free, and so is one whose thread ended (its thread-local token's
    finalizer gives it back), and every slot of this handle once it closes.
    """

    def __init__(self, mm, plan: PackPlan):
        self.mm, self.base = mm, plan.readers_offset
        self.view = np.frombuffer(mm, "<u8", READER_SLOTS * 2, plan.readers_offset)
        self._local = threading.local()
        self._held: set[int] = set()   # offsets of the slots this handle's threads claimed

    def close(self) -> None:
        """Give back this handle's idle slots and drop the mapping (the buffer closes)."""
        mm, self.mm = self.mm, None
        if mm is not None:
            for off in list(self._held):
                _release(mm, off, os.getpid() << 32)
        self._held.clear()
        self.view = None   # type: ignore[assignment]

    def enter(self) -> None:
        tl, pid = self._local, os.getpid()
        if getattr(tl, "pid", None) != pid:
            self._claim(tl, pid)
        tl.gen += 1
        atomic.store_release(self.mm, tl.off, pid << 32 | (tl.gen & 0xFFFFFFFF))
        # seq_cst: this store before any chunk word this thread loads next
        # (the Dekker pair with a compressor's CAS and its loads of the slots).
        atomic.fence_seq_cst()

    def leave(self) -> None:
        tl = self._local
        tl.gen += 1
        atomic.store_release(self.mm, tl.off, os.getpid() << 32 | (tl.gen & 0xFFFFFFFF))

    def _claim(self, tl, pid: int) -> None:
        me = my_start_time()
        for i in range(READER_SLOTS):
            off = self.base + i * READER_ENTRY
            word = atomic.load_acquire(self.mm, off)
            holder = word >> 32
            if word and (holder == pid or is_alive(holder, atomic.load_acquire(self.mm, off + 8))):
                continue
            if atomic.compare_exchange(self.mm, off, word, pid << 32):
                atomic.store_release(self.mm, off + 8, me)
                tl.pid, tl.off, tl.gen = pid, off, 0
                # The thread's local dict dies with the thread: give the slot back then
                # (through a weak reference: a finalizer must not keep the mapping alive).
                tl.token = token = _Token()
                weakref.finalize(token, _release_weak, weakref.ref(self), off, pid << 32)
                self._held.add(off)
                return
        raise RuntimeError(f"all {READER_SLOTS} reader slots of the buffer are held by live "
                           "threads; read from fewer threads at once")

    def busy(self) -> list[tuple[int, int]]:
        """``(offset, word)`` of every slot whose thread is inside a read now."""
        atomic.fence_seq_cst()
        words = self.view[0::2].copy()
        atomic.fence_acquire()
        odd = np.flatnonzero(words & np.uint64(1))
        return [(self.base + int(i) * READER_ENTRY, int(words[i])) for i in odd]

    def moved_on(self, off: int, word: int) -> bool:
        """True once the reader that held ``word`` at ``off`` left its read, or died."""
        if atomic.load_acquire(self.mm, off) != word:
            return True
        return not is_alive(word >> 32, atomic.load_acquire(self.mm, off + 8))


class _Token:
    """A weak-referenceable object kept in a thread's locals (see ``Readers._claim``)."""


def _release_weak(readers, off: int, idle: int) -> None:
    r = readers()
    if r is not None and r.mm is not None:
        r._held.discard(off)
        _release(r.mm, off, idle)


def _release(mm, off: int, idle: int) -> None:
    try:
        word = atomic.load_acquire(mm, off)
        if word >> 32 == idle >> 32 and not word & 1:
            atomic.compare_exchange(mm, off, word, 0)
    except (ValueError, TypeError):   # the mapping was closed first: nothing to give back
        pass


class PackWords:
    """The packing words and blob slots of one mapped buffer (``mm``, descriptor ``fd``)."""

    def __init__(self, mm, fd: int, plan: PackPlan, name: str):
        self.mm, self.fd, self.plan, self.name = mm, fd, plan, name
        self.words = np.frombuffer(mm, "<u8", plan.n_chunks, plan.words_offset)
        self.readers = Readers(mm, plan)

    def close(self) -> None:
        """Drop every view of the mapping (the buffer closes; the descriptor is its)."""
        self.readers.close()
        self.mm = self.words = None   # type: ignore[assignment]

    def _off(self, chunk: int) -> int:
        return self.plan.words_offset + chunk * 8

    # -- readers ---------------------------------------------------------------------
    def load(self, chunks: np.ndarray) -> np.ndarray:
        """The words of ``chunks`` (relaxed loads, then an acquire fence)."""
        out = self.words[chunks]
        atomic.fence_acquire()
        return out

    def word(self, chunk: int) -> int:
        return atomic.load_acquire(self.mm, self._off(chunk))

    def read_dir(self, chunk: int) -> np.ndarray:
        """The blob directory of ``chunk``: ``(columns, blocks, 2)`` u32 offset and length.

        Read with ``pread``, so a slot given back meanwhile reads as zeros."""
        plan = self.plan
        raw = os.pread(self.fd, plan.dir_bytes, plan.slot(chunk))
        if len(raw) < plan.dir_bytes:
            raw = raw.ljust(plan.dir_bytes, b"\0")
        return np.frombuffer(raw, "<u4").reshape(len(plan.columns), plan.n_blocks, 2)

    def read_blob(self, chunk: int, offset: int, length: int) -> bytes:
        """``length`` bytes at ``offset`` of ``chunk``'s slot (bounded by the slot)."""
        plan = self.plan
        length = max(0, min(length, plan.slot_bytes - offset))
        return os.pread(self.fd, length, plan.slot(chunk) + offset)

    # -- compressors -------------------------------------------------------------------
    def stamp(self, chunk: int) -> int:
        """``chunk``'s stamp (see ``holder_alive``)."""
        return atomic.load_acquire(self.mm, self.plan.stamps_offset + chunk * 8)

    def held_by_live(self, chunk: int, pid: int) -> bool:
        """True if the compressor ``pid`` that ``chunk``'s word names may still run."""
        return holder_alive(pid, self.stamp(chunk))

    def mark(self, chunk: int) -> None:
        """Stamp ``chunk`` with this process: before a CAS that may name it, and after."""
        atomic.store_release(self.mm, self.plan.stamps_offset + chunk * 8, my_stamp())

    def take(self, chunk: int, expected: int, desired: int) -> bool:
        """CAS ``chunk``'s word; then a seq_cst fence, so the caller's next load of the
        chunk's state comes after it (the Dekker pair with ``on_recycle``)."""
        won = atomic.compare_exchange(self.mm, self._off(chunk), expected, desired)
        atomic.fence_seq_cst()
        return won

    def write_slot(self, chunk: int, data: bytes) -> None:
        """Reserve the pages ``data`` needs at the start of ``chunk``'s slot, write it
        (``pwrite``), and give back the rest of the slot.  The caller holds the word.

        Raises:
            SharedMemoryFullError: /dev/shm cannot hold the blob; nothing was written.
        """
        start, used = self.plan.slot(chunk), -(-len(data) // PAGE) * PAGE
        if used:
            self.reserve(start, used, f"the compressed columns of chunk {chunk}")
            os.pwrite(self.fd, data, start)
        punch(self.fd, start + used, start + self.plan.slot_bytes)

    def punch_raw(self, chunk: int, mask: int) -> None:
        """Give back the raw pages of ``chunk``'s packed columns (the caller holds the
        word in ``PUNCHING`` and has quiesced the readers)."""
        for col in self.plan.columns:
            if mask >> col.bit & 1:
                punch(self.fd, *self.plan.raw_range(col, chunk, inward=True))

    def reserve(self, start: int, length: int, what: str) -> None:
        try:
            os.posix_fallocate(self.fd, start, length)
        except OSError as exc:
            if exc.errno not in _FULL:
                raise
            from ..posix.space import fs_bytes, human
            total, free = fs_bytes(os.path.dirname(os.readlink(f"/proc/self/fd/{self.fd}")))
            raise SharedMemoryFullError(
                exc.errno, f"buffer {self.name!r}: /dev/shm cannot reserve {length} bytes for "
                f"{what}: it has {free} bytes ({human(free)}) left of {human(total)}. Nothing "
                "was written and the buffer keeps what it holds; free space or give the machine "
                "more shared memory (docker run --shm-size=...)") from None

    # -- a load (restore of a save's compressed blocks) --------------------------------
    def put_packed(self, chunk: int, seq: int, mask: int, data: bytes) -> bool:
        """Make ``data`` (a slot's bytes: directory, then blocks, as a compressor writes
        them) ``chunk``'s packed columns ``mask`` at ``seq``; False if its word is not
        free (the caller then writes those rows raw).

        The caller has just claimed the chunk (seq ``seq``, unsealed, none of its rows
        published) and will never write the rows of ``mask``'s columns: the word is
        ``PACKED`` before the first row is published (the count's store-release comes
        after this CAS), so no reader ever reads those rows raw, and their pages stay
        holes (a recycle had reserved them again: they are given back here).  A
        compressor takes only sealed chunks; one that won the free word before the claim
        showed undoes it at once, so this waits for that briefly.

        Raises:
            SharedMemoryFullError: /dev/shm cannot hold the blob; nothing was published.
        """
        off, written = self._off(chunk), False
        for _ in range(100_000):
            word = atomic.load_acquire(self.mm, off)
            if word == 0:
                if not written:
                    self.write_slot(chunk, data)
                    written = True
                if atomic.compare_exchange(self.mm, off, 0, pack_word(seq, PACKED, mask, 0)):
                    atomic.fence_seq_cst()
                    # Nothing of this claim is there; pages a recycle reserved again may
                    # still be read by a reader of the chunk's previous claim (its re-check
                    # drops the copy), so they go back only once those readers have left.
                    if self._quiet(QUIET_WAIT):
                        self.punch_raw(chunk, mask)
                    return True
                continue
            _, phase, _, pid = unpack_word(word)
            if phase != BUSY or not self.held_by_live(chunk, pid):
                break
            os.sched_yield()   # a compressor that saw the chunk sealed before: it backs off
        if written:
            start = self.plan.slot(chunk)
            punch(self.fd, start, start + self.plan.slot_bytes)
        return False

    def _quiet(self, timeout: float) -> bool:
        """Wait until every reader inside a read now has left it; False after ``timeout``."""
        busy = self.readers.busy()
        if not busy:
            return True
        try:
            poll(lambda: True if all(self.readers.moved_on(o, w) for o, w in busy) else None,
                 timeout, lambda: TimeoutError())
        except TimeoutError:
            return False
        return True

    # -- the recycler (Ring.recycle, after its state CAS) -------------------------------
    def reserve_raw(self, chunk: int, word: int | None = None) -> bool:
        """Reserve ``chunk``'s raw pages of its packed columns again, as its recycle will;
        False (nothing reserved) if a live compressor holds it (``word``: its word as
        read, default: read now).  Also before the claim's ticket moves (``Ring``), so
        that a full /dev/shm stops the claim while the chunk is still next in FIFO order.

        Raises:
            SharedMemoryFullError: /dev/shm cannot hold them.
        """
        word = self.word(chunk) if word is None else word
        if word == 0:
            return True   # raw: its pages are reserved
        _, phase, _, pid = unpack_word(word)
        if phase in (BUSY, PUNCHING) and self.held_by_live(chunk, pid):
            return False
        # Packed, or left by a dead compressor: raw pages may be holes.  Reserving
        # pages that are reserved changes nothing, so this is always safe.
        for col in self.plan.columns:
            lo, hi = self.plan.raw_range(col, chunk, inward=False)
            self.reserve(lo, hi - lo, f"chunk {chunk}'s rows of {col.name!r} again")
        return True

    def on_recycle(self, chunk: int) -> bool:
        """Make ``chunk`` raw again for a writer that has just claimed it (seq odd,
        nothing written yet); False: a live compressor holds it, undo the claim.

        Raises:
            SharedMemoryFullError: its raw pages cannot be reserved again (undo the claim).
        """
        atomic.fence_seq_cst()   # the claim's CAS before this load (Dekker with ``take``)
        off = self._off(chunk)
        while True:
            word = atomic.load_acquire(self.mm, off)
            if word == 0:
                return True
            if not self.reserve_raw(chunk, word):
                return False
            if atomic.compare_exchange(self.mm, off, word, 0):
                break
        start = self.plan.slot(chunk)
        punch(self.fd, start, start + self.plan.slot_bytes)
        return True
