"""``ShmWriter``: a TorchRL ``Writer`` whose every process appends its own lock-free stream.

TorchRL's writers pick a row and call ``Storage.set``, under the replay
buffer's lock when it is shared.  ``ShmWriter`` instead hands each batch to
this process's shmbuf ``Writer``: the steps go to the end of the process's
own stream, in chunks that no other process writes, and are published chunk
by chunk, so a reader never sees a torn step and a writer that dies mid-batch
leaves only whole steps.  Eviction is FIFO per chunk, across streams.

Trajectory ends become shmbuf episode ends, so that slices never cross them:
a true ``end_key`` (default ``("next", "done")``) ends one at its step, and
a change of ``traj_key`` (default ``("collector", "traj_ids")``) between two
steps, or between this process's last batch and the next, cuts the stream.
"""
from __future__ import annotations

import contextlib
import functools
import os
from pathlib import Path

import numpy as np
import torch
from tensordict import is_tensor_collection, is_tensorclass
from tensordict.utils import unravel_key
from torch.utils._pytree import tree_flatten, tree_map
from torchrl.data.replay_buffers.writers import Writer

from . import _schema
from ._control import STREAMS
from ._storage import LazyShmStorage


def _as_batch(data):
    """A list of elements as one batch (TorchRL's ``extend`` takes both)."""
    if not isinstance(data, list):
        return data
    if is_tensor_collection(data[0]) or isinstance(data[0], torch.Tensor):
        return torch.stack(data)
    return tree_map(lambda *xs: torch.stack(xs), *data)


def _length(data) -> int:
    if is_tensor_collection(data) or isinstance(data, torch.Tensor):
        return data.shape[0] if data.ndim else 0
    leaves = tree_flatten(data)[0]
    return leaves[0].shape[0] if leaves and leaves[0].ndim else 0


def _to_numpy(name: str, value, dtype: str, shape, n: int) -> np.ndarray:
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"data[{name}]: expected a tensor, got {type(value).__name__}; "
                         "nothing was written")
    if tuple(value.shape) != (n, *shape):
        raise ValueError(f"data[{name}]: shape {tuple(value.shape)} where a batch of {n} "
                         f"steps needs {(n, *shape)}; nothing was written")
    stored = _schema.torch_dtype(dtype)
    if value.dtype != stored and not torch.can_cast(value.dtype, stored):
        raise ValueError(f"data[{name}]: dtype {_schema.dtype_name(value.dtype)} does not "
                         f"cast safely to the stored {dtype}; nothing was written")
    value = value.detach().to("cpu", stored)
    if stored in _schema._RAW:
        raw = _schema.numpy_dtype(stored)
        value = value.view(torch.uint16 if raw.itemsize == 2 else torch.uint8)
    return value.contiguous().numpy()


def columns_of(schema: dict, data, n: int) -> dict:
    """``{column: array (n, ...)}`` of a batch, in the storage's dtypes, after checking
    that the batch has exactly the storage's keys and shapes (ValueError otherwise)."""
    kind = schema["kind"]
    if kind == "lazy":
        raise TypeError("data: ShmWriter cannot write a lazy stack of differently shaped "
                        "parts; write them as separate keys")
    if kind == "tensor":
        values = [data]
    elif kind == "tree":
        values = tree_flatten(data)[0]
        if len(values) != len(schema["leaves"]):
            values = []
    else:
        inner = data._tensordict if is_tensorclass(data) else data
        values = [inner.get(tuple(key), None) for key, _, _, _ in schema["leaves"]]
        if len(list(inner.keys(True, True))) != len(values):
            values = []   # other keys too: said below (non-tensor ones are let through)
    if not values or any(v is None for v in values):
        why = _schema.drift(schema, data[0] if is_tensor_collection(data) else
                            tree_map(lambda x: x[0], data), exact=True)
        if why is not None:
            raise ValueError(f"data: {why}; a LazyShmStorage written by ShmWriter keeps the "
                             "keys, shapes and dtypes of its first batch. Nothing was written")
        inner = data._tensordict if is_tensorclass(data) else data
        values = [inner.get(tuple(key)) for key, _, _, _ in schema["leaves"]]
    return {col: _to_numpy(str(tuple(key)), value, dt, shape, n)
            for (key, col, dt, shape), value in zip(schema["leaves"], values)}


def _without_write_lock(buffer) -> None:
    """Keep ``buffer``'s process lock off its writes and samples, now and after ``share()``.

    A shared TorchRL replay buffer takes one ``multiprocessing.Lock`` around
    every ``extend`` and ``sample``.  ShmWriter's streams need none, and a
    writer killed while holding it would stop every other process for good.
    """
    buffer._write_lock = contextlib.nullcontext()
    buffer.__dict__["share"] = functools.partial(_share_without_lock, buffer)


def _share_without_lock(buffer, shared: bool = True):
    type(buffer).share(buffer, shared)
    buffer._write_lock = contextlib.nullcontext()
    return buffer


