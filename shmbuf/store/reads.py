"""A Buffer's reads: windows, steps, episodes, priorities and the trainer's feeds.

A mixin of ``Buffer``: it holds no state of its own.
"""
from __future__ import annotations

import numpy as np

from .._args import check_int, generator
from .._errors import SampleTooLargeError
from ..posix.memory import available_bytes
from ..posix.wait import check_timeout
from ..protocol.ring import Episodes
from ..sampling import gather as _gather
from ..sampling.out import prepare_out as _prepare_out
from ..select import resolve
from ..writing.cast import coerce, host_array
from .state import BufferState

# Batches below this many bytes are not checked against the memory available: the check
# reads /proc and the cgroup's files (tens of microseconds, as long as a whole small
# draw), while such a batch costs a few milliseconds at most to copy, and one that does
# not fit means the process is out of memory anyway (numpy's MemoryError says so).
MEMORY_CHECK_FLOOR = 16 << 20


class Reads(BufferState):
    """Sampling, counting, episodes and priorities of a ``Buffer`` (see its docs)."""

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
                (``Uniform()`` is ``"steps"``).  The sampling guide, "Sampling regimes".
            timeout: with a rate limit (``create(..., rate_limit=)``), the
                seconds to wait for inserts (None: as long as it takes); the
                batch takes its ``batch_size * length`` replayed steps from
                the shared budget when it is drawn.  Without one, unused.
            ids: also return ``"ids"``: int64 step ids in the batch's layout,
                for ``update_priorities`` (a buffer made with
                ``priorities=True`` only).  An id names its step while the
                buffer holds it and never another one; only this buffer (and
                one ``shmbuf.load`` makes from its save) takes it.  With
                ``out``, give an ``"ids"`` array too.

        Returns:
            ``{column: array}``, fresh arrays or the ``out`` objects.

        Raises:
            NotEnoughDataError: no valid window exists yet.
            ValueError / TypeError: a bad argument, or a batch wider than
                the rate limit's band could ever serve; nothing is sampled.
            SampleTooLargeError: (a MemoryError) without ``out``, the batch's
                arrays would not fit in the memory available; nothing is
                allocated or sampled.
            WaitTimeoutError: the rate limit made it wait ``timeout`` s.

        Example:
            >>> batch = buf.sample_sequences(50, 50)
            >>> batch["obs"].shape   # (50, 50, 3, 64, 64)
        """
        self._check_live()
        batch_size, length, tail, sel = self._sample_args(batch_size, length, tail, uniform,
                                                          newest, select,
                                                          allocates=out is None)
        timeout = check_timeout(timeout)
        gen = self._random.get() if rng is None else generator("rng", rng)
        lead = (length, batch_size) if time_major else (batch_size, length)
        if not isinstance(ids, bool):
            raise TypeError(f"ids must be True or False, got {ids!r}")
        if ids:
            self._check_priorities("sample_sequences(..., ids=True)")
            if "ids" in self._views:
                raise ValueError("ids=True: the buffer has a column named 'ids', which the "
                                 "batch's step ids would replace")
        targets = _prepare_out(out, self._layout.spec(), lead, ids=ids)
        limiter = self._limiter
        if limiter is not None:   # the batch's budget, taken before it is drawn
            limiter.replay(batch_size * length, timeout, "sample_sequences")
        try:
            return _gather.sample(self._port, sel, gen, batch_size, length, tail, targets,
                                  time_major)
        except BaseException:
            if limiter is not None:
                limiter.refund(batch_size * length)   # nothing was delivered
            raise

    def _sample_args(self, batch_size, length, tail=0, uniform=None, newest=None, select=None,
                     allocates: bool = True):
        """The checked ``(batch_size, length, tail, selector)`` of a sample (also for
        ``dataset`` and ``prefetch``, which must fail at the door like ``sample_*``);
        the selector is what ``uniform``, ``newest`` and ``select`` mean together.
        ``allocates``: the caller makes the batch's arrays (no ``out=``), so the
        batch must fit in the memory available."""
        batch_size = check_int("batch_size", batch_size, 1, 1 << 24)
        length = check_int("length", length, 1, self._layout.capacity)
        if allocates:
            self._check_batch_memory(batch_size, length)
        if isinstance(tail, bool) or not isinstance(tail, (int, np.integer)) or not (
                0 <= tail < length):
            raise ValueError(f"tail must be an int with 0 <= tail < length ({length}), "
                             f"got {tail!r}")
        if newest is not None:
            newest = check_int("newest", newest, 1)
        sel = resolve(select, uniform, newest)
        sel.check(self)
        return batch_size, length, int(tail), sel

    def _check_batch_memory(self, batch_size: int, length: int) -> None:
        """Refuse a batch larger than the memory available, before anything is allocated
        (a batch of at least ``MEMORY_CHECK_FLOOR`` bytes: smaller ones are not checked)."""
        need = batch_size * length * self._layout.user_row_bytes
        if need < MEMORY_CHECK_FLOOR:
            return
        have = available_bytes()
        if have is not None and need > have:
            raise SampleTooLargeError(
                f"batch_size={batch_size} windows of length {length} need {need} bytes "
                f"({need / 2**30:.1f} GiB) of arrays, but {have} bytes "
                f"({have / 2**30:.1f} GiB) of memory are available here; sample a smaller "
                "batch_size (several batches), or pass out= arrays")

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
            ForeignStepIdsError: (a ValueError) an id this buffer did not
                issue: another buffer's (the message names the first).
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
        local = self._local_ids(checked_ids(ids, "updated"))   # the ids' own shape
        _, stored = checked_priorities(ids, priorities)
        return self._ring.prio().update(np.ascontiguousarray(local.reshape(-1)), stored)

    def write_steps(self, ids, **columns) -> int:
        """Write values into the held steps that step ``ids`` name, from any process.

        This is how a learner stores what it computed for sampled steps beside
        them (DreamerV3's replay context: latents written back into the
        frames' steps).  An id whose step was evicted is skipped and never
        names another step: the chunks of the held steps are pinned while
        their rows are written, so no writer recycles them meanwhile (a writer
        that reaches one takes the next chunk).  Nothing is written when any
        of the errors below is raised.

        Args:
            ids: int64 ids from ``sample_sequences(..., ids=True)["ids"]``, any
                shape (numpy, or a torch tensor on any device).
            **columns: one array per column to write, of shape
                ``ids.shape + column shape``, losslessly castable to the
                column's dtype.

        Returns:
            How many ids named a held step (and were written).

        Raises:
            ForeignStepIdsError: (a ValueError) an id this buffer did not
                issue: another buffer's (the message names the first).
            ValueError: the buffer has no priorities (so no step ids); a
                negative id; a column's value of the wrong shape; no columns.
            KeyError: a column the buffer does not have.
            TypeError: ids that are not int64; a lossy value.
            TimeoutError: another process kept a chunk pinned for 10 s (a
                ``write_steps`` of its own that never ended).

        Example:
            >>> batch = buf.sample_sequences(16, 64, ids=True, time_major=False)
            >>> buf.write_steps(batch["ids"], deter=latents)   # (16, 64, 512)
        """
        self._check_live()
        self._check_priorities("write_steps")
        ids = checked_ids(ids, "written")
        if not columns:
            raise ValueError("write_steps: give at least one column=values")
        local = self._local_ids(ids)
        spec = self._layout.spec()
        pack = self._layout.pack
        packed = set() if pack is None else {c.name for c in pack.columns}
        values = {}
        for name, value in columns.items():
            if name not in spec:
                raise KeyError(f"write_steps: no column {name!r} (columns {sorted(spec)}); "
                               "nothing was written")
            if name in packed:   # a cold step's bytes are in a compressed block, not its row
                raise ValueError(f"write_steps: column {name!r} is compressed "
                                 "(create(compress=...)), so its steps cannot be written in "
                                 "place; leave it out of Compress's columns. Nothing was "
                                 "written")
            shape, dtype = spec[name]
            values[name] = coerce(f"write_steps({name}=...)", value, dtype, ids.shape + shape)
        # Pinned, the chunks the ids name cannot be recycled until the rows are written,
        # so a written value never lands in a later step (protocol.pins); the held check
        # comes after the pins.
        lay, named = self._layout, local.reshape(-1)
        with self._ring.pins.pinned(named[named >= 0] // lay.chunk_size % lay.n_chunks):
            rows, held, _, _ = self._ring.held_rows(named)
            for name, value in values.items():
                flat = value.reshape((len(rows),) + spec[name][0])
                self._views[name][rows[held]] = flat[held]
        return int(held.sum())

    def priorities_of(self, ids) -> np.ndarray:
        """The priorities of the steps ``ids`` names now (NaN where an id is stale).

        Raises:
            ForeignStepIdsError: (a ValueError) an id this buffer did not issue.
            TypeError / ValueError: ids that are not int64 step ids >= 0.

        Example:
            >>> buf.priorities_of(batch["ids"])
        """
        self._check_open()
        self._check_priorities("priorities_of")
        return self._ring.priorities_of(self._local_ids(checked_ids(ids, "read")))

    def _local_ids(self, ids: np.ndarray) -> np.ndarray:
        """Checked step ids (``checked_ids``) as this buffer's protocol numbers them
        (``protocol.stepids``): -1 where an id is stale for sure.

        Raises:
            ForeignStepIdsError: an id another buffer issued; nothing is written.
        """
        return self._step_ids.decode(ids, "ids", self.name)

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
            batch_size: as ``sample_sequences``.
            length: as ``sample_sequences``.
            **sample_kwargs: as ``sample_sequences`` (``time_major``, ``tail``,
                ``uniform``, ``newest``, ``select``, ``ids``: with ``ids=True``
                each item carries ``"ids"`` too, for ``update_priorities`` from
                the trainer).
            batches: batches per pass (an epoch), split over the workers;
                None (default): endless.
            seed: the streams' seed (see ``create``); default this buffer's.

        Returns:
            ``shmbuf.feed.torch_dataset.BatchDataset``.  When the buffer is closed or its
            owner removes it, iteration ends after the batch in hand; a
            worker that starts after the buffer is gone raises
            ``SegmentNotFoundError``.

        Raises:
            ValueError / TypeError: a bad argument, as ``sample_sequences``.

        Example:
            >>> loader = DataLoader(buf.dataset(50, 50), batch_size=None, num_workers=2)
            >>> next(iter(loader))["obs"].shape   # torch.Size([50, 50, 3, 64, 64])
        """
        from ..feed.torch_dataset import BatchDataset

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
            batch_size: as ``sample_sequences``.
            length: as ``sample_sequences``.
            **sample_kwargs: as ``sample_sequences`` (``select``, ``ids``: with
                ``ids=True`` each batch carries ``"ids"``, an int64 tensor on
                ``device``).
            depth: preallocated batches, >= 1 (2: one in use, one being made).
            device: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``; default CUDA when
                available, else CPU.
            pin_memory: pin the host buffers; default: when ``device`` is CUDA.
            rng: a ``np.random.Generator`` or seed for the thread's draws;
                default this process's stream of the buffer.

        Returns:
            ``shmbuf.feed.prefetch.Prefetcher``: an iterator of ``{column: tensor}``
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
        from ..feed.prefetch import Prefetcher

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
        from ..sampling import episodes as _episodes

        self._check_open()
        return _episodes.iterate(self, self._port, newest, include_open)

    def read_episode(self, index: int) -> dict | None:
        """Finished episode ``index`` (an ``episodes().index``) as ``{column: (steps, ...)}``.

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
        from ..sampling import episodes as _episodes

        self._check_open()
        names = [c.name for c in self._layout.user_columns]
        return _episodes.one(self._port, names, index)

    # -- waiting and counters ---------------------------------------------------
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
        gen = self._random.get() if rng is None else generator("rng", rng)
        return length, tail, gen, probes


def checked_priorities(ids, priorities) -> tuple[np.ndarray, np.ndarray]:
    """``update_priorities``' arguments checked: (flat int64 ids, flat float32 priorities).

    Raises what ``Buffer.update_priorities`` documents (whose buffer the ids
    belong to is the caller's to check); shmbuf.ray checks its arguments here
    too, before anything is written on any shard.
    """
    ids = checked_ids(ids, "updated")
    values = host_array(priorities)
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
    return flat, stored


def checked_ids(ids, undone: str | None = None) -> np.ndarray:
    """``ids`` as an int64 array of step ids (numpy, or a torch tensor on any device),
    the one check every id-taking call makes.

    Raises:
        TypeError: ids that are not int64.
        ValueError: with ``undone`` (what the call does, "written" say), a negative
            id; the message names its position and says nothing was ``undone``.
    """
    ids = host_array(ids)
    if ids.dtype != np.int64:
        raise TypeError(f"ids must be int64 step ids (as sample_sequences(..., ids=True) "
                        f"returns them), got dtype {ids.dtype}")
    if undone is not None and ids.size and ids.min() < 0:
        at = [int(i) for i in np.unravel_index(int(np.argmin(ids)), ids.shape)]
        raise ValueError(f"ids{at} is {int(ids.min())}; step ids are >= 0; nothing was "
                         f"{undone}")
    return ids

