"""The shared step store: one buffer of named columns in one POSIX segment."""
from __future__ import annotations

import dataclasses
import json
import os
import time

import numpy as np

from .._args import check_int
from .._errors import WaitTimeoutError
from .._registry import register
from ..posix import signals as _signals
from ..posix.procs import my_start_time
from ..posix.space import check_fits
from ..posix.wait import check_timeout, poll
from ..protocol import stepids as _stepids
from ..protocol.header import (
    owner_alive,
    owner_record,
    resume_writers,
    stop_writers,
    writers_stopped,
)
from ..protocol.layout import KIND_STORE, Layout, encode_header, encode_meta, plan
from ..protocol.ring import Ring
from ..sampling.rng import ProcessRandom
from ..sampling.windows import WindowFinder
from ..segment.lifecycle import Shared, unpickled
from ..segment.pages import ChunkPages
from ..segment.segment import SHM_DIR, Segment, column_views, generate_name, validate_name
from ..writing.compress import Compress, CompressionStats
from ..writing.port import StorePort
from ..writing.ratelimit import Limiter, RateLimit, RateStats, check_rate_limit, pid_check
from ..writing.writer import Writer
from . import compression as _compression
from .checkpoints import Checkpoints
from .compression import Compaction
from .reads import Reads


@dataclasses.dataclass(frozen=True)
class Stats:
    """Counters of a buffer, read from its header by any attached process.

    Steps are numbered in global write order: ``oldest_step`` and
    ``newest_step`` bound the live ones.  ``reserved_bytes`` is how much of
    /dev/shm the segment holds now, of its ``total_bytes`` at full capacity
    (pages are reserved as chunks are first claimed).  Counts taken while writers join,
    leave or die may be off by the steps of that one writer for an instant.
    """

    name: str
    capacity: int
    chunk_size: int
    n_chunks: int
    steps_written: int
    live_steps: int
    episodes: int
    oldest_step: int
    newest_step: int
    chunks_in_use: int
    writers: int
    streams: int
    samples: int
    owner_pid: int
    owner_alive: bool
    rate: RateStats | None = None   # the rate limiter's counters, if the buffer has one
    reserved_bytes: int = 0
    total_bytes: int = 0
    writers_stopped: bool = False   # Buffer.stop_writers() is in force
    compression: CompressionStats | None = None   # with compress=Compress(...), else None


