"""One random stream per process, so that no two processes draw the same batches.

A buffer handle, a facade or a dataset holds a ``ProcessRandom`` instead of a
``np.random.Generator``.  The generator it hands out belongs to the process
that asks: a forked child (an ``mp.Pool`` worker, a DataLoader worker) sees a
new pid, the way writers notice a fork (``Writer._check``), and gets a stream
of its own instead of a copy of its parent's.

Without a seed every process draws from fresh OS entropy.  With ``seed=s``
a process's stream is ``np.random.default_rng(stream_seed(s, place))``:

=====================================  ==============================================
place                                  SeedSequence
=====================================  ==============================================
the buffer's owner (its creating pid)  ``SeedSequence(s)``, so ``create(seed=s)`` and
                                       ``np.random.default_rng(s)`` agree
DataLoader worker ``id`` (torch's      ``SeedSequence(s, spawn_key=(1, id, base))``,
``get_worker_info()``)                 ``base = info.seed - id``: the loader's seed
                                       for this round of workers
any other process, by pid              ``SeedSequence(s, spawn_key=(2, pid))``
=====================================  ==============================================

``base`` is drawn by the DataLoader from torch's generator each time it
starts workers (each epoch, unless ``persistent_workers``): seed torch
(``torch.manual_seed`` or ``DataLoader(generator=...)``) to repeat a
loader's batches, and workers of a later epoch never repeat an earlier one.
Two workers, or a worker and the owner, or two children with different
pids, never share a stream.  An object made with ``seed=s`` starts its
process's stream from the beginning, as ``np.random.default_rng`` would;
objects that arrive by pickle (a Pool unpickles its arguments for every
task) continue one stream per process, buffer and seed instead of
repeating it.
"""
from __future__ import annotations

import os
import sys

import numpy as np

OWNER, WORKER, CHILD = 0, 1, 2


def stream_seed(seed: int, place: tuple = ()) -> np.random.SeedSequence:
    """The ``SeedSequence`` of the process at ``place`` (see the module table).

    ``place`` is ``()`` for the owner, ``(WORKER, id, base)`` for a
    DataLoader worker, ``(CHILD, pid)`` for any other process.
    """
    return np.random.SeedSequence(seed, spawn_key=tuple(int(p) for p in place))


def current_place(owner_pid: int) -> tuple:
    """Where this process stands: the owner, a DataLoader worker, or another child."""
    info = _worker_info()
    if info is not None:
        return (WORKER, info.id, (info.seed - info.id) & 0xFFFFFFFFFFFFFFFF)
    if os.getpid() == owner_pid:
        return ()
    return (CHILD, os.getpid())


def _worker_info():
    # Only a process that runs a DataLoader worker has imported torch's data
    # package; never import torch here for the others.
    data = sys.modules.get("torch.utils.data")
    return data.get_worker_info() if data is not None else None


# Seeded streams of this process shared by the unpickled objects of one buffer
# and seed: a Pool task that unpickles a buffer again continues the stream of
# the task before it instead of repeating it.  Bounded, oldest dropped.
_STREAMS: dict = {}
_MAX_STREAMS = 256


class ProcessRandom:
    """A seed (or None) that gives each process its own ``np.random.Generator``.

    ``get()`` returns this process's generator, made on first use in the
    process (and again after a fork, or in a new round of DataLoader
    workers).  ``shared``: draw from the process's one stream of buffer
    ``name`` and this seed (what unpickled objects do).
    """

    def __init__(self, seed=None, owner_pid: int | None = None, name: str = "",
                 shared: bool = False):
        if isinstance(seed, bool) or seed is not None and not isinstance(seed, (int, np.integer)):
            raise TypeError(f"seed must be None or a non-negative int, got {seed!r}")
        if seed is not None and seed < 0:
            raise ValueError(f"seed must be None or a non-negative int, got {seed!r}")
        self.seed = None if seed is None else int(seed)
        self.owner_pid = os.getpid() if owner_pid is None else owner_pid
        self.name = name
        self.shared = shared
        self._key: tuple[int, int | None] | None = None
        self._gen: np.random.Generator = None  # type: ignore[assignment]  # made by the first get()

    def get(self) -> np.random.Generator:
        """This process's generator."""
        info = _worker_info()
        key = (os.getpid(), None if info is None else info.seed)
        if key != self._key:
            self._gen = self._make(key)
            self._key = key
        return self._gen

    def _make(self, key) -> np.random.Generator:
        if self.seed is None:
            return np.random.default_rng()
        if not self.shared:
            return np.random.default_rng(stream_seed(self.seed, current_place(self.owner_pid)))
        shared = (self.name, self.seed, key)
        gen = _STREAMS.get(shared)
        if gen is None:
            for stale in [k for k in _STREAMS if k[2][0] != key[0]]:
                del _STREAMS[stale]   # inherited through a fork: not this process's
            while len(_STREAMS) >= _MAX_STREAMS:
                del _STREAMS[next(iter(_STREAMS))]
            gen = _STREAMS[shared] = np.random.default_rng(
                stream_seed(self.seed, current_place(self.owner_pid)))
        return gen

    def __getstate__(self):
        return {"seed": self.seed, "owner_pid": self.owner_pid, "name": self.name}

    def __setstate__(self, state):
        ProcessRandom.__init__(self, state["seed"], state["owner_pid"], state["name"], shared=True)
