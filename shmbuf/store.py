"""The shared step store: one buffer of named columns in one POSIX segment."""
from __future__ import annotations

import dataclasses
import json
import os
import time

import numpy as np

from . import _atomic as atomic
from . import _checkpoint
from ._args import check_int
from ._errors import SampleRetryError, WaitTimeoutError
from ._layout import (KIND_STORE, NO_SLOT, PAGE, Layout, encode_header,
                      encode_meta, pack_chunk_state, plan)
from ._procs import is_alive, my_start_time
from ._ring import Ring
from ._segment import Mapped, Segment, column_views, generate_name, validate_name
from ._out import prepare_out as _prepare_out
from .sampling import WindowFinder
from .writer import Writer

_MAX_REDRAWS = 64
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14; not among Python 3.11's mmap constants


@dataclasses.dataclass(frozen=True)
class Stats:
    """Counters of a buffer, read from its header by any attached process.

    Steps are numbered in global write order: ``oldest_step`` and
    ``newest_step`` bound the live ones.  Counts taken while writers join,
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


class Buffer(Mapped):
    """A replay buffer in shared memory; make one with ``create`` or ``attach``.

    Pickling a buffer sends its name: the receiving process attaches to the
    same live memory and never unlinks it.
    """

    def __init__(self, segment: Segment, layout: Layout, owner: tuple[int, int], meta: dict,
                 seed=None, mapped: bool = False):
        self._layout = layout
        self._owner_pid, self._owner_start = owner
        self._meta = meta
        self._ring = Ring(segment.mmap, layout)
        self._views = column_views(segment, layout, layout.columns)
        self._finder = WindowFinder(self._ring)
        self._rng = np.random.default_rng(seed)
        # Chunks whose pages this process has not mapped yet (None: all mapped).
        self._unmapped = None if mapped else np.ones(layout.n_chunks, np.bool_)
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
        """Zero-copy numpy views of each column's whole storage, ``(capacity, *shape)``."""
        self._check_open()
        return {c.name: self._views[c.name] for c in self._layout.user_columns}

    @property
    def tensors(self) -> dict:
        """Zero-copy torch views of the same storage (imports torch on first use)."""
        import torch

        return {k: torch.from_numpy(v) for k, v in self.arrays.items()}

    # -- writing --------------------------------------------------------------
    def writer(self) -> Writer:
        """Claim a writer slot and return a ``Writer`` for this process.

        Example:
            >>> w = buf.writer()
            >>> w.add(obs=o, action=a, reward=r, done=d)
        """
        self._check_open()
        return Writer(self)

    def _populate(self, chunk: int) -> None:
        """Map a claimed chunk's pages into this process before its first write here.

        A prefaulting owner maps everything at create; an attached writer
        would otherwise take a minor fault per page of its first pass over
        the ring.  One madvise per column instead of one fault per page, once
        per chunk: the pages stay mapped in this process after that.
        """
        if self._unmapped is None or not self._unmapped[chunk]:
            return
        self._unmapped[chunk] = False
        lay = self._layout
        first = chunk * lay.chunk_size
        rows = int(self._ring.chunk_rows[chunk])
        mm = self._segment.mmap
        for col in lay.columns:
            start = col.offset + first * col.row_bytes
            aligned = start - start % PAGE
            try:
                mm.madvise(_MADV_POPULATE_WRITE, aligned, start + rows * col.row_bytes - aligned)
            except OSError:
                return  # kernels before 5.14: the pages fault in as they are written

    # -- sampling -------------------------------------------------------------
    def sample_sequences(self, batch_size: int, length: int, *, time_major: bool = True,
                         out: dict | None = None, rng=None, tail: int = 0) -> dict:
        """Draw ``batch_size`` windows of ``length`` consecutive steps.

        Start steps are uniform over every valid start: a window lies in one
        writer stream and never continues past a terminal step (it may end on
        one).  Rows recycled while they were copied are redrawn, so no torn or
        overwritten step is ever returned.

        Args:
            batch_size: windows per batch, >= 1.
            length: steps per window, 1 <= length <= capacity.
            time_major: arrays are ``(length, batch, ...)`` if True, else
                ``(batch, length, ...)``.
            out: optional dict of preallocated numpy arrays or torch tensors
                (pinned ones included) of exactly that shape and dtype.
            rng: a ``np.random.Generator`` or an int seed; default the
                buffer's own generator (``seed=`` of create/attach).
            tail: the last ``tail`` rows only have to follow the window in its
                stream: they may lie past a terminal step of the first
                ``length - tail`` rows (next-frame targets; mask them with
                ``done``).  Default 0.

        Returns:
            ``{column: array}``, fresh arrays or the ``out`` objects.

        Raises:
            NotEnoughDataError: no valid window exists yet.
            ValueError / TypeError: a bad argument; nothing is sampled.

        Example:
            >>> batch = buf.sample_sequences(50, 50)
            >>> batch["obs"].shape   # (50, 50, 3, 64, 64)
        """
        self._check_open()
        batch_size = check_int("batch_size", batch_size, 1, 1 << 24)
        length = check_int("length", length, 1, self._layout.capacity)
        if isinstance(tail, bool) or not isinstance(tail, (int, np.integer)) or not (
                0 <= tail < length):
            raise ValueError(f"tail must be an int with 0 <= tail < length ({length}), "
                             f"got {tail!r}")
        gen = self._rng if rng is None else np.random.default_rng(rng)
        lead = (length, batch_size) if time_major else (batch_size, length)
        targets = _prepare_out(out, self.spec, lead)
        windows = self._finder.draw(gen, batch_size, length, tail)
        pending = np.arange(batch_size)
        for _ in range(_MAX_REDRAWS):
            self._gather(windows.rows, pending, targets, time_major, batch_size)
            stale = ~self._finder.still_valid(windows)
            if not stale.any():
                self._ring.bump("samples")
                return {k: t.result for k, t in targets.items()}
            pending = pending[stale]
            windows = self._finder.draw(gen, len(pending), length, tail)
        raise SampleRetryError(
            f"writers recycled sampled chunks {_MAX_REDRAWS} times in a row; the buffer "
            f"(capacity {self.capacity}) is too small for its ingest rate")

    def sample_steps(self, batch_size: int, *, out: dict | None = None, rng=None) -> dict:
        """Draw ``batch_size`` single steps uniformly: ``{column: (batch, ...)}``.

        Args and Raises are those of ``sample_sequences`` with ``length=1``.

        Example:
            >>> buf.sample_steps(256)["reward"].shape   # (256,)
        """
        self._check_open()
        if out is None:
            batch = self.sample_sequences(batch_size, 1, rng=rng)
            return {k: v[0] for k, v in batch.items()}
        if not isinstance(out, dict):
            raise ValueError(f"out must be a dict of arrays, got {type(out).__name__}")
        lifted = {k: (v[None] if isinstance(v, np.ndarray)
                      else v.unsqueeze(0) if type(v).__module__.startswith("torch") else v)
                  for k, v in out.items()}
        self.sample_sequences(batch_size, 1, out=lifted, rng=rng)
        return out

    def _gather(self, rows, pending, targets, time_major, batch_size) -> None:
        idx = np.ascontiguousarray(rows.T) if time_major else rows
        everything = len(pending) == batch_size
        for name, target in targets.items():
            src = self._views[name]
            if everything and target.array is not None:
                np.take(src, idx, axis=0, out=target.array, mode="clip")
            else:
                target.put(np.take(src, idx, axis=0, mode="clip"), pending, time_major)

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
        self._check_open()
        min_steps = check_int("min_steps", min_steps, 1, self._layout.capacity)
        if timeout is not None and (isinstance(timeout, bool)
                                    or not isinstance(timeout, (int, float, np.number))):
            raise TypeError(f"timeout must be None or a number of seconds, got {timeout!r}")
        if timeout is not None and not timeout >= 0:
            raise ValueError(f"timeout must be None or >= 0 seconds, got {timeout!r}")
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = 1e-4
        while True:
            live = self._ring.live_steps()
            if live >= min_steps:
                return live
            if deadline is not None and time.monotonic() >= deadline:
                raise WaitTimeoutError(
                    f"buffer {self.name!r} holds {live} live steps after {timeout} s; "
                    f"wait_ready wanted {min_steps}. Are the writers running?")
            time.sleep(pause)
            pause = min(pause * 2, 0.02)

    def stats(self) -> Stats:
        """A snapshot of the header counters (see ``Stats``)."""
        self._check_open()
        ring, lay = self._ring, self._layout
        # Read order matters.  A step is counted as written before it is
        # published, and published before it can be evicted; the written and
        # evicted counts only grow.  Reading evicted, then live, then written
        # keeps evicted <= written and live <= written however long this
        # process is descheduled between the reads.
        evicted = ring.counter("evicted")
        live = ring.live_steps()
        written = ring.steps_written()
        return Stats(self.name, lay.capacity, lay.chunk_size, lay.n_chunks, written,
                     live, ring.episodes_ended(), evicted, written - 1,
                     ring.chunks_in_use(), len(ring.live_writers()),
                     ring.counter("next_stream"), ring.counter("samples"),
                     self._owner_pid, is_alive(self._owner_pid, self._owner_start))

    # -- checkpoints --------------------------------------------------------------
    def snapshot(self) -> dict:
        """Copy every live step, oldest first, for a checkpoint.

        Returns:
            ``{"format", "spec", "columns": {col: (n, ...) array}, "stream": (n,),
            "episode": (n,)}``: numpy arrays and plain Python values only.

        Example:
            >>> np.savez("ckpt.npz", **buf.snapshot()["columns"])
        """
        self._check_open()
        return _checkpoint.snapshot(self)

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
        _checkpoint.restore(self, state)

    # -- lifecycle ----------------------------------------------------------------
    def _release(self) -> None:
        self._views = self._ring = self._finder = None

    def __reduce__(self):
        return attach, (self.name,)

    def __repr__(self):
        state = "closed" if self._closed else f"capacity={self.capacity}"
        return f"<shmbuf.Buffer {self._segment.name!r} {state}{' owner' if self.owner else ''}>"


