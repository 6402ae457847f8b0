"""The compressor: packs cold chunks of one buffer, a round at a time.

A round (``Packer.round``) finds the eligible chunks (sealed, even seq,
rows committed, newest step at least ``hot_steps`` old, not packed at this
seq), newest first, and for each: wins its word (``BUSY``), checks that the
chunk is still the one it saw, encodes the packed columns block by block
from the raw rows (which nobody can change or punch while the word is held),
writes the blob slot, and publishes ``PUNCHING``.  Then one quiescence wait
covers every chunk of the round, the raw pages are punched, and each word
becomes ``PACKED``.  A compressor that dies at any instant leaves words that
name a dead pid: the next round (in an adopter, or ``compact`` anywhere)
takes them over, and a writer that recycles such a chunk reserves its pages
again.  See ``protocol.packing`` and docs/design.md.

Who compresses: a background thread of the owner (``start``), and anyone who
calls ``Buffer.compact``.  Two rounds in one process never overlap (a lock):
the words and stamps tell processes apart, not threads.
"""
from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .._errors import SharedMemoryFullError
from ..posix.space import PAGE
from ..posix.wait import poll
from ..protocol.layout import chunk_seqs, chunks_sealed
from ..protocol.packing import (
    BUSY,
    MIN_RATIO,
    PACKED,
    PUNCHING,
    PackWords,
    pack_word,
    unpack_word,
    unpack_words,
)
from ..sampling.codec import Codec

ROUND_CHUNKS = 64       # chunks per round at most: one quiescence wait covers them
ROUND_SHARE = 8         # and at most 1/8 of the chunks: writers skip chunks a round holds
IDLE_PAUSE = 0.05       # seconds the background thread sleeps when nothing is cold
THREAD_NICE = 19        # the compressor thread's nice value: writers and the trainer go first
CATCH_UP_NICE = 10      # the catch-up thread's: it takes CPU from busy writers when behind
BACKLOG_SHARE = 10      # behind = more cold raw steps than max(hot_steps, capacity / this)
CATCH_UP_CORES = 4      # catching up encodes on one thread per this many usable cores


def candidates(ring, words: PackWords, hot: int) -> np.ndarray:
    """Chunks to pack now, newest first (they stay packed longest)."""
    state, count = ring.chunk_states()
    claimed = len(state)
    if not claimed:
        return np.empty(0, np.int64)
    wseq, phase, _ = unpack_words(words.load(np.arange(claimed)))
    clock = ring.clock()
    seq, sealed = chunk_seqs(state), chunks_sealed(state)
    last = ring.clock_rows[ring.chunk_base[:claimed] + np.maximum(count, 1) - 1]
    done = (phase == PACKED) & (wseq == seq)
    ok = sealed & (seq & 1 == 0) & (count > 0) & ~done & (clock - 1 - last >= hot)
    chunks = np.flatnonzero(ok)
    return chunks[np.argsort(-last[chunks], kind="stable")]