class Buffer(Reads, Checkpoints, Compaction, Shared):
    """A replay buffer in shared memory; make one with ``create`` or ``attach``.

    Pickling a buffer sends its name: the receiving process attaches to the
    same live memory and never unlinks it.
    """

    _savers: set = frozenset()  # type: ignore[assignment]  # running Savers; class default, so close() works early

    def __init__(self, segment: Segment, layout: Layout, owner: tuple[int, int], meta: dict,
                 seed=None, mapped: bool = False):
        self._layout = layout
        self._owner_pid, self._owner_start = owner
        self._meta = meta
        self._step_ids = _stepids.StepIds.of_meta(meta, layout.chunk_size)
        self._ring = Ring(segment.mmap, layout, segment.name, segment.space)
        self._space = segment.space  # the bytes reserved, for stats()
        self._views = column_views(segment, layout, layout.columns)
        self._finder = WindowFinder(self._ring)
        self._limiter = Limiter.of(self._ring.rate, segment.name,
                                   pid_check(self._ring, self._check_open),
                                   self._ring.stop_mark.check)
        self._random = ProcessRandom(seed, self._owner_pid, segment.name)  # per process
        self._pages = ChunkPages(segment.mmap, layout, mapped)
        self._savers = set()
        packing = unpacker = None
        if layout.pack is not None:
            self._packer, packing, unpacker = _compression.attach_packing(
                self._ring, self._views, segment, layout, meta)
        self._port = StorePort(self._ring, self._views, self._finder, self._limiter,
                               self._random, self._owner_pid,
                               (self._writer, self._sample_args, self._check_priorities),
                               self._savers, self._step_ids, packing, unpacker)
        self._open(segment)

    @property
    def port(self) -> StorePort:
        """The store's one door for shmbuf's own layers and extensions (``StorePort``).

        The facades, saving, the feeds and Ray reach the store's insides only
        through it: windows, step ids, chunks, episodes.  Most users never need it.

        Raises:
            BufferClosedError: this handle was closed.
        """
        self._check_open()
        return self._port

    # -- identity -----------------------------------------------------------
    @property
    def capacity(self) -> int:
        """Steps the buffer holds before the oldest are recycled."""
        return self._layout.capacity

    @property
    def chunk_size(self) -> int:
        return self._layout.chunk_size

    @property
    def spec(self) -> dict:
        """``{column: (shape, dtype)}``, as given to ``create``."""
        return self._layout.spec()

    @property
    def meta(self) -> dict:
        """The JSON metadata given to ``create`` (facades keep their parameters here)."""
        return dict(self._meta)

    def next_serial(self, count: int = 1) -> int:
        """A buffer-wide serial number, unique across all processes (0, 1, 2, ...).

        Args:
            count: take ``count`` consecutive serials at once (an int >= 1);
                the first is returned.

        Example:
            >>> first = buf.next_serial(8)   # first, first + 1, ..., first + 7 are ours
        """
        self._check_open()
        if count != 1:
            count = check_int("count", count, 1)
        return self._ring.bump("serial", count)

    def serial_count(self) -> int:
        """How many serials ``next_serial`` has handed out, in every process together.

        Example:
            >>> buf.next_serial(3); buf.serial_count()   # 3
        """
        self._check_open()
        return self._ring.counter("serial")

    @property
    def done_key(self) -> str | None:
        lay = self._layout
        return lay.columns[lay.done_column].name if lay.done_column >= 0 else None

    def __len__(self) -> int:
        """Live steps right now (cheap: one pass over the chunk counts)."""
        self._check_open()
        return self._ring.live_steps()

    # -- views ----------------------------------------------------------------
    @property
    def arrays(self) -> dict[str, np.ndarray]:
        """Zero-copy numpy views of each column's raw storage, ``(capacity, *shape)``.

        Raw: rows are in no time order, streams interleave chunk by chunk,
        rows that hold no step (or a recycled one) are included, and a writer
        recycling a chunk may rewrite its rows at any moment.
        ``committed_rows()`` lists the rows that hold a step right now.  For
        ordered, validated reads use ``sample_*``, ``iter_episodes`` or
        ``state_dict``.
        """
        self._check_open()
        return {c.name: self._views[c.name] for c in self._layout.user_columns}

    @property
    def tensors(self) -> dict:
        """Zero-copy torch views of the same raw storage as ``arrays`` (imports torch)."""
        import torch

        return {k: torch.from_numpy(v) for k, v in self.arrays.items()}

    # -- writing --------------------------------------------------------------
    def writer(self) -> Writer:
        """Claim a writer slot and return a ``Writer`` for this process.

        Example:
            >>> w = buf.writer()
            >>> w.add(obs=o, action=a, reward=r, done=d)
        """
        return self._writer(limited=True)

    def _writer(self, limited: bool) -> Writer:
        """A writer; ``limited=False`` bypasses the rate limit (a restore's writers)."""
        self._check_live()
        limit = self._limiter if limited and self._limiter and self._limiter.block_writers \
            else None
        return Writer(self._ring, self._views, self._check_open, self._pages.populate, limit,
                      stoppable=limited)

    def stop_writers(self) -> None:
        """Stop every writer of this buffer, in every process, until ``resume_writers``.

        Each write after it (``add``, ``add_batch``, ``extend``,
        ``end_episode``, by any writer, new ones included) raises
        ``WritersStoppedError`` and writes nothing, and a writer waiting for
        the rate limit wakes within a few milliseconds and raises it too, so
        worker loops end and can be joined (a loop that catches the error
        ends cleanly).  Samplers are not affected.  The stop lasts until
        ``resume_writers()``: it does not undo itself, and closing the
        buffer makes it moot.  Idempotent; any attached process may call it.

        Raises:
            BufferClosedError: this handle or the buffer is closed.

        Example:
            >>> buf.stop_writers()          # the workers' add() raise WritersStoppedError
            >>> for p in workers: p.join()
        """
        self._check_live()
        stop_writers(self._ring.mm, os.getpid())

    def resume_writers(self) -> None:
        """Undo ``stop_writers``: writes go through again (a writer that raised may go on).

        Raises:
            BufferClosedError: this handle or the buffer is closed.

        Example:
            >>> buf.resume_writers()        # start new workers for the next phase
        """
        self._check_live()
        resume_writers(self._ring.mm)

    @property
    def rate_limit(self) -> RateLimit | None:
        """The ``RateLimit`` the buffer was created with (every process sees it), or None."""
        return None if self._limiter is None else self._limiter.limit()

    def wait_ready(self, min_steps: int = 1, timeout: float | None = None) -> int:
        """Block until at least ``min_steps`` steps are live; return the count.

        It counts steps, not windows: a sample of long windows can still raise
        NotEnoughDataError if the live steps lie in short episodes.

        Raises:
            WaitTimeoutError: ``timeout`` seconds passed first.
            ValueError: ``min_steps`` exceeds the capacity (it could never be met).

        Example:
            >>> buf.wait_ready(min_steps=5_000, timeout=60)
        """
        self._check_live()
        min_steps = check_int("min_steps", min_steps, 1, self._layout.capacity)
        timeout = check_timeout(timeout)
        ring = self._ring

        def ready():
            ring.check_open(os.getpid())  # a worker waiting on a closed buffer stops
            live = ring.live_steps()
            return live if live >= min_steps else None

        return poll(ready, timeout, lambda: WaitTimeoutError(
            f"buffer {self.name!r} holds {ring.live_steps()} live steps after {timeout} s; "
            f"wait_ready wanted {min_steps}. Are the writers running?"))

    def _check_live(self) -> None:
        """Closed here, or by the owner (or ``shmbuf rm``) in another process: raise."""
        self._check_open()
        self._ring.check_open(os.getpid())

    def stats(self) -> Stats:
        """A snapshot of the header counters (see ``Stats``)."""
        self._check_open()
        lay = self._layout
        c = self._ring.counts()  # in the one order that keeps them consistent
        return Stats(self.name, lay.capacity, lay.chunk_size, lay.n_chunks, c.written,
                     c.live, c.episodes, c.evicted, c.written - 1, c.chunks_in_use,
                     len(self._ring.live_writers()), c.streams, c.samples,
                     owner_record(self._ring.mm)[0], owner_alive(self._ring.mm),
                     None if self._limiter is None else self._limiter.stats(),
                     self._space.reserved_bytes() if self._space else 0, lay.total_bytes,
                     bool(writers_stopped(self._ring.mm)), self._compression_stats())

    # -- episodes and rows ------------------------------------------------------------
    def committed_rows(self) -> np.ndarray:
        """Physical rows of every committed step, chunk by chunk (int64, unordered in time).

        Rows of ``arrays`` outside this set hold no step, or a recycled one.
        """
        self._check_open()
        return self._ring.committed_rows()

    def _closed_mark(self):
        ring = getattr(self, "_ring", None)
        return None if ring is None else ring.mark

    def _release(self) -> None:
        _signals.forget(self)
        self._stop_compressing()
        for saver in list(self._savers):
            saver.close()  # saves what is left, while the mapping is still ours
        # Closed: never read again.  Dropping every reference to the views lets the mapping go.
        self._views = self._ring = self._finder = self._port = None  # type: ignore[assignment]

    @classmethod
    def _open_segment(cls, segment, layout, owner, *, seed=None, own: bool = False,
                      handle_signals: bool | None = None):
        """The Buffer over an attached step-store segment (the registry's way in)."""
        return open_segment(segment, layout, owner, seed=seed, own=own,
                            handle_signals=handle_signals)

    def __reduce__(self):
        return unpickled, (_reattach, self.name, self._random.seed)

    def __repr__(self):
        state = "closed" if self._closed else f"capacity={self.capacity}"
        return f"<shmbuf.Buffer {self._name!r} {state}{' owner' if self.owner else ''}>"


