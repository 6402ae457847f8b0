"""A save's compressed blocks at load: checked, then put back compressed, or decoded.

A compressing buffer's save holds the blocks of its compressed chunks as they
were in shared memory (``_blocks.npy``, listed in ``_packed.npy``; see
``disk.save``).  ``load`` checks every block before it creates anything (its
CRC-32, or, in a save whose entries carry none, a trial decode), so a damaged
save is a ``CorruptSaveError`` naming the file and nothing is half loaded.

Then ``restore`` (``checkpoint._Replay``) puts the blocks back as they are:
each time the writer replaying a saved stream needs a chunk, ``Placer`` says
which packed columns of the steps that will fill it have saved blocks that
start at its first step and cover it block for block; the chunk is claimed
without reserving those columns' pages, the blocks go into its blob slot and
its word is published as packed (``PackWords.put_packed``) before any of its
rows is, and those rows are never written: /dev/shm holds the compressed
bytes only.  Blocks are matched by stream position, not by saved chunk, so
one new chunk may take the blocks of two saved ones.  A block is decoded into
its rows instead only where it cannot be kept:

- the loaded buffer does not compress that column, or uses another codec or
  block size;
- it is among the newest ``hot_steps`` saved steps (by save order), which the
  loaded buffer keeps raw;
- a chunk of the loaded buffer does not start on one of its stream's blocks:
  a smaller ``capacity`` cut a chunk off the block grid, or a ring whose
  ``capacity`` is not a multiple of ``chunk_size`` had a short last chunk
  that shifted its stream's later chunks by a part of a block;
- the blocks do not fit the chunk's blob slot, or a claim elsewhere took the
  chunk that was planned for, so it has another size.
"""
from __future__ import annotations

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


def _size_reader(codec: str):
    """``size(blob)``: the bytes a block of ``codec`` decodes to, from its header alone
    (a zstd frame records it; an lz4 block starts with it, as a little-endian u32)."""
    if codec == "zstd":
        import zstandard

        def size(blob) -> int:
            try:
                return int(zstandard.get_frame_parameters(blob).content_size)
            except zstandard.ZstdError:
                return -1
        return size
    return lambda blob: int.from_bytes(bytes(blob[:4]), "little") if len(blob) >= 4 else -1


class SavedBlocks:
    """The compressed blocks of one save: ``entries`` (m, 5 or 6) int64 (see ``COL``..
    ``CRC``), ``blocks`` the bytes of ``_blocks.npy``, ``names`` the spec's columns."""

    def __init__(self, path, codec: str, block_rows: int, entries: np.ndarray,
                 blocks: np.ndarray, names: list[str]):
        from ..sampling.codec import Codec

        self.path, self.codec_name, self.block_rows = os.fspath(path), codec, block_rows
        self.entries, self.blocks, self.names = entries, blocks, names
        self.codec = Codec(codec, 1)   # the level matters to encoding only

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
        """Raise ``CorruptSaveError`` unless the entries tile each column's rows in blocks
        of at most ``block_rows`` (naming ``_packed.npy``) and every block is whole (naming
        ``_blocks.npy``): its CRC-32 matches and its header says it holds its rows, or, in
        a save without CRCs, it decodes to its rows."""
        entries = self.entries
        for col in np.unique(entries[:, COL]).tolist():
            mine = entries[entries[:, COL] == col]
            mine = mine[np.argsort(mine[:, FIRST], kind="stable")]
            if (mine[:, ROWS] > self.block_rows).any() or (
                    mine[1:, FIRST] < mine[:-1, FIRST] + mine[:-1, ROWS]).any():
                raise _bad(self.path, f"_packed.npy lists blocks of column {self.names[col]!r} "
                                      f"that overlap or exceed {self.block_rows} rows")
        if entries.shape[1] > CRC:
            crc = entries[:, CRC].tolist()
            sizes = {name: a.itemsize * int(np.prod(a.shape[1:], dtype=np.int64))
                     for name, a in columns.items()}
            size_of = _size_reader(self.codec_name)

            def run(part: range) -> None:
                for e in part:
                    blob = self.block(e)
                    col, _, n = (int(x) for x in entries[e, :3])
                    if zlib.crc32(blob) != crc[e]:
                        raise _bad(self.path, f"{BLOCKS_FILE} is damaged: the compressed block "
                                              f"of {self._where(e)} fails its CRC-32 check")
                    if size_of(blob) != n * sizes[self.names[col]]:
                        raise _bad(self.path, f"the compressed block of {self._where(e)} in "
                                              f"{BLOCKS_FILE} does not hold those rows")
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