class ShmWriter(Writer):
    """A TorchRL ``Writer`` for many processes: each appends its own stream, with no lock.

    ``extend`` returns the storage indices (rows) it wrote; they work with
    ``rb[index]`` in every process until the steps are evicted.  Eviction is
    FIFO per chunk of steps, across every process's stream.  Use it with a
    ``LazyShmStorage``; every batch must carry the keys and shapes of the
    first one.

    Args:
        end_key: a key whose true value ends a trajectory at its step
            (default ``("next", "done")``); None: none.  Absent keys are ignored.
        traj_key: a key of trajectory ids; a change between two steps ends
            the trajectory there (default ``("collector", "traj_ids")``); None: none.

    Raises:
        TypeError: registered with a storage that is not a ``LazyShmStorage``.

    Example:
        >>> rb = ReplayBuffer(storage=LazyShmStorage(1_000_000), writer=ShmWriter())
        >>> index = rb.extend(batch)          # from any process, no lock
    """

    def __init__(self, *, end_key=("next", "done"), traj_key=("collector", "traj_ids")):
        super().__init__()
        self.end_key = None if end_key is None else unravel_key(end_key)
        self.traj_key = None if traj_key is None else unravel_key(traj_key)
        self._here = None   # (pid, data Buffer, its shmbuf Writer, last trajectory id)

    def register_storage(self, storage) -> None:
        if not isinstance(storage, LazyShmStorage):
            raise TypeError(f"storage: ShmWriter writes a shmbuf.compat.torchrl.LazyShmStorage, "
                            f"got {type(storage).__name__}")
        super().register_storage(storage)
        for buffer in storage._attached_entities:
            if getattr(buffer, "_writer", None) is self:
                _without_write_lock(buffer)

    def __getstate__(self):
        state = super().__getstate__()
        state["_here"] = None   # a shmbuf Writer belongs to one process
        return state

    # -- writing ------------------------------------------------------------------
    def add(self, data):
        """Append one element; returns its storage index."""
        if is_tensor_collection(data) or isinstance(data, torch.Tensor):
            batch = data.unsqueeze(0)
        else:
            batch = tree_map(lambda x: x.unsqueeze(0), data)
        index = self.extend(batch)
        return index[0]

    def extend(self, data) -> torch.Tensor:
        """Append a batch of elements (dim 0) to this process's stream; returns their indices.

        Raises:
            ValueError: the batch drifts from the first one written (keys,
                shapes, or a dtype that does not cast safely), or is empty;
                nothing is written.
            RuntimeError: the storage is written by TorchRL's writers.
        """
        storage: LazyShmStorage = self._storage
        storage._claim_mode(STREAMS)
        data = _as_batch(data)
        n = _length(data)
        if n == 0:
            raise ValueError("data: extend needs at least one element along dim 0; nothing "
                             "was written")
        if not storage.initialized:
            storage._init(data[0] if is_tensor_collection(data) or isinstance(
                data, torch.Tensor) else tree_map(lambda x: x[0], data))
        columns = columns_of(storage._schema_cache, data, n)   # checked: nothing written yet
        ends, traj = self._ends(data, n)
        columns[_schema.END_COLUMN] = ends
        # An empty() in another process may remove the segment under this write: then
        # the whole batch goes to the new one (what reached the old one goes with it).
        rows = storage._on_data(lambda buf: self._append(buf, columns, traj))
        storage._bump_mutation_revision()
        index = self._replicate_index(torch.from_numpy(rows))
        for entity in storage._attached_entities_iter():
            entity.mark_update(index)
        return index

    def _ends(self, data, n: int):
        """Per step, whether a trajectory ends there; and the trajectory ids (or None)."""
        ends = np.zeros(n, np.bool_)
        if not is_tensor_collection(data):
            return ends, None
        if self.end_key is not None:
            done = data.get(self.end_key, None)
            if isinstance(done, torch.Tensor):
                ends |= done.detach().reshape(n, -1).any(-1).cpu().numpy()
        traj = None
        if self.traj_key is not None:
            ids = data.get(self.traj_key, None)
            if isinstance(ids, torch.Tensor):
                traj = ids.detach().reshape(n, -1)[:, 0].cpu().numpy()
                ends[:-1] |= traj[:-1] != traj[1:]
        return ends, traj

    def _append(self, buf, columns: dict, traj) -> np.ndarray:
        """Write ``columns`` to this process's stream of data buffer ``buf``; the rows."""
        writer = self._writer(buf)
        if traj is not None:
            pid, _, _, last = self._here  # type: ignore[misc]  # set by _writer
            if last is not None and last != int(traj[0]):
                writer.end_episode()   # the trajectory of the last batch ended there
            self._here = (pid, buf, writer, int(traj[-1]))
        return writer.extend(**columns)

    def _writer(self, buf):
        """This process's shmbuf ``Writer`` on data buffer ``buf`` (the current one)."""
        here = self._here
        if here is None or here[0] != os.getpid() or here[1] is not buf:
            self._here = here = (os.getpid(), buf, buf.writer(), None)
        return here[2]

    # -- TorchRL's bookkeeping ------------------------------------------------------
    @property
    def _write_count(self) -> int:
        """Steps written by every process (the storage's count, kept across ``empty()``
        unless ``empty_write_count``)."""
        storage = self._storage
        return 0 if storage is None else storage._steps_written()

    @_write_count.setter
    def _write_count(self, value) -> None:
        """The count lives in the storage."""

    def _empty(self, empty_write_count: bool = True) -> None:
        """``ReplayBuffer.empty()``: this process's stream ends; the storage's ``_empty``
        renews the data, and every process's next write opens a stream on the new one."""
        self._here = None
        if empty_write_count and self._storage is not None:
            self._storage._restart_count()

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state_dict: dict) -> None:
        return None

    def dumps(self, path) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)

    def loads(self, path) -> None:
        return None

    def __repr__(self):
        return f"{type(self).__name__}(end_key={self.end_key}, traj_key={self.traj_key})"
