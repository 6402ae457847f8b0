"""shmbuf's W1 sample latency, idle and under 2 writer processes, for compare.py.

Single ``sample_sequences(50, 50)`` calls alternate with a numpy gather of
the same bytes (the control: it has no synchronisation at all, so whatever
the writers do to it is CPU and memory-bandwidth contention, not shmbuf).
The writers are spawned children that ``add`` W1 steps until told to stop.
"pinned" puts this process on one core and both writers on the other, as
bench_store does.  p50 and p99 are taken over all calls pooled; the
figures' min-max run over the per-block percentiles.
"""
from __future__ import annotations

import os
import time

import numpy as np
from _store_workload import _w1_rows, _write_add, touch_mapping

from .pool import collect, stop_children
from .report import failure, figure

N_WRITERS = 2
CASES = (("idle", None), (f"{N_WRITERS} writers", False),
         (f"{N_WRITERS} writers, pinned apart", True))


def _spin(buf, wid, stop, results, cpus):
    """Child (``buf`` arrived by pickle, so attached): add W1 steps until ``stop``."""
    w = None
    try:
        if cpus:
            os.sched_setaffinity(0, cpus)
        touch_mapping(buf)     # steady state: a long-running worker has mapped every page
        w, rows = buf.writer(), _w1_rows(8, seed=wid)
        results.put(("ready", wid))
        steps, t0 = 0, time.perf_counter()
        while not stop.is_set():
            _write_add(w, rows, 256)
            steps += 256
        results.put(("done", steps, time.perf_counter() - t0))
    except BaseException as exc:  # noqa: BLE001 - the parent reports it
        results.put(("error", wid, f"{type(exc).__name__}: {exc}"))
    finally:
        if w is not None:
            w.close()
        buf.close()


def _alternating(fns, calls: int) -> np.ndarray:
    """(len(fns), calls) single-call seconds, the functions called in turn."""
    out = np.empty((len(fns), calls))
    for i in range(calls):
        order = range(len(fns)) if i % 2 == 0 else reversed(range(len(fns)))
        for j in order:
            t0 = time.perf_counter()
            fns[j]()
            out[j, i] = time.perf_counter() - t0
    return out


def _blocks(cfg, sample, gather) -> np.ndarray:
    """(2, reps, calls) single-call seconds: shmbuf, then the numpy control."""
    sample(), gather()
    return np.stack([_alternating((sample, gather), cfg.lat_calls) for _ in range(cfg.reps)],
                    axis=1)


def _under_writes(cfg, ctx, buf, sample, gather, pin):
    if pin and (not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2):
        return None, None
    mine = os.sched_getaffinity(0)
    cpus = sorted(mine)[1:] if pin else None
    stop, results, procs = ctx.Event(), ctx.Queue(), []
    try:
        for wid in range(N_WRITERS):
            procs.append(ctx.Process(target=_spin, args=(buf, wid, stop, results, cpus),
                                     daemon=True))
            procs[-1].start()
        collect(results, procs, "ready", N_WRITERS)
        if pin:
            os.sched_setaffinity(0, sorted(mine)[:1])
        time.sleep(0.2)
        lat = _blocks(cfg, sample, gather)
        stop.set()
        done = collect(results, procs, "done", N_WRITERS)
    finally:
        stop.set()
        os.sched_setaffinity(0, mine)
        stop_children(procs)
        results.close()
        results.join_thread()
    return lat, sum(steps / secs for _, steps, secs in done)


class _Who:
    def __init__(self, key, label):
        self.key, self.label, self.note = key, label, {
            "W1": "single sample_sequences(50, 50) calls, pooled over all blocks"
            if key == "shmbuf" else "the same bytes gathered in-process: CPU contention only"}


SHMBUF, CONTROL = _Who("shmbuf", "shmbuf core"), _Who("numpy_gather", "numpy gather (control)")


def latency_rows(cfg, ctx, buf, gather_cls, wl) -> list[dict]:
    gather_b = gather_cls(ctx, None)
    rows = []
    try:
        gather_b.setup(wl)
        sample = lambda: buf.sample_sequences(wl.batch, wl.length)   # noqa: E731
        for config, pin in CASES:
            try:
                if pin is None:
                    lat, rate = _blocks(cfg, sample, gather_b.sample), None
                else:
                    lat, rate = _under_writes(cfg, ctx, buf, sample, gather_b.sample, pin)
            except Exception as exc:  # noqa: BLE001 - reported in the table
                status, reason = failure(exc)
                rows.append(figure("W1", "latency p50", config, SHMBUF, "s", status=status,
                                   reason=reason))
                continue
            if lat is None:
                continue
            for side, who in ((0, SHMBUF), (1, CONTROL)):
                for q in (50, 99):
                    fig = figure("W1", f"latency p{q}", config, who, "s",
                                 list(np.percentile(lat[side], q, axis=1)))
                    fig["stats"]["per_block_median"] = fig["stats"]["median"]
                    fig["stats"]["median"] = float(np.percentile(lat[side], q))  # pooled
                    fig["writer_rows_per_s"] = rate
                    rows.append(fig)
    finally:
        gather_b.teardown()
    return rows
