"""Memory on demand: what reserving /dev/shm as chunks are claimed costs writers and readers.

    python benchmarks/bench_memory.py [--quick] [--json PATH]

Prints one table (``_store_report``) and writes benchmarks/results/bench_memory.json.
Workload W1 (``_store_workload``); 2 spawned writer processes that stay up for the
whole run and take one task per round; rounds of shmbuf and of its baseline alternate,
and each ratio is the median of the per-round ratios.  Targets are reported, never
asserted.  Every buffer is closed (its owner unlinks it) in ``finally``.

Rows:
  m1-m3  first pass of a fresh buffer (pages reserved as chunks are claimed), 2 writers:
         add / extend(500) / add_batch(16), rows/s, against the ceiling: 2 processes that
         attach a prefaulted segment, populate their own rows with one
         madvise(MADV_POPULATE_WRITE) per column and copy the same rows with the same
         granularity (/work/shared/bench/l0_attached.py's approach), target >= 0.95x.
  m1f-m3f the same rows against a fresh ceiling: the same copies into a sparse segment,
         whose populate allocates the pages (as shmbuf's claims must).
  m1p-m3p the same into a buffer made with prefault=True (reserved ahead, as the ceiling's).
  m4, m5 after the ring has wrapped: extend / add per writer, against an in-process
         np.copyto of the same rows into a private array in the same child; targets
         >= 0.8x and >= 0.5x.
  m6     create(..., overcommit=True) of a 1 TB W1 buffer: seconds, and bytes reserved.
  m7     Dreamer ReplayBuffer(size = 80% of MemAvailable): construct, 1,000 add, one
         sample(), against the same calls on an np.empty ring (bench_dreamer's
         UpstreamRing); target <= 1.5x.
  m8     a trainer attached to a full buffer: 300 sample_sequences(50, 50) after populating
         every page with one madvise per column, against the same batches faulting pages in
         on first touch (fresh process each), populate time included.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

import numpy as np
from _store_report import Row, print_table
from _store_workload import (
    EPISODE,
    N_WRITERS,
    SHM_DIR,
    W1_CAPACITY,
    W1_SPEC,
    WAIT_S,
    Tracker,
    _episode_rows,
    _w1_rows,
    _write_add,
    _write_episodes,
    _write_rows,
    children,
    fill,
)

import shmbuf

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "bench_memory.json"
MADV_POPULATE_READ, MADV_POPULATE_WRITE = 22, 23
PRIVATE_ROWS = 10_000  # the steady-state baseline's private ring: 123 MB, beyond any cache
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


@dataclasses.dataclass(frozen=True)
class Config:
    reps: int          # rounds per figure (each side)
    first_rows: int    # rows per writer in a first pass (multiple of 16 and of 500)
    steady_rows: int   # rows per writer after the wrap (multiple of 500)
    samples: int       # sample_sequences(50, 50) calls of m8


QUICK = Config(reps=3, first_rows=20_000, steady_rows=10_000, samples=100)
FULL = Config(reps=7, first_rows=44_000, steady_rows=30_000, samples=300)


def _populate(a: np.ndarray, advice: int = MADV_POPULATE_WRITE) -> None:
    start = a.ctypes.data - a.ctypes.data % 4096
    if _libc.madvise(start, a.ctypes.data + a.nbytes - start, advice):
        raise OSError(ctypes.get_errno(), "madvise")


# -- the writer children: one task per round --------------------------------------------------
def _copy_rows(arrays, rows: dict, lo: int, n: int, step: int) -> None:
    """The ceiling: copy ``n`` rows from row ``lo``, ``step`` rows per statement per column."""
    obs, act, rew, done = (arrays[k] for k in ("obs", "action", "reward", "done"))
    src = {k: rows[k] for k in ("obs", "action", "reward", "done")}
    period = len(src["done"])
    if step == 1:
        a = src["action"][0]
        for i in range(n):
            j = lo + i
            obs[j] = src["obs"][i & 7]; act[j] = a; rew[j] = i & 255; done[j] = False  # noqa: E702
        return
    for i in range(0, n, step):
        j, k = lo + i, i % period
        obs[j:j + step] = src["obs"][k:k + step]; act[j:j + step] = src["action"][k:k + step]  # noqa: E702
        rew[j:j + step] = src["reward"][k:k + step]; done[j:j + step] = src["done"][k:k + step]  # noqa: E702


def _private_copy(dst, rows: dict, n: int, step: int) -> None:
    """The steady-state baseline: np.copyto of the same rows into private arrays."""
    src = [rows[k] for k in ("obs", "action", "reward", "done")]
    period = len(rows["done"])
    cap = len(dst[0])
    for i in range(0, n, step):
        j, k = i % (cap - step + 1), i % period
        for d, s in zip(dst, src):
            np.copyto(d[j:j + step], s[k:k + step] if step > 1 else s[k])


def _writer_child(wid, tasks, barrier, results):
    rows = {"add": _w1_rows(8, seed=wid), "batch16": _w1_rows(16, seed=wid),
            "ep500": _episode_rows(seed=wid)}
    step = {"add": 1, "batch16": 16, "ep500": EPISODE}
    private, kept = None, None   # kept: (buf, writer) of a steady-state buffer, across rounds
    while True:
        task = tasks.get(timeout=10 * WAIT_S)
        if kept is not None and (task is None or task[0] != kept[0].name):
            kept[1].close()
            kept[0].close()
            kept = None
        if task is None:
            return
        name, side, mode, n = task
        if side == "warm":   # a long-running writer: its page tables map the whole ring
            kept = shmbuf.attach(name), None
            for col in kept[0].arrays.values():
                _populate(col)
            kept = kept[0], kept[0].writer()
            results.put((wid, 0.0))
            continue
        buf = kept[0] if kept is not None else shmbuf.attach(name)
        try:
            w = None if side in ("ceiling", "private") else \
                kept[1] if kept is not None else buf.writer()
            barrier.wait(WAIT_S)
            t0 = time.perf_counter()
            if side == "ceiling":
                arrays, lo = buf.arrays, wid * (W1_CAPACITY // N_WRITERS)
                for col in arrays.values():
                    _populate(col[lo:lo + n])
                _copy_rows(arrays, rows[mode], lo, n, step[mode])
            elif side == "private":
                if private is None:   # allocated and touched once, outside the clock
                    private = [np.ones((PRIVATE_ROWS,) + s, d) for s, d in W1_SPEC.values()]
                _private_copy(private, rows[mode], n, step[mode])
            elif mode == "add":
                _write_add(w, rows["add"], n)
            elif mode == "ep500":
                _write_episodes(w, rows["ep500"], n)
            else:
                _write_rows(w, rows["batch16"], n, batched=True)
            results.put((wid, time.perf_counter() - t0))
        finally:
            if kept is None:
                if w is not None:
                    w.close()
                buf.close()


class Writers:
    """The two persistent writer processes and the round protocol."""

    def __init__(self, ctx, stack):
        self.tasks = [ctx.Queue() for _ in range(N_WRITERS)]
        self.barrier, self.results = ctx.Barrier(N_WRITERS), ctx.Queue()
        self.procs = stack.enter_context(children(
            ctx, _writer_child, [(i, self.tasks[i], self.barrier, self.results)
                                 for i in range(N_WRITERS)], barrier=self.barrier))
        stack.callback(lambda: [q.put(None) for q in self.tasks])

    def round(self, name: str, side: str, mode: str, n: int) -> list[float]:
        """Seconds each writer took for ``n`` rows (slowest first)."""
        for q in self.tasks:
            q.put((name, side, mode, n))
        secs = [self.results.get(timeout=10 * WAIT_S)[1] for _ in self.procs]
        return sorted(secs, reverse=True)


# -- measurements ---------------------------------------------------------------------------------
MODES = (("add", "add"), ("ep500", "extend(500)"), ("batch16", "add_batch(16)"))


def bench_first_pass(cfg, tracker, writers) -> list[Row]:
    rows = []
    n = cfg.first_rows
    # side: (buffer made with prefault=, what the children do)
    sides = {"demand": (False, "shm"), "prefault": (True, "shm"),
             "ceiling": (True, "ceiling"), "fresh": (False, "ceiling")}
    for key, (mode, label) in zip(("m1", "m2", "m3"), MODES):
        got: dict = {side: [] for side in sides}
        for rep in range(cfg.reps):
            for side in (list(sides) if rep % 2 else list(sides)[::-1]):
                prefault, task = sides[side]
                with tracker.buffer(W1_SPEC, W1_CAPACITY, prefault=prefault) as buf:
                    secs = writers.round(buf.name, task, mode, n)
                    got[side].append(N_WRITERS * n / secs[0])
        rows.append(Row(key, f"{key} first pass, 2 writers, {label}: rows/s", "/s",
                        got["demand"], got["ceiling"],
                        "2 procs: populate own rows (1 madvise/column) + copy into a "
                        "prefaulted, attached segment", ("ratio", ">=", 0.95)))
        rows.append(Row(key + "f", f"{key}f the same, vs a fresh ceiling", "/s", got["demand"],
                        got["fresh"], "as the ceiling, but the segment is sparse: the "
                        "populate allocates the pages, as shmbuf's claims do",
                        ("ratio", ">=", 0.95)))
        rows.append(Row(key + "p", f"{key}p the same, prefault=True", "/s", got["prefault"],
                        got["ceiling"], f"as {key}", ("ratio", ">=", 0.95)))
    return rows


def bench_steady(cfg, tracker, writers) -> list[Row]:
    rows, n = [], cfg.steady_rows
    for key, mode, label, target in (("m4", "ep500", "extend(500)", 0.8),
                                      ("m5", "add", "add", 0.5)):
        shm, base = [], []
        with tracker.buffer(W1_SPEC, W1_CAPACITY, prefault=False) as buf:
            fill(buf, _w1_rows(16, seed=99), int(W1_CAPACITY * 1.1))   # wrapped
            writers.round(buf.name, "warm", mode, n)
            for rep in range(cfg.reps):
                pair = (("shm", shm), ("private", base))
                for side, out in (pair if rep % 2 == 0 else pair[::-1]):
                    out.append(n / writers.round(buf.name, side, mode, n)[0])
        rows.append(Row(key, f"{key} after the wrap, per writer, {label}: rows/s", "/s", shm,
                        base, "np.copyto of the same rows into a private array, same child",
                        ("ratio", ">=", target)))
    return rows


def bench_create_huge(cfg, tracker) -> list[Row]:
    row = sum(int(np.prod(s)) * np.dtype(d).itemsize for s, d in W1_SPEC.values()) + 8
    capacity = (10 ** 12) // row
    secs, reserved = [], []
    for _ in range(cfg.reps):
        t0 = time.perf_counter()
        with tracker.buffer(W1_SPEC, capacity, overcommit=True, prefault=False) as buf:
            secs.append(time.perf_counter() - t0)
            reserved.append(buf.stats().reserved_bytes)
    return [Row("m6", f"m6 create(overcommit=True), 1 TB W1 ({capacity} steps)", "s", secs, [],
                "-", ("shmbuf", "<=", 0.05), extra={"reserved_bytes": reserved}),
            Row("m6r", "m6r /dev/shm reserved by that create", "B", reserved, [], "-",
                ("shmbuf", "<=", 1e6))]


def _dreamer_round(size: int, upstream: bool) -> float:
    from bench_dreamer import UpstreamRing

    from shmbuf.compat.dreamer import ReplayBuffer

    rng = np.random.default_rng(0)
    frames = rng.integers(0, 256, (16, 3, 64, 64), dtype=np.uint8)
    action = rng.standard_normal(6).astype(np.float32)
    t0 = time.perf_counter()
    rb = UpstreamRing(size, (3, 64, 64), 6, 50, 50) if upstream else \
        ReplayBuffer(size, (3, 64, 64), 6)
    try:
        for i in range(1000):
            rb.add({"image": frames[i & 15]}, action, float(i), float(i % 500 == 499))
        rb.sample()
        return time.perf_counter() - t0
    finally:
        if not upstream:
            rb.close()


def bench_dreamer(cfg) -> list[Row]:
    with open("/proc/meminfo") as f:
        avail = next(int(x.split()[1]) * 1024 for x in f if x.startswith("MemAvailable"))
    size = int(0.8 * avail) // (3 * 64 * 64 + 6 * 4 + 4 + 4)
    shm, base = [], []
    for rep in range(cfg.reps):
        for upstream in ((True, False) if rep % 2 else (False, True)):
            (base if upstream else shm).append(_dreamer_round(size, upstream))
    return [Row("m7", f"m7 Dreamer ReplayBuffer(size={size}): new + 1k add + sample", "s", shm,
                base, "the same calls on an np.empty ring (bench_dreamer.UpstreamRing)",
                ("ratio", "<=", 1.5))]


def _reader_child(name, populate, calls, results):
    buf = shmbuf.attach(name, seed=1)
    try:
        t0 = time.perf_counter()
        if populate:
            for col in buf.arrays.values():
                _populate(col, MADV_POPULATE_READ)
        for _ in range(calls):
            buf.sample_sequences(50, 50)
        results.put(time.perf_counter() - t0)
    finally:
        buf.close()


def bench_readers(cfg, tracker, ctx) -> list[Row]:
    shm, base = [], []
    with tracker.buffer(W1_SPEC, W1_CAPACITY, prefault=True) as buf:
        fill(buf, _w1_rows(16, seed=7), int(W1_CAPACITY * 1.1))
        for rep in range(cfg.reps):
            for populate in ((True, False) if rep % 2 else (False, True)):
                results = ctx.Queue()
                with children(ctx, _reader_child, [(buf.name, populate, cfg.samples, results)]):
                    (shm if populate else base).append(results.get(timeout=10 * WAIT_S))
    return [Row("m8", f"m8 trainer's first {cfg.samples} sample_sequences(50, 50), populated", "s",
                shm, base, "the same batches, pages faulted in on first touch",
                ("ratio", "<=", 1.0))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds and rows")
    ap.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = ap.parse_args(argv)
    cfg = QUICK if args.quick else FULL
    ctx, tracker, started = mp.get_context("spawn"), Tracker(), time.perf_counter()
    load0 = os.getloadavg()[0]
    rows: list[Row] = []
    try:
        with contextlib.ExitStack() as stack:
            writers = Writers(ctx, stack)
            rows += bench_first_pass(cfg, tracker, writers)
            rows += bench_steady(cfg, tracker, writers)
        rows += bench_create_huge(cfg, tracker)
        rows += bench_dreamer(cfg)
        rows += bench_readers(cfg, tracker, ctx)
    finally:
        leaked = tracker.leftovers()
        for name in leaked:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(SHM_DIR, name))
    print_table(rows)
    load = (load0, os.getloadavg()[0])
    wall = time.perf_counter() - started
    print(f"\nmode={'quick' if args.quick else 'full'}  wall={wall:.1f} s  cpus={os.cpu_count()}  "
          f"load1 before/after={load[0]:.2f}/{load[1]:.2f}  leaked segments={leaked or 'none'}")
    meta = {"mode": "quick" if args.quick else "full", "config": dataclasses.asdict(cfg),
            "wall_seconds": wall, "load1_before_after": load, "cpus": os.cpu_count(),
            "shmbuf": shmbuf.__version__, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"meta": meta, "results": [r.to_json() for r in rows]},
                                    indent=1))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
