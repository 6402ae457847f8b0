"""A stable-worldmodel episode table in one shared step store, made at the first episode.

swm's buffers fix their schema from the first episode, so the segment can
only be sized then: a ``Table`` knows its name from the start (it pickles to
it) and creates the segment when the first episode arrives, in whatever
process that is; a process that loses the race attaches.

Storage: user column ``i`` is the store's column ``c{i}`` (swm names need
not be Python identifiers), ``done`` ends every episode on its last row,
``mark`` flags the one-row episodes that ``clear()`` writes (``MARK_CLEAR``)
and the rows that only carry episode data (``MARK_DATA``), and ``epd``
carries the episode's ``_episode_data`` (see ``_swm_codec``).  Data that the
episode's own rows cannot hold (the column's width is fixed by the first
episode) goes into extra rows written before the episode's steps, in the
same append: any size fits, published and recycled with its episode.  The metadata
keeps the user names, the text columns and the parameters.

Reading: a ``View`` is the finished episodes held now, oldest first (the
order they ended), as one flat array of physical rows, episode after
episode, like swm's flat storage (data rows left out).  Episodes whose
rows were recycled are dropped, and so is everything up to the newest ``clear()`` mark.  Every read
checks, after its copy, that no chunk it read was recycled meanwhile.
"""
from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from .._errors import (
    BufferClosedError,
    CorruptSegmentError,
    OwnerAliveError,
    SegmentExistsError,
    SegmentNotFoundError,
)
from ..protocol.layout import CLOSED_OWNER
from ..sampling.codec import Codec
from ..sampling.windows import Windows
from ..segment.segment import unlink as unlink_segment
from ..store import buffer as store
from ..writing.compress import Compress
from . import _swm_codec as codec

FACADE = "swm"
RETRIES = 8   # reads again after a recycled episode, before giving up
MARK_CLEAR = 1   # ``mark`` of the one-row episode clear() writes
MARK_DATA = 2    # ``mark`` of a row before an episode's steps that carries only its data


class TableChangedError(RuntimeError):
    """Rows being read were recycled by a writer; read again with a fresh view."""


def remove(name: str) -> None:
    """Mark segment ``name`` closed and remove it (its writers stop); gone already is fine."""
    try:
        unlink_segment(name, CLOSED_OWNER)
    except (FileNotFoundError, SegmentNotFoundError):
        pass


def exists(name: str) -> bool:
    return os.path.exists(os.path.join("/dev/shm", name))


def attach_table(name: str, who: str):
    """The core buffer of swm table ``name``, attached (never owned).

    Raises:
        SegmentNotFoundError: no segment has that name.
        ValueError: the segment is not a stable-worldmodel table.
    """
    try:
        buf = store.attach(name)
    except CorruptSegmentError as exc:
        raise ValueError(f"{who}: segment {name!r} is not a stable-worldmodel buffer "
                         f"({exc})") from None
    if buf.meta.get("facade") != FACADE:
        made = buf.meta.get("facade") or buf.meta.get("source") or "shmbuf.create"
        buf.close()
        raise ValueError(f"{who}: segment {name!r} is not a stable-worldmodel buffer (it was "
                         f"made by {made}); use shmbuf.attach for it")
    return buf


def check_compress(compress, capacity: int, who: str):
    """``compress=`` of a swm object, checked before anything exists: None (raw), True
    (every uint8 column of two or more dimensions per step: the frames), or a
    ``shmbuf.Compress`` naming swm columns (checked against them at the first episode).

    Raises:
        TypeError: another type.
        ValueError: ``hot_steps`` above ``capacity`` (swm's ``max_steps``).
        ImportError: the codec's library is not installed (names the extra).
    """
    if compress is None or compress is False:
        return None
    if compress is True:
        Codec("zstd", 1)   # Compress's defaults; the library must import
        return True
    if not isinstance(compress, Compress):
        raise TypeError(f"{who}: compress must be True, False, None or a shmbuf.Compress, "
                        f"got {compress!r}")
    if compress.hot_steps is not None and compress.hot_steps > capacity:
        raise ValueError(f"{who}: compress: hot_steps must be at most max_steps "
                         f"({capacity}), got {compress.hot_steps}")
    Codec(compress.codec, compress.level)   # its library must import: fail here, not later
    return compress


