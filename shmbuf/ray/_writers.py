"""The two writers ``ShardedBuffer.writer()`` hands out.

- ``LocalWriter``: this process runs on a node that has a shard.  It is the
  core ``Writer`` of that shard's buffer, attached by name: shared memory,
  no RPC per step.
- ``ShippingWriter``: no shard on this node.  Steps are gathered per stream
  into blocks of ``block_steps`` rows (a shard chunk by default) and each
  full block goes to one shard in one actor call, whose arguments travel
  through Ray's object store.  At most ``max_inflight_bytes`` of blocks are
  unacknowledged at once: the writer waits for the oldest before it ships
  more (backpressure, not unbounded memory).

Both have the core writer's ``add``, ``add_batch``, ``end_episode``,
``close`` and ``steps``, plus ``flush``, ``mode`` (``"shm"`` or ``"ship"``)
and ``node_id`` (the shard's node).
"""
from __future__ import annotations

import collections
import uuid

import numpy as np
import ray

from shmbuf import BufferClosedError, WritersStoppedError
from shmbuf.ray._errors import ShardLostError, is_loss
from shmbuf.writing.cast import coerce, scalar_fast_path

_OWNER_CHECK_EVERY = 1024  # local steps between checks that the shard still lives


class LocalWriter:
    """A core ``Writer`` on this node's shard, plus a liveness check of the shard."""

    mode = "shm"

    def __init__(self, buffer, shard_node: str, describe: str):
        self._buffer = buffer            # keeps the mapping alive as long as the writer
        self._writer = buffer.writer()
        self.node_id = shard_node
        self._describe = describe
        self._until_check = _OWNER_CHECK_EVERY

    def _tick(self, n: int) -> None:
        self._until_check -= n
        if self._until_check <= 0:
            self._until_check = _OWNER_CHECK_EVERY
            if not self._buffer.stats().owner_alive:
                self.close()
                raise ShardLostError(f"{self._describe} died (its process is gone); the "
                                     "steps already written stay in its segment but no "
                                     "sampler reads them. Call rb.refresh() and get a new "
                                     "writer")

    def add(self, **columns) -> None:
        self._writer.add(**columns)
        self._tick(1)

    def add_batch(self, **columns) -> None:
        self._writer.add_batch(**columns)
        self._tick(len(next(iter(columns.values()))))

    def end_episode(self, env: int | None = None) -> None:
        self._writer.end_episode(env)

    def flush(self) -> None:
        """Nothing to do: every step is visible once ``add`` returns."""

    @property
    def steps(self) -> int:
        return self._writer.steps

    def close(self) -> None:
        self._writer.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _fit(label: str, value, dtype: np.dtype, shape: tuple):
    """``value`` as it may be stored: the core writer's checks, with its two fast paths."""
    if type(value) is np.ndarray and value.dtype == dtype and value.shape == shape:
        return value
    if not shape and scalar_fast_path(value, dtype):
        return value
    return coerce(label, value, dtype, shape)


class _Block:
    """Staging arrays of ``n`` streams x ``rows`` steps, and the cuts among them."""

    def __init__(self, cols: list, n: int, rows: int):
        self.arrays = {name: np.empty((n, rows) + shape, dtype) for name, shape, dtype in cols}
        self.first = [a[0] for a in self.arrays.values()]    # stream 0's rows, column order
        self.n, self.rows, self.fill = n, rows, 0
        self.cuts: list[tuple[int, int]] = []   # (fill, env) of each cut

    def payload(self) -> dict:
        if self.fill == self.rows:
            return self.arrays
        return {k: a[:, :self.fill] for k, a in self.arrays.items()}

    def nbytes(self) -> int:
        return sum(a[:, :self.fill].nbytes for a in self.arrays.values())