def create(spec: dict, capacity: int, *, name: str | None = None, chunk_size: int | None = None,
           max_writers: int = 128, done_key: str | None = "done", seed=None,
           prefault: bool = True, meta: dict | None = None) -> Buffer:
    """Create a buffer in a new shared-memory segment; the caller owns it.

    Args:
        spec: ``{column: (per-step shape, numpy dtype)}``.
        capacity: steps held before the oldest chunk is recycled.
        name: segment name (letters, digits, ``._-``); generated if None.
        chunk_size: steps per chunk; default ``min(512, capacity // 64)``, at least 1.
        max_writers: writer objects that may be open at once.
        done_key: the scalar column whose true value ends an episode, or None.
        seed: seed of the buffer's own random generator.
        prefault: map every page into this process now (writers in other
            processes populate each chunk's pages when they claim it).
        meta: small JSON-serialisable dict stored in the header (``Buffer.meta``).

    Returns:
        The owning ``Buffer``; closing it (or dropping it, or exiting) unlinks
        the segment.

    Raises:
        ValueError / TypeError: a bad argument, before any system call.
        SegmentExistsError: ``name`` is taken.
        SharedMemoryFullError: /dev/shm is too small; nothing is left behind.

    Example:
        >>> spec = {"obs": ((3, 64, 64), np.uint8), "done": ((), np.bool_)}
        >>> with shmbuf.create(spec, capacity=100_000) as buf:
        ...     print(buf.name)
    """
    layout = plan(spec, capacity, chunk_size=chunk_size, max_writers=max_writers,
                  done_key=done_key)
    raw_meta = encode_meta(meta)
    name = generate_name() if name is None else validate_name(name)
    segment = Segment.create(name, layout.total_bytes, populate=prefault)
    try:
        owner = (os.getpid(), my_start_time())
        header = encode_header(layout, *owner, time.time_ns(), KIND_STORE, raw_meta)
        segment.mmap[:len(header)] = header
        ring = Ring(segment.mmap, layout)
        ring.chunk_table[:, 0] = pack_chunk_state(0, True, NO_SLOT, 0)  # free to claim
        atomic.fence_seq_cst()
        return Buffer(segment, layout, owner, json.loads(raw_meta), seed, mapped=prefault)
    except BaseException:
        segment.unlink()
        segment.close()
        raise


def attach(name: str, *, seed=None) -> Buffer:
    """Attach to an existing buffer by name; the result never unlinks it.

    Raises:
        SegmentNotFoundError: no segment has that name.
        CorruptSegmentError / LayoutVersionError: it is not a readable shmbuf buffer.

    Example:
        >>> buf = shmbuf.attach("shmbuf-1a2b3c4d5e6f")
    """
    segment = Segment.attach(name)
    try:
        layout, owner = segment.header(KIND_STORE)
        return Buffer(segment, layout, (owner["owner_pid"], owner["owner_start"]),
                      owner["meta"], seed)
    except BaseException:
        segment.close()
        raise
