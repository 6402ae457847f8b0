"""The shared step store: one buffer of named columns in one POSIX segment."""
from __future__ import annotations

import dataclasses
import json
import os
import time

import numpy as np

from . import _checkpoint, _saving, _signals
from ._args import check_int
from ._errors import SampleRetryError, WaitTimeoutError
from ._layout import KIND_STORE, Layout, encode_header, encode_meta, plan
from ._out import prepare_out as _prepare_out
from ._pages import ChunkPages
from ._process_rng import ProcessRandom
from ._procs import my_start_time
from ._ring import Episodes, Ring, owner_alive, owner_record
from ._handle import Shared
from ._segment import SHM_DIR, Segment, column_views, generate_name, validate_name
from ._space import check_fits
from ._wait import check_timeout, poll
from .ratelimit import Limiter, RateLimit, RateStats, check_rate_limit, pid_check
from .sampling import WindowFinder
from .select import resolve
from .writer import Writer

_MAX_REDRAWS = 64


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


class Buffer(Shared):
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
        self._ring = Ring(segment.mmap, layout, segment.name, segment.space)
        self._space = segment.space  # the bytes reserved, for stats()
        self._views = column_views(segment, layout, layout.columns)
        self._finder = WindowFinder(self._ring)
        self._limiter = Limiter.of(self._ring.rate, segment.name,
                                   pid_check(self._ring, self._check_open))
        self._random = ProcessRandom(seed, self._owner_pid, segment.name)  # per process
        self._pages = ChunkPages(segment.mmap, layout, mapped)
        self._savers = set()
        self._open(segment)

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
        return {c.name: (c.shape, c.dtype) for c in self._layout.user_columns}

    @property
    def meta(self) -> dict:
        """The JSON metadata given to ``create`` (facades keep their parameters here)."""
        return dict(self._meta)

    def next_serial(self) -> int:
        """A buffer-wide serial number, unique across all processes (0, 1, 2, ...)."""
        self._check_open()
        return self._ring.bump("serial")

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
        return Writer(self._ring, self._views, self._check_open, self._pages.populate, limit)

    @property
    def rate_limit(self) -> RateLimit | None:
        """The ``RateLimit`` the buffer was created with (every process sees it), or None."""
        return None if self._limiter is None else self._limiter.limit()

    # -- sampling -------------------------------------------------------------
    def sample_sequences(self, batch_size: int, length: int, *, time_major: bool = True,
                         out: dict | None = None, rng=None, tail: int = 0,
                         uniform: str | None = None, newest: int | None = None,
                         select=None, timeout: float | None = None,
                         ids: bool = False) -> dict:
        """Draw ``batch_size`` windows of ``length`` consecutive steps, with replacement.

        Start steps are uniform over every valid start (or drawn as
        ``select`` says): a window lies in one writer stream and never
        continues past a terminal step (it may end on one).  Rows recycled
        while they were copied are redrawn, so no torn or overwritten step is
        ever returned.

        Args:
            batch_size: windows per batch, >= 1.
            length: steps per window, 1 <= length <= capacity.
            time_major: arrays are ``(length, batch, ...)`` if True, else
                ``(batch, length, ...)``.
            out: optional dict of preallocated numpy arrays or torch tensors
                (pinned ones included) of exactly that shape and dtype.
            rng: a ``np.random.Generator`` or an int seed; default this
                process's own stream of the buffer (``seed=`` of create/attach;
                a forked or spawned child never repeats its parent's draws).
            tail: the last ``tail`` rows only have to follow the window in its
                stream: they may lie past a terminal step of the first
                ``length - tail`` rows (next-frame targets; mask them with
                ``done``).  Default 0.
            uniform: ``"steps"`` (the default unless ``select`` is given):
                every valid start is equally likely, so long episodes give
                more windows.  ``"episodes"``:
                every finished episode (ended by a terminal step or
                ``Writer.end_episode``) with at least ``length - tail``
                steps is equally likely, and the start is uniform within it
                (PlaNet's rule).  Open episodes take no part.  The cost is
                per window, not per episode held.
            newest: with ``uniform="episodes"``, draw only from the newest
                ``newest`` finished episodes (in the order they ended).
            select: a sampling regime of ``shmbuf.select`` (``Uniform()``,
                ``Recency(...)``, ``AgeBuckets(...)``, ``Prioritized(...)``,
                ``Mixture(...)``); with ``uniform`` too, the two must agree
                (``Uniform()`` is ``"steps"``).  README, "Sampling regimes".
            timeout: with a rate limit (``create(..., rate_limit=)``), the
                seconds to wait for inserts (None: as long as it takes); the
                batch takes its ``batch_size * length`` replayed steps from
                the shared budget when it is drawn.  Without one, unused.
            ids: also return ``"ids"``: int64 step ids in the batch's layout,
                for ``update_priorities`` (a buffer made with
                ``priorities=True`` only).  An id names its step while the
                buffer holds it and never another one.  With ``out``, give an
                ``"ids"`` array too.

        Returns:
            ``{column: array}``, fresh arrays or the ``out`` objects.

        Raises:
            NotEnoughDataError: no valid window exists yet.
            ValueError / TypeError: a bad argument, or a batch wider than
                the rate limit's band could ever serve; nothing is sampled.
            WaitTimeoutError: the rate limit made it wait ``timeout`` s.

        Example:
            >>> batch = buf.sample_sequences(50, 50)
            >>> batch["obs"].shape   # (50, 50, 3, 64, 64)
        """
        self._check_live()
        batch_size, length, tail, sel = self._sample_args(batch_size, length, tail, uniform,
                                                          newest, select)
        timeout = check_timeout(timeout)
        gen = self._random.get() if rng is None else np.random.default_rng(rng)
        lead = (length, batch_size) if time_major else (batch_size, length)
        if not isinstance(ids, bool):
            raise TypeError(f"ids must be True or False, got {ids!r}")
        if ids:
            self._check_priorities("sample_sequences(..., ids=True)")
            if "ids" in self._views:
                raise ValueError("ids=True: the buffer has a column named 'ids', which the "
                                 "batch's step ids would replace")
        targets = _prepare_out(out, self.spec, lead, ids=ids)
        limiter = self._limiter
        if limiter is not None:   # the batch's budget, taken before it is drawn
            limiter.replay(batch_size * length, timeout, "sample_sequences")
        try:
            return self._draw(gen, batch_size, length, tail, sel, targets, time_major)
        except BaseException:
            if limiter is not None:
                limiter.refund(batch_size * length)   # nothing was delivered
            raise

    def _draw(self, gen, batch_size, length, tail, sel, targets, time_major):
        """``sample_sequences`` after its checks (and its rate limit): draw, gather, re-check."""
        def draw(n):
            return sel._draw(self._finder, gen, n, length, tail)

        windows = draw(batch_size)
        pending = np.arange(batch_size)
        for _ in range(_MAX_REDRAWS):
            self._gather(windows.rows, pending, targets, time_major, batch_size)
            stale = ~self._finder.still_valid(windows)
            if not stale.any():
                self._ring.count_sample(batch_size * length)
                return {k: t.result for k, t in targets.items()}
            pending = pending[stale]
            windows = draw(len(pending))
        raise SampleRetryError(
            f"writers recycled sampled chunks {_MAX_REDRAWS} times in a row; the buffer "
            f"(capacity {self.capacity}) is too small for its ingest rate")

    def _sample_args(self, batch_size, length, tail=0, uniform=None, newest=None, select=None):
        """The checked ``(batch_size, length, tail, selector)`` of a sample (also for
        ``dataset`` and ``prefetch``, which must fail at the door like ``sample_*``);
        the selector is what ``uniform``, ``newest`` and ``select`` mean together."""
        batch_size = check_int("batch_size", batch_size, 1, 1 << 24)
        length = check_int("length", length, 1, self._layout.capacity)
        if isinstance(tail, bool) or not isinstance(tail, (int, np.integer)) or not (
                0 <= tail < length):
            raise ValueError(f"tail must be an int with 0 <= tail < length ({length}), "
                             f"got {tail!r}")
        if newest is not None:
            newest = check_int("newest", newest, 1)
        sel = resolve(select, uniform, newest)
        sel._check(self)
        return batch_size, length, int(tail), sel

    def sample_steps(self, batch_size: int, *, out: dict | None = None, rng=None,
                     timeout: float | None = None) -> dict:
        """Draw ``batch_size`` single steps uniformly, with replacement: ``{column: (batch, ...)}``.

        Every live step is equally likely on every draw, so a batch may hold
        the same step twice (as ``sample_sequences`` may hold a window twice).
        Args and Raises are those of ``sample_sequences`` with ``length=1``.

        Example:
            >>> buf.sample_steps(256)["reward"].shape   # (256,)
        """
        self._check_open()
        if out is None:
            batch = self.sample_sequences(batch_size, 1, rng=rng, timeout=timeout)
            return {k: v[0] for k, v in batch.items()}
        if not isinstance(out, dict):
            raise ValueError(f"out must be a dict of arrays, got {type(out).__name__}")
        lifted = {k: (v[None] if isinstance(v, np.ndarray)
                      else v.unsqueeze(0) if type(v).__module__.startswith("torch") else v)
                  for k, v in out.items()}
        self.sample_sequences(batch_size, 1, out=lifted, rng=rng, timeout=timeout)
        return out

    def _gather(self, rows, pending, targets, time_major, batch_size) -> None:
        idx = np.ascontiguousarray(rows.T) if time_major else rows
        everything = len(pending) == batch_size
        for name, target in targets.items():
            if name == "ids":   # read with the rows, checked by the same seqs after
                ids = self._ring.prio().ids(idx)
                if everything and target.array is not None:
                    target.array[...] = ids
                else:
                    target.put(ids, pending, time_major)
                continue
            src = self._views[name]
            if everything and target.array is not None:
                np.take(src, idx, axis=0, out=target.array, mode="clip")
            else:
                target.put(np.take(src, idx, axis=0, mode="clip"), pending, time_major)

    # -- priorities --------------------------------------------------------------------
    @property
    def priorities(self) -> bool:
        """True if the buffer keeps a priority per step (``create(..., priorities=True)``)."""
        return self._layout.priorities

    def _check_priorities(self, what: str) -> None:
        if not self._layout.priorities:
            raise ValueError(f"{what} needs a buffer made with create(..., priorities=True); "
                             f"buffer {self.name!r} keeps no priorities")

    def update_priorities(self, ids, priorities) -> int:
        """Set the priorities of sampled steps, from any attached process.

        Steps the buffer no longer holds are skipped (their ids are stale and
        never name another step).  Concurrent updates interleave; the last
        write to a step wins.  Priorities are stored as float32.  A step never
        updated has the largest priority ever set in this buffer, or 1.0
        before any update.

        Args:
            ids: int64 ids from ``sample_sequences(..., ids=True)["ids"]``, a
                numpy array or a CPU or CUDA torch tensor, any shape.
            priorities: floats of the same shape, finite and >= 0.

        Returns:
            How many entries named a held step (and were written).

        Raises:
            ValueError: the buffer has no priorities; a shape mismatch; a
                negative id; a priority that is NaN, infinite, negative or
                too large for float32 (the message names the first such
                position).  Nothing is written then.
            TypeError: ids that are not int64, or priorities that are not floats.

        Example:
            >>> batch = buf.sample_sequences(50, 50, ids=True)
            >>> buf.update_priorities(batch["ids"], loss.detach().abs())
        """
        self._check_live()
        self._check_priorities("update_priorities")
        ids, stored = checked_priorities(ids, priorities)
        return self._ring.prio().update(ids, stored)

    def priorities_of(self, ids) -> np.ndarray:
        """The priorities of the steps ``ids`` names now (NaN where an id is stale).

        Example:
            >>> buf.priorities_of(batch["ids"])
        """
        self._check_open()
        self._check_priorities("priorities_of")
        ids = _host_array("ids", ids)
        if ids.dtype != np.int64:
            raise TypeError(f"ids must be int64 step ids, got dtype {ids.dtype}")
        return self._ring.prio().of_ids(ids)

    # -- the trainer's data path ---------------------------------------------------------
    def dataset(self, batch_size: int, length: int, *, batches: int | None = None, seed=None,
                **sample_kwargs):
        """A torch ``IterableDataset`` whose items are whole batches, for a ``DataLoader``.

        Each item is ``sample_sequences(batch_size, length, **sample_kwargs)``
        as a dict of CPU tensors (time-major by default), already collated:
        give the loader ``batch_size=None``.  Works with any start method and
        ``persistent_workers``: each worker attaches by name (the dataset
        pickles to the name and its arguments) and draws its own random
        stream.  In a worker the batch is gathered straight into torch's
        shared memory, so handing it to the trainer copies nothing more.

        Args:
            batch_size, length, **sample_kwargs: as ``sample_sequences``
                (``time_major``, ``tail``, ``uniform``, ``newest``, ``select``,
                ``ids``: with ``ids=True`` each item carries ``"ids"`` too, for
                ``update_priorities`` from the trainer).
            batches: batches per pass (an epoch), split over the workers;
                None (default): endless.
            seed: the streams' seed (see ``create``); default this buffer's.

        Returns:
            ``shmbuf.dataset.BatchDataset``.  When the buffer is closed or its
            owner removes it, iteration ends after the batch in hand; a
            worker that starts after the buffer is gone raises
            ``SegmentNotFoundError``.

        Raises:
            ValueError / TypeError: a bad argument, as ``sample_sequences``.

        Example:
            >>> loader = DataLoader(buf.dataset(50, 50), batch_size=None, num_workers=2)
            >>> next(iter(loader))["obs"].shape   # torch.Size([50, 50, 3, 64, 64])
        """
        from .dataset import BatchDataset

        self._check_open()
        return BatchDataset(self, batch_size, length, batches=batches, seed=seed,
                            **sample_kwargs)

    def prefetch(self, batch_size: int, length: int, *, depth: int = 2, device=None,
                 pin_memory: bool | None = None, rng=None, **sample_kwargs):
        """Batches sampled ahead by a background thread and delivered on ``device``.

        The thread samples into ``depth`` preallocated buffers (``out=``;
        pinned when ``device`` is CUDA), copies each to the device with
        ``non_blocking=True`` on a side CUDA stream, and the consumer's
        stream waits for that copy: no kernel sees a half-copied batch.

        A yielded batch stays valid until the next ``next()`` (or ``close()``):
        only then is its buffer handed back to the thread (on CUDA, after the
        kernels queued on it so far).  ``.clone()`` what you keep longer.
        Errors in the thread are raised by ``next()``; ``close()`` or leaving
        the ``with`` block stops the thread after the batch in hand.

        Args:
            batch_size, length, **sample_kwargs: as ``sample_sequences``
                (``select``, ``ids``: with ``ids=True`` each batch carries
                ``"ids"``, an int64 tensor on ``device``).
            depth: preallocated batches, >= 1 (2: one in use, one being made).
            device: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``; default CUDA when
                available, else CPU.
            pin_memory: pin the host buffers; default: when ``device`` is CUDA.
            rng: a ``np.random.Generator`` or seed for the thread's draws;
                default this process's stream of the buffer.

        Returns:
            ``shmbuf.prefetch.Prefetcher``: an iterator of ``{column: tensor}``
            and a context manager.

        Raises:
            ValueError / TypeError: a bad argument (``depth < 1``, an unknown
                or unavailable device, ``pin_memory=True`` without CUDA), as
                ``sample_sequences`` for the rest.
            BufferClosedError: the buffer is closed.

        Example:
            >>> with buf.prefetch(50, 50, device="cuda") as batches:
            ...     for batch in batches:
            ...         loss = model(batch["obs"])
        """
        from .prefetch import Prefetcher

        self._check_open()
        return Prefetcher(self, batch_size, length, depth=depth, device=device,
                          pin_memory=pin_memory, rng=rng, **sample_kwargs)

    def iter_episodes(self, newest: int | None = None, include_open: bool = False):
        """Yield whole episodes as ``{column: (steps, ...) array}``, oldest first.

        The finished episodes (ended by a terminal step or
        ``Writer.end_episode``) that the buffer still holds, in the order they
        ended, read from the episode index.  Safe while writers run: an
        episode recycled before or while it is read is skipped, never
        returned torn; episodes that end after the call began are not
        included.  The arrays are copies.

        Args:
            newest: only the newest ``newest`` finished episodes.
            include_open: then also each stream's unfinished episode: the
                steps it holds after its last finished one (the oldest may be
                recycled already), streams in the order of their newest chunk.

        Raises:
            BufferClosedError: the buffer was closed (also between episodes).

        Example:
            >>> for ep in buf.iter_episodes(newest=10):
            ...     print(len(ep["reward"]), ep["reward"].sum())
        """
        from . import _episode_reader

        self._check_open()
        return _episode_reader.iterate(self, self._ring, self._finder, self._views, newest,
                                       include_open)

    def read_episode(self, index: int) -> dict | None:
        """Finished episode number ``index`` (an ``episodes().index``) as ``{column: (steps, ...)}``.

        Read and validated like ``iter_episodes`` (copies, never torn), in
        time independent of the number of episodes held.

        Returns:
            The episode, or None if it is no longer wholly held (recycled, or
            its index entry reused) or has not ended yet.

        Raises:
            TypeError / ValueError: ``index`` is not an int >= 0.
            BufferClosedError: the buffer was closed.

        Example:
            >>> eps = buf.episodes(newest=1)
            >>> last = buf.read_episode(int(eps.index[-1]))
        """
        from . import _episode_reader

        self._check_open()
        return _episode_reader.one(self._ring, self._finder, self._views, list(self.spec), index)

    # -- waiting and counters ---------------------------------------------------
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
        return Stats(self.name, lay.capacity, lay.chunk_size, lay.n_chunks, c.written,  # type: ignore[arg-type]  # open: named
                     c.live, c.episodes, c.evicted, c.written - 1, c.chunks_in_use,
                     len(self._ring.live_writers()), c.streams, c.samples,
                     owner_record(self._ring.mm)[0], owner_alive(self._ring.mm),
                     None if self._limiter is None else self._limiter.stats(),
                     self._space.reserved_bytes() if self._space else 0, lay.total_bytes)

    # -- episodes and rows ------------------------------------------------------------
    def episodes(self, newest: int | None = None) -> Episodes:
        """The finished episodes still wholly held, oldest first (in the order they ended).

        An episode is finished when a terminal step or ``Writer.end_episode``
        ended it; the buffer indexes the last ``episode_slots`` of them.

        Args:
            newest: only the newest ``newest`` finished episodes (before
                dropping the ones already recycled).

        Returns:
            ``Episodes``: equal-length arrays ``index`` (ascending), ``length``
            (steps), ``terminal`` (False: cut), ``stream``, ...

        Example:
            >>> eps = buf.episodes(newest=100)
            >>> eps.length.mean()
        """
        self._check_open()
        ring = self._ring
        hi = ring.episodes_logged()
        held = min(hi, self._layout.episode_slots)
        if newest is not None:
            held = min(held, check_int("newest", newest, 1))
        return ring.read_episodes(np.arange(hi - held, hi, dtype=np.int64))

    def count_valid_starts(self, length: int, tail: int = 0, *, rng=None,
                           probes: int = 4096) -> int:
        """How many windows ``sample_sequences(..., length, tail=tail)`` could start now.

        Exact while at most ``probes`` rows have been written; beyond that
        an unbiased estimate from ``probes`` uniform candidates checked like
        a sample (relative error about 1.6% when half of them are valid),
        at a cost that does not grow with the capacity.  Sharded buffers
        weigh shards by it.

        Example:
            >>> buf.count_valid_starts(50)
        """
        return self._finder.count_valid(*self._count_args(length, tail, rng, probes))

    def count_episodes(self, length: int, tail: int = 0, *, newest: int | None = None,
                       rng=None, probes: int = 4096) -> int:
        """How many episodes ``sample_sequences(..., length, tail=tail, uniform="episodes",
        newest=newest)`` could draw from now.

        An episode counts when it is finished, still in the episode index
        and still held, and has at least ``length - tail`` steps (each is
        checked like a draw checks it).  Exact while the index range holds
        at most ``probes`` episodes; beyond that an unbiased estimate from
        ``probes`` uniform picks of that range, at a cost that does not grow
        with the capacity.  Sharded buffers weigh shards by it for
        ``uniform="episodes"``.

        Args:
            length: steps per window, 1 <= length <= capacity.
            tail: as in ``sample_sequences``: 0 <= tail < length.  Default 0.
            newest: only the newest ``newest`` finished episodes (all the
                index holds if None), as in ``sample_sequences``.
            rng: a ``np.random.Generator`` or an int seed for the estimate's
                picks; default this process's stream of the buffer.
            probes: index entries checked at most, >= 1.  Default 4096.

        Returns:
            The count (an estimate when the index range is larger than ``probes``).

        Raises:
            ValueError / TypeError: a bad argument.

        Example:
            >>> buf.count_episodes(50)
        """
        length, tail, gen, probes = self._count_args(length, tail, rng, probes)
        newest = None if newest is None else check_int("newest", newest, 1)
        return self._finder.count_episodes(length, tail, newest, gen, probes)

    def _count_args(self, length, tail, rng, probes) -> tuple[int, int, np.random.Generator, int]:
        """The checked ``(length, tail, generator, probes)`` of the ``count_*`` methods."""
        self._check_open()
        length = check_int("length", length, 1, self._layout.capacity)
        tail = check_int("tail", tail, 0, length - 1)
        probes = check_int("probes", probes, 1, 1 << 24)
        gen = self._random.get() if rng is None else np.random.default_rng(rng)
        return length, tail, gen, probes

    def committed_rows(self) -> np.ndarray:
        """Physical rows of every committed step, chunk by chunk (int64, unordered in time).

        Rows of ``arrays`` outside this set hold no step, or a recycled one.
        """
        self._check_open()
        return self._ring.committed_rows()

    # -- checkpoints --------------------------------------------------------------
    def snapshot(self) -> dict:
        """Copy every live step, oldest first, for a checkpoint.

        Returns:
            ``{"format", "spec", "columns": {col: (n, ...) array}, "stream": (n,),
            "episode": (n,), "ends": (n,), "chunks": (c,)}``: numpy arrays and plain
            Python values only (``ends``: the episode-index number of the episode a
            row ends, else -1; ``chunks``: the first row of each chunk).

        Example:
            >>> np.savez("ckpt.npz", **buf.snapshot()["columns"])
        """
        self._check_open()
        return self._with_rate(_checkpoint.snapshot(self._ring, self._views))

    def restore(self, state: dict) -> None:
        """Replace the contents with a ``snapshot()``; the capacity stays this buffer's.

        Streams, episode boundaries and their order are kept; a snapshot
        larger than the capacity keeps its newest steps.  Chunks that live
        writers are filling right now are left as they are.

        Raises:
            ValueError: the snapshot's schema, shapes or dtypes differ; nothing
                is changed.

        Example:
            >>> fresh.restore(buf.snapshot())
        """
        self._check_open()
        _checkpoint.restore(self, self._ring, state)
        self._restore_rate(state)

    # -- saving to disk ---------------------------------------------------------------
    def save(self, path, *, follow: bool = False, overwrite: bool = False,
             durable: bool | None = None, interval: float = 1.0):
        """Write the live steps to the directory ``path``, consistently, while writers run.

        Each chunk is written straight from shared memory and then validated
        as a sample is (a chunk recycled meanwhile is left out), so no torn
        step is saved and no more than the files' own page cache is used.
        The format (one ``.npy`` per column, a JSON manifest, readable with
        numpy alone) is described in ``shmbuf._saving``; ``shmbuf.load``
        rebuilds a buffer from it.

        Args:
            path: a directory to create.
            follow: instead of one copy, keep saving: return a ``Saver`` that
                appends every chunk as it is sealed (so a reboot loses at
                most the open chunks) until ``Saver.close()`` or this
                buffer's close.
            overwrite: if ``path`` exists, replace it, but only if it is a
                shmbuf save (or empty); otherwise ``SaveExistsError``.
            durable: fsync the files before the manifest names them.
                Default: False for one copy (like ``np.save``), True with
                ``follow``.
            interval: seconds between the ``Saver``'s looks for sealed chunks.

        Returns:
            The steps saved (an int), or the running ``Saver`` with ``follow``.

        Raises:
            SaveExistsError: ``path`` exists (see ``overwrite``).
            BufferClosedError: the buffer is closed.

        Example:
            >>> buf.save("ckpt/replay")
            >>> buf2 = shmbuf.load("ckpt/replay")
        """
        self._check_live()
        if follow:
            saver = _saving.Saver(self, path, interval=interval, overwrite=overwrite,
                                  durable=True if durable is None else durable)
            self._savers.add(saver)
            return saver
        return _saving.save(self, path, overwrite=overwrite, durable=bool(durable))

    def state_dict(self) -> dict:
        """The live steps as torch tensors and plain values, for ``torch.save``.

        ``torch.load(path, weights_only=True)`` reads it back.  It holds every
        live step, oldest chunk first, with its stream and episode number, so
        ``load_state_dict`` rebuilds the same streams and episodes.  Taken
        while writers run it is a set of whole chunks (a chunk recycled while
        it is copied is left out, and its stream is split there).  It costs
        one copy of the live steps in memory, no more (README, Training loop).

        Returns:
            ``{"format", "spec", "raw_bytes", "columns": {col: tensor (n, ...)},
            "stream": int64 (n,), "episode": int64 (n,), "ends": int64 (n,),
            "chunks": int64 (c,)}``, as ``snapshot``.

        Example:
            >>> torch.save(buf.state_dict(), "replay.pt")
        """
        self._check_open()
        return self._with_rate(_checkpoint.state_dict(self._ring, self._views))

    def load_state_dict(self, state: dict) -> None:
        """Replace the contents with a ``state_dict()``; the capacity stays this buffer's.

        As ``restore``: streams, episode boundaries and their order are kept,
        and a larger checkpoint keeps its newest steps.

        Raises:
            ValueError: not a state_dict, or the schema differs; nothing is changed.

        Example:
            >>> buf.load_state_dict(torch.load("replay.pt", weights_only=True))
        """
        self._check_open()
        state = _checkpoint.from_state_dict(state)
        _checkpoint.restore(self, self._ring, state)
        self._restore_rate(state)

    def _with_rate(self, state: dict) -> dict:
        """A checkpoint with the rate limiter's counters (``"rate"``), if the buffer has one."""
        if self._limiter is not None:
            state["rate"] = self._limiter.state()
        return state

    def _restore_rate(self, state: dict) -> None:
        """After a restore: continue the checkpoint's rate counters, so that a resumed run
        holds its ratio from where it stopped instead of catching up in a burst."""
        if self._limiter is not None and state.get("rate") is not None:
            self._limiter.restore(state["rate"])

    # -- lifecycle ----------------------------------------------------------------
    def _closed_mark(self):
        ring = getattr(self, "_ring", None)
        return None if ring is None else ring.mark

    def _release(self) -> None:
        _signals.forget(self)
        for saver in list(self._savers):
            saver.close()  # saves what is left, while the mapping is still ours
        self._views = self._ring = self._finder = None  # type: ignore[assignment]  # closed: never read again

    def __reduce__(self):
        return _reattach, (self.name, self._random.seed)

    def __repr__(self):
        state = "closed" if self._closed else f"capacity={self.capacity}"
        return f"<shmbuf.Buffer {self._segment.name!r} {state}{' owner' if self.owner else ''}>"