class ShippingWriter:
    """Blocks of steps shipped to a shard on another node, with bounded in-flight bytes."""

    mode = "ship"

    def __init__(self, shard, shard_node: str, spec: dict, *, block_steps: int,
                 max_inflight_bytes: int, timeout_s: float, describe: str):
        self._shard = shard
        self.node_id = shard_node
        self._describe = describe
        self._cols = [(k, tuple(shape), np.dtype(dtype)) for k, (shape, dtype) in spec.items()]
        self._names = set(spec)
        self._rows = block_steps
        self._max = max_inflight_bytes
        self._timeout = timeout_s
        self._key = uuid.uuid4().hex
        self._blocks: dict[str, _Block] = {}          # "solo" (add) and "batch" (add_batch)
        self._seq: collections.Counter[str] = collections.Counter()
        self._inflight: collections.deque = collections.deque()   # (ref, nbytes)
        self._inflight_bytes = 0
        self._steps = 0
        self._error: BaseException | None = None
        self._closed = False
        self.blocks_shipped = 0
        self.max_inflight_seen = 0

    # -- the writer API -------------------------------------------------------------------
    def add(self, **columns) -> None:
        """Append one step to this writer's stream (shipped with its block)."""
        self._check(columns, "add")
        values = [_fit(f"add({name}=...)", columns[name], dtype, shape)
                  for name, shape, dtype in self._cols]    # all checked before any is copied
        block = self._block("solo", 1)
        fill = block.fill
        for view, v in zip(block.first, values):
            view[fill] = v
        self._advance(block, "solo", 1)

    def add_batch(self, **columns) -> None:
        """Append one step to each of ``n_envs`` streams (one per row)."""
        self._check(columns, "add_batch")
        first = self._cols[0][0]
        shape = np.shape(columns[first])
        n = shape[0] if shape else 0
        if n <= 0:
            raise ValueError(f"add_batch({first}=...): expected a leading env axis of at "
                             f"least 1 row, got shape {shape}")
        old = self._blocks.get("batch")
        if old is not None and old.n != n:
            raise ValueError(f"add_batch({first}=...): this writer has {old.n} env streams, "
                             f"got {n} rows; use one writer per vectorised env")
        values = {name: _fit(f"add_batch({name}=...)", columns[name], dtype, (n,) + shape_)
                  for name, shape_, dtype in self._cols}
        block = self._block("batch", n)
        for name, v in values.items():
            block.arrays[name][:, block.fill] = v
        self._advance(block, "batch", n)

    def end_episode(self, env: int | None = None) -> None:
        """Cut the stream (or env stream ``env``) without a terminal step."""
        self._check_alive()
        mode = "solo" if env is None else "batch"
        block = self._blocks.get(mode)
        if env is not None and (block is None or isinstance(env, bool) or not isinstance(
                env, (int, np.integer)) or not 0 <= env < block.n):
            raise IndexError(f"end_episode: env {env!r} is not one of this writer's "
                             f"{0 if block is None else block.n} env streams")
        if block is not None:
            block.cuts.append((block.fill, 0 if env is None else int(env)))

    def flush(self) -> None:
        """Ship partly filled blocks and wait until every shipped block is written."""
        self._check_alive()
        for mode, block in list(self._blocks.items()):
            if block.fill or block.cuts:
                self._ship(mode, block)
        while self._inflight:
            self._reap_oldest()

    @property
    def steps(self) -> int:
        return self._steps

    def close(self) -> None:
        """Flush, then let the shard seal this writer's streams.  Idempotent."""
        if self._closed:
            return
        try:
            if self._error is None:
                self.flush()
                ray.get(self._shard.release.remote(self._key), timeout=self._timeout)
        except Exception as exc:
            if self._error is None and is_loss(exc):
                raise self._lost(exc) from None
            if self._error is None:
                raise
        finally:
            self._closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __reduce__(self):
        raise TypeError("a writer belongs to one process; pass the ShardedBuffer to the "
                        "worker and call rb.writer() there")

    def __del__(self):
        try:        # ship what is staged, like a core Writer seals its chunks when dropped
            self.close()
        except Exception:
            pass

    # -- blocks ---------------------------------------------------------------------------
    def _check(self, columns: dict, verb: str) -> None:
        self._check_alive()
        if columns.keys() != self._names:
            raise KeyError(f"{verb}: missing columns {sorted(self._names - columns.keys())}, "
                           f"unknown columns {sorted(columns.keys() - self._names)}; the "
                           f"buffer's columns are {sorted(self._names)}")

    def _check_alive(self) -> None:
        if self._closed:
            raise BufferClosedError("this writer is closed; get a new one with rb.writer()")
        if self._error is not None:
            raise self._error

    def _block(self, mode: str, n: int) -> _Block:
        block = self._blocks.get(mode)
        if block is None:
            block = self._blocks[mode] = _Block(self._cols, n, self._rows)
        return block

    def _advance(self, block: _Block, mode: str, n: int) -> None:
        block.fill += 1
        self._steps += n
        if block.fill == block.rows:
            self._ship(mode, block)

    def _ship(self, mode: str, block: _Block) -> None:
        nbytes = block.nbytes()
        while self._inflight and self._inflight_bytes + nbytes > self._max:
            self._reap_oldest()
        key = f"{self._key}:{mode}"
        try:   # the arguments are serialised here, so the block's arrays can be reused
            ref = self._shard.ingest.remote(key, self._seq[mode], block.payload(), block.cuts)
        except Exception as exc:
            raise self._fail(exc) from None
        self._seq[mode] += 1
        self._inflight.append((ref, nbytes))
        self._inflight_bytes += nbytes
        self.max_inflight_seen = max(self.max_inflight_seen, self._inflight_bytes)
        self.blocks_shipped += 1
        block.fill, block.cuts = 0, []

    def _reap_oldest(self) -> None:
        ref, nbytes = self._inflight[0]
        try:
            ray.get(ref, timeout=self._timeout)
        except Exception as exc:
            if isinstance(exc, WritersStoppedError):
                raise self._stopped(exc) from None
            raise self._fail(exc) from None
        self._inflight.popleft()
        self._inflight_bytes -= nbytes

    def _stopped(self, exc: BaseException) -> WritersStoppedError:
        """The shard refused a block (``stop_writers``): the blocks in flight behind it and
        the rows staged here went into the same stop.  Settle them all, so that this one
        error is the stop's only one and the writer goes on cleanly after a resume."""
        while self._inflight:
            ref, nbytes = self._inflight.popleft()
            self._inflight_bytes -= nbytes
            try:
                ray.get(ref, timeout=self._timeout)
            except WritersStoppedError:
                pass
            except Exception as other:
                raise self._fail(other) from None
        for block in self._blocks.values():
            block.fill, block.cuts = 0, []
        # The shard's own error, not Ray's wrapper: ``except WritersStoppedError`` ends a
        # worker loop as it does on a local writer.
        return WritersStoppedError(str(getattr(exc, "cause", None) or exc))

    def _fail(self, exc: BaseException) -> BaseException:
        if not is_loss(exc):
            return exc
        self._error = self._lost(exc)
        return self._error

    def _lost(self, exc: BaseException) -> ShardLostError:
        return ShardLostError(
            f"{self._describe} is gone ({type(exc).__name__}); the blocks this writer had in "
            f"flight ({len(self._inflight)}, {self._inflight_bytes} bytes) and everything "
            "that shard held are lost with it. Get a new writer with rb.writer() to write "
            "to a live shard")
