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

Data-parallel ranks.  Every rank of a job seeds torch alike (Lightning's
``seed_everything``), so its DataLoader workers would get the same ``base``,
and a rank that made its own buffer with ``seed=s`` would be its owner like
every other rank: each rank would draw the others' batches.  So a process
of rank ``r >= 1`` prefixes its place with ``(RANK, r)``:

=====================================  ==============================================
place, in rank ``r >= 1``              SeedSequence
=====================================  ==============================================
the buffer's owner                     ``SeedSequence(s, spawn_key=(3, r))``
DataLoader worker ``id``               ``SeedSequence(s, spawn_key=(3, r, 1, id, base))``
any other process, by pid              ``SeedSequence(s, spawn_key=(3, r, 2, pid))``
=====================================  ==============================================

Rank 0, and a process with no rank, keep the first table, so a job of one
process draws what it drew before.  A process's rank is
``torch.distributed.get_rank()`` when a process group is initialized in it
(looked up only if torch is imported already: this module never imports
it); else, in a process that received the object by pickle (a spawned
DataLoader worker), the rank of the process that pickled it; else the
``RANK`` environment variable (torchrun, Lightning and Accelerate set it
before the process starts; each object reads it once per process); else
none.  Everything in the tables is a function of the seeds, the rank and
the worker ids, so a rerun of a job with the same seeds repeats each rank's
batches (but for the pid-keyed places, as before).  ``prefetch``
and ``sample_sequences`` without ``rng=`` draw from the process's stream,
so they follow the same rule.
"""
from __future__ import annotations

import os
import sys

import numpy as np

from ..posix.procs import this_pid

OWNER, WORKER, CHILD, RANK = 0, 1, 2, 3


def stream_seed(seed: int, place: tuple = ()) -> np.random.SeedSequence:
    """The ``SeedSequence`` of the process at ``place`` (see the module tables).

    ``place`` is ``()`` for the owner, ``(WORKER, id, base)`` for a
    DataLoader worker, ``(CHILD, pid)`` for any other process; in a rank
    ``r >= 1`` it begins with ``(RANK, r)``.
    """
    return np.random.SeedSequence(seed, spawn_key=tuple(int(p) for p in place))


def current_place(owner_pid: int, rank: int | None = None) -> tuple:
    """Where this process stands: the owner, a DataLoader worker, or another child, in
    data-parallel rank ``rank`` (``current_rank``)."""
    prefix = (RANK, rank) if rank else ()
    info = _worker_info()
    if info is not None:
        return prefix + (WORKER, info.id, (info.seed - info.id) & 0xFFFFFFFFFFFFFFFF)
    if os.getpid() == owner_pid:
        return prefix
    return prefix + (CHILD, os.getpid())


_READ = object()   # current_rank(env=...): read RANK now


def current_rank(pickled: int | None = None, env=_READ) -> int | None:
    """This process's data-parallel rank, or None (the module docstring's rule).

    ``pickled``: the rank of the process that pickled the asking object, if any.
    ``env``: ``env_rank()`` as the caller read it already (read now by default).

    Raises:
        ValueError: no process group here and ``RANK`` is not an int >= 0.
    """
    dist = sys.modules.get("torch.distributed")   # never imported here (see the docstring)
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    if pickled is not None:
        return pickled
    return env_rank() if env is _READ else env


def env_rank() -> int | None:
    """The ``RANK`` environment variable as an int, or None if it is unset.

    Raises:
        ValueError: ``RANK`` is set but not an int >= 0.
    """
    env = os.environ.get("RANK", "").strip()
    if not env:
        return None
    if not env.isdigit():
        raise ValueError(f"the environment variable RANK is {env!r}; shmbuf mixes the "
                         "data-parallel rank into each process's random stream and expects "
                         "an int >= 0 (as torchrun sets it), or RANK unset")
    return int(env)


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
    process (and again after a fork, in a new round of DataLoader workers, or
    when the process's rank changes).  ``shared``: draw from the process's one
    stream of buffer ``name`` and this seed (what unpickled objects do).
    ``rank``: the rank of the process that pickled this object (``current_rank``).
    """

    def __init__(self, seed=None, owner_pid: int | None = None, name: str = "",
                 shared: bool = False, rank: int | None = None):
        if isinstance(seed, bool) or seed is not None and not isinstance(seed, (int, np.integer)):
            raise TypeError(f"seed must be None or a non-negative int, got {seed!r}")
        if seed is not None and seed < 0:
            raise ValueError(f"seed must be None or a non-negative int, got {seed!r}")
        self.seed = None if seed is None else int(seed)
        self.owner_pid = os.getpid() if owner_pid is None else owner_pid
        self.name = name
        self.shared = shared
        self._pickled_rank = rank
        self._env: tuple[int, int | None] = (-1, None)   # (pid, RANK) read in that process
        self._key: tuple[int, int | None, int | None] | None = None
        self._gen: np.random.Generator = None  # type: ignore[assignment]  # made by the first get()

    def get(self) -> np.random.Generator:
        """This process's generator."""
        pid = this_pid()
        key = self._key
        modules = sys.modules
        if (key is not None and key[0] == pid and key[1] is None
                and "torch.utils.data" not in modules and "torch.distributed" not in modules):
            return self._gen   # the usual case: the same plain process, torch not in it
        info = _worker_info()
        key = (pid, None if info is None else info.seed, self._rank(pid))
        if key != self._key:
            self._gen = self._make(key)
            self._key = key
        return self._gen

    def _rank(self, pid: int | None = None) -> int | None:
        """This process's rank, for a seeded stream only (an unseeded one ignores it).
        ``RANK`` is read once per process (launchers set it before the process starts);
        a process group is looked for every time."""
        if self.seed is None:
            return None
        pid = os.getpid() if pid is None else pid
        if self._env[0] != pid:
            self._env = (pid, env_rank())
        return current_rank(self._pickled_rank, self._env[1])

    def _make(self, key) -> np.random.Generator:
        if self.seed is None:
            return np.random.default_rng()
        place = current_place(self.owner_pid, key[2])
        if not self.shared:
            return np.random.default_rng(stream_seed(self.seed, place))
        shared = (self.name, self.seed, key)
        gen = _STREAMS.get(shared)
        if gen is None:
            for stale in [k for k in _STREAMS if k[2][0] != key[0]]:
                del _STREAMS[stale]   # inherited through a fork: not this process's
            while len(_STREAMS) >= _MAX_STREAMS:
                del _STREAMS[next(iter(_STREAMS))]
            gen = _STREAMS[shared] = np.random.default_rng(stream_seed(self.seed, place))
        return gen

    def __getstate__(self):
        return {"seed": self.seed, "owner_pid": self.owner_pid, "name": self.name,
                "rank": self._rank()}

    def __setstate__(self, state):
        ProcessRandom.__init__(self, state["seed"], state["owner_pid"], state["name"], shared=True,
                               rank=state.get("rank"))