def checked_priorities(ids, priorities) -> tuple[np.ndarray, np.ndarray]:
    """``update_priorities``' arguments checked: (flat int64 ids, flat float32 priorities).

    Raises what ``Buffer.update_priorities`` documents; shmbuf.ray checks its
    arguments here too, before anything is written on any shard.
    """
    ids = _host_array("ids", ids)
    values = _host_array("priorities", priorities)
    if ids.dtype != np.int64:
        raise TypeError(f"ids must be int64 step ids (as sample_sequences(..., ids=True) "
                        f"returns them), got dtype {ids.dtype}")
    if values.dtype.kind != "f":
        raise TypeError(f"priorities must be floats, got dtype {values.dtype}")
    if values.shape != ids.shape:
        raise ValueError(f"priorities has shape {values.shape} but ids has shape "
                         f"{ids.shape}; they must match")
    flat = np.ascontiguousarray(ids.reshape(-1))
    with np.errstate(over="ignore", invalid="ignore"):
        stored = np.ascontiguousarray(values.reshape(-1), np.float32)
    bad = ~np.isfinite(stored) | (stored < 0)
    if bad.any():
        at = int(np.argmax(bad))
        pos = [int(i) for i in np.unravel_index(at, values.shape)] if values.ndim else []
        raise ValueError(f"priorities{pos} is {float(values.reshape(-1)[at])!r}; priorities "
                         "must be finite, >= 0 and fit float32; nothing was updated")
    if len(flat) and flat.min() < 0:
        at = int(np.argmax(flat < 0))
        pos = [int(i) for i in np.unravel_index(at, values.shape)]
        raise ValueError(f"ids{pos} is {int(flat[at])}; step ids are >= 0; nothing "
                         "was updated")
    return flat, stored


