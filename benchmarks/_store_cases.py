"""The measurements of bench_store: 1 sampling, 2-3 ingest, 4 memory, 5 scaling, 6 create.

Each ``bench_*(cfg, tracker, ctx)`` runs one measurement against its
baseline in the same run and returns its ``Row``s.
"""
from __future__ import annotations

import contextlib
import json
import mmap
import os
import subprocess
import sys
import time

import numpy as np
from _store_report import Row, summarize
from _store_workload import (
    GIB,
    N_WRITERS,
    SMALL_SPEC,
    W1_CAPACITY,
    W1_SPEC,
    WAIT_S,
    _barrier,
    _get,
    _ingest_worker,
    _queue_producer,
    _spin_writer,
    _w1_rows,
    children,
    fill,
)


# -- 1. sampling: shmbuf vs numpy gather, idle and under writes -------------------------
def _numpy_gather(arrays: dict, rng, batch: int, length: int) -> dict:
    starts = rng.integers(0, W1_CAPACITY - length + 1, batch)
    idx = starts[None, :] + np.arange(length)[:, None]   # (L, B): time-major
    return {k: np.take(a, idx, axis=0) for k, a in arrays.items()}


def _alternating(fns: tuple, calls: int) -> np.ndarray:
    """(len(fns), calls) single-call latencies, the functions called in turn."""
    out = np.empty((len(fns), calls))
    for i in range(calls):
        for j, fn in enumerate(fns if i % 2 == 0 else fns[::-1]):
            k = j if i % 2 == 0 else len(fns) - 1 - j
            t0 = time.perf_counter()
            fn()
            out[k, i] = time.perf_counter() - t0
    return out


_STATS = {"mean": np.mean, "p50": np.median, "p99": lambda a: np.percentile(a, 99)}


def _block_stats(lat: np.ndarray, into: dict) -> None:
    """Append mean, p50 and p99 of one block's [shmbuf, numpy] latencies to ``into``."""
    for side, row in (("shm", lat[0]), ("np", lat[1])):
        for name, f in _STATS.items():
            into.setdefault(f"{side}_{name}", []).append(float(f(row)))


def _idle_busy_blocks(cfg, ctx, buf, sample, gather, pin=False):
    """Per repetition, one block with the writers paused and one with them adding.

    Pairing the two in time keeps drifting background load out of the ratio.
    ``pin``: sampler on the first core and writers on the others, so that the
    writers cannot take the sampler's CPU and only shmbuf's own interference stays.
    """
    mine = os.sched_getaffinity(0)
    cpus = sorted(mine)[1:] if pin else None
    go, stop, results = ctx.Event(), ctx.Event(), ctx.Queue()
    args = [(buf.name, wid, go, stop, results, cpus) for wid in range(N_WRITERS)]
    idle, busy, busy_s = {}, {}, 0.0
    try:
        if pin:
            os.sched_setaffinity(0, sorted(mine)[:1])
        with children(ctx, _spin_writer, args, stop=stop) as procs:
            _get(results, N_WRITERS, procs)
            sample(), gather()      # warm the allocator and the page tables
            for _ in range(cfg.reps):
                go.clear()
                time.sleep(0.05)
                _block_stats(_alternating((sample, gather), cfg.lat_calls), idle)
                go.set()
                time.sleep(0.05)
                t0 = time.perf_counter()
                _block_stats(_alternating((sample, gather), cfg.lat_calls), busy)
                busy_s += time.perf_counter() - t0
            go.clear()
            stop.set()
            steps = sum(m[1] for m in _get(results, N_WRITERS, procs))
    finally:
        os.sched_setaffinity(0, mine)
    return idle, busy, steps / busy_s