def pack_stats(ring, words: PackWords, hot: int) -> tuple[int, int, int, int, int]:
    """``(chunks packed, chunks raw, cold raw, raw bytes, stored bytes)`` now."""
    plan = words.plan
    state, count = ring.chunk_states()
    claimed = len(state)
    if not claimed:
        return 0, 0, 0, 0, 0
    wseq, phase, mask = unpack_words(words.load(np.arange(claimed)))
    packed = (phase >= PUNCHING) & (wseq == chunk_seqs(state)) & (mask > 0) & (count > 0)
    raw_bytes = stored = 0
    for chunk in np.flatnonzero(packed).tolist():
        directory = words.read_dir(chunk)
        used = plan.dir_bytes
        for col in plan.columns:
            if mask[chunk] >> col.bit & 1:
                raw_bytes += int(count[chunk]) * col.row_bytes
                used = max(used, int((directory[col.bit, :, 0].astype(np.int64)
                                      + directory[col.bit, :, 1]).max()))
        stored += -(-used // PAGE) * PAGE
    holding = int(((count > 0) & ~packed).sum())
    return int(packed.sum()), holding, len(candidates(ring, words, hot)), raw_bytes, stored


class Packer:
    """Packs cold chunks of one buffer (``ring``, its column ``views``)."""

    def __init__(self, ring, words: PackWords, codec: Codec, views: dict, hot_steps: int):
        self.ring, self.words, self.codec, self.hot = ring, words, codec, hot_steps
        self.plan = words.plan
        self.views = {c.name: views[c.name] for c in self.plan.columns}
        self.lock = threading.Lock()     # one round at a time in this process
        self.last_error: str | None = None
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()
        self._behind = threading.Event()   # set while the catch-up thread works
        # Cold chunks still raw beyond which compression stops waiting for idle CPU.
        self.backlog = max(1, max(hot_steps, self.plan.capacity // BACKLOG_SHARE)
                           // self.plan.chunk_size)
        # Threads that encode when behind: one per CATCH_UP_CORES usable cores.
        self.catch_up_workers = max(1, len(os.sched_getaffinity(0)) // CATCH_UP_CORES)

    # -- choosing ------------------------------------------------------------------
    def candidates(self) -> np.ndarray:
        """Chunks to pack now, newest first (they stay packed longest)."""
        return candidates(self.ring, self.words, self.hot)

    def pending(self) -> int:
        """Chunks that a round would pack now."""
        return len(self.candidates())

    # -- one chunk -------------------------------------------------------------------
    def _state(self, chunk: int) -> tuple[int, bool, int]:
        return self.ring.chunk_state(chunk)

    def _take(self, chunk: int) -> tuple[int, int, int, int] | None:
        """Win ``chunk``'s word and get it to ``PUNCHING``: ``(chunk, seq, mask, word)``;
        None if it is not ours to pack now."""
        words, me = self.words, os.getpid()
        w = words.word(chunk)
        wseq, phase, mask, pid = unpack_word(w)
        seq, sealed, count = self._state(chunk)
        if not sealed or seq & 1 or not count:
            return None
        if phase in (BUSY, PUNCHING) and words.held_by_live(chunk, pid):
            return None
        if phase == PACKED and wseq == seq:
            return None
        words.mark(chunk)       # before the CAS: a holder is never seen without its stamp
        if phase == PUNCHING and wseq == seq:     # a dead compressor's finished blob
            mine = pack_word(seq, PUNCHING, mask, me)
            if not words.take(chunk, w, mine):
                return None
            words.mark(chunk)   # again: a racer that lost may have stamped after us
            if self._state(chunk)[:2] != (seq, True):
                words.take(chunk, mine, w)
                return None
            return chunk, seq, mask, mine
        busy = pack_word(seq, BUSY, 0, me)
        if not words.take(chunk, w, busy):
            return None
        words.mark(chunk)
        try:
            # After the CAS and its fence: a recycler that claimed the chunk before
            # now shows here; one that claims it later sees BUSY and backs off.
            if self._state(chunk) != (seq, True, count):
                words.take(chunk, busy, w)
                return None
            blob, mask = self._encode(chunk, count)
            words.write_slot(chunk, blob)
        except BaseException:
            words.take(chunk, busy, w)
            raise
        mine = pack_word(seq, PUNCHING, mask, me)
        words.take(chunk, busy, mine)   # ours: nobody else writes a live holder's word
        return chunk, seq, mask, mine

    def _encode(self, chunk: int, count: int) -> tuple[bytes, int]:
        """The slot's bytes (directory, then blocks) and the mask of columns kept packed."""
        plan = self.plan
        b, base = plan.block_rows, chunk * plan.chunk_size
        directory = np.zeros((len(plan.columns), plan.n_blocks, 2), "<u4")
        parts: list[bytes] = []
        at, mask = plan.dir_bytes, 0
        for col in plan.columns:
            rows = self.views[col.name][base:base + count]
            flat = np.ascontiguousarray(rows).reshape(-1).view(np.uint8).data
            blocks = [self.codec.encode(flat[j * b * col.row_bytes:(j + 1) * b * col.row_bytes])
                      for j in range(-(-count // b))]
            size = sum(len(x) for x in blocks)
            if size * MIN_RATIO > count * col.row_bytes:
                continue     # does not shrink enough: stays raw, costs nothing
            mask |= 1 << col.bit
            for j, x in enumerate(blocks):
                directory[col.bit, j] = (at, len(x))
                at += len(x)
            parts.extend(blocks)
        if not mask:
            return b"", 0
        return directory.tobytes() + b"".join(parts), mask

    def stats(self) -> tuple[int, int, int, int, int]:
        """``(chunks packed, chunks raw, cold raw, raw bytes, stored bytes)`` now."""
        return pack_stats(self.ring, self.words, self.hot)

    # -- a round ---------------------------------------------------------------------
    def round(self, limit: int | None = None, timeout: float | None = None,
              stop: threading.Event | None = None, pool: ThreadPoolExecutor | None = None
              ) -> int:
        """Pack up to ``limit`` eligible chunks; return how many now hold packed columns.

        ``limit`` defaults to ``ROUND_CHUNKS``, and to at most 1/``ROUND_SHARE`` of
        the chunks: a writer that reaches a chunk a round holds takes the next one,
        so a round must never hold the ring.  ``stop`` (the background thread's):
        once set, the round ends early and gives back the chunks it could not finish.
        ``pool``: threads that encode the round's chunks side by side (the codec
        releases the GIL; each chunk's word, blob slot and rows are its own).

        Raises:
            SharedMemoryFullError: /dev/shm could not hold a blob (the chunks
                packed before it are finished first).
        """
        if limit is None:
            limit = max(1, min(ROUND_CHUNKS, self.plan.n_chunks // ROUND_SHARE))

        def take(chunk: int) -> tuple[int, int, int, int] | None:
            return None if stop is not None and stop.is_set() else self._take(chunk)

        with self.lock:
            held: list[tuple[int, int, int, int]] = []
            try:
                chunks = [int(c) for c in self.candidates()[:limit]]
                if pool is None:
                    for chunk in chunks:
                        if stop is not None and stop.is_set():
                            break
                        got = take(chunk)
                        if got is not None:
                            held.append(got)
                else:
                    # Every future is waited for, so that each word a worker won is
                    # finished (or given back) below, whatever another one raised.
                    futures = [pool.submit(take, c) for c in chunks]
                    failed: BaseException | None = None
                    for f in futures:
                        try:
                            got = f.result()
                        except BaseException as exc:
                            failed = failed or exc
                            continue
                        if got is not None:
                            held.append(got)
                    if failed is not None:
                        raise failed
            finally:
                done = self._finish(held, timeout, stop or threading.Event())
            return done

    def _finish(self, held, timeout: float | None, stop: threading.Event) -> int:
        """Quiesce the readers, punch, publish ``PACKED``: the second half of a round."""
        words = self.words
        if any(mask for _, _, mask, _ in held):
            busy = words.readers.busy()

            def quiet():
                return True if stop.is_set() or all(
                    words.readers.moved_on(off, w) for off, w in busy) else None
            try:
                poll(quiet, timeout, lambda: TimeoutError("readers did not leave their reads"))
            except TimeoutError:
                stop_now = True
            else:
                stop_now = stop.is_set() and not all(
                    words.readers.moved_on(off, w) for off, w in busy)
            if stop_now:    # raw pages still whole: let them stay the truth
                for chunk, _, _, mine in held:
                    if words.take(chunk, mine, 0):
                        words.write_slot(chunk, b"")
                return 0
        n = 0
        for chunk, seq, mask, mine in held:
            words.punch_raw(chunk, mask)
            words.take(chunk, mine, pack_word(seq, PACKED, mask, 0))
            n += bool(mask)
        return n

    def compact(self, timeout: float | None = None) -> int:
        """Pack every eligible chunk now; return how many were packed (``Buffer.compact``)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        total = 0
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            n = self.round(timeout=left)
            total += n
            if not self.pending():
                return total
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"compact: {self.pending()} chunks still to compress after "
                                   f"{timeout} s (packed {total})")
            if not n:
                time.sleep(0.001)   # others hold them (a live compressor): let it finish

    # -- the owner's background threads ------------------------------------------------
    def start(self) -> None:
        """Run rounds in daemon threads until ``stop``: the compressor, and its catch-up.

        The compressor runs at the lowest CPU priority, so writers and the
        trainer go first and it uses what they leave.  Where they leave too
        little (env workers busy on every core), cold chunks would stay raw
        and the buffer's memory would grow back towards the raw size: once
        more than ``backlog`` chunks are cold and raw, the catch-up thread
        works at a middling priority (it takes CPU from the writers) until
        half of them are compressed, while the compressor steps aside.
        """
        if any(t.is_alive() for t in self._threads):
            return   # (threads listed in a forked child are its parent's, and gone)
        self._stop.clear()
        self._behind.clear()
        self._threads = [
            threading.Thread(target=self._run, name="shmbuf-compress", daemon=True),
            threading.Thread(target=self._catch_up, name="shmbuf-compress-catch-up",
                             daemon=True)]
        for t in self._threads:
            t.start()

    def _run(self) -> None:
        # Linux gives each thread its own nice value: this one yields the CPU to writers
        # and to the trainer's own threads, and uses what they leave (its work can wait;
        # theirs cannot).  Best effort: a refused change leaves it at the process's.
        _nice(THREAD_NICE)
        while not self._stop.is_set():
            n: int | None = 0
            if not self._behind.is_set():
                n = self._round(self._behind)
                if n is None:
                    return
            if not n and self._stop.wait(IDLE_PAUSE):
                return

    def _catch_up(self) -> None:
        _nice(CATCH_UP_NICE)
        pool = None
        try:
            while not self._stop.wait(IDLE_PAUSE):
                if self.pending() <= self.backlog:
                    continue
                if pool is None and self.catch_up_workers > 1:
                    # On a big machine one thread's share of a busy core is too little
                    # for env workers on every core: encode on several, each at this
                    # thread's priority.
                    pool = ThreadPoolExecutor(self.catch_up_workers,
                                              thread_name_prefix="shmbuf-compress-catch-up",
                                              initializer=_nice, initargs=(CATCH_UP_NICE,))
                self._behind.set()     # the compressor's round ends at its next chunk
                try:
                    while not self._stop.is_set() and self.pending() > self.backlog // 2:
                        if self._round(self._stop, pool) is None:
                            return
                finally:
                    self._behind.clear()
        finally:
            if pool is not None:
                pool.shutdown(wait=True)

    def _round(self, yield_to: threading.Event,
               pool: ThreadPoolExecutor | None = None) -> int | None:
        """One background round (ending early once ``yield_to`` or ``stop`` is set);
        None once the buffer is closing under it."""
        stop = _Either(self._stop, yield_to)
        try:
            return self.round(stop=stop, pool=pool)    # type: ignore[arg-type]
        except SharedMemoryFullError as exc:
            self.last_error = str(exc)
            return 0
        except (ValueError, TypeError, OSError):
            if self._stop.is_set():     # the mapping went away under a closing buffer
                return None
            raise

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the background threads (a round in flight finishes or gives its chunks back)."""
        self._stop.set()
        threads, self._threads = self._threads, []
        for thread in threads:
            thread.join(timeout)


class _Either:
    """Set when either of two events is (``round``'s ``stop``: it only asks ``is_set``)."""

    def __init__(self, a: threading.Event, b: threading.Event):
        self.a, self.b = a, b

    def is_set(self) -> bool:
        return self.a.is_set() or self.b.is_set()


def _nice(value: int) -> None:
    """Set this thread's nice value to ``value`` (never below the process's); best effort."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(),
                       max(value, os.getpriority(os.PRIO_PROCESS, 0)))
    except OSError:
        pass
