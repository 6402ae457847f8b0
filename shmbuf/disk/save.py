"""Save a buffer to disk while writers run: ``save`` and the incremental ``Saver``.

The format, and how a save is read back, is ``disk.saved``'s.

Rows are whole chunks in the order they were claimed, oldest first; within
a stream that is step order, so the steps of episode ``e`` of stream ``s``
are ``np.flatnonzero((stream == s) & (episode == e))``, in order.  Each
chunk is written straight from the mapping, then its seq is checked, as a
sample is: a chunk recycled while it was written is cut off the files again
(its steps are gone anyway).  If a stream lost a chunk that way, its later
steps get a new stream id, so that loading never splices across the gap.
``manifest.json`` is written last, through a rename: a save without one is
incomplete, and ``load`` trusts no more rows than the manifest names.

Keyed rings (a HistoryBuffer) save to the same kind of directory, with
``"kind": "keyed"`` in the manifest and their own files: ``disk.keyed_save``.
A manifest without ``kind`` is a step store's.
"""
from __future__ import annotations

import json
import os
import shutil
import struct
import threading
import time
import zlib

import numpy as np
from numpy.typing import DTypeLike

from .._errors import BufferClosedError, SaveExistsError
from ..protocol.layout import EP_COLUMN
from .checkpoint import StreamIds, copy_chunks
from .saved import (
    BLOCKS,
    CHUNKS,
    ENDS,
    ENTRY_FIELDS,
    EPISODE,
    FORMAT,
    MANIFEST,
    PACKED,
    PACKED_VERSION,
    PRIORITIES,
    STREAM,
    TICKETS,
    VERSION,
)

NPY_HEADER = 256  # bytes: room for any shape, so appending rewrites it in place
GAP_IDS = 1 << 48  # stream ids given to a stream's steps after a gap
INDEX_BATCH = 1 << 14  # episode index entries read at once (1 MiB of entries)


# -- .npy files that grow ------------------------------------------------------------
def _npy_header(dtype: np.dtype, shape: tuple) -> bytes:
    body = repr({"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False,
                 "shape": tuple(int(d) for d in shape)})
    pad = NPY_HEADER - 10 - len(body) - 1
    if pad < 0:
        raise ValueError(f"shape {shape} does not fit a {NPY_HEADER}-byte .npy header")
    body = body + " " * pad + "\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(body)) + body.encode("latin1")


class _Column:
    """One growing .npy file: rows are appended, the header says how many."""

    def __init__(self, path: str, dtype: DTypeLike, shape: tuple, rows: int = 0):
        self.path, self.dtype, self.shape = path, np.dtype(dtype), tuple(shape)
        self.row_bytes = int(np.prod(shape, dtype=np.int64)) * self.dtype.itemsize
        self.rows = rows
        self.file = open(path, "r+b" if rows else "w+b", buffering=0)
        if not rows:
            self.file.write(_npy_header(self.dtype, (0,) + self.shape))

    def write(self, at_row: int, data) -> None:
        """Write ``data`` (rows) from row ``at_row`` on; the header is not touched."""
        view = memoryview(np.ascontiguousarray(data)).cast("B")  # type: ignore[arg-type]  # a buffer (typed so from 3.12)
        self.file.seek(NPY_HEADER + at_row * self.row_bytes)
        while view:
            view = view[self.file.write(view):]

    def truncate(self, rows: int) -> None:
        self.file.truncate(NPY_HEADER + rows * self.row_bytes)

    def commit(self, rows: int) -> None:
        self.rows = rows
        self.file.seek(0)
        self.file.write(_npy_header(self.dtype, (rows,) + self.shape))

    def sync(self) -> None:
        os.fsync(self.file.fileno())

    def close(self) -> None:
        self.file.close()


# -- writing -------------------------------------------------------------------------
def _prepare_dir(path: str, overwrite: bool) -> None:
    """Make ``path`` an empty directory; replace an old save only if ``overwrite``."""
    path = os.fspath(path)
    if os.path.lexists(path):
        if not overwrite:
            raise SaveExistsError(
                f"{path!r} already exists; pass overwrite=True to replace a shmbuf save "
                "there, or pick another path")
        if not os.path.isdir(path) or os.path.islink(path):
            raise SaveExistsError(f"{path!r} exists and is not a directory; overwrite=True "
                                  "replaces only a shmbuf save, remove it yourself")
        entries = set(os.listdir(path))
        if entries and MANIFEST not in entries and not _only_save_files(entries):
            raise SaveExistsError(f"{path!r} is a directory that holds no shmbuf save; "
                                  "overwrite=True replaces only a save, remove it yourself")
        shutil.rmtree(path)
    os.makedirs(path)


def _only_save_files(entries) -> bool:
    return all(e.endswith((".npy", ".json", ".tmp")) for e in entries)


