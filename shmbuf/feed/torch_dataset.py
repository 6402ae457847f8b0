"""``Buffer.dataset``: a torch ``IterableDataset`` of whole batches drawn live.

Each item is one batch, already collated: ``sample_sequences``'s dict of
time-major arrays as torch tensors, so a ``DataLoader`` takes it with
``batch_size=None``.  In a DataLoader worker the batch is gathered straight
into shared memory that the worker reuses once the trainer has freed the
batch (``shmbuf.feed.handoff``), so passing it to the trainer copies nothing
and costs no page faults; in the main process the tensors share the
gathered arrays.

Workers attach to the buffer by name (the dataset pickles to the name and
its arguments, never to data); each draws from its own random stream
(``shmbuf.sampling.rng``).  When the buffer is closed, or its name is gone
(the owner closed or unlinked it), iteration ends cleanly after the batch
in hand; a worker that starts after the name is gone raises
``SegmentNotFoundError`` naming the buffer.

This module imports torch; ``Buffer.dataset`` imports it on first use.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from .._args import check_int
from .._errors import BufferClosedError, SegmentNotFoundError
from ..sampling.rng import ProcessRandom

if TYPE_CHECKING:
    from .handoff import SlotPool
from ..segment.segment import SHM_DIR

SAMPLE_KEYS = ("time_major", "tail", "uniform", "newest", "select", "ids")
IDS_ENTRY = ((), np.dtype(np.int64))   # a batch's "ids" (sample_sequences(..., ids=True))


def check_sample_kwargs(buffer, batch_size, length, sample_kwargs: dict, where: str) -> dict:
    """The checked keyword arguments of ``sample_sequences`` (without ``out`` and ``rng``),
    to pass back as ``sample_sequences(**args, out=..., rng=...)``."""
    unknown = sorted(set(sample_kwargs) - set(SAMPLE_KEYS))
    if unknown:
        raise TypeError(f"{where}: unknown arguments {unknown}; it takes batch_size, length "
                        f"and sample_sequences' {list(SAMPLE_KEYS)}")
    time_major = sample_kwargs.get("time_major", True)
    if not isinstance(time_major, (bool, np.bool_)):
        raise TypeError(f"time_major must be True or False, got {time_major!r}")
    uniform, newest, select = (sample_kwargs.get(k) for k in ("uniform", "newest", "select"))
    door = buffer.port   # a Buffer's StorePort, or a ShardedBuffer's own checks
    batch_size, length, tail, _ = door.sample_args(
        batch_size, length, sample_kwargs.get("tail", 0), uniform, newest, select)
    args = {"batch_size": batch_size, "length": length, "time_major": bool(time_major),
            "tail": tail, "uniform": uniform, "newest": newest, "select": select}
    ids = sample_kwargs.get("ids", False)
    if not isinstance(ids, (bool, np.bool_)):
        raise TypeError(f"ids must be True or False, got {ids!r}")
    if ids:
        door.check_priorities(f"{where}(..., ids=True)")
        args["ids"] = True   # only when asked: a buffer without ids= samples as before
    return args


def batch_spec(buffer, args: dict) -> dict:
    """``{name: (shape, dtype)}`` of a batch ``sample_sequences(**args)`` fills: the
    buffer's columns, and ``"ids"`` when asked."""
    spec = buffer.spec
    return dict(spec, ids=IDS_ENTRY) if args.get("ids") else spec


def torch_dtype(dtype: np.dtype, column: str = ""):
    """torch's dtype for a column's numpy dtype; TypeError naming the column if it has none."""
    try:
        return torch.from_numpy(np.empty(0, dtype)).dtype
    except (TypeError, ValueError):   # no such dtype, or not in native byte order
        raise TypeError(f"column {column!r} has dtype {dtype}, which torch tensors cannot "
                        "hold; sample it with sample_sequences (numpy) instead") from None


def shared_empty(shape: tuple, dtype: np.dtype) -> torch.Tensor:
    """An uninitialised tensor in torch's shared memory: a worker sends it without a copy."""
    tdtype = torch_dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    new_shared = getattr(torch.UntypedStorage, "_new_shared", None)
    if new_shared is None:   # older torch: share_memory_ copies, but still works
        return torch.empty(shape, dtype=tdtype).share_memory_()
    return torch.empty(0, dtype=tdtype).set_(new_shared(nbytes), 0, shape)  # type: ignore[call-overload]  # stride is optional


def ended(buf) -> bool:
    """True once this handle is closed, or the owner marked the buffer closed (or removed
    its name) in any process: the header's closed word, then the name, as a backstop."""
    return buf.closed or not buf.port.live() or not os.path.exists(
        os.path.join(SHM_DIR, buf.name))