class Placer:
    """Puts a save's blocks into the chunks a restore claims (``checkpoint._Replay``).

    The replay writes each saved stream's rows in order through one writer.  Each time
    that writer needs a new chunk, ``chunk(row, rows)`` says which columns of the
    ``rows`` stream steps from saved row ``row`` on can go in as their saved blocks:
    those whose blocks start at the chunk's first row and cover its steps block for
    block (so they need not come from one saved chunk: a ring whose short last chunk
    shifted the chunk boundaries still fits, when the shift is a multiple of the block
    size), none of them among the newest ``hot_steps`` saved steps, and all of them
    within the chunk's blob slot.  ``decode(...)`` fills the rows of the other blocks.
    """

    def __init__(self, saved: SavedBlocks, plan, codec: str, hot_steps: int,
                 stream: np.ndarray, columns: dict):
        self.saved, self.plan, self.columns = saved, plan, columns
        n, e = len(stream), saved.entries
        self.done = np.zeros(len(saved), bool)   # decoded into the rows already
        same = (plan is not None and codec == saved.codec_name
                and saved.block_rows == plan.block_rows)
        self.bits = {c.name: c.bit for c in plan.columns} if same else {}
        hot = e[:, FIRST] + e[:, ROWS] > n - hot_steps
        # blocks that go in nowhere compressed: decoded at once, on a few threads
        names = np.array(saved.names)[e[:, COL]] if len(e) else np.empty(0, str)
        never = ~np.isin(names, list(self.bits)) | hot
        self._decode(np.flatnonzero(never))
        # each stream's rows in order, and where each row is in it
        self.order = np.argsort(stream, kind="stable")
        self.at = np.empty(n, np.int64)
        self.at[self.order] = np.arange(n)
        self.end = np.searchsorted(stream[self.order], stream, side="right")   # per row
        # per column that may go in compressed: the entry starting at each row, and the
        # one covering it (-1: none)
        self.starts: dict[str, np.ndarray] = {}
        self.cover: dict[str, np.ndarray] = {}
        for name in self.bits:
            if name not in saved.names:
                continue
            mine = np.flatnonzero((e[:, COL] == saved.names.index(name)) & ~self.done)
            if not len(mine):
                continue
            first = np.full(n, -1, np.int64)
            first[e[mine, FIRST]] = mine
            cover = np.full(n, -1, np.int64)
            cover[np.repeat(e[mine, FIRST], e[mine, ROWS])
                  + _ramps(e[mine, ROWS])] = np.repeat(mine, e[mine, ROWS])
            self.starts[name], self.cover[name] = first, cover
        self.hot_from = n - hot_steps

    def _decode(self, which: np.ndarray) -> None:
        which = which[~self.done[which]]
        if len(which):
            self.saved.decode(which, self.columns)
            self.done[which] = True

    def rows_at(self, row: int, rows: int) -> np.ndarray:
        """The saved rows of the ``rows`` stream steps from saved row ``row`` on (fewer
        where the stream ends first)."""
        i = int(self.at[row])
        return self.order[i:min(i + rows, int(self.end[row]))]

    def chunk(self, row: int, rows: int) -> tuple[frozenset, int, np.ndarray]:
        """For a chunk of ``rows`` steps from saved row ``row``: the columns that go in
        compressed, their mask, and their entries in the slot's (bit) order."""
        plan, e = self.plan, self.saved.entries
        saved_rows = self.rows_at(row, rows)
        if not self.starts or saved_rows[-1] >= self.hot_from:
            return frozenset(), 0, np.empty(0, np.int64)
        b = plan.block_rows
        want = np.minimum(b, len(saved_rows) - np.arange(0, len(saved_rows), b))
        names, mask, parts, stored = set(), 0, [], 0
        for name, first in sorted(self.starts.items(), key=lambda kv: self.bits[kv[0]]):
            got = first[saved_rows[::b]]
            if (got < 0).any() or not np.array_equal(e[got, ROWS], want):
                continue   # its blocks do not start where this chunk's do
            names.add(name)
            mask |= 1 << self.bits[name]
            parts.append(got)
            stored += int(e[got, LENGTH].sum())
        if not names or plan.dir_bytes + stored > plan.slot_bytes:
            return frozenset(), 0, np.empty(0, np.int64)
        return frozenset(names), mask, np.concatenate(parts)

    def decode(self, row: int, rows: int, kept: frozenset) -> None:
        """Decode the blocks of the columns not in ``kept`` that cover the ``rows`` stream
        steps from saved row ``row`` on (their rows are written raw)."""
        saved_rows = self.rows_at(row, rows)
        for name, cover in self.cover.items():
            if name not in kept:
                got = np.unique(cover[saved_rows])
                self._decode(got[got >= 0])

    def slot_bytes(self, entries: np.ndarray, row: int) -> bytes:
        """The blob slot's bytes for ``entries`` (``chunk``'s) of a chunk whose first step
        is saved row ``row``: the directory, then the blocks, as a compressor writes."""
        plan, saved = self.plan, self.saved
        ent = saved.entries[entries]
        bit = np.array([self.bits.get(name, -1) for name in saved.names])[ent[:, COL]]
        block = (self.at[ent[:, FIRST]] - int(self.at[row])) // plan.block_rows
        length = ent[:, LENGTH]
        directory = np.zeros((len(plan.columns), plan.n_blocks, 2), "<u4")
        directory[bit, block, 0] = plan.dir_bytes + np.cumsum(length) - length
        directory[bit, block, 1] = length
        off = ent[:, OFFSET]
        if (off[1:] == off[:-1] + length[:-1]).all():   # back to back in the file: one read
            body = saved.blocks[int(off[0]):int(off[-1] + length[-1])]
            return directory.tobytes() + body.tobytes()
        return directory.tobytes() + b"".join(saved.block(e) for e in entries.tolist())


def _ramps(lengths: np.ndarray) -> np.ndarray:
    """0, 1, .., l - 1 for each l of ``lengths``, concatenated."""
    ends = np.cumsum(lengths)
    return np.arange(int(ends[-1]) if len(ends) else 0) - np.repeat(ends - lengths, lengths)
