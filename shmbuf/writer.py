"""Writers: append steps to a buffer from any process, without a lock.

A writer holds one slot in the header and one or more *streams*.  Each
stream fills its own chunk; when the chunk is full it claims the oldest
recyclable chunk, links it as the successor, and seals the old one.  A step
is published by storing the chunk's new row count with release order after
every column of the row is written, so readers never see half a step.
"""
from __future__ import annotations

import os

import numpy as np

from . import _atomic as atomic
from ._cast import coerce, scalar_fast_path
from ._errors import BufferClosedError


class _Streams:
    """Per-stream cursors of one writer, as arrays indexed by stream."""

    def __init__(self, n: int):
        self.id = np.zeros(n, np.int64)
        self.chunk = np.full(n, -1, np.int64)
        self.seq = np.zeros(n, np.int64)
        self.base = np.zeros(n, np.int64)     # first row of the chunk
        self.fill = np.zeros(n, np.int64)     # rows written into the chunk
        self.rows = np.zeros(n, np.int64)     # rows the chunk can hold
        self.ep = np.zeros(n, np.int64)       # episode number within the stream
        self.count_off = np.zeros(n, np.int64)
        self.left = 0                         # calls before some stream's chunk is full


class Writer:
    """Appends steps to one buffer; get one with ``Buffer.writer()``.

    ``add`` writes one step to the writer's own stream; ``add_batch`` writes
    one step to each of ``n_envs`` streams (one per row of a vectorised env).
    A writer belongs to the process that made it: a forked child that uses an
    inherited writer silently gets new streams of its own.
    """

    _closed = True
    _slot = None

    def __init__(self, buffer):
        self._buf = buffer
        self._ring = buffer._ring
        self._mm = buffer._ring.mm
        lay = buffer._layout
        self._k = lay.chunk_size
        self._cols = [(c.name, buffer._views[c.name], c.dtype, c.shape)
                      for c in lay.user_columns]
        self._names = set(buffer._views) - {"_ep"}
        self._ep_col = buffer._views["_ep"]
        self._done = lay.columns[lay.done_column].name if lay.done_column >= 0 else None
        self._done_index = lay.done_column
        self._bind()

    def _bind(self) -> None:
        self._pid = os.getpid()
        self._slot, self._lease = self._ring.claim_slot()
        self._steps_off = self._ring.layout.slot_field(self._slot, "steps")
        self._episodes_off = self._ring.layout.slot_field(self._slot, "episodes")
        # The slot's counters are cumulative over its holders: continue them.
        self._slot_steps = atomic.load_acquire(self._mm, self._steps_off)
        self._slot_episodes = atomic.load_acquire(self._mm, self._episodes_off)
        self._streams_off = self._ring.layout.slot_field(self._slot, "streams")
        self._steps = 0
        self._solo = None
        self._batch = None
        self._closed = False

    def _check(self) -> None:
        if self._closed:
            raise BufferClosedError("this writer is closed; get a new one with buf.writer()")
        if self._pid != os.getpid():
            self._bind()  # a forked child never continues its parent's streams
        self._buf._check_open()

    def _new_streams(self, n: int) -> _Streams:
        s = _Streams(n)
        first = self._ring.bump("next_stream", n)
        s.id[:] = np.arange(first, first + n)
        atomic.fetch_add(self._mm, self._streams_off, n)
        return s

    def _advance(self, s: _Streams, i: int) -> None:
        """Give stream ``i`` a fresh chunk, linked after its current one."""
        chunk, seq = self._ring.claim_chunk(self._slot, self._lease, int(s.id[i]))
        old = int(s.chunk[i])
        if old >= 0:
            self._ring.link(old, chunk, seq)
            self._ring.seal(old, int(s.seq[i]), self._slot, self._lease)
        self._buf._populate(chunk)
        s.chunk[i], s.seq[i], s.fill[i] = chunk, seq, 0
        s.base[i] = chunk * self._k
        s.rows[i] = self._ring.chunk_rows[chunk]
        s.count_off[i] = self._ring.count_off[chunk]

    def _check_names(self, columns: dict, verb: str) -> None:
        if columns.keys() != self._names:
            missing = sorted(self._names - columns.keys())
            unknown = sorted(columns.keys() - self._names)
            raise KeyError(f"{verb}: missing columns {missing}, unknown columns {unknown}; "
                           f"the buffer's columns are {sorted(self._names)}")

    def _coerce_all(self, columns: dict, lead: tuple, verb: str) -> list:
        """The values in column order, cast losslessly; the names are already checked."""
        out = []
        for name, _, dtype, shape in self._cols:
            v = columns[name]
            if ((type(v) is np.ndarray or isinstance(v, np.generic)) and v.dtype == dtype
                    and v.shape == lead + shape):
                out.append(v)
            elif not lead and not shape and scalar_fast_path(v, dtype):
                out.append(v)
            else:
                out.append(coerce(f"{verb}({name}=...)", v, dtype, lead + shape))
        return out

    def add(self, **columns) -> None:
        """Append one step to this writer's stream.

        Args:
            **columns: one value per column of the buffer, each of the
                column's per-step shape and losslessly castable to its dtype.
                A true ``done`` ends the episode: no sampled window continues
                past this step.

        Raises:
            KeyError: a column is missing or unknown.
            ValueError / TypeError: a value has the wrong shape, or its dtype
                would lose information; nothing is written.
            BufferClosedError: the writer or the buffer is closed.

        Example:
            >>> w = buf.writer()
            >>> w.add(obs=frame, action=a, reward=1.0, done=False)
        """
        self._check()
        self._check_names(columns, "add")
        values = self._coerce_all(columns, (), "add")
        s = self._solo
        if s is None:
            s = self._solo = self._new_streams(1)
        if s.fill[0] == s.rows[0]:
            self._advance(s, 0)
        fill = int(s.fill[0])
        row = int(s.base[0]) + fill
        for (_, view, _, _), v in zip(self._cols, values):
            view[row] = v
        self._ep_col[row] = s.ep[0]
        s.fill[0] = fill + 1
        # Counted before it is published: a writer killed in between leaves
        # steps_written one ahead, never behind what readers can see.
        self._count_steps(1)
        atomic.store_release(self._mm, int(s.count_off[0]), fill + 1)
        if self._done is not None and values[self._done_index]:
            s.ep[0] += 1
            self._count_episodes(1)

    def add_batch(self, **columns) -> None:
        """Append one step to each of ``n_envs`` streams, from a vectorised env.

        Args:
            **columns: one array per column with a leading ``n_envs`` axis;
                row ``i`` goes to this writer's stream ``i``.  ``n_envs`` is
                fixed by the first call.

        Raises:
            The same as ``add``; a bad row rejects the whole batch, unwritten.

        Example:
            >>> w.add_batch(obs=frames, action=acts, reward=rews, done=dones)  # (16, ...)
        """
        self._check()
        self._check_names(columns, "add_batch")
        first_name = self._cols[0][0]
        shape = np.shape(columns[first_name])
        n = shape[0] if shape else 0
        if n <= 0:
            raise ValueError(f"add_batch({first_name}=...): expected a leading env axis of at "
                             f"least 1 row, got shape {shape}")
        if self._batch is not None and n != len(self._batch.id):
            raise ValueError(f"add_batch({first_name}=...): this writer has "
                             f"{len(self._batch.id)} env streams, got {n} rows; use one "
                             "writer per vectorised env")
        values = self._coerce_all(columns, (n,), "add_batch")
        s = self._batch
        if s is None:
            s = self._batch = self._new_streams(n)
        if not s.left:   # every stream gains a row per call: chunks fill in lockstep
            for i in np.flatnonzero(s.fill == s.rows):
                self._advance(s, int(i))
            s.left = int((s.rows - s.fill).min())
        rows = s.base + s.fill
        for (_, view, _, _), v in zip(self._cols, values):
            view[rows] = v
        self._ep_col[rows] = s.ep
        s.fill += 1
        s.left -= 1
        self._count_steps(n)
        atomic.store_many(self._mm, s.count_off, s.fill)
        if self._done is not None:
            ended = values[self._done_index]
            n_ended = int(np.count_nonzero(ended))
            if n_ended:
                s.ep += ended.astype(np.bool_, copy=False)
                self._count_episodes(n_ended)

    def _count_steps(self, n: int) -> None:
        self._steps += n
        self._slot_steps += n
        atomic.store_release(self._mm, self._steps_off, self._slot_steps)

    def _count_episodes(self, n: int) -> None:
        if n:
            self._slot_episodes += n
            atomic.store_release(self._mm, self._episodes_off, self._slot_episodes)

    def end_episode(self, env: int | None = None) -> None:
        """Cut the stream (or env stream ``env``) without a terminal step.

        Use it for time limits: later steps start a new episode, and no window
        spans the cut.
        """
        self._check()
        if env is None:
            if self._solo is not None:
                self._solo.ep[0] += 1
        else:
            if self._batch is None or not 0 <= env < len(self._batch.id):
                raise IndexError(f"end_episode: env {env} is not one of this writer's streams")
            self._batch.ep[env] += 1

    @property
    def steps(self) -> int:
        """Steps this writer has added in this process."""
        return self._steps

    def close(self) -> None:
        """Seal this writer's chunks and free its slot.  Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._pid != os.getpid() or self._buf._closed:
            return
        for s in (self._solo, self._batch):
            if s is not None:
                for i in np.flatnonzero(s.chunk >= 0):
                    self._ring.seal(int(s.chunk[i]), int(s.seq[i]), self._slot, self._lease)
        self._ring.release_slot(self._slot, self._lease)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __reduce__(self):
        raise TypeError("a Writer belongs to one process and cannot be pickled; pass the "
                        "buffer to the worker and call buf.writer() there")