class _Writer:
    """The files of one save and the bookkeeping that keeps streams whole."""

    def __init__(self, buf, path: str, rows: int = 0):
        port = buf.port
        self.buf, self.path, self.port, self.ring = buf, os.fspath(path), port, port.ring
        lay = self.ring.layout
        self.views = port.views
        self.columns = {c.name: _Column(os.path.join(self.path, c.name + ".npy"), c.dtype,
                                        c.shape, rows) for c in lay.user_columns}
        self.columns[STREAM] = _Column(os.path.join(self.path, STREAM + ".npy"), np.int64, (),
                                       rows)
        self.columns[EPISODE] = _Column(os.path.join(self.path, EPISODE + ".npy"), np.int64,
                                        (), rows)
        self.columns[ENDS] = _Column(os.path.join(self.path, ENDS + ".npy"), np.int64, (), rows)
        if self.ring.priorities is not None:
            self.columns[PRIORITIES] = _Column(os.path.join(self.path, PRIORITIES + ".npy"),
                                               np.float32, (), rows)
        self.chunk_starts = _Column(os.path.join(self.path, CHUNKS + ".npy"), np.int64, ())
        # The id ticket of each chunk (the ring's ticket + the ids' base), for loading ids.
        self.tickets = None if self.ring.priorities is None else _Column(
            os.path.join(self.path, TICKETS + ".npy"), np.int64, ())
        self.n_chunks = 0
        # Compressed blocks copied as they are (a compressing buffer only): the entries
        # and bytes of kept chunks, and what the chunk being copied adds (kept or not).
        self.unpack = port.unpacker
        self.packed: _Column | None = None
        self.blocks: _Column | None = None
        self.n_packed = self.n_bytes = 0
        self.staged: list[tuple[int, ...]] = []
        if self.unpack is not None:
            self.packed = _Column(os.path.join(self.path, PACKED + ".npy"), np.int64,
                                  (ENTRY_FIELDS,))
            self.blocks = _Column(os.path.join(self.path, BLOCKS + ".npy"), np.uint8, ())
        self.col_index = {c.name: i for i, c in enumerate(lay.user_columns)}
        # Episode ends, so that loading ends every finished episode (a cut one too, at the
        # end of a stream) in the order they ended: the last saved row of each (stream,
        # episode), each stream's newest episode saved, and index entries not matched yet.
        self.last_row: dict[tuple[int, int], int] = {}
        self.newest_ep: dict[int, int] = {}
        self.pending: dict[tuple[int, int], int] = {}
        self.logged = max(0, self.ring.episodes_logged() - self.ring.layout.episode_slots)
        self.rows = rows          # rows written and validated
        self.committed = rows     # rows the manifest names
        self.ids = StreamIds(GAP_IDS)   # a Saver's later calls continue the same streams
        self.dropped = 0

    def write_chunks(self, chunks) -> int:
        """Append each chunk that stays intact while written; return the rows added."""
        before = self.rows
        eps = np.empty(0, np.int64)

        chunk_size = self.ring.layout.chunk_size
        seq_of = dict(zip(chunks.chunk.tolist(), chunks.seq.tolist()))

        def copy(base: int, count: int, read) -> None:   # straight from the mapping
            nonlocal eps
            eps = self.views[EP_COLUMN][base:base + count].copy()  # 8 bytes a row: the only copy
            packed = self._copy_packed(base // chunk_size, seq_of[base // chunk_size], count)
            for name, col in self.columns.items():
                if name == PRIORITIES:
                    col.write(self.rows, self.ring.priorities.saved(base, count))
                elif name not in (STREAM, EPISODE, ENDS) and name not in packed:
                    col.write(self.rows, read(name))

        kept = 0
        for i, sid in copy_chunks(self.port, chunks, copy, self.ids):
            kept += 1
            self._keep_packed()
            count, stream = int(chunks.count[i]), int(chunks.stream[i])
            self.columns[EPISODE].write(self.rows, eps)
            self.columns[ENDS].write(self.rows, np.full(count, -1, np.int64))
            self.columns[STREAM].write(self.rows, np.full(count, sid, np.int64))
            self.chunk_starts.write(self.n_chunks, np.array([self.rows], np.int64))
            if self.tickets is not None:
                self.tickets.write(self.n_chunks, np.array(
                    [int(chunks.ticket[i]) + self.port.id_base], np.int64))
            self.n_chunks += 1
            for ep, back in zip(*np.unique(eps[::-1], return_index=True)):
                self.last_row[(stream, int(ep))] = self.rows + count - 1 - int(back)
            self.newest_ep[stream] = max(self.newest_ep.get(stream, -1), int(eps.max()))
            self.rows += count
        self.dropped += len(chunks.chunk) - kept   # recycled while written
        for col in self.columns.values():
            col.truncate(self.rows)  # drop what a recycled last chunk left
        self.staged = []
        if self.packed is not None and self.blocks is not None:
            self.packed.truncate(self.n_packed)
            self.blocks.truncate(self.n_bytes)
        return self.rows - before

    def _copy_packed(self, chunk: int, seq: int, count: int) -> set[str]:
        """Copy the blocks of ``chunk``'s columns compressed at ``seq`` to the blocks file,
        as they are, and stage their entries; return the names of those columns.

        Called inside the reader bracket, before the chunk's seq re-check: blocks of a
        chunk recycled meanwhile are overwritten by the next chunk's (``_keep_packed``
        is called only for chunks kept)."""
        self.staged = []
        unpack = self.unpack
        if unpack is None or self.blocks is None:
            return set()
        flags = unpack.chunk_flags(chunk, seq, count)
        if flags is None or not bool(flags.packed[0, 0]):
            return set()   # raw (or stale: the re-check drops the chunk)
        mask = int(flags.mask[0, 0])
        plan, words = unpack.plan, unpack.words
        b, at = plan.block_rows, self.n_bytes
        directory = words.read_dir(chunk)
        names = set()
        for col in plan.columns:
            if not mask >> col.bit & 1 or col.name not in self.col_index:
                continue
            names.add(col.name)
            for j in range(-(-count // b)):
                off, length = (int(x) for x in directory[col.bit, j])
                blob = words.read_blob(chunk, off, length)
                self.blocks.write(at, np.frombuffer(blob, np.uint8))
                self.staged.append((self.col_index[col.name], self.rows + j * b,
                                    min(b, count - j * b), at, len(blob), zlib.crc32(blob)))
                at += len(blob)
        return names

    def _keep_packed(self) -> None:
        """The chunk just copied was kept: its staged blocks become part of the save."""
        if self.staged and self.packed is not None:
            self.packed.write(self.n_packed, np.array(self.staged, np.int64))
            self.n_packed += len(self.staged)
            self.n_bytes = self.staged[-1][3] + self.staged[-1][4]
        self.staged = []

    def mark_ends(self, final: bool) -> None:
        """Write, at the last saved row of each finished episode, its index number.

        Until the save is final, an episode's last saved row counts only once
        its stream has saved a later episode (more of it may still come).
        """
        ring = self.ring
        hi = ring.episodes_logged()
        lo = max(self.logged, hi - ring.layout.episode_slots)
        for at in range(lo, hi, INDEX_BATCH):  # a bounded slice of the index at a time
            done = ring.read_episodes(np.arange(at, min(at + INDEX_BATCH, hi), dtype=np.int64))
            for stream, ep, index in zip(done.stream.tolist(), done.ep.tolist(),
                                         done.index.tolist()):
                self.pending[(stream, ep)] = index
        self.logged = hi
        oldest = hi - ring.layout.episode_slots
        for key, index in list(self.pending.items()):
            row = self.last_row.get(key)
            moved_on = self.newest_ep.get(key[0], -1) > key[1]
            if row is not None and (final or moved_on):
                self.columns[ENDS].write(row, np.array([index], np.int64))
                del self.pending[key]
            elif moved_on or index < oldest:
                del self.pending[key]  # its rows were recycled before they were saved

    def commit(self, *, following: bool, durable: bool) -> None:
        """Make the rows written so far the save: headers, then the manifest (renamed in)."""
        self.mark_ends(final=not following)
        self.chunk_starts.commit(self.n_chunks)
        files = list(self.columns.values()) + [self.chunk_starts]
        if self.tickets is not None:
            self.tickets.commit(self.n_chunks)
            files.append(self.tickets)
        if self.packed is not None and self.blocks is not None:
            self.packed.commit(self.n_packed)
            self.blocks.commit(self.n_bytes)
            files += [self.packed, self.blocks]
        if durable:
            for col in files:
                col.sync()
        for col in self.columns.values():
            col.commit(self.rows)
        if durable:
            for col in files:
                col.sync()
        _write_manifest(self.path, self._manifest(following), durable)
        self.committed = self.rows

    def _manifest(self, following: bool) -> dict:
        lay, buf = self.ring.layout, self.buf
        packed = {}
        if self.n_packed and self.unpack is not None:
            packed = {"packed": {"codec": self.unpack.codec.name,
                                 "block_rows": self.unpack.plan.block_rows,
                                 "blocks": self.n_packed, "bytes": self.n_bytes}}
        return {
            "format": FORMAT, "version": PACKED_VERSION if packed else VERSION,
            "rows": self.rows, "chunks": self.n_chunks, **packed,
            "following": following,
            "spec": {c.name: {"shape": list(c.shape), "dtype": c.dtype.str}
                     for c in lay.user_columns},
            "done_key": buf.done_key, "capacity": lay.capacity, "chunk_size": lay.chunk_size,
            "max_writers": lay.max_writers, "meta": buf.meta, "source": buf.name,
            "saved_ns": time.time_ns(),
            **_rate_manifest(self.port.limiter),
            **({"priorities": True, "max_priority": self.ring.priorities.largest_set(),
                "tickets": True}
               if self.ring.priorities is not None else {}),
        }

    def close(self) -> None:
        for col in list(self.columns.values()) + [self.chunk_starts, self.tickets, self.packed,
                                                  self.blocks]:
            if col is not None:
                col.close()


def _rate_manifest(limiter) -> dict:
    """The rate limit and its counters, so that a loaded buffer holds the ratio on."""
    if limiter is None:
        return {}
    return {"rate_limit": limiter.limit().to_json(), "rate": limiter.state()}


def _write_manifest(path: str, manifest: dict, durable: bool) -> None:
    tmp = os.path.join(path, MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, os.path.join(path, MANIFEST))
    if durable:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def save(buf, path, *, overwrite: bool = False, durable: bool = False) -> int:
    """Write every live step of ``buf`` to the directory ``path``; return the steps saved."""
    _prepare_dir(path, overwrite)
    out = _Writer(buf, path)
    try:
        out.write_chunks(out.ring.live_chunks())
        out.commit(following=False, durable=durable)
    finally:
        out.close()
    return out.rows


class Saver:
    """Incremental save: appends each chunk to ``path`` as soon as it is sealed.

    A background thread looks every ``interval`` seconds for chunks that no
    writer will add to any more (sealed, or their writer died), appends
    them, fsyncs, and then renames a new manifest in: a machine that reboots
    loses at most the chunks still open (and the last ``interval``).
    ``close()`` (also at the buffer's close) saves the open chunks too.

    Keep ``interval`` below the time the buffer takes to recycle its
    oldest chunk, or chunks are recycled before they are saved
    (``missed`` counts the chunks the saver found recycled mid-write).

    Example:
        >>> saver = buf.save("run/replay", follow=True)   # a Saver
        >>> ...                                           # train for days
        >>> saver.close()                                 # or buf.close()
    """

    def __init__(self, buf, path, *, interval: float = 1.0, overwrite: bool = False,
                 durable: bool = True):
        if not (isinstance(interval, (int, float)) and interval > 0):
            raise ValueError(f"interval must be a number of seconds > 0, got {interval!r}")
        self.path, self.interval, self.durable = os.fspath(path), float(interval), durable
        self._buf, self._port = buf, buf.port
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._saved: set[int] = set()  # claim tickets of chunks already in the save
        self._rows = self._missed = 0
        _prepare_dir(path, overwrite)
        self._out: _Writer | None = _Writer(buf, path)   # None once closed
        self._out.commit(following=True, durable=durable)
        self._thread = threading.Thread(target=self._run, name=f"shmbuf-saver {buf.name}",
                                        daemon=True)
        self._thread.start()

    @property
    def rows(self) -> int:
        """Steps in the save so far."""
        return self._rows

    @property
    def missed(self) -> int:
        """Chunks recycled while they were being written (their steps are not saved)."""
        return self._missed

    @property
    def closed(self) -> bool:
        return self._out is None

    def flush(self, include_open: bool = False) -> int:
        """Append every sealed chunk not saved yet (and open ones if asked); return rows added.

        Raises the error that stopped the background thread, if one did.
        """
        with self._lock:
            if self._error is not None:
                raise self._error
            if self._out is None:
                raise BufferClosedError(f"the saver of {self.path!r} is closed")
            ring = self._out.ring
            chunks = ring.live_chunks() if include_open else ring.final_chunks()
            new = np.array([t not in self._saved for t in chunks.ticket.tolist()], bool)
            if not new.any():
                return 0
            picked = type(chunks)(*(getattr(chunks, f)[new] for f in (
                "chunk", "seq", "count", "stream", "base", "ticket")))
            added = self._out.write_chunks(picked)
            self._saved.update(picked.ticket.tolist())
            self._saved &= set(ring.live_chunks().ticket.tolist()) | set(picked.ticket.tolist())
            self._out.commit(following=not include_open, durable=self.durable)
            self._rows, self._missed = self._out.committed, self._out.dropped
            return added

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.flush()
            except BaseException as exc:  # kept for flush() and close() to raise
                with self._lock:
                    self._error = exc
                return

    def close(self) -> None:
        """Save what is left (open chunks included) and stop.  Idempotent."""
        if self._out is None:
            return
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join()
        try:
            if self._error is None:
                self.flush(include_open=True)
        finally:
            with self._lock:
                out, self._out = self._out, None
            out.close()
            self._port.savers.discard(self)
        if self._error is not None:
            raise self._error

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
