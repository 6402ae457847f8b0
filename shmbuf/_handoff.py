"""Batches handed from a DataLoader worker to the trainer through reused shared memory.

A worker that gathered each batch into fresh shared memory paid for its page
faults (about 4x the gather itself for W1 batches), so the DataLoader ran far
below direct sampling.  Instead each worker keeps ``SLOTS`` batch-sized
regions of one torch shared storage and a shared state word per region
(0 free, 1 lent).  The worker gathers into a free region and yields a
``Handoff``; unpickled in the trainer it becomes a plain dict of tensors
over that region, and when the last tensor (or numpy view) over it is freed
the region's state goes back to 0.  With every region lent (the trainer
keeps many batches), the worker falls back to fresh shared memory, so
nothing ever waits and no batch is overwritten while the trainer holds it.

The storage and the state travel as torch shared storages (file descriptors,
mapped once per process while in use: torch caches them).
"""
from __future__ import annotations

import ctypes
import weakref

import numpy as np
import torch

SLOTS = 4
_ALIGN = 64


class SlotPool:
    """A worker's ``SLOTS`` reusable batch regions, for ``spec`` with leading dims ``lead``."""

    def __init__(self, spec: dict, lead: tuple, torch_dtype):
        self.layout = []
        at = 0
        for name, (shape, dtype) in spec.items():
            dtype = np.dtype(dtype)
            nbytes = int(np.prod(lead + shape, dtype=np.int64)) * dtype.itemsize
            self.layout.append((name, lead + shape, dtype.str, at, nbytes))
            at += -(-nbytes // _ALIGN) * _ALIGN
        self.slot_bytes = max(at, _ALIGN)
        self.storage = torch.UntypedStorage._new_shared(SLOTS * self.slot_bytes)
        self.state = torch.zeros(SLOTS, dtype=torch.int64).share_memory_()
        self._state = self.state.numpy()
        self._views = [{name: torch.empty(0, dtype=torch_dtype(np.dtype(dt))).set_(  # type: ignore[call-overload]  # stride is optional
                            self.storage, (s * self.slot_bytes + off) // np.dtype(dt).itemsize,
                            shape)
                        for name, shape, dt, off, _ in self.layout} for s in range(SLOTS)]

    def take(self) -> int | None:
        """A free region, now lent; None if every region is lent."""
        free = np.flatnonzero(self._state == 0)
        if not len(free):
            return None
        slot = int(free[0])
        self._state[slot] = 1
        return slot

    def tensors(self, slot: int) -> dict:
        """The worker's tensors over region ``slot`` (for ``out=``)."""
        return self._views[slot]

    def handoff(self, slot: int, transform=None) -> "Handoff":
        return Handoff(self, slot, transform)

    def give_back(self, slot: int) -> None:
        self._state[slot] = 0


class Handoff:
    """A filled region on its way to the trainer; pickles to what ``receive`` needs."""

    def __init__(self, pool: SlotPool, slot: int, transform=None):
        self.pool, self.slot, self.transform = pool, slot, transform

    def __reduce__(self):
        p = self.pool
        return receive, (p.storage, p.state, self.slot, p.slot_bytes, p.layout, self.transform)


def receive(storage, state, slot: int, slot_bytes: int, layout: list, transform=None):
    """In the trainer: the batch as tensors over the region; freeing them frees the region."""
    region = (ctypes.c_uint8 * slot_bytes).from_address(storage.data_ptr() + slot * slot_bytes)
    # The finalizer holds the storage (so the mapping outlives the views) and runs when
    # the last array or tensor over the region is gone.
    weakref.finalize(region, _release, state, slot, storage)
    raw = np.frombuffer(region, np.uint8)  # type: ignore[call-overload]  # a ctypes array is a buffer
    batch = {name: torch.from_numpy(raw[off:off + nbytes].view(np.dtype(dt)).reshape(shape))
             for name, shape, dt, off, nbytes in layout}
    return batch if transform is None else transform(batch)


def _release(state, slot: int, storage) -> None:
    state[slot] = 0