def bench_sampling(cfg, tracker, ctx) -> list[Row]:
    can_pin = hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) >= 2
    with tracker.buffer(W1_SPEC, W1_CAPACITY, seed=0) as buf:
        fill(buf, _w1_rows(16, seed=99), int(W1_CAPACITY * 1.1))
        live = buf.stats().live_steps
        arrays = {k: np.array(v) for k, v in buf.arrays.items()}
        rng = np.random.default_rng(1)
        sample = lambda: buf.sample_sequences(50, 50)          # noqa: E731
        gather = lambda: _numpy_gather(arrays, rng, 50, 50)   # noqa: E731
        idle, busy, rate = _idle_busy_blocks(cfg, ctx, buf, sample, gather)
        pinned = _idle_busy_blocks(cfg, ctx, buf, sample, gather, pin=True) if can_pin else None
        arrays.clear()  # free the private copies before the page-size control
        pages = _page_size_control(cfg, buf.arrays["obs"])
    extra = {"live_steps_at_start": live, "writer_steps_per_s_while_adding": rate}
    label = "sample_sequences(50,50)"
    return [
        Row("1a", f"1a {label} idle: time/call", "s", idle["shm_mean"], idle["np_mean"],
            "numpy np.take of (L,B) indices from an in-process array, same run",
            ("ratio", "<=", 1.3), extra=extra),
        Row("1b", f"1b {label} 2 writers: time/call", "s", busy["shm_mean"],
            busy["np_mean"], "the same numpy gather while the same 2 writers add",
            ("ratio", "<=", 1.3), extra=extra),
        Row("1c", "1c sample p50 latency: under writes vs idle", "s", busy["shm_p50"],
            idle["shm_p50"], "shmbuf sample p50, writers paused (blocks interleaved)",
            ("ratio", "<=", 1.3), extra=extra),
        Row("1d", "1d sample p99 latency: under writes vs idle", "s", busy["shm_p99"],
            idle["shm_p99"], "shmbuf sample p99, writers paused (blocks interleaved)",
            ("ratio", "<=", 1.3), extra=extra),
        Row("1e", "1e numpy gather p50: under writes vs idle (ctrl)", "s", busy["np_p50"],
            idle["np_p50"], "numpy gather p50, writers paused (CPU-contention control)",
            None, extra=extra),
    ] + _pinned_rows(pinned) + [
        Row("1h", "1h np.take 50x50 obs: shm mapping vs private THP", "s", pages["shm"],
            pages["huge"], "the same take from a private copy with MADV_HUGEPAGE", None),
        Row("1i", "1i the same from a private copy, 4 KiB pages", "s", pages["small"],
            pages["huge"], "the same take from a private copy with MADV_HUGEPAGE", None),
    ]


def _private_copy(src: np.ndarray, huge: bool) -> np.ndarray:
    """A private anonymous copy of ``src``, asking for transparent huge pages or not."""
    mm = mmap.mmap(-1, src.nbytes)
    mm.madvise(mmap.MADV_HUGEPAGE if huge else mmap.MADV_NOHUGEPAGE)
    out = np.frombuffer(mm, src.dtype, src.size).reshape(src.shape)   # keeps mm alive
    out[...] = src
    return out


