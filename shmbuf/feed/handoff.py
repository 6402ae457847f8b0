"""Batches handed from a DataLoader worker to the trainer through reused shared memory.

A worker that gathered each batch into fresh shared memory paid for its page
faults (about 4x the gather itself for W1 batches), so the DataLoader ran far
below direct sampling.  Instead each worker keeps ``SLOTS`` batch-sized
regions in one memfd, after a header of one state word per region (0 free,
1 lent).  The worker gathers into a free region and yields a ``Handoff``;
unpickled in the trainer it becomes a plain dict of tensors over that
region, and when the last tensor (or numpy view) over it is freed the
region's state goes back to 0.  With every region lent (the trainer keeps
many batches), the worker falls back to fresh shared memory, so nothing ever
waits and no batch is overwritten while the trainer holds it.

How the memory travels: a ``Handoff`` pickles to a few ints, the worker's
pid and start time, the memfd's descriptor number and inode, and the slot.
The first handoff of a pool also carries the descriptor itself, through
multiprocessing's resource sharer (one authenticated socket connection);
the trainer maps the memfd and keeps the mapping, keyed by (pid, inode),
for the worker's lifetime.  A process that missed that first handoff opens
the memfd through ``/proc/PID/fd/N`` instead (the kernel's ptrace-read
check: the same user, and under Yama a parent may open its children's) and
checks the inode.  Pickling torch shared storages instead would send every
batch's descriptors through the resource sharer, an authenticated socket
connection per storage: the trainer unpickles a W1 batch so sent in 1.4-1.9
ms, a handoff in 0.012-0.020 ms (``benchmarks/bench_trainer.py`` row 2c),
and the DataLoader ran near 60% of direct sampling that way.  A memfd has
no name, so nothing is left in /dev/shm whatever happens to the worker.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import weakref
from multiprocessing import reduction

import numpy as np
import torch

from ..posix.procs import is_alive, my_start_time

SLOTS = 4
_ALIGN = 64
_HEADER = 64  # the state words, one int64 per slot


def available() -> bool:
    """True where a worker can share a pool this way (Linux: memfd and /proc)."""
    return hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd")


class SlotPool:
    """A worker's ``SLOTS`` reusable batch regions, for ``spec`` with leading dims ``lead``."""

    def __init__(self, spec: dict, lead: tuple):
        self.layout = []
        at = 0
        for name, (shape, dtype) in spec.items():
            dtype = np.dtype(dtype)
            nbytes = int(np.prod(lead + shape, dtype=np.int64)) * dtype.itemsize
            self.layout.append((name, lead + shape, dtype.str, at, nbytes))
            at += -(-nbytes // _ALIGN) * _ALIGN
        self.slot_bytes = max(at, _ALIGN)
        self.size = _HEADER + SLOTS * self.slot_bytes
        self.fd = os.memfd_create("shmbuf-handoff", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, self.size)
            self.mm = mmap.mmap(self.fd, self.size)
        except BaseException:
            os.close(self.fd)
            raise
        # What a Handoff sends: enough to open, check and map the memfd in another process.
        self.address = (os.getpid(), my_start_time(), self.fd, os.fstat(self.fd).st_ino,
                        self.size)
        self._state = np.frombuffer(self.mm, np.int64, SLOTS)
        self._views = [_tensors(self.mm, s, self.slot_bytes, self.layout) for s in range(SLOTS)]
        self.descriptor_sent = False

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


def _tensors(mm, slot: int, slot_bytes: int, layout: list, region=None) -> dict:
    """Tensors over region ``slot`` of mapping ``mm``.

    Over ``region`` (a buffer of ``mm``) instead, if given.
    """
    if region is None:
        start = _HEADER + slot * slot_bytes
        raw = np.frombuffer(mm, np.uint8, slot_bytes, start)
    else:
        raw = np.frombuffer(region, np.uint8)
    return {name: torch.from_numpy(raw[off:off + nbytes].view(np.dtype(dt)).reshape(shape))
            for name, shape, dt, off, nbytes in layout}


class Handoff:
    """A filled region on its way to the trainer; pickles to what ``receive`` needs."""

    def __init__(self, pool: SlotPool, slot: int, transform=None):
        self.pool, self.slot, self.transform = pool, slot, transform

    def __reduce__(self):
        p = self.pool
        fd = None
        if not p.descriptor_sent:   # the pool's first batch: send the memfd itself, once
            p.descriptor_sent = True
            fd = reduction.DupFd(p.fd)
        return receive, (p.address, self.slot, p.slot_bytes, p.layout, self.transform, fd)


# The pools this process has mapped: (pid, inode) -> (start time, mapping).  An entry
# goes when its worker has died and a new pool is mapped; its batches keep the mapping.
_mapped: dict[tuple[int, int], tuple[int, mmap.mmap]] = {}


def _mapping(pid: int, start: int, fd: int, inode: int, size: int, sent=None) -> mmap.mmap:
    """The worker's pool, mapped once per process: from ``sent`` (the descriptor, sent
    with the pool's first batch) or else through /proc."""
    opened = sent.detach() if sent is not None else None   # always taken, even if mapped
    try:
        got = _mapped.get((pid, inode))
        if got is not None:
            return got[1]
        for key, (began, _) in list(_mapped.items()):
            if not is_alive(key[0], began):
                del _mapped[key]
        where = f"/proc/{pid}/fd/{fd}"
        if opened is None:
            try:
                opened = os.open(where, os.O_RDWR | os.O_CLOEXEC)
            except OSError as exc:
                raise RuntimeError(
                    f"a DataLoader batch of shmbuf lives in worker pid {pid}'s memory, which "
                    f"this process (pid {os.getpid()}) cannot open at {where} "
                    f"({exc.strerror}): the worker has exited or closed it, or this process may "
                    "not read its descriptors (another user, or a Yama ptrace_scope above 1). "
                    "Iterate the DataLoader in the process that started its workers") from None
        st = os.fstat(opened)
        if st.st_ino != inode or st.st_size < size or not is_alive(pid, start):
            raise RuntimeError(f"a DataLoader batch of shmbuf names worker pid {pid}'s memory "
                               f"at {where}, but that worker has exited")
        mm = mmap.mmap(opened, size)
    finally:
        if opened is not None:
            os.close(opened)
    _mapped[(pid, inode)] = (start, mm)
    return mm


def receive(address: tuple, slot: int, slot_bytes: int, layout: list, transform=None,
            sent=None):
    """In the trainer: the batch as tensors over the region; freeing them frees the region."""
    pid, start, fd, inode, size = address
    mm = _mapping(pid, start, fd, inode, size, sent)
    region = (ctypes.c_uint8 * slot_bytes).from_buffer(mm, _HEADER + slot * slot_bytes)
    # The finalizer holds the mapping (the region does too) and runs when the last
    # array or tensor over the region is gone.
    weakref.finalize(region, _release, mm, slot)
    batch = _tensors(mm, slot, slot_bytes, layout, region)
    return batch if transform is None else transform(batch)


def _release(mm: mmap.mmap, slot: int) -> None:
    np.frombuffer(mm, np.int64, SLOTS)[slot] = 0
