"""A save's compressed blocks at load: checked, then put back compressed, or decoded.

A compressing buffer's save holds the blocks of its compressed chunks as they
were in shared memory (``_blocks.npy``, listed in ``_packed.npy``; see
``disk.save``).  ``load`` checks every block before it creates anything (its
CRC-32, or, in a save whose entries carry none, a trial decode), so a damaged
save is a ``CorruptSaveError`` naming the file and nothing is half loaded.

Then ``restore`` puts each saved chunk's blocks back as they are: it claims
the chunk for them, writes them into the chunk's blob slot and publishes the
chunk's word as packed (``PackWords.put_packed``) before any of its rows is
published; the rows of its packed columns are never written, and their pages
never reserved, so /dev/shm holds the compressed bytes only.  A block is
decoded into the rows instead only where it cannot be kept:

- the loaded buffer does not compress that column, or uses another codec or
  block size (a save loaded with another ``capacity`` may get another chunk
  size);
- the chunk is among the newest ``hot_steps`` saved steps, which the loaded
  buffer keeps raw;
- its blocks do not cover its rows block for block from its first row (a
  chunk that a smaller ``capacity`` cut), or do not fit the chunk's blob slot;
- the chunk does not land at a fresh chunk of the loaded buffer that it fills
  exactly (or, the last of its stream, fits): the stream is inside a chunk, or
  the chunk is shorter (the short last chunk of a capacity that is not a
  multiple of the chunk size).
"""
from __future__ import annotations

import dataclasses
import os
import zlib

import numpy as np

from .._errors import CorruptSaveError

DECODE_THREADS = 4   # threads that decode or check a save's blocks at load
COL, FIRST, ROWS, OFFSET, LENGTH, CRC = range(6)   # the fields of an entry of _packed.npy
BLOCKS_FILE = "_blocks.npy"


def _bad(path: str, why: str) -> CorruptSaveError:
    return CorruptSaveError(f"{path!r} is not a usable shmbuf save: {why}")