def store_compress(compress, cols: dict[str, np.ndarray], who: str) -> Compress | None:
    """The store's ``Compress`` (columns ``c{i}``) for ``check_compress``'s value, once the
    first episode's columns ``cols`` are known.

    Raises:
        ValueError: a column that is not one of the episode's (nothing is made).
    """
    if compress is None:
        return None
    names = list(cols)
    if compress is True:    # the frames: uint8, two or more dimensions per step
        picked = [c for c, arr in cols.items() if arr.dtype == np.uint8 and arr.ndim >= 3]
        return Compress([f"c{names.index(c)}" for c in picked]) if picked else None
    for c in compress.columns:
        if c not in names:
            raise ValueError(f"{who}: compress: columns names {c!r}, which is not a column "
                             f"of the episodes; their columns are {sorted(names)}")
    return Compress([f"c{names.index(c)}" for c in compress.columns], codec=compress.codec,
                    level=compress.level, hot_steps=compress.hot_steps)


class Table:
    """The shared table behind one swm object (see the module docstring).

    Args:
        name: the segment's name (made on the first episode).
        capacity: steps the store holds (swm's ``max_steps``).
        params: JSON-able parameters kept in the metadata.
        keep_created: a segment this process creates outlives it (``keep``).
        adopt: this process answers for the segment: when the process that
            created it has died, take ownership (``attach(own=True)``), so that
            ``shmbuf gc`` leaves it alone and this process removes it at close.
        compress: ``check_compress``'s value: the columns a segment made here
            keeps compressed in its cold chunks (an existing one keeps its own).
    """

    def __init__(self, name: str, capacity: int, params: dict, *, keep_created: bool,
                 adopt: bool = False, compress=None):
        self.name = name
        self.compress = compress
        self.adopt = adopt
        self.capacity = capacity
        self.params = params
        self.keep_created = keep_created
        self.buf: Any = None          # the core Buffer once attached or created
        self._writer: Any = None
        self._writer_pid = -1
        self._view: View | None = None

    # -- the segment ----------------------------------------------------------------
    def attached(self, who: str):
        """The core buffer, attached now if it exists; None before the first episode."""
        if self.buf is None:
            try:
                self.buf = attach_table(self.name, who)
            except SegmentNotFoundError:
                return None
        return self.buf

    def _create(self, cols: dict[str, np.ndarray], blob: bytes, steps: int, who: str):
        spec: dict[str, tuple] = {f"c{i}": (arr.shape[1:], codec.column_dtype(arr))
                                  for i, arr in enumerate(cols.values())}
        width = codec.data_width(blob, steps)
        spec.update(done=((), np.bool_), mark=((), np.uint8), epd=((width,), np.uint8))
        meta = {"facade": FACADE, "params": self.params, "columns": list(cols)}
        compress = store_compress(self.compress, cols, who)
        try:
            # overcommit: like swm's np.empty rings (and a file on tmpfs), the table takes
            # memory as it fills; a full /dev/shm is SharedMemoryFullError at that write.
            buf = store.create(spec, self.capacity, name=self.name, meta=meta, priorities=True,
                               overcommit=True, compress=compress,
                               handle_signals=None if not self.keep_created else False)
        except SegmentExistsError:
            return self.attached(who)
        if self.keep_created:
            buf.keep()   # it outlives this process (see the module docstring)
        self.buf = buf
        return buf

    def columns(self) -> list[str]:
        return [] if self.buf is None else list(self.buf.meta["columns"])

    def stored(self) -> dict[str, tuple[tuple, np.dtype]]:
        """``{user column: (per-step shape, dtype)}``; empty before the first episode."""
        if self.buf is None:
            return {}
        spec = self.buf.spec
        return {c: spec[f"c{i}"] for i, c in enumerate(self.buf.meta["columns"])}

    # -- writing --------------------------------------------------------------------------
    def check(self, cols: dict[str, np.ndarray], who: str) -> None:
        """Schema drift is refused here, before anything is written."""
        stored = self.stored()
        if not stored:
            return
        if set(stored) != set(cols):
            raise ValueError(f"{who}: schema mismatch. missing={sorted(set(stored) - set(cols))}, "
                             f"extra={sorted(set(cols) - set(stored))}")
        for col, arr in cols.items():
            shape, dtype = stored[col]
            codec.check_value(col, arr, shape, dtype, who)

    def write(self, cols: dict[str, np.ndarray], steps: int, data: dict, who: str) -> None:
        """Append one whole episode; it becomes visible when its last row is published."""
        blob = codec.encode_data(data)
        buf = self.attached(who)
        if buf is None:
            buf = self._create(cols, blob, steps, who)
        self.check(cols, who)
        extra, epd = codec.spread(blob, steps, buf.spec["epd"][0][0])
        if steps + extra > buf.capacity:
            raise ValueError(
                f"{who}: the episode's {codec.EPISODE_DATA_KEY} takes {len(blob)} bytes "
                f"encoded, which needs {extra} rows beside its {steps} steps; "
                f"{steps + extra} rows exceed max_steps={buf.capacity}")
        done = np.zeros(steps + extra, np.bool_)
        done[-1] = True
        mark = np.zeros(steps + extra, np.uint8)
        mark[:extra] = MARK_DATA
        values = {f"c{i}": _with_blank_rows(cols[c], extra)
                  for i, c in enumerate(buf.meta["columns"])}
        values.update(done=done, mark=mark, epd=epd)
        self._get_writer().extend(**values)

    def clear(self) -> None:
        """Hide every episode held now, in every process (a one-row mark episode)."""
        buf = self.attached("clear")
        if buf is None:
            return
        values = {}
        for col, (shape, dtype) in buf.spec.items():
            values[col] = np.zeros((1,) + tuple(shape), dtype)
        values["done"][:] = True
        values["mark"][:] = MARK_CLEAR
        self._get_writer().extend(**values)
        self._view = None

    def _get_writer(self):
        if self._writer is None or self._writer_pid != os.getpid():
            self._writer = self.buf.writer()
            self._writer_pid = os.getpid()
        return self._writer

    # -- reading ------------------------------------------------------------------------
    def view(self, who: str = "read") -> View:
        """The finished episodes held now (cached until the episode index moves)."""
        buf = self.attached(who)
        if buf is None:
            return View.empty()
        logged = buf.port.episodes_logged()
        if self._view is None or self._view.logged != logged or not self._view.valid():
            if self.adopt and not buf.owner:
                buf = self._adopt_if_orphaned(buf)
            self._view = View.build(buf, logged, self._view)
        return self._view

    def _adopt_if_orphaned(self, buf):
        """Own the segment once its creator (a collector that wrote first) has exited."""
        if buf.stats().owner_alive:
            return buf
        try:
            mine = store.attach(self.name, own=True)
        except (OwnerAliveError, BufferClosedError, SegmentNotFoundError):
            return buf        # a rival adopted it, or it is being removed
        if self._writer is not None and self._writer_pid == os.getpid():
            self._writer.close()   # its slot goes with the old handle
        self._writer = None
        buf.close()
        self.buf = mine
        self._view = None
        return mine

    def close_writer(self) -> None:
        """Close this process's writer: its open chunk is sealed (``compact`` can take it)."""
        writer, self._writer = self._writer, None
        if writer is not None and getattr(self, "_writer_pid", None) == os.getpid():
            writer.close()

    def close(self, remove_segment: bool) -> None:
        self.close_writer()
        buf, self.buf = self.buf, None
        self._view = None
        if buf is not None:
            buf.close()
        if remove_segment:
            remove(self.name)


