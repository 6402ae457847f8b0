"""Reading columns of a buffer whose cold chunks may be packed: the one gather every read
path uses (samples, episodes, checkpoints, saves).

``Unpacker.reading()`` brackets a read: inside it, the reader's slot is odd,
so no compressor punches a raw page the read may still touch.  ``flags``
then loads the chunk words of the windows' hops and says, per row, whether
it is raw (read in place), packed at the window's seq (decode its block,
read with ``pread``), or stale (its chunk was packed at another seq: the
window's chunk was recycled, the seq re-check after the copy throws the
window away, so nothing is read).  A decode that fails is stale too, unless
the chunk still has the window's seq: then the segment is corrupt.
"""
from __future__ import annotations

import contextlib
import os
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .._errors import CorruptSegmentError
from ..protocol.packing import PUNCHING, PackWords, unpack_words
from .codec import Codec


class Flags:
    """Per row of a read (any shape): packed, stale, and the chunk word's mask."""

    def __init__(self, packed: np.ndarray, stale: np.ndarray, mask: np.ndarray,
                 chunk: np.ndarray, seq: np.ndarray):
        self.packed, self.stale, self.mask, self.chunk, self.seq = packed, stale, mask, chunk, seq

    def transpose(self) -> Flags:
        return Flags(self.packed.T, self.stale.T, self.mask.T, self.chunk.T, self.seq.T)