def _run(fn, n: int) -> None:
    """``fn(range)`` over ``range(n)`` on up to ``DECODE_THREADS`` threads (the codecs,
    zlib's CRC and numpy's copies release the GIL; the parts share nothing)."""
    threads = max(1, min(DECODE_THREADS, os.cpu_count() or 1, n // 16))
    if threads == 1:
        fn(range(n))
        return
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(threads, thread_name_prefix="shmbuf-load") as pool:
        for f in [pool.submit(fn, range(i, n, threads)) for i in range(threads)]:
            f.result()


class SavedBlocks:
    """The compressed blocks of one save: ``entries`` (m, 5 or 6) int64 (see ``COL``..
    ``CRC``), ``blocks`` the bytes of ``_blocks.npy``, ``names`` the spec's columns."""

    def __init__(self, path, codec: str, block_rows: int, entries: np.ndarray,
                 blocks: np.ndarray, names: list[str]):
        from ..sampling.codec import Codec

        self.path, self.codec_name, self.block_rows = os.fspath(path), codec, block_rows
        self.entries, self.blocks, self.names = entries, blocks, names
        self.codec = Codec(codec, 1)   # the level matters to encoding only
        self._order = np.argsort(entries[:, FIRST], kind="stable")
        self._firsts = entries[self._order, FIRST]

    def __len__(self) -> int:
        return len(self.entries)

    def _where(self, e: int) -> str:
        col, first, n = (int(x) for x in self.entries[e, :3])
        return f"column {self.names[col]!r} at rows {first}..{first + n - 1}"

    def block(self, e: int) -> memoryview:
        """The bytes of entry ``e``'s block (a view of the mapped file)."""
        off, length = int(self.entries[e, OFFSET]), int(self.entries[e, LENGTH])
        return memoryview(self.blocks[off:off + length])  # type: ignore[arg-type]  # a buffer (typed so from 3.12)

    # -- checking ----------------------------------------------------------------------
    def check(self, columns: dict) -> None:
        """Raise ``CorruptSaveError`` (naming ``_blocks.npy``) unless every block is whole:
        its CRC-32 matches, or, in a save without CRCs, it decodes to its rows."""
        entries = self.entries
        if entries.shape[1] > CRC:
            crc = entries[:, CRC].tolist()

            def run(part: range) -> None:
                for e in part:
                    if zlib.crc32(self.block(e)) != crc[e]:
                        raise _bad(self.path, f"{BLOCKS_FILE} is damaged: the compressed block "
                                              f"of {self._where(e)} fails its CRC-32 check")
        else:
            def run(part: range) -> None:
                for e in part:
                    self._decoded(e, columns)
        _run(run, len(entries))

    def _decoded(self, e: int, columns: dict) -> np.ndarray:
        """Entry ``e``'s rows, decoded; ``CorruptSaveError`` if they do not come out whole."""
        col, first, n = (int(x) for x in self.entries[e, :3])
        out = columns[self.names[col]]
        want = n * out.itemsize * int(np.prod(out.shape[1:], dtype=np.int64))
        try:
            raw = self.codec.decode(self.block(e).tobytes(), want)
        except ValueError:
            raw = b""
        if len(raw) != want:
            raise _bad(self.path, f"the compressed block of {self._where(e)} does not decode "
                                  f"to those rows ({BLOCKS_FILE} is damaged)")
        return np.frombuffer(raw, out.dtype).reshape((n,) + out.shape[1:])

    # -- decoding into the rows ------------------------------------------------------------
    def decode(self, which, columns: dict) -> None:
        """Decode the entries ``which`` into their rows of ``columns`` (writable arrays:
        a load's copy-on-write mappings of the save's column files)."""
        which = np.asarray(which, np.int64).tolist()

        def run(part: range) -> None:
            for i in part:
                e = which[i]
                col, first, n = (int(x) for x in self.entries[e, :3])
                columns[self.names[col]][first:first + n] = self._decoded(e, columns)
        _run(run, len(which))

    def in_rows(self, a: int, b: int) -> np.ndarray:
        """The entries whose first row is in ``[a, b)``."""
        lo, hi = np.searchsorted(self._firsts, [a, b])
        return self._order[lo:hi]

    def cut(self, cut: int, columns: dict) -> SavedBlocks:
        """The blocks of rows ``cut`` on, renumbered from 0 (``checkpoint.newest_rows``);
        a block that the cut splits is decoded into ``columns`` now."""
        e = self.entries
        split = np.flatnonzero((e[:, FIRST] < cut) & (e[:, FIRST] + e[:, ROWS] > cut))
        self.decode(split, columns)
        kept = e[e[:, FIRST] >= cut].copy()
        kept[:, FIRST] -= cut
        return SavedBlocks(self.path, self.codec_name, self.block_rows, kept, self.blocks,
                           self.names)


@dataclasses.dataclass
class Kept:
    """One saved chunk whose compressed columns go back as they are (``keep_plan``)."""

    entries: np.ndarray     # its entries, in the loaded buffer's column (bit) order
    names: frozenset        # the columns put back compressed: their rows are never written
    mask: int               # their bits in the chunk word
    exact: bool             # the chunk must fill its new chunk (its stream goes on after it)

    def slot_bytes(self, saved: SavedBlocks, plan) -> bytes:
        """The blob slot's bytes: the directory, then the blocks, as a compressor writes."""
        from ..protocol.packing import DIR_ENTRY

        directory = np.zeros((len(plan.columns), plan.n_blocks, 2), "<u4")
        bit = {c.name: c.bit for c in plan.columns}
        first = int(saved.entries[self.entries, FIRST].min())
        at = len(plan.columns) * plan.n_blocks * DIR_ENTRY
        parts = []
        for e in self.entries.tolist():
            col, row, _, _, length = (int(x) for x in saved.entries[e, :5])
            directory[bit[saved.names[col]], (row - first) // plan.block_rows] = (at, length)
            parts.append(saved.block(e))
            at += length
        return directory.tobytes() + b"".join(parts)


def keep_plan(saved: SavedBlocks, plan, codec: str, hot_steps: int, starts: np.ndarray,
              stream: np.ndarray, columns: dict) -> dict[int, Kept]:
    """Which saved chunks go back compressed: ``{first row: Kept}``; every other block is
    decoded into ``columns`` now.  ``plan``: the loaded buffer's ``PackPlan`` (None: it
    compresses nothing), ``codec`` its codec; ``starts`` the chunks' first rows and
    ``stream`` each row's stream (after any cut).  The rules: the module docstring."""
    n = len(stream)
    keep: dict[int, Kept] = {}
    decode: list[np.ndarray] = []
    same = plan is not None and codec == saved.codec_name and saved.block_rows == plan.block_rows
    if not same or not len(saved):
        saved.decode(np.arange(len(saved)), columns)
        return keep
    bits = {c.name: c.bit for c in plan.columns}
    b_rows = plan.block_rows
    ends = np.append(starts[1:], n).astype(np.int64)
    # a chunk is the last of its stream when no later chunk starts in the same stream
    first_stream = stream[starts] if n else np.empty(0, np.int64)
    last = np.ones(len(starts), bool)
    seen: set[int] = set()
    for i in range(len(starts) - 1, -1, -1):
        sid = int(first_stream[i])
        last[i] = sid not in seen
        seen.add(sid)
    e = saved.entries
    for i, (a, b) in enumerate(zip(starts.tolist(), ends.tolist())):
        mine = saved.in_rows(a, b)
        if not len(mine):
            continue
        count = b - a
        if count > plan.chunk_size or n - b < hot_steps:
            decode.append(mine)
            continue
        want = np.arange(a, b, b_rows)
        kept, names, mask, stored = [], set(), 0, 0
        for col in np.unique(e[mine, COL]).tolist():
            own = mine[e[mine, COL] == col]
            own = own[np.argsort(e[own, FIRST], kind="stable")]
            name = saved.names[col]
            whole = (name in bits and len(own) == len(want)
                     and np.array_equal(e[own, FIRST], want)
                     and np.array_equal(e[own, ROWS], np.minimum(b_rows, b - want)))
            if not whole:
                decode.append(own)
                continue
            kept.append((bits[name], own))
            names.add(name)
            mask |= 1 << bits[name]
            stored += int(e[own, LENGTH].sum())
        if not kept:
            continue
        order = np.concatenate([own for _, own in sorted(kept, key=lambda x: x[0])])
        if plan.dir_bytes + stored > plan.slot_bytes:   # another layout: it does not fit
            decode.append(order)
            continue
        keep[a] = Kept(order, frozenset(names), mask, exact=not last[i])
    if decode:
        saved.decode(np.concatenate(decode), columns)
    return keep