def _page_size_control(cfg, shm_obs: np.ndarray) -> dict:
    """Mean time of the same kind of 50 x 50 window take of ``obs`` from the shm
    mapping, a private huge-page copy and a private 4 KiB-page copy, interleaved.

    Shared memory gets 4 KiB pages wherever ``shmem_enabled`` is ``never``
    (as on the project's VM), while numpy asks for huge pages on large
    private arrays: this separates the page size from shmbuf's own work.
    """
    sources = {"shm": shm_obs, "huge": _private_copy(shm_obs, True),
               "small": _private_copy(shm_obs, False)}
    rng = np.random.default_rng(3)

    def take(a):
        return lambda: np.take(a, rng.integers(0, len(a) - 49, 50)[None, :]
                               + np.arange(50)[:, None], axis=0)

    out = {k: [] for k in sources}
    fns = tuple(take(a) for a in sources.values())
    for _ in range(cfg.reps):
        lat = _alternating(fns, max(cfg.lat_calls // 4, 10))
        for key, row in zip(sources, lat):
            out[key].append(float(row.mean()))
    return out


def _pinned_rows(pinned) -> list[Row]:
    if pinned is None:
        return []
    idle, busy, rate = pinned
    why = " (sampler on cpu 0, writers on the other cpus)"
    extra = {"writer_steps_per_s_while_adding": rate}
    return [
        Row("1f", "1f sample p50, writers pinned apart, vs idle", "s", busy["shm_p50"],
            idle["shm_p50"], "shmbuf sample p50, writers paused" + why,
            ("ratio", "<=", 1.3), extra=extra),
        Row("1g", "1g sample p99, writers pinned apart, vs idle", "s", busy["shm_p99"],
            idle["shm_p99"], "shmbuf sample p99, writers paused" + why,
            ("ratio", "<=", 1.3), extra=extra),
    ]


# -- 2 and 3. ingest from 2 writer processes -----------------------------------------------
@contextlib.contextmanager
def _writer_pipeline(cfg, ctx, buf, mode, n_steps, pretouch=False):
    """N_WRITERS fresh children; yields run_round() -> (total steps/s from the barrier
    to the last end, minor page faults per step)."""
    barrier, results = ctx.Barrier(N_WRITERS + 1), ctx.Queue()
    args = [(buf.name, wid, mode, n_steps, cfg.reps + 1, barrier, results, pretouch)
            for wid in range(N_WRITERS)]
    with children(ctx, _ingest_worker, args, barrier=barrier) as procs:
        def run_round():
            _barrier(barrier, results, procs)
            got = _get(results, N_WRITERS, procs)
            span = max(g[2] for g in got) - min(g[1] for g in got)
            return N_WRITERS * n_steps / span, sum(g[3] for g in got) / (N_WRITERS * n_steps)
        yield run_round


@contextlib.contextmanager
def _queue_pipeline(cfg, ctx):
    """DIY baseline: producers -> multiprocessing.Queue -> parent -> numpy ring."""
    ring = [np.empty((W1_CAPACITY,) + shape, dtype) for shape, dtype in W1_SPEC.values()]
    for column in ring:
        column.fill(0)      # prefault, as shmbuf's buffer is
    n, pos = cfg.queue_steps, [0]
    barrier, steps_q, results = ctx.Barrier(N_WRITERS + 1), ctx.Queue(), ctx.Queue()
    args = [(wid, n, cfg.reps + 1, barrier, steps_q, results) for wid in range(N_WRITERS)]
    obs, act, rew, done = ring
    with children(ctx, _queue_producer, args, barrier=barrier) as procs:
        def run_round():
            _barrier(barrier, results, procs)
            t0, live, i = time.perf_counter(), N_WRITERS, pos[0]
            while live:
                item = steps_q.get(timeout=WAIT_S)
                if item is None:
                    live -= 1
                    continue
                obs[i], act[i], rew[i], done[i] = item
                i = (i + 1) % W1_CAPACITY
            t1, pos[0] = time.perf_counter(), i
            starts = [t for _, t, _ in _get(results, N_WRITERS, procs)]
            return N_WRITERS * n / (t1 - min(starts + [t0])), 0.0
        yield run_round


@contextlib.contextmanager
def _ring_pipeline(cfg):
    """An in-process numpy ring's add() for one stream: torchwm's ring (bench_dreamer)."""
    from bench_dreamer import UpstreamRing

    ring = UpstreamRing(W1_CAPACITY, (3, 64, 64), 6, 50, 50)
    for a in (ring.observations, ring.actions, ring.rewards, ring.terminals):
        a.fill(0)      # prefault, as shmbuf's buffer is
    frames = _w1_rows(8, seed=5)
    obs, action, n = frames["obs"], frames["action"][0], cfg.ring_steps

    def run_round():
        add = ring.add
        t0 = time.perf_counter()
        for i in range(n):
            add({"image": obs[i & 7]}, action, float(i & 255), i % 500 == 499)
        return n / (time.perf_counter() - t0), 0.0
    yield run_round


def _interleave(cfg, pipelines: dict) -> dict:
    """One warm-up round each, then cfg.reps rounds each, in a rotating order."""
    names = list(pipelines)
    for name in names:
        pipelines[name]()
    out = {name: ([], []) for name in names}
    for rep in range(cfg.reps):
        k = rep % len(names)
        for name in names[k:] + names[:k]:
            rate, faults = pipelines[name]()
            out[name][0].append(rate)
            out[name][1].append(faults)
    return out


def bench_ingest(cfg, tracker, ctx) -> list[Row]:
    with tracker.buffer(W1_SPEC, W1_CAPACITY) as buf:
        with _writer_pipeline(cfg, ctx, buf, "add", cfg.ingest_steps) as shm, \
                _queue_pipeline(cfg, ctx) as diy, _ring_pipeline(cfg) as ring:
            two = _interleave(cfg, {"shm": shm, "diy": diy, "ring": ring})
        with _writer_pipeline(cfg, ctx, buf, "batch16", cfg.batch_rows) as batch, \
                _writer_pipeline(cfg, ctx, buf, "rows1", cfg.add_rows) as single, \
                _writer_pipeline(cfg, ctx, buf, "batch16", cfg.batch_rows, True) as warm:
            three = _interleave(cfg, {"batch": batch, "single": single, "warm": warm})
        with tracker.buffer(W1_SPEC, W1_CAPACITY) as ctl, \
                _writer_pipeline(cfg, ctx, buf, "ep500", cfg.episode_rows, True) as ext, \
                _writer_pipeline(cfg, ctx, ctl, "copy500", cfg.episode_rows, True) as copy:
            seven = _interleave(cfg, {"ext": ext, "copy": copy})
    per_writer = [r / N_WRITERS for r in two["shm"][0]]
    faults = lambda got: {"writer_minor_faults_per_row": summarize(got[1])}   # noqa: E731
    return [
        Row("2", "2 ingest Writer.add W1, 2 procs: steps/s", "/s", two["shm"][0],
            two["diy"][0], "2 procs -> multiprocessing.Queue -> parent -> numpy ring",
            ("ratio", ">=", 5), extra=faults(two["shm"])),
        Row("3", "3 add_batch(16 rows) W1, 2 procs: rows/s", "/s", three["batch"][0],
            three["single"][0], "the same rows through add() one at a time, 2 procs",
            ("shmbuf", ">=", 500e3), extra=dict(faults(three["batch"]),
                                                baseline=faults(three["single"]))),
        Row("3p", "3p same, writers' mappings pre-touched: rows/s", "/s", three["warm"][0],
            three["batch"][0], "row 3, whose attached writers fault on each first write",
            ("shmbuf", ">=", 500e3), extra=faults(three["warm"])),
        Row("2r", "2r Writer.add, 2 procs: steps/s per writer", "/s", per_writer,
            two["ring"][0], "an in-process numpy ring's add() (torchwm's), one stream",
            ("ratio", ">=", 1)),
        Row("7", "7 Writer.extend(500 steps) W1, 2 procs: rows/s", "/s", seven["ext"][0],
            seven["copy"][0], "2 procs copying the same bytes into a shmbuf mapping, no "
            "bookkeeping (copy bandwidth)", ("ratio", ">=", 0.6),
            extra=faults(seven["ext"])),
    ]


# -- 4. a writer process's private memory ----------------------------------------------------
_SMAPS = r'''
import json, sys
def private_mib():
    kb = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            key, _, value = line.partition(":")
            kb[key] = value.split()[0] if value.strip() else "0"
    return {"private": (int(kb["Private_Clean"]) + int(kb["Private_Dirty"])) / 1024,
            "rss": int(kb["Rss"]) / 1024}
'''
_MEM_WRITER = _SMAPS + r'''
import shmbuf
import numpy as np
buf = shmbuf.attach(sys.argv[1])
w = buf.writer()
obs = np.zeros((3, 64, 64), np.uint8)
act = np.zeros(6, np.float32)
for i in range(int(sys.argv[2])):
    w.add(obs=obs, action=act, reward=0.0, done=i % 500 == 499)
print(json.dumps(dict(private_mib(), torch="torch" in sys.modules)))
w.close()
buf.close()
'''
_MEM_BARE = _SMAPS + "print(json.dumps(dict(private_mib(), torch='torch' in sys.modules)))\n"


def _probe(code: str, *args) -> dict:
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                         timeout=WAIT_S)
    if out.returncode:
        raise RuntimeError(f"memory probe failed: {out.stderr.strip()[-300:]}")
    return json.loads(out.stdout)


def bench_memory(cfg, tracker, ctx) -> list[Row]:
    writer, bare = [], []
    with tracker.buffer(W1_SPEC, W1_CAPACITY) as buf:
        for _ in range(cfg.reps):
            writer.append(_probe(_MEM_WRITER, buf.name, str(cfg.mem_steps)))
            bare.append(_probe(_MEM_BARE))
    torch = any(p["torch"] for p in writer)
    extra = {"torch_imported_by_writer": torch,
             "writer_rss_mib": summarize([p["rss"] for p in writer])}
    return [
        Row("4", f"4 writer private mem (import+attach+{cfg.mem_steps // 1000}k add)", "MiB",
            [p["private"] for p in writer], [p["private"] for p in bare],
            "a bare `python -c` process (Private_Clean+Private_Dirty)",
            ("shmbuf", "<=", 40), extra=extra),
        Row("4t", "4t 'torch' in sys.modules of that writer", "flag",
            [float(p["torch"]) for p in writer], [float(p["torch"]) for p in bare],
            "the bare process", ("shmbuf", "<=", 0), paired=False),
    ]


# -- 5. sampling cost vs capacity -------------------------------------------------------------
def _small_rows(n: int) -> dict:
    rng = np.random.default_rng(n)
    return {"obs": rng.standard_normal((n, 16)).astype(np.float32), "done": np.zeros(n, np.bool_)}


def _block_means(cfg, fns: dict) -> dict:
    out = {k: [] for k in fns}
    for fn in fns.values():
        fn()
    for rep in range(cfg.reps):
        items = list(fns.items())
        for key, fn in (items if rep % 2 == 0 else items[::-1]):
            t0 = time.perf_counter()
            for _ in range(cfg.scale_calls):
                fn()
            out[key].append((time.perf_counter() - t0) / cfg.scale_calls)
    return out


def bench_scaling(cfg, tracker, ctx) -> list[Row]:
    small_cap, big_cap = 10_000, cfg.big_capacity
    with tracker.buffer(SMALL_SPEC, small_cap, seed=0) as small, \
            tracker.buffer(SMALL_SPEC, big_cap, seed=0) as big:
        t0 = time.perf_counter()
        # Few streams per chunk in both, so that partly filled chunks (invalid
        # window starts, which cost redraws) are a few percent of each buffer.
        fill(small, _small_rows(2), int(small_cap * 1.1))
        fill(big, _small_rows(1024), int(big_cap * 1.02))
        fill_s = time.perf_counter() - t0
        rng = np.random.default_rng(2)
        arr_small, arr_big = np.array(small.arrays["obs"]), np.array(big.arrays["obs"])

        def gather(a):
            idx = rng.integers(0, len(a) - 4, 256)[None, :] + np.arange(4)[:, None]
            return np.take(a, idx, axis=0)

        got = _block_means(cfg, {
            "small": lambda: small.sample_sequences(256, 4),
            "big": lambda: big.sample_sequences(256, 4),
            "np_small": lambda: gather(arr_small), "np_big": lambda: gather(arr_big)})
        extra = {"fill_seconds": fill_s, "live_fraction_big": big.stats().live_steps / big_cap,
                 "live_fraction_small": small.stats().live_steps / small_cap}
    growth = [b / s for b, s in zip(got["big"], got["small"])]
    np_growth = [b / s for b, s in zip(got["np_big"], got["np_small"])]
    return [
        Row("5r", f"5r growth {big_cap / 1e6:g}M / 10k: shmbuf sampler vs numpy gather", "x",
            growth, np_growth, "the numpy gather's growth over the same capacities (paired "
            "blocks)", ("ratio", "<=", 1.2)),
        Row("5", f"5 sample_seq(256,4) small cols: {big_cap / 1e6:g}M vs 10k cap", "s",
            got["big"], got["small"], "the same call on a full 10k-step buffer",
            ("ratio", "<=", 1.2), extra=extra),
        Row("5c", f"5c numpy gather (256,4): {big_cap / 1e6:g}M vs 10k rows (ctrl)", "s",
            got["np_big"], got["np_small"], "numpy gather from a 10k-row array (cache control)",
            None),
    ]


# -- 6. create() and first touch ---------------------------------------------------------------
def _w1_bytes(capacity: int) -> int:
    """Column bytes of a W1 buffer (header and page padding left out)."""
    row = sum(int(np.prod(s)) * np.dtype(d).itemsize for s, d in W1_SPEC.values()) + 8
    return row * capacity


def bench_create(cfg, tracker, ctx) -> list[Row]:
    capacity = int(cfg.create_gib * GIB / _w1_bytes(1))
    per_gib = {True: [], False: []}
    for rep in range(cfg.reps):
        for prefault in ((True, False) if rep % 2 == 0 else (False, True)):
            t0 = time.perf_counter()
            with tracker.buffer(W1_SPEC, capacity, prefault=prefault):
                dt = time.perf_counter() - t0
            per_gib[prefault].append(dt / (_w1_bytes(capacity) / GIB))
    touch = {True: [], False: []}
    rows, cap = _w1_rows(16, seed=5), cfg.touch_capacity
    for rep in range(cfg.reps):
        for prefault in ((False, True) if rep % 2 == 0 else (True, False)):
            with tracker.buffer(W1_SPEC, cap, prefault=prefault) as buf:
                t0 = time.perf_counter()
                fill(buf, rows, cap)
                touch[prefault].append(time.perf_counter() - t0)
    return [
        Row("6a", f"6a create() W1 {cfg.create_gib:g} GiB: prefault=True", "s/GiB",
            per_gib[True], per_gib[False], "create(..., prefault=False), s/GiB"),
        Row("6b", f"6b write {cap // 1000}k W1 steps: not prefaulted", "s",
            touch[False], touch[True], "the same writes into a prefaulted buffer (first touch)",
            extra={"bytes_touched": _w1_bytes(cap)}),
    ]