class BatchDataset(IterableDataset):
    """Batches of ``sample_sequences(batch_size, length, **sample_kwargs)`` as tensors.

    Made by ``Buffer.dataset``; see it for the arguments.  ``transform``, if
    given, is a picklable function applied to each batch (the facades use it
    for their own output format).
    """

    def __init__(self, buffer, batch_size: int, length: int, *, batches: int | None = None,
                 seed=None, transform=None, **sample_kwargs):
        buffer._check_open()
        self._args = check_sample_kwargs(buffer, batch_size, length, sample_kwargs,
                                         "Buffer.dataset")
        self.batches = None if batches is None else check_int("batches", batches, 1)
        port = buffer.port
        if seed is None:
            seed = port.random.seed
        # Seeded like the buffer by default.  Made here it starts its own stream from the
        # beginning (sampling.rng); unpickled in a worker it continues that process's one
        # stream of this buffer and seed.
        self._random = ProcessRandom(seed, port.owner_pid, buffer.name)
        self.name = buffer.name
        self.transform = transform
        self._spec = batch_spec(buffer, self._args)
        for name, (_, dtype) in self._spec.items():
            torch_dtype(dtype, name)
        self._buffer, self._pid = buffer, os.getpid()
        # How another process opens the buffer by name: what unpickling it calls.  Kept
        # as that recipe so that this module never imports the store (it sits above it).
        self._reopen = buffer.__reduce__()
        self._slot_pool: tuple[int, SlotPool | None] | None = None   # (pid, this worker's pool)

    @property
    def batch_size(self) -> int:
        return self._args["batch_size"]

    @property
    def length(self) -> int:
        return self._args["length"]

    @property
    def seed(self):
        return self._random.seed

    # -- pickling: the name and the arguments only --------------------------------
    def __getstate__(self):
        state = dict(self.__dict__)
        state["_buffer"] = state["_pid"] = state["_slot_pool"] = None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)

    # -- iteration ------------------------------------------------------------------
    def __iter__(self):
        buf = self._handle()
        worker = get_worker_info()
        todo = self._share(worker)
        rng = self._random.get()
        pool = self._pool() if worker is not None else None
        done = 0
        while todo is None or done < todo:
            if ended(buf):
                return   # the buffer ended: a clean end of the iteration
            slot = pool.take() if pool is not None else None
            try:
                if pool is not None and slot is not None:
                    self._sample(buf, pool.tensors(slot), rng)
                    item = pool.handoff(slot, self.transform)
                elif worker is not None:   # every region lent: fresh shared memory
                    out = {k: shared_empty(self._lead() + shape, dtype)
                           for k, (shape, dtype) in self._spec.items()}
                    item = self._shaped(self._sample(buf, out, rng))
                else:
                    batch = self._sample(buf, None, rng)
                    item = self._shaped({k: torch.from_numpy(v) for k, v in batch.items()})
            except BufferClosedError:
                if pool is not None and slot is not None:
                    pool.give_back(slot)
                return   # closed while this batch was drawn
            except BaseException:
                if pool is not None and slot is not None:
                    pool.give_back(slot)
                raise
            yield item
            done += 1

    def _sample(self, buf, out, rng):
        return buf.sample_sequences(**self._args, out=out, rng=rng)

    def _shaped(self, batch):
        return batch if self.transform is None else self.transform(batch)

    def _pool(self) -> SlotPool | None:
        """This worker's reusable regions (``shmbuf.feed.handoff``), made once per process."""
        from . import handoff as _handoff

        if self._slot_pool is None or self._slot_pool[0] != os.getpid():
            # Without memfd and /proc (not Linux): fresh shared memory per batch
            pool = _handoff.SlotPool(self._spec, self._lead()) if _handoff.available() else None
            self._slot_pool = (os.getpid(), pool)
        return self._slot_pool[1]

    def _lead(self) -> tuple:
        b, n = self.batch_size, self.length
        return (n, b) if self._args["time_major"] else (b, n)

    def _share(self, worker) -> int | None:
        """Batches this process yields per pass: ``batches`` split over the workers."""
        if self.batches is None:
            return None
        if worker is None:
            return self.batches
        share, extra = divmod(self.batches, worker.num_workers)
        return share + (worker.id < extra)

    def _handle(self):
        """The buffer in this process: the one given, or attached by name (once per process)."""
        if self._pid == os.getpid() and self._buffer is not None:
            return self._buffer
        attach, args = self._reopen
        try:
            buf = attach(*args)
        except SegmentNotFoundError:
            raise SegmentNotFoundError(
                f"dataset over buffer {self.name!r}: the buffer no longer exists (its owner "
                f"closed or unlinked it) when this process (pid {os.getpid()}) tried to attach; "
                "keep the buffer open while a DataLoader reads it") from None
        self._buffer, self._pid = buf, os.getpid()
        return buf

    def __repr__(self):
        return (f"<shmbuf.BatchDataset of {self.name!r} batch_size={self.batch_size} "
                f"length={self.length}>")
