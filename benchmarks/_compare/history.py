"""W3 backends of compare.py: the seeds' deque HistoryBuffer and shmbuf's HistoryBuffer."""
from __future__ import annotations

import sys
import time
import types

from .base import Backend, NotApplicable, Unavailable


def _import_bench_history():
    """bench_history (the deque baseline), even while shmbuf's HistoryBuffer cannot import.

    bench_history imports the facade at the top; when that fails, it is
    imported against a stub so that the deque baseline still runs, and the
    reason is kept for the shmbuf row ("unavailable: ...").
    """
    try:
        import bench_history
        return bench_history, None
    except Exception as exc:  # noqa: BLE001 - the facade may still be in progress
        reason = f"{type(exc).__name__}: {exc}"
    name = "shmbuf.compat.history"
    saved = sys.modules.pop(name, None)
    stub = types.ModuleType(name)
    stub.HistoryBuffer = None
    sys.modules[name] = stub
    try:
        import bench_history
    finally:
        del sys.modules[name]
        if saved is not None:
            sys.modules[name] = saved
    return bench_history, reason


_bh, HISTORY_IMPORT_ERROR = _import_bench_history()
AB, MAX_LEN, N_ENVS, STEPS = _bh.AB, _bh.MAX_LEN, _bh.N_ENVS, _bh.STEPS
DequeHistory, infos = _bh.DequeHistory, _bh.infos


class _History(Backend):
    def _fill(self, buf):
        for info in infos(False):
            buf.append(info)
        self.info = next(infos(False))

    def ingest(self, n_writers, mode, rows):
        append, info = self.buf.append, self.info
        t0 = time.perf_counter()
        for _ in range(rows):
            append(info)
        return time.perf_counter() - t0

    def sample(self):
        return self.buf.get(self.wl.length)


class SeedDeque(_History):
    key, label = "seed_deque", "seed: deque HistoryBuffer (1 proc)"
    note = {"W3": "bench_history.DequeHistory: per-env deques of entry dicts, get() loops "
                  "over keys and envs"}

    def setup(self, wl):
        if wl.key != "W3":
            raise NotApplicable("history API only")
        self.wl, self.buf = wl, DequeHistory(N_ENVS, wl.capacity, AB, ("action",))
        self._fill(self.buf)

    def _free(self):
        self.buf = None


class ShmbufHistory(_History):
    key, label = "shmbuf_history", "shmbuf HistoryBuffer"
    note = {"W3": "shmbuf.compat.history.HistoryBuffer: append and get(8) in the trainer"}

    def setup(self, wl):
        if wl.key != "W3":
            raise NotApplicable("history API only")
        if HISTORY_IMPORT_ERROR is not None:
            raise Unavailable(f"HistoryBuffer not importable ({HISTORY_IMPORT_ERROR})")
        from shmbuf.compat.history import HistoryBuffer
        self.wl = wl
        self.buf = self.tracker.own(HistoryBuffer(N_ENVS, wl.capacity, AB, ("action",)))
        self._fill(self.buf)

    def _free(self):
        buf, self.buf = getattr(self, "buf", None), None
        if buf is not None:
            buf.close()