def create(spec: dict, capacity: int, *, name: str | None = None, chunk_size: int | None = None,
           max_writers: int = 128, done_key: str | None = "done", seed=None,
           prefault: bool = False, overcommit: bool = False, meta: dict | None = None,
           episode_slots: int | None = None, handle_signals: bool | None = None,
           rate_limit: RateLimit | None = None, priorities: bool = False,
           compress: Compress | None = None, _step_ids: dict | None = None) -> Buffer:
    """Create a buffer in a new shared-memory segment; the caller owns it.

    Args:
        spec: ``{column: (per-step shape, numpy dtype)}``.
        capacity: steps held before the oldest chunk is recycled.
        name: segment name (letters, digits, ``._-``); generated if None.
        chunk_size: steps per chunk; default ``min(512, capacity // 64)``, at least 1.
        max_writers: writer objects that may be open at once.
        done_key: the scalar column whose true value ends an episode (a bool
            or integer column, or a float one holding exactly 0 or 1).  It
            must be in ``spec``: the default ``"done"`` too.  Only an
            explicit None makes a buffer without episodes.
        seed: seed of the buffer's random streams: every process that samples
            draws its own stream, a function of ``seed`` and of the process
            (this one, a DataLoader worker, another child); fresh OS entropy
            if None.  See ``shmbuf.sampling.rng``.
        prefault: reserve every page of /dev/shm now and map it into this
            process, so that a /dev/shm too small for the whole buffer fails
            here.  Default False: pages are reserved as writers first claim
            each chunk (like ``np.empty``, the buffer takes memory as it
            fills), and a full /dev/shm raises ``SharedMemoryFullError`` at
            that claim.  Either way, writers in other processes map each
            chunk's pages with one call when they claim it.
        overcommit: allow a capacity larger than the whole /dev/shm
            filesystem (it can never be filled: writers get
            ``SharedMemoryFullError`` when /dev/shm runs out).  Default
            False: such a capacity is refused here.
        meta: a JSON-serialisable dict kept with the buffer (``Buffer.meta``):
            up to 1 KiB in the header, longer (up to 64 MiB) in a room of its
            own, sized here.  shmbuf keeps its own keys there too:
            ``"compress"`` and ``"step_ids"`` (yours may not use them).
        episode_slots: finished episodes the episode index remembers
            (``episodes()``, ``uniform="episodes"``); default
            ``capacity // 8`` within 1024 and 4M (at most the capacity),
            64 bytes each.
        handle_signals: None (default): install shmbuf's SIGTERM handler if
            this is the main thread and SIGTERM has its default action, so
            that SIGTERM unwinds, unlinks the buffer, and then ends the
            process by SIGTERM; True: also chain a handler already in place;
            False: install nothing (the program handles signals itself).
            SIGINT is never touched.  Details: ``shmbuf.posix.signals``.
        rate_limit: a ``shmbuf.RateLimit`` that holds the train ratio
            (replayed steps per inserted step) for every process attached to
            the buffer: samples wait for inserts, and writers for samples
            (see ``shmbuf.writing.ratelimit``).  None (default): no limit.
        priorities: keep one float priority per step in the segment, seen by
            every attached process (``update_priorities``,
            ``select=Prioritized(...)``, ``sample_sequences(..., ids=True)``).
            It costs 8 bytes per step and about 0.2 bytes per step of tree.
            The buffer's step ids carry a random tag of its own, so that
            another buffer refuses them (``ForeignStepIdsError``).
        compress: a ``shmbuf.Compress`` naming the columns whose cold chunks
            are kept compressed in shared memory, their raw pages given back
            to /dev/shm (a background thread of the owner compresses them; see
            ``Compress`` and ``Buffer.compact``).  None (default): every
            column stays raw.

    Returns:
        The owning ``Buffer``; closing it (or dropping it, or exiting, or
        SIGTERM) marks it closed, so writers in other processes stop with
        BufferClosedError, and unlinks the segment.

    Raises:
        ValueError / TypeError: a bad argument, before any system call (a
            ``done_key`` that is not in ``spec`` among them).
        SegmentExistsError: ``name`` is taken.
        SharedMemoryFullError: the capacity exceeds the size of /dev/shm
            (see ``overcommit``), or /dev/shm has too little free space for
            the header (for all of it, with ``prefault``); nothing is left
            behind.

    Example:
        >>> spec = {"obs": ((3, 64, 64), np.uint8), "done": ((), np.bool_)}
        >>> with shmbuf.create(spec, capacity=100_000) as buf:
        ...     print(buf.name)
    """
    if not isinstance(priorities, bool):
        raise TypeError(f"priorities must be True or False, got {priorities!r}")
    packing, meta = _compression.settings(compress, spec, capacity, chunk_size, done_key, meta)
    meta = _ids_meta(priorities, meta, _step_ids)
    raw_meta = encode_meta(meta)
    layout = plan(spec, capacity, chunk_size=chunk_size, max_writers=max_writers,
                  done_key=done_key, episode_slots=episode_slots, priorities=priorities,
                  meta_bytes=len(raw_meta), packing=packing)
    _signals.check(handle_signals)
    rate = check_rate_limit(rate_limit)
    for flag, value in (("prefault", prefault), ("overcommit", overcommit)):
        if not isinstance(value, (bool, np.bool_)):
            raise TypeError(f"{flag} must be True or False, got {value!r}")
    name = generate_name() if name is None else validate_name(name)
    if not overcommit:
        check_fits(name, *_compression.fit_bytes(layout, meta or {}), layout.capacity,
                   SHM_DIR)
    # The header and the writer slots are written by everyone: reserved now.
    # The chunk table, the episode index and the rows follow the tickets (protocol.ring).
    segment = Segment.create(name, layout.total_bytes,
                             reserve=None if prefault else layout.chunks_offset,
                             populate=prefault)
    try:
        owner = (os.getpid(), my_start_time())
        if not prefault:
            _compression.reserve_words(segment, layout)
        if layout.priorities and segment.space is not None and not prefault:
            # Every process updates the bounds and trees: reserved now, like the header
            # (about 0.4 bytes a step); the _p column is reserved chunk by chunk.
            start = layout.priority_blocks_offset
            segment.space.reserve(start, layout.total_bytes - start,
                                  "the priority bounds and trees")
        segment.write_meta(layout, raw_meta)
        segment.publish(encode_header(layout, *owner, time.time_ns(), KIND_STORE, raw_meta,
                                      None if rate is None else rate._words()))
        buf = Buffer(segment, layout, owner, json.loads(raw_meta), seed, mapped=prefault)
        if buf._packer is not None:
            buf._packer.start()      # the owner compresses, in a thread of its own
    except BaseException:
        segment.unlink()
        segment.close()
        raise
    return _signals.watch_or_close(buf, handle_signals)   # SIGTERM unlinks an owner's


