"""The adapter every backend of compare.py implements, and the workloads they run.

``setup(wl)`` builds the backend for one workload (and fills it when the
workload samples), raising ``NotApplicable`` when the backend has no API for
it and ``Unavailable`` when a peer is not installed or cannot start.
``ingest(n_writers, mode, rows)`` returns the seconds that ``n_writers``
writers took to store ``rows`` rows each; ``sample()`` draws one batch;
``teardown()`` kills writer processes and frees (and unlinks) memory, and is
safe to call after a failed setup.
"""
from __future__ import annotations

import dataclasses

import numpy as np
from _store_workload import EPISODE, W1_SPEC, _w1_rows

from .pool import WriterPool

W2_SPEC = {"obs": ((64,), np.float32), "done": ((), np.bool_)}


class Unavailable(Exception):
    """The peer is not installed, or failed to start on this machine."""


class NotApplicable(Exception):
    """The backend has no API for this workload."""


@dataclasses.dataclass(frozen=True)
class Workload:
    key: str            # "W1", "W2" or "W3"
    capacity: int       # steps (W1, W2) or max_len per env (W3)
    batch: int          # sequences per sample (W3: envs)
    length: int         # steps per sequence (W3: n of get(n))
    filled: bool        # setup fills the buffer (sampling) or leaves it empty (ingest)
    max_writers: int = 4

    @property
    def spec(self) -> dict:
        return W1_SPEC if self.key == "W1" else W2_SPEC

    @property
    def steps(self) -> int:
        return self.batch * self.length


def columns(wl: Workload) -> dict:
    """``capacity`` rows of every column, episodes of EPISODE steps, in-process numpy."""
    cap, rows = wl.capacity, _w1_rows(16, seed=99) if wl.key == "W1" else {
        "obs": np.random.default_rng(1).standard_normal((16, 64)).astype(np.float32),
        "done": np.zeros(16, np.bool_)}
    out = {}
    for name, (shape, dtype) in wl.spec.items():
        col = np.empty((cap,) + shape, dtype)
        col.reshape((cap // 16, 16) + shape)[:] = rows[name]
        out[name] = col
    out["done"][:] = False
    out["done"][EPISODE - 1::EPISODE] = True
    return out


def time_major_rows(rng, n_valid: int, batch: int, length: int, first: int = 0,
                    size: int | None = None) -> np.ndarray:
    """(length, batch) row indices of windows starting uniformly in ``first + [0, n_valid)``."""
    starts = first + rng.integers(0, n_valid, batch)
    rows = starts[None, :] + np.arange(length)[:, None]
    return rows % size if size else rows


class Backend:
    key = label = ""
    note = {}            # workload key -> what to know about this backend's figures

    def __init__(self, ctx, tracker):
        self.ctx, self.tracker = ctx, tracker
        self.wl = None
        self._pool = None

    @property
    def pool_ctx(self):
        """The start method of this backend's writer processes."""
        return self.ctx

    def setup(self, wl: Workload) -> None:
        raise NotApplicable("no API for this workload")

    def ingest(self, n_writers: int, mode: str, rows: int) -> float:
        raise NotApplicable("no ingest path")

    def sample(self):
        raise NotImplementedError

    def stop_writers(self) -> None:
        """Stop and reap this backend's writer processes, if any."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()

    def teardown(self) -> None:
        try:
            self.stop_writers()
        finally:
            self._free()

    def _free(self) -> None:
        pass

    def _pooled(self, kind, handle, n_writers, mode, rows, consume=None) -> float:
        if self._pool is None:
            self._pool = WriterPool(self.pool_ctx, kind, handle, self.wl.max_writers)
        return self._pool.round(n_writers, mode, rows, consume)