def _host_array(what: str, value) -> np.ndarray:
    """``value`` (an ndarray, a torch tensor on any device, or a sequence) as an ndarray."""
    if type(value).__module__.startswith("torch"):
        return value.detach().cpu().numpy()
    return np.asarray(value)


def create(spec: dict, capacity: int, *, name: str | None = None, chunk_size: int | None = None,
           max_writers: int = 128, done_key: str | None = "done", seed=None,
           prefault: bool = False, overcommit: bool = False, meta: dict | None = None,
           episode_slots: int | None = None, handle_signals: bool | None = None,
           rate_limit: RateLimit | None = None, priorities: bool = False) -> Buffer:
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
            if None.  See ``shmbuf._process_rng``.
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
        meta: small JSON-serialisable dict stored in the header (``Buffer.meta``).
        episode_slots: finished episodes the episode index remembers
            (``episodes()``, ``uniform="episodes"``); default
            ``capacity // 8`` within 1024 and 4M (at most the capacity),
            64 bytes each.
        handle_signals: None (default): install shmbuf's SIGTERM handler if
            this is the main thread and SIGTERM has its default action, so
            that SIGTERM unwinds, unlinks the buffer, and then ends the
            process by SIGTERM; True: also chain a handler already in place;
            False: install nothing (the program handles signals itself).
            SIGINT is never touched.  Details: ``shmbuf._signals``.
        rate_limit: a ``shmbuf.RateLimit`` that holds the train ratio
            (replayed steps per inserted step) for every process attached to
            the buffer: samples wait for inserts, and writers for samples
            (see ``shmbuf.ratelimit``).  None (default): no limit.
        priorities: keep one float priority per step in the segment, seen by
            every attached process (``update_priorities``,
            ``select=Prioritized(...)``, ``sample_sequences(..., ids=True)``).
            It costs 8 bytes per step and about 0.2 bytes per step of tree.

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
    layout = plan(spec, capacity, chunk_size=chunk_size, max_writers=max_writers,
                  done_key=done_key, episode_slots=episode_slots, priorities=priorities)
    _signals.check(handle_signals)
    rate = check_rate_limit(rate_limit)
    for flag, value in (("prefault", prefault), ("overcommit", overcommit)):
        if not isinstance(value, (bool, np.bool_)):
            raise TypeError(f"{flag} must be True or False, got {value!r}")
    raw_meta = encode_meta(meta)
    name = generate_name() if name is None else validate_name(name)
    if not overcommit:
        check_fits(name, layout.total_bytes, layout.columns[0].offset,
                   sum(c.row_bytes for c in layout.columns), layout.capacity, SHM_DIR)
    # The header and the writer slots are written by everyone: reserved now.
    # The chunk table, the episode index and the rows follow the tickets (_ring).
    segment = Segment.create(name, layout.total_bytes,
                             reserve=None if prefault else layout.chunks_offset,
                             populate=prefault)
    try:
        owner = (os.getpid(), my_start_time())
        if layout.priorities and segment.space is not None and not prefault:
            # Every process updates the bounds and trees: reserved now, like the header
            # (about 0.4 bytes a step); the _p column is reserved chunk by chunk.
            start = layout.priority_blocks_offset
            segment.space.reserve(start, layout.total_bytes - start,
                                  "the priority bounds and trees")
        segment.publish(encode_header(layout, *owner, time.time_ns(), KIND_STORE, raw_meta,
                                      None if rate is None else rate._words()))
        buf = Buffer(segment, layout, owner, json.loads(raw_meta), seed, mapped=prefault)
    except BaseException:
        segment.unlink()
        segment.close()
        raise
    return _signals.watch_or_close(buf, handle_signals)   # SIGTERM unlinks an owner's


def _reattach(name: str, seed) -> Buffer:
    """Unpickling: attach, keeping the seed; the buffers unpickled in one process continue
    one stream (a Pool's tasks never repeat each other), see _process_rng."""
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


def from_segment(segment: Segment, layout: Layout, owner: dict, seed=None, own: bool = False,
                 handle_signals: bool | None = None) -> Buffer:
    """The Buffer over an attached step-store ``segment`` (whose header was read).

    Refuses a buffer its owner closed; with ``own``, adopts it first.
    """
    segment.admit(own)
    buf = Buffer(segment, layout, (owner["owner_pid"], owner["owner_start"]), owner["meta"], seed)
    if own and buf._ring.priorities is not None:
        buf._ring.priorities.repair()   # the dead owner may have died inside an update
    return _signals.watch_or_close(buf, handle_signals) if own else buf