def _ids_meta(priorities: bool, meta, entry: dict | None) -> dict | None:
    """The metadata with the buffer's step-id rules (``protocol.stepids``), for a buffer
    with priorities: a fresh tag, or ``entry`` (``shmbuf.load``: the saved buffer's heirs)."""
    if isinstance(meta, dict) and _stepids.META_KEY in meta:
        raise ValueError(f"meta key {_stepids.META_KEY!r} is reserved for the buffer's step "
                         "ids")
    if not priorities:
        return meta
    if meta is not None and not isinstance(meta, dict):
        raise TypeError(f"meta must be a dict of JSON-serialisable plain data, got {meta!r}")
    return dict(meta or {}, **{_stepids.META_KEY: entry or _stepids.fresh_meta()})


# The name ``shmbuf.attach`` and ``shmbuf.load`` find a plain step store under.
KIND = "Buffer"
register(Buffer, KIND)


def _reattach(name: str, seed) -> Buffer:
    """Unpickling: attach, keeping the seed; the buffers unpickled in one process continue
    one stream (a Pool's tasks never repeat each other), see sampling.rng."""
    buf = attach(name, seed=seed)
    buf._random.shared = True
    return buf


def attach(name: str, *, seed=None, own: bool = False,
           handle_signals: bool | None = None) -> Buffer:
    """Attach to an existing buffer by name; the result never unlinks it, unless ``own``.

    Args:
        own: take the buffer over from an owner that died (SIGKILL, a crash):
            this process becomes the owner, unlinks it at close and answers
            for SIGTERM (``handle_signals`` as in ``create``).  The data and
            the writers attached before the crash carry on.  One
            compare-and-swap on the header's owner record decides, so of two
            restarted trainers exactly one wins.

    Raises:
        SegmentNotFoundError: no segment has that name.
        CorruptSegmentError / LayoutVersionError: it is not a readable shmbuf buffer.
        BufferClosedError: its owner closed it (it is being removed).
        OwnerAliveError: ``own=True`` and the recorded owner is alive (the
            message names its pid), or a rival took it over first.

    Example:
        >>> buf = shmbuf.attach("shmbuf-1a2b3c4d5e6f")
        >>> buf = shmbuf.attach("shmbuf-1a2b3c4d5e6f", own=True)  # after the trainer crashed
    """
    _signals.check(handle_signals)
    segment = Segment.attach(name)
    try:
        layout, owner = segment.header(KIND_STORE)
        return from_segment(segment, layout, owner, seed, own, handle_signals)
    except BaseException:
        segment.close()
        raise


def open_segment(segment, layout: Layout, owner: dict, *, seed=None, own: bool = False,
                 handle_signals: bool | None = None) -> Buffer:
    """The Buffer over an attached step-store segment, for the registry and the facades
    built on a step store; closes the segment if it refuses it."""
    try:
        return from_segment(segment, layout, owner, seed, own, handle_signals)
    except BaseException:
        segment.close()
        raise


def from_segment(segment: Segment, layout: Layout, owner: dict, seed=None, own: bool = False,
                 handle_signals: bool | None = None) -> Buffer:
    """The Buffer over an attached step-store ``segment`` (whose header was read).

    Refuses a buffer its owner closed; with ``own``, adopts it first.
    """
    segment.admit(own)
    buf = Buffer(segment, layout, (owner["owner_pid"], owner["owner_start"]), owner["meta"], seed)
    if own and buf._ring.priorities is not None:
        buf._ring.priorities.repair()   # the dead owner may have died inside an update
    if own and buf._packer is not None:
        buf._packer.start()   # compression goes on in the adopter
    return _signals.watch_or_close(buf, handle_signals) if own else buf