def _with_blank_rows(arr: np.ndarray, extra: int) -> np.ndarray:
    """``arr`` after ``extra`` blank rows (the data rows' value in a user column)."""
    if not extra:
        return arr
    return np.concatenate([np.zeros((extra,) + arr.shape[1:], arr.dtype), arr])


class View:
    """The held finished episodes as flat rows (see the module docstring)."""

    def __init__(self, buf, logged: int, index, lengths, rows, chunks, seqs, hops,
                 data_rows=None):
        self.buf = buf
        self.logged = logged
        self.index = index                  # episode-index numbers, oldest first
        self.lengths = lengths              # int64 steps per episode
        self.offsets = np.zeros(len(lengths), np.int64)
        if len(lengths):
            np.cumsum(lengths[:-1], out=self.offsets[1:])
        self.rows = rows                    # int64 physical rows, episode after episode
        self.chunks, self.seqs, self.hops = chunks, seqs, hops   # (n, hops) padded
        # {episode-index number: physical rows before its steps that carry only its data}
        self.data_rows: dict[int, np.ndarray] = data_rows or {}
        self._starts: dict[int, np.ndarray] = {}
        self._data: dict[int, dict] = {}
        self._inverse: tuple[np.ndarray, np.ndarray] | None = None
        self.cleared = False                # built from entries that held a clear() mark
        self.built = time.monotonic()

    @classmethod
    def empty(cls) -> View:
        z = np.zeros(0, np.int64)
        return cls(None, 0, z, z, z, np.zeros((0, 1), np.int64), np.zeros((0, 1), np.int64), 1)

    @property
    def steps(self) -> int:
        return int(self.lengths.sum())

    @classmethod
    def build(cls, buf, logged: int, old: View | None) -> View:
        """The view now; from ``old`` (same buffer) only the episodes that ended since are read.

        Old episodes still indexed are re-checked in one pass (recycled ones dropped), the
        new ones are located; the newest ``clear()`` mark hides all before it.
        """
        if old is None or old.buf is not buf:
            return cls._located(buf, logged, buf.episodes())
        slots = buf.port.episode_slots
        last = int(old.index[-1]) if len(old.index) else logged - 1 - min(logged, slots)
        fresh = min(logged - 1 - last, slots)
        kept = old.index >= logged - slots
        if len(old.index):
            kept &= old.check_episodes(np.arange(len(old.index)))
        base = old if kept.all() else old.keep_only(kept, logged)
        if fresh <= 0:
            base.logged = logged
            return base
        new = cls._located(buf, logged, buf.episodes(newest=fresh))
        if new.cleared:
            return new
        return base.joined(new, logged)

    @classmethod
    def _located(cls, buf, logged: int, eps) -> View:
        """A view of the index entries ``eps`` that are still held (each located)."""
        port = buf.port
        found = []
        for k in range(len(eps.index)):
            start = int(port.chunk_base[int(eps.chunk[k])]) + int(eps.offset[k])
            w = port.locate(np.array([start], np.int64), int(eps.length[k]))
            if not len(w.rows) or (int(w.chunks[0, 0]), int(w.seqs[0, 0])) != (
                    int(eps.chunk[k]), int(eps.seq[k])):
                continue
            found.append((int(eps.index[k]), w.rows[0], w.chunks[0], w.seqs[0]))
        # The newest clear() mark hides itself and everything that ended before it.
        marks, extra = _marks(buf, found)
        if marks:
            found = found[marks[-1] + 1:]
        data_rows = {i: r[:extra[i]] for i, r, _, _ in found if i in extra}
        found = [(i, r[extra.get(i, 0):], c, s) for i, r, c, s in found]
        hops = max([len(f[2]) for f in found], default=1)
        n = len(found)
        chunks = np.empty((n, hops), np.int64)
        seqs = np.empty((n, hops), np.int64)
        for k, (_, _, c, s) in enumerate(found):
            chunks[k, :len(c)], seqs[k, :len(s)] = c, s
            chunks[k, len(c):], seqs[k, len(s):] = c[-1], s[-1]   # a repeat checks nothing new
        view = cls(buf, logged, np.array([f[0] for f in found], np.int64),
                   np.array([len(f[1]) for f in found], np.int64),
                   np.concatenate([f[1] for f in found]) if found else np.zeros(0, np.int64),
                   chunks, seqs, hops, data_rows)
        view.cleared = bool(marks)
        ok = view.check_episodes(np.arange(n))
        if not ok.all():   # recycled since the index was read: drop them
            cleared, view = view.cleared, view.keep_only(ok, logged)
            view.cleared = cleared
        return view

    def joined(self, newer: View, logged: int) -> View:
        """This view's episodes, then ``newer``'s."""
        hops = max(self.hops, newer.hops)

        def pad(a: np.ndarray) -> np.ndarray:
            if a.shape[1] == hops:
                return a
            return np.concatenate([a, np.repeat(a[:, -1:], hops - a.shape[1], axis=1)], axis=1)

        return View(self.buf, logged, np.concatenate([self.index, newer.index]),
                    np.concatenate([self.lengths, newer.lengths]),
                    np.concatenate([self.rows, newer.rows]),
                    np.concatenate([pad(self.chunks), pad(newer.chunks)]),
                    np.concatenate([pad(self.seqs), pad(newer.seqs)]), hops,
                    {**self.data_rows, **newer.data_rows})

    def keep_only(self, ok: np.ndarray, logged: int) -> View:
        """The episodes where ``ok``."""
        first = int(np.argmax(ok)) if ok.any() else len(ok)
        data_rows = self.data_rows
        if data_rows:
            kept = set(self.index[ok].tolist())
            data_rows = {i: r for i, r in data_rows.items() if i in kept}
        if ok[first:].all():     # the usual case: the oldest episodes went
            a = int(self.offsets[first]) if first < len(ok) else len(self.rows)
            return View(self.buf, logged, self.index[first:], self.lengths[first:],
                        self.rows[a:], self.chunks[first:], self.seqs[first:], self.hops,
                        data_rows)
        parts = [self.rows[a:a + n] for a, n, good in
                 zip(self.offsets.tolist(), self.lengths.tolist(), ok.tolist()) if good]
        return View(self.buf, logged, self.index[ok], self.lengths[ok],
                    np.concatenate(parts) if parts else np.zeros(0, np.int64),
                    self.chunks[ok], self.seqs[ok], self.hops, data_rows)

    def check_episodes(self, eps: np.ndarray) -> np.ndarray:
        """True for each episode of ``eps`` whose chunks were not recycled."""
        eps = np.unique(eps) if len(eps) > 1 else eps
        if self.buf is None or not len(eps):
            return np.ones(len(eps), np.bool_)
        w = Windows(np.zeros((len(eps), 1), np.int64), np.ascontiguousarray(self.chunks[eps]),
                    np.ascontiguousarray(self.seqs[eps]))
        return self.buf.port.still_valid(w)

    def still_held(self, eps: np.ndarray) -> np.ndarray:
        """Per entry of ``eps`` (episodes, repeats allowed): its chunks were not recycled."""
        unique, inverse = np.unique(eps, return_inverse=True)
        return self.check_episodes(unique)[inverse.reshape(-1)]

    def valid(self) -> bool:
        """The cached view's oldest episode is still whole (a cheap freshness check)."""
        return not len(self.index) or bool(self.check_episodes(np.array([0]))[0])

    def inverse(self) -> tuple[np.ndarray, np.ndarray]:
        """(flat position of each physical row or -1, episode of each flat position), cached."""
        if self._inverse is None:
            where = np.full(self.buf.capacity, -1, np.int64)
            where[self.rows] = np.arange(len(self.rows))
            self._inverse = (where, np.repeat(np.arange(len(self.lengths)), self.lengths))
        return self._inverse

    def clip_starts(self, span: int) -> np.ndarray:
        """``(n + 1,)`` cumulative counts of clips of ``span`` steps per episode."""
        got = self._starts.get(span)
        if got is None:
            got = np.zeros(len(self.lengths) + 1, np.int64)
            np.cumsum(np.maximum(0, self.lengths - span + 1), out=got[1:])
            self._starts[span] = got
        return got

    def to_clips(self, flat: np.ndarray, span: int, who: str) -> tuple[np.ndarray, np.ndarray]:
        """``(episode, local start)`` of flat clip indices (swm's order: oldest first)."""
        starts = self.clip_starts(span)
        total = int(starts[-1])
        if flat.size and (flat.min() < 0 or flat.max() >= total):
            raise IndexError(f"{who}: clip index out of range [0, {total})")
        ep = np.searchsorted(starts[1:], flat, side="right")
        return ep, flat - starts[ep]

    def gather(self, col: str, positions: np.ndarray) -> np.ndarray:
        """Store column ``col`` at flat positions (any shape), copied (see ``take``)."""
        return self.take([col], positions)[col]

    def take(self, cols: list[str], positions: np.ndarray,
             eps: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """Store columns ``cols`` at flat positions (any shape), copied, packed rows decoded.

        ``eps``: the episode of each entry of ``positions``' first axis, where each
        of its rows lies in one episode (clips); found per position otherwise.  As
        every read, confirm the episodes afterwards (a recycled row reads as zeros).
        """
        port = self.buf.port
        rows = self.rows[positions]
        if port.unpacker is None:     # nothing is ever packed: index in place
            return {c: np.take(port.views[c], rows, axis=0) for c in cols}
        if eps is None or rows.ndim != 2:   # one window per position, at its episode's hops
            flat = np.asarray(positions).reshape(-1)
            eps = np.searchsorted(self.offsets, flat, side="right") - 1
            got = port.take_rows(cols, rows.reshape(-1, 1), self.chunks[eps], self.seqs[eps])
            return {c: v.reshape(rows.shape + v.shape[2:]) for c, v in got.items()}
        return port.take_rows(cols, rows, self.chunks[eps], self.seqs[eps])

    def confirm(self, eps: np.ndarray, who: str) -> None:
        """Raise TableChangedError if an episode of ``eps`` was recycled during a read."""
        if not self.check_episodes(eps).all():
            raise TableChangedError(f"{who}: episodes were recycled while they were read")

    def episode_data(self, ep: int) -> dict:
        got = self._data.get(ep)
        if got is None:
            a, n = int(self.offsets[ep]), int(self.lengths[ep])
            extra = self.data_rows.get(int(self.index[ep]))
            rows = self.rows[a:a + n]
            if extra is not None:
                rows = np.concatenate([extra, rows])
            epd = self.buf.port.take_rows(["epd"], rows[None], self.chunks[ep:ep + 1],
                                            self.seqs[ep:ep + 1])["epd"][0]
            got = codec.gather_data(epd, extra is not None)
            self.confirm(np.array([ep]), "episode data")
            self._data[ep] = got
        return got


def _marks(buf, found: list) -> tuple[list[int], dict[int, int]]:
    """``(clears, extra)`` of the located episodes ``found``: the positions of ``clear()``
    marks (one row, ``MARK_CLEAR``), and ``{episode-index number: data rows}`` of the
    episodes that begin with rows carrying only data (``MARK_DATA``).  Read like every
    column (``take_rows``); the caller re-checks the episodes after."""
    if not found:
        return [], {}
    rows = np.array([f[1][:1] for f in found], np.int64)           # (m, 1): first rows
    hops = (np.array([f[2][:1] for f in found], np.int64),
            np.array([f[3][:1] for f in found], np.int64))
    got = buf.port.take_rows(["mark", "epd"], rows, *hops)
    clears, extra = [], {}
    for n, m in enumerate(got["mark"][:, 0].tolist()):
        length = len(found[n][1])
        if length == 1 and m:
            clears.append(n)
        elif m == MARK_DATA and length > 1:   # a recycled row may read anything: clamp
            extra[found[n][0]] = min(max(codec.extra_rows(got["epd"][n, 0]), 1), length - 1)
    return clears, extra


def retrying(fn, table: Table, who: str):
    """``fn(view)`` with a fresh view after each TableChangedError (a few times)."""
    for _ in range(RETRIES):
        try:
            return fn(table.view(who))
        except TableChangedError:
            table._view = None
    return fn(table.view(who))