class Unpacker:
    """Reads the packed columns of one buffer (``ring``, its column ``views``)."""

    def __init__(self, ring, words: PackWords, codec: Codec):
        # The buffer holds this reader (``StorePort.unpacker``) and the ring: a weak
        # reference to the ring, so that no cycle keeps a closed buffer's views, and its
        # mapping, alive until a gc pass.
        self._ring = weakref.ref(ring)
        self.words, self.codec = words, codec
        self.plan = words.plan
        self.columns = {c.name: c for c in self.plan.columns}

    @contextlib.contextmanager
    def reading(self):
        """Bracket a read of raw rows that a compressor may want to punch."""
        self.words.readers.enter()
        try:
            yield
        finally:
            self.words.readers.leave()

    def flags(self, rows: np.ndarray, chunks: np.ndarray, seqs: np.ndarray) -> Flags | None:
        """Row flags of windows ``rows`` (B, L) located at hops ``chunks``/``seqs`` (B, H);
        None if every row is raw (the common, hot case).  Call inside ``reading()``."""
        ok = chunks >= 0
        seq, phase, masks = unpack_words(self.words.load(np.where(ok, chunks, 0)))
        # A chunk packed with no column (none shrank: noise) reads raw, like a raw one.
        cooked = ok & (phase >= PUNCHING) & (masks != 0)
        if not cooked.any():
            return None
        match = seq == (seqs & 0xFFFFFFFF)
        row_chunk = rows // self.plan.chunk_size
        hop = np.argmax(row_chunk[:, :, None] == chunks[:, None, :], axis=2)
        pick = (lambda a: np.take_along_axis(a, hop, axis=1))
        mask = pick(masks * cooked)
        return Flags(pick(cooked & match), pick(cooked & ~match), mask, row_chunk, pick(seqs))

    def chunk_flags(self, chunk: int, seq: int, n: int) -> Flags | None:
        """Flags of ``n`` rows of one chunk read at ``seq`` (checkpoints, saves)."""
        rows = (chunk * self.plan.chunk_size + np.arange(n, dtype=np.int64))[None]
        return self.flags(rows, np.array([[chunk]]), np.array([[seq]]))

    def chunk_reader(self, views: dict, chunk: int, seq: int, base: int, count: int):
        """``read(name)``: rows ``[base, base + count)`` of ``chunk`` read at ``seq`` (inside
        ``reading()``), decoded where packed."""
        flags = self.chunk_flags(chunk, seq, count)
        idx = (base + np.arange(count, dtype=np.int64))[None]

        def read(name: str) -> np.ndarray:
            if flags is None or name not in self.columns:
                return views[name][base:base + count]
            return self.take(name, views[name], idx, flags)[0]
        return read

    def take(self, name: str, view: np.ndarray, idx: np.ndarray, flags: Flags | None,
             out: np.ndarray | None = None) -> np.ndarray:
        """``np.take(view, idx, axis=0)`` with packed rows decoded; ``flags`` for ``idx``."""
        col = self.columns.get(name)
        if flags is None or col is None:
            return np.take(view, idx, axis=0, out=out, mode="clip")
        packed = flags.packed & (flags.mask >> col.bit & 1 == 1)
        raw = ~packed & ~flags.stale
        if out is None:
            out = np.empty(idx.shape + view.shape[1:], view.dtype)
        if raw.all():
            return np.take(view, idx, axis=0, out=out, mode="clip")
        if raw.any():
            out[raw] = view[idx[raw]]
        zero = ~raw & ~packed
        if zero.any():
            out[zero] = 0     # stale: the re-check throws these windows away
        if packed.any():
            self._decode(col, view, idx[packed], flags.chunk[packed], flags.seq[packed],
                         out, packed)
        return out

    def _decode(self, col, view, rows, chunks, seqs, out, where) -> None:
        """Decode each block the ``rows`` touch once and copy its rows to ``out[where]``.

        Where a block's rows go to consecutive output rows (a window's rows in a
        C-ordered batch), the block is decoded straight into the output when the
        window covers it whole, or into this thread's scratch block and copied as
        one slice; other layouts gather through a fancy index.  Blocks are split
        between this thread and ``DECODE_THREADS - 1`` helpers (the codec and
        numpy's copies release the GIL), each writing disjoint rows."""
        plan, k, b = self.plan, self.plan.chunk_size, self.plan.block_rows
        key = chunks * plan.n_blocks + (rows - chunks * k) // b
        order = np.argsort(key, kind="stable")
        skey = key[order]
        firsts = np.flatnonzero(np.r_[True, skey[1:] != skey[:-1]])
        lasts = np.r_[firsts[1:], len(skey)]
        shape, row_bytes, block_bytes = view.shape[1:], col.row_bytes, b * col.row_bytes
        local = rows[order] - (skey % plan.n_blocks) * b - (skey // plan.n_blocks) * k
        if out.flags.c_contiguous:      # copy straight into the output rows
            dest, pos = out.reshape((-1,) + shape), np.flatnonzero(where.reshape(-1))
            # A group whose sorted rows and output positions both step by one is one slice.
            spos = pos[order]
            bad = np.r_[0, np.cumsum((np.diff(spos) != 1) | (np.diff(local) != 1))]
            runs = (bad[lasts - 1] - bad[firsts]) == 0
        else:
            dest, pos = np.empty((len(rows),) + shape, view.dtype), None
            spos = np.arange(len(rows))[order]
            runs = np.zeros(len(firsts), bool)
        flat = dest.reshape(len(dest), row_bytes // view.dtype.itemsize).view(np.uint8)
        chunk_of = skey[firsts] // plan.n_blocks
        dirs = {c: self.words.read_dir(c) for c in np.unique(chunk_of).tolist()}
        codec, words = self.codec, self.words

        def run(part: range) -> None:
            scratch = _scratch(block_bytes)
            block_rows = scratch.view(view.dtype).reshape((-1,) + shape)
            for g in part:
                first, last = int(firsts[g]), int(lasts[g])
                chunk, j = divmod(int(skey[first]), plan.n_blocks)
                off, length = (int(x) for x in dirs[chunk][col.bit, j])
                lo, m = int(local[first]), last - first
                try:
                    blob = words.read_blob(chunk, off, length)
                    if runs[g]:
                        a0 = int(spos[first])
                        if lo == 0 and codec.block_bytes(blob) == m * row_bytes:
                            codec.decode_into(blob, flat[a0:a0 + m], m * row_bytes)
                            continue       # the window covers the block: no copy at all
                        codec.decode_into(blob, scratch, block_bytes)
                        dest[a0:a0 + m] = block_rows[lo:lo + m]
                    else:
                        codec.decode_into(blob, scratch, block_bytes)
                        dest[spos[first:last]] = block_rows[local[first:last]]
                except (ValueError, IndexError):
                    seq = int(seqs[order[first]])
                    ring = self._ring()
                    if ring is not None and ring.unchanged(np.array([chunk]),
                                                           np.array([seq]))[0]:
                        raise CorruptSegmentError(
                            f"chunk {chunk} (seq {seq}) of column {col.name!r}: block {j} "
                            "does not decode, yet the chunk was not recycled") from None
                    dest[spos[first:last]] = 0   # recycled under us: the re-check rejects it

        n = len(firsts)
        helpers = _pool() if n >= 2 * MIN_SHARE else None
        if helpers is None:
            run(range(n))
        else:
            parts = [range(i, n, DECODE_THREADS) for i in range(DECODE_THREADS)]
            futures = [helpers.submit(run, p) for p in parts[1:]]
            run(parts[0])
            for f in futures:
                f.result()
        if pos is None:
            out[where] = dest


DECODE_THREADS = 2   # threads that decode one read's blocks (this one and a helper)
MIN_SHARE = 8        # blocks per thread below which one thread decodes them all
_POOL: tuple[int, ThreadPoolExecutor] | None = None


_SCRATCH = threading.local()


def _scratch(nbytes: int) -> np.ndarray:
    """This thread's scratch block of ``nbytes`` (kept, so that a read allocates nothing)."""
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None or len(buf) < nbytes:
        buf = _SCRATCH.buf = np.empty(nbytes, np.uint8)
    return buf[:nbytes]


def _pool() -> ThreadPoolExecutor:
    """This process's decode helpers (made again in a forked child, whose threads are gone)."""
    global _POOL
    if _POOL is None or _POOL[0] != os.getpid():
        _POOL = (os.getpid(), ThreadPoolExecutor(DECODE_THREADS - 1,
                                                 thread_name_prefix="shmbuf-decode"))
    return _POOL[1]
