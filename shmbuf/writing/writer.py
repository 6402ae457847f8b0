"""Writers: append steps to a buffer from any process, without a lock.

A writer holds one slot in the header and one or more *streams*.  Each
stream fills its own chunk; when the chunk is full it claims the oldest
recyclable chunk, links it as the successor, and seals the old one.  All of
that, and the publish that makes a step visible, is the protocol's
(``protocol.streams``: ``Slot`` and ``Streams``, over ``protocol.ring``): a
writer checks and casts the values, copies them into the row its streams
give it, and asks them to publish.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from .._errors import BufferClosedError, SharedMemoryFullError
from ..posix.procs import this_pid
from ..protocol.layout import EP_COLUMN, Layout
from ..protocol.ring import Ring, copy_rows
from ..protocol.streams import Slot, Streams, claim_slot
from .cast import check_flags, coerce, scalar_fast_path


class Writer:
    """Appends steps to one buffer; get one with ``Buffer.writer()``.

    ``add`` writes one step to the writer's own stream; ``add_batch`` writes
    one step to each of ``n_envs`` streams (one per row of a vectorised env).
    A writer belongs to the process that made it: a forked child that uses an
    inherited writer silently gets new streams of its own.
    """

    _closed = True
    _slot: Slot = None  # type: ignore[assignment]  # class default: close() works after a failed constructor

    def __init__(self, ring: Ring, views: dict[str, np.ndarray],
                 check_open: Callable[[], None], on_claim: Callable[[int], None] | None = None,
                 limit=None, stoppable: bool = True):
        """Internal: ``Buffer.writer()`` builds writers from its ring and column views
        (``limit``: the buffer's rate limiter, when it makes writers wait;
        ``stoppable``: whether ``Buffer.stop_writers`` stops it, as it stops
        every writer but a restore's)."""
        lay: Layout = ring.layout
        self._ring = ring
        self._closed_word = ring.closed_view  # the header's closed word, read on every call
        self._stop = ring.stop_mark if stoppable else None  # its word is read beside it
        self._check_open = check_open
        self._on_claim = on_claim
        self._limit = limit
        self._cols = [(c.name, views[c.name], c.dtype, c.shape) for c in lay.user_columns]
        self._names = {c.name for c in lay.user_columns}
        self._ep_col = views[EP_COLUMN]
        self._done = lay.columns[lay.done_column].name if lay.done_column >= 0 else None
        self._done_index = lay.done_column
        # A float done column holds flags only (cast.check_flags); others need no check.
        self._done_dtype = lay.columns[lay.done_column].dtype
        self._float_done = self._done is not None and self._done_dtype.kind in "fc"
        self._bind()

    def _bind(self) -> None:
        self._pid = this_pid()   # a fork (this_pid() changes) binds again, see _check
        self._slot = claim_slot(self._ring)
        self._steps = 0
        self._solo: Streams | None = None
        self._batch: Streams | None = None
        # The C fast paths of add / add_batch, built with their streams.
        self._fast_add = self._fast_batch = None
        self._closed = False

    def _check(self) -> None:
        if self._closed:
            raise BufferClosedError("this writer is closed; get a new one with buf.writer()")
        if self._pid != this_pid():
            self._bind()  # a forked child never continues its parent's streams
        self._check_open()
        if self._closed_word[0]:  # one relaxed load: the owner closed it, this worker stops
            self._ring.check_open(self._pid)
        if self._stop is not None:
            self._stop.check()    # one relaxed load: Buffer.stop_writers ends worker loops

    def _solo_streams(self) -> Streams:
        """The one stream of ``add`` and ``extend``, opened at the first of them with
        ``add``'s C fast path (whichever call opens it, later adds take that path)."""
        s = self._solo
        if s is None:
            s = self._solo = self._slot.open_streams(1, self._on_claim, self._limit)
            self._fast_add = self._appender(s, "add")
        return s

    def _check_names(self, columns: dict, verb: str) -> None:
        if columns.keys() != self._names:
            missing = sorted(self._names - columns.keys())
            unknown = sorted(columns.keys() - self._names)
            raise KeyError(f"{verb}: missing columns {missing}, unknown columns {unknown}; "
                           f"the buffer's columns are {sorted(self._names)}")

    def _coerce_all(self, columns: dict, lead: tuple, verb: str,
                    skip: frozenset = frozenset()) -> list:
        """The values in column order, cast losslessly (None for the columns ``skip``);
        the names are already checked."""
        out: list = []
        for name, _, dtype, shape in self._cols:
            if skip and name in skip:
                out.append(None)
                continue
            v = columns[name]
            if ((type(v) is np.ndarray or isinstance(v, np.generic)) and v.dtype == dtype
                    and v.shape == lead + shape):
                out.append(v)
            elif not lead and not shape and scalar_fast_path(v, dtype):
                out.append(v)
            else:
                out.append(coerce(f"{verb}({name}=...)", v, dtype, lead + shape))
        return out

    def add(self, **columns: Any) -> None:
        """Append one step to this writer's stream.

        Args:
            **columns: one value per column of the buffer, each of the
                column's per-step shape and losslessly castable to its dtype.
                A true ``done`` ends the episode: no sampled window continues
                past this step.

        Raises:
            KeyError: a column is missing or unknown.
            ValueError / TypeError: a value has the wrong shape, its dtype
                would lose information, or a float ``done`` is not exactly 0
                or 1 (the message names the value and the step); nothing is
                written.
            BufferClosedError: the writer or the buffer is closed, here or by
                its owner in another process (or by ``shmbuf rm`` / ``gc``).
            WritersStoppedError: ``Buffer.stop_writers()`` was called, in
                any process, also while this step waited for the rate limit;
                nothing was published.
            WaitTimeoutError: the buffer's rate limit (``RateLimit``, with
                ``block_writers``) made the step wait ``writer_timeout``
                seconds for samples; nothing was published.
            SharedMemoryFullError: the step needs a new chunk and /dev/shm has
                no room for its pages; nothing is written, and the same call
                may be retried once space is freed.

        Example:
            >>> w = buf.writer()
            >>> w.add(obs=frame, action=a, reward=1.0, done=False)
        """
        fast = self._fast_add
        if fast is not None and self._pid == this_pid():
            # Values that already fit go in C, which also checks the closed
            # word; anything else (a cast, a bad value, a full chunk, a closed
            # buffer) returns -1 unwritten and takes the Python path below.
            self._check_open()
            ended = fast(columns)
            if ended >= 0:
                self._steps += 1
                if ended:
                    self._solo.end(0, True)
                return
        self._check()
        self._check_names(columns, "add")
        values = self._coerce_all(columns, (), "add")
        if self._float_done:
            check_flags(f"add({self._done}=...)", values[self._done_index],
                        self._done_dtype,
                        lambda i: f"this writer's step {self._steps}")
        s = self._solo_streams()
        row = s.row(0)
        for (_, view, _, _), v in zip(self._cols, values):
            view[row] = v
        self._ep_col[row] = s.ep[0]
        s.publish(0, self._done is not None and bool(values[self._done_index]))
        self._steps += 1

    def add_batch(self, **columns: Any) -> None:
        """Append one step to each of ``n_envs`` streams, from a vectorised env.

        Args:
            **columns: one array per column with a leading ``n_envs`` axis;
                row ``i`` goes to this writer's stream ``i``.  ``n_envs`` is
                fixed by the first call.

        A bad row rejects the whole batch, unwritten.

        Raises:
            KeyError: as in ``add``.
            ValueError: as in ``add``, for any row.
            TypeError: as in ``add``, for any row.
            BufferClosedError: as in ``add``.
            WaitTimeoutError: as in ``add``.
            SharedMemoryFullError: as in ``add``.

        Example:
            >>> w.add_batch(obs=frames, action=acts, reward=rews, done=dones)  # (16, ...)
        """
        fast = self._fast_batch
        if fast is not None and self._pid == this_pid():
            self._check_open()
            ended = fast(columns)
            if ended >= 0:
                self._steps += len(self._batch)
                if ended:
                    for i in np.flatnonzero(columns[self._done]):
                        self._batch.end(int(i), True)
                return
        self._check()
        self._check_names(columns, "add_batch")
        first_name = self._cols[0][0]
        shape = np.shape(columns[first_name])
        n = shape[0] if shape else 0
        if n <= 0:
            raise ValueError(f"add_batch({first_name}=...): expected a leading env axis of at "
                             f"least 1 row, got shape {shape}")
        if self._batch is not None and n != len(self._batch):
            raise ValueError(f"add_batch({first_name}=...): this writer has "
                             f"{len(self._batch)} env streams, got {n} rows; use one "
                             "writer per vectorised env")
        values = self._coerce_all(columns, (n,), "add_batch")
        if self._float_done:
            check_flags(f"add_batch({self._done}=...)", values[self._done_index],
                        self._done_dtype,
                        lambda i: f"env row {i} of this writer's step {self._steps // n}")
        s = self._batch
        if s is None:
            s = self._batch = self._slot.open_streams(n, self._on_claim, self._limit)
            self._fast_batch = self._appender(s, "add_batch")
        rows = s.rows_all()
        for (_, view, _, _), v in zip(self._cols, values):
            view[rows] = v
        self._ep_col[rows] = s.ep
        ended = None
        if self._done is not None:
            ended = values[self._done_index]
            if not np.count_nonzero(ended):
                ended = None
        s.publish_all(ended)
        self._steps += n

    def _appender(self, streams: Streams, method: str):
        """The C fast path for ``streams`` (validated once, here), or None."""
        fast = streams.appender(tuple(c[0] for c in self._cols), tuple(c[1] for c in self._cols),
                                self._ep_col, self._done_index)
        return None if fast is None else getattr(fast, method)

    def extend(self, **columns: Any) -> np.ndarray:
        """Append a run of ``T`` consecutive steps to this writer's stream.

        Args:
            **columns: one array per column with a leading axis ``T`` (the
                same for every column, at least 1 and at most the capacity),
                each row of the column's per-step shape and losslessly
                castable to its dtype.  A true ``done`` at step ``t`` ends an
                episode there; the run continues with the next one.

        The run is copied with one slice assignment per column and chunk it
        spans, and published once per chunk: a reader sees a prefix of the
        run, never a partial step.

        Returns:
            The rows the run went to, in order (``(T,)`` int64): rows of
            ``Buffer.arrays``, holding these steps until writers recycle them.

        Raises:
            KeyError: a column is missing or unknown.
            ValueError / TypeError: columns of different lengths, ``T == 0``,
                a run longer than the capacity, a wrong shape, a lossy cast
                or a ``done`` that is not 0/1; nothing is written.
            BufferClosedError: the writer or the buffer is closed.
            WritersStoppedError: ``Buffer.stop_writers()`` was called.
            WaitTimeoutError: as ``add``; the chunk segments of the run
                published before the wait stay (a reader sees a prefix).
            SharedMemoryFullError: /dev/shm had no room for the next chunk;
                the steps before it are written (the message says how many).

        Example:
            >>> w.extend(obs=frames, action=acts, reward=rews, done=dones)  # (T, ...) each
        """
        return self._extend(columns)

    def _extend(self, columns: dict, unwritten: frozenset = frozenset()) -> np.ndarray:
        """``extend``, leaving the rows of the columns ``unwritten`` as they are (a load
        whose chunk holds them compressed already: ``_claim_next``); their values are
        neither read nor checked beyond their shape.  Returns the rows written."""
        self._check()
        self._check_names(columns, "extend")
        n = self._run_length(columns)
        values = self._coerce_all(columns, (n,), "extend", unwritten)
        if self._float_done:
            check_flags(f"extend({self._done}=...)", values[self._done_index],
                        self._done_dtype,
                        lambda i: f"step {i} of the run")
        s = self._solo_streams()
        ends = np.empty(0, np.int64)
        ep = s.ep[0]
        if self._done is not None:
            done = values[self._done_index] != 0
            ends = np.flatnonzero(done)
            if len(ends):   # a step's episode: the episodes ended before it in the run
                ep = s.ep[0] + np.cumsum(done) - done
        at = 0
        rows = np.empty(n, np.int64)
        while at < n:
            try:
                row, room = s.room(0)
            except SharedMemoryFullError as exc:
                if not at:
                    raise
                raise SharedMemoryFullError(exc.errno, f"{exc.strerror} This extend had written "
                                            f"the first {at} of its {n} steps; retry with "
                                            f"the rest (rows {at}: of each column)") from None
            k = min(room, n - at)
            for (_, view, dtype, _), v in zip(self._cols, values):
                if v is None:
                    continue   # unwritten: held compressed
                part = v[at:at + k]
                if type(part) is np.ndarray and part.dtype == dtype and part.flags.c_contiguous:
                    copy_rows(view[row:row + k], part)   # the same bytes, streamed
                else:
                    view[row:row + k] = part
            self._ep_col[row:row + k] = ep if np.ndim(ep) == 0 else ep[at:at + k]
            here = ends[(ends >= at) & (ends < at + k)] - at
            s.publish_run(0, k, here)
            rows[at:at + k] = np.arange(row, row + k)
            self._steps += k
            at += k
        return rows

    def _room(self) -> int:
        """Internal (load): steps that still fit this writer's stream's current chunk
        (0: the next step claims a chunk)."""
        s = self._solo
        return 0 if s is None else int(s.rows[0] - s.fill[0])

    def _claim_next(self, unwritten: frozenset) -> tuple[int, int, int]:
        """Internal (load): claim the chunk this writer's stream fills next (its current
        one is full, ``_room() == 0``), leaving the pages of the columns ``unwritten``
        neither reserved nor mapped (a load puts them in compressed).  Returns
        ``(chunk, seq, rows)``.

        Raises:
            SharedMemoryFullError: as ``add``; nothing was claimed.
        """
        self._check()
        s = self._solo_streams()
        assert s.fill[0] == s.rows[0], "the stream is inside a chunk"
        s.advance(0, unwritten)
        return int(s.chunk[0]), int(s.seq[0]), int(s.rows[0])

    def _run_length(self, columns: dict) -> int:
        """The run length ``T`` every column of an ``extend`` agrees on; raises if none."""
        lengths = {}
        for name, _, _, shape in self._cols:
            dims = np.shape(columns[name])
            lengths[name] = dims[0] if len(dims) == len(shape) + 1 else None
        if None in lengths.values():
            name = next(k for k, v in lengths.items() if v is None)
            shape = dict((c[0], c[3]) for c in self._cols)[name]
            raise ValueError(f"extend({name}=...): expected shape (T,) + {shape} with a "
                             f"leading run axis T, got shape {np.shape(columns[name])}; "
                             "nothing was written")
        if len(set(lengths.values())) > 1:
            runs = ", ".join(f"{k} {v}" for k, v in lengths.items())
            raise ValueError(f"extend: every column needs the same run length T, got {runs}; "
                             "nothing was written")
        n: int = next(iter(lengths.values()))  # type: ignore[assignment]  # None raised above
        if n < 1:
            first = self._cols[0][0]
            raise ValueError(f"extend({first}=...): a run needs at least 1 step, got T = {n} "
                             f"(shape {np.shape(columns[first])}); nothing was written")
        capacity = self._ring.layout.capacity
        if n > capacity:
            raise ValueError(f"extend: a run of T = {n} steps is longer than the buffer's "
                             f"capacity of {capacity} steps and would overwrite itself; "
                             "split it, or create a larger buffer; nothing was written")
        return n

    def end_episode(self, env: int | None = None) -> None:
        """Cut the stream (or env stream ``env``) without a terminal step.

        Use it for time limits (truncation): later steps start a new episode,
        no window spans the cut, and the episode so far is indexed as cut,
        not terminal.

        Raises:
            IndexError: ``env`` is not one of this writer's env streams.
            BufferClosedError: the writer or the buffer is closed.
            WritersStoppedError: ``Buffer.stop_writers()`` was called.
        """
        self._check()
        if env is None:
            if self._solo is not None:
                self._solo.end(0, False)
        else:
            if self._batch is None or isinstance(env, bool) or not isinstance(
                    env, (int, np.integer)) or not 0 <= env < len(self._batch):
                raise IndexError(f"end_episode: env {env!r} is not one of this writer's "
                                 f"{0 if self._batch is None else len(self._batch)} env streams")
            self._batch.end(int(env), False)

    @property
    def steps(self) -> int:
        """Steps this writer has added in this process."""
        return self._steps

    def stream_id(self) -> int:
        """The buffer-wide id of the stream ``add``/``extend`` write (-1 before the first)."""
        return int(self._solo.id[0]) if self._solo is not None else -1

    def close(self) -> None:
        """Seal this writer's chunks and free its slot.  Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._fast_add = self._fast_batch = None
        if self._pid != this_pid():
            return
        try:
            self._check_open()
        except BufferClosedError:
            return  # the mapping is gone with the buffer
        self._slot.release([s for s in (self._solo, self._batch) if s is not None])

    def __enter__(self) -> "Writer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __reduce__(self):
        raise TypeError("a Writer belongs to one process and cannot be pickled; pass the "
                        "buffer to the worker and call buf.writer() there")
