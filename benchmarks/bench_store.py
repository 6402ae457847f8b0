"""Benchmarks of the shared step store against baselines measured in the same run.

    python benchmarks/bench_store.py [--quick] [--json PATH]

Prints one fixed-format table and writes a JSON file (default
benchmarks/results/bench_store.json).  Every figure is the median of at least
five repetitions with its min-max, next to a baseline; the ratio is
shmbuf / baseline, taken per repetition where the two were interleaved.
Targets are reported, never asserted.  Children use the spawn context; every
buffer is closed (the owner unlinks it) in ``finally``, so /dev/shm is left as
it was found even on error or Ctrl-C.

Workload W1: obs uint8 (3, 64, 64), action f32 (6,), reward f32, done bool;
episodes of 500 steps; capacity 100k steps; buffers prefaulted.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import multiprocessing as mp
import os
import platform
import queue
import resource
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import numpy as np

import shmbuf

W1_SPEC = {"obs": ((3, 64, 64), np.uint8), "action": ((6,), np.float32),
           "reward": ((), np.float32), "done": ((), np.bool_)}
SMALL_SPEC = {"obs": ((16,), np.float32), "done": ((), np.bool_)}
EPISODE = 500
W1_CAPACITY = 100_000
N_WRITERS = 2
WAIT_S = 60.0           # every barrier wait, queue get and join is bounded by this
SHM_DIR = "/dev/shm"
GIB = float(1 << 30)
DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "bench_store.json"


@dataclasses.dataclass(frozen=True)
class Config:
    reps: int              # repetitions per figure (>= 5)
    lat_calls: int         # single sample calls per latency block
    ingest_steps: int      # Writer.add steps per writer per repetition
    queue_steps: int       # queue-pipeline steps per producer per repetition
    batch_rows: int        # add_batch rows per writer per repetition (multiple of 16)
    add_rows: int          # add() rows per writer per repetition (baseline of 3)
    mem_steps: int         # steps the memory probe writes
    scale_calls: int       # sample_sequences(256, 4) calls per block
    big_capacity: int      # the large buffer of measurement 5
    create_gib: float      # segment size for create() timing
    touch_capacity: int    # W1 steps for the first-touch measurement


QUICK = Config(reps=5, lat_calls=40, ingest_steps=15_000, queue_steps=3_000, batch_rows=32_000,
               add_rows=8_000, mem_steps=10_000, scale_calls=300, big_capacity=10_000_000,
               create_gib=0.5, touch_capacity=10_000)
FULL = Config(reps=9, lat_calls=200, ingest_steps=40_000, queue_steps=8_000, batch_rows=96_000,
              add_rows=24_000, mem_steps=10_000, scale_calls=1000, big_capacity=10_000_000,
              create_gib=1.0, touch_capacity=30_000)


# -- figures and rows -----------------------------------------------------------------
def summarize(values) -> dict:
    vals = [float(v) for v in values]
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals),
            "n": len(vals), "values": vals}


@dataclasses.dataclass
class Row:
    key: str
    label: str
    unit: str               # "s", "/s", "MiB", "s/GiB"
    shmbuf: list
    baseline: list
    baseline_label: str
    target: tuple | None = None   # (what, op, value): what in {"ratio", "shmbuf"}
    paired: bool = True           # repetitions were interleaved: ratio per pair
    error: str | None = None
    extra: dict = dataclasses.field(default_factory=dict)

    def ratio(self) -> dict | None:
        s, b = self.shmbuf, self.baseline
        if not s or not b or self.unit == "flag":
            return None
        if self.paired and len(s) == len(b):
            return summarize([x / y for x, y in zip(s, b)])
        out = summarize([statistics.median(s) / statistics.median(b)])
        out.update(min=min(s) / max(b), max=max(s) / min(b), n=0, values=[])
        return out

    def met(self) -> bool | None:
        if self.error or self.target is None:
            return None
        what, op, value = self.target
        got = (self.ratio() or {}).get("median") if what == "ratio" else \
            statistics.median(self.shmbuf)
        return None if got is None else (got <= value if op == "<=" else got >= value)

    def target_text(self) -> str:
        if self.target is None:
            return "-"
        what, op, value = self.target
        if self.unit == "flag":
            return "absent"
        return f"{op} {value:g}x" if what == "ratio" else f"{op} {_fmt_one(value, self.unit)}"

    def to_json(self) -> dict:
        return {"key": self.key, "measurement": self.label, "unit": self.unit,
                "baseline_is": self.baseline_label, "error": self.error,
                "shmbuf": summarize(self.shmbuf) if self.shmbuf else None,
                "baseline": summarize(self.baseline) if self.baseline else None,
                "ratio": self.ratio(), "ratio_is": "shmbuf / baseline",
                "ratio_paired": self.paired, "target": self.target_text(), "met": self.met(),
                **self.extra}


def _scale(value: float, unit: str) -> tuple[float, str]:
    if unit == "s":
        for factor, name in ((1.0, "s"), (1e-3, "ms"), (1e-6, "us")):
            if abs(value) >= factor:
                return factor, name
        return 1e-9, "ns"
    if unit == "/s":
        for factor, name in ((1e6, "M/s"), (1e3, "k/s")):
            if abs(value) >= factor:
                return factor, name
        return 1.0, "/s"
    return 1.0, unit


def _fmt_one(value: float, unit: str) -> str:
    factor, name = _scale(value, unit)
    return f"{value / factor:.3g} {name}"


def _cell(values: list, unit: str) -> str:
    if not values:
        return "-"
    if unit == "flag":
        hits = sum(1 for v in values if v)
        return f"{'yes' if hits else 'no'} ({hits}/{len(values)} procs)"
    med = statistics.median(values)
    factor, name = _scale(med, unit)
    return f"{med / factor:.3g} [{min(values) / factor:.3g}-{max(values) / factor:.3g}] {name}"


def print_table(rows: list[Row]) -> None:
    widths = (50, 27, 27, 20, 11, 4)
    heads = ("measurement", "shmbuf", "baseline", "ratio", "target", "met?")
    line = "  ".join(f"{h:<{w}}" for h, w in zip(heads, widths))
    print(line)
    print("-" * len(line))
    for row in rows:
        if row.error:
            cells = (row.label, "ERROR", row.error[:27], "-", row.target_text(), "ERR")
        else:
            r = row.ratio()
            ratio = "-" if r is None else f"{r['median']:.3g} [{r['min']:.3g}-{r['max']:.3g}]"
            met = {True: "yes", False: "NO", None: "n/a"}[row.met()]
            cells = (row.label, _cell(row.shmbuf, row.unit), _cell(row.baseline, row.unit),
                     ratio, row.target_text(), met)
        print("  ".join(f"{c:<{w}}" for c, w in zip(cells, widths)))
    print()
    for row in rows:
        print(f"  {row.key}: " + (f"ERROR {row.error}" if row.error else
                                  f"baseline = {row.baseline_label}"))


# -- processes and buffers ------------------------------------------------------------
class Tracker:
    """Names of the segments this run created, checked for leftovers at exit."""

    def __init__(self):
        self.names = []

    @contextlib.contextmanager
    def buffer(self, spec, capacity, **kw):
        buf = shmbuf.create(spec, capacity, **kw)
        self.names.append(buf.name)
        try:
            yield buf
        finally:
            buf.close()

    def leftovers(self) -> list[str]:
        return [n for n in self.names if os.path.exists(os.path.join(SHM_DIR, n))]


@contextlib.contextmanager
def children(ctx, target, arg_tuples, *, stop=None, barrier=None):
    """Start one spawned process per args tuple; stop, join (bounded) and kill on exit."""
    procs, grace = [], 2.0      # on error, children get 2 s to exit before the kill
    try:
        for args in arg_tuples:
            proc = ctx.Process(target=target, args=args, daemon=True)
            proc.start()
            procs.append(proc)
        yield procs
        grace = WAIT_S
    finally:
        if stop is not None:
            stop.set()
        if barrier is not None:
            barrier.abort()
        deadline = time.monotonic() + grace
        for proc in procs:
            proc.join(max(0.1, deadline - time.monotonic()))
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(10)


def _w1_rows(n: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"obs": rng.integers(0, 256, (n, 3, 64, 64), dtype=np.uint8),
            "action": rng.standard_normal((n, 6)).astype(np.float32),
            "reward": rng.standard_normal(n).astype(np.float32),
            "done": np.zeros(n, np.bool_)}


def fill(buf, rows: dict, steps: int) -> None:
    """Write ``steps`` steps with add_batch(rows), episodes of EPISODE steps per stream."""
    n = len(rows["done"])
    last = dict(rows, done=np.ones(n, np.bool_))
    with buf.writer() as w:
        for call in range(-(-steps // n)):
            w.add_batch(**(last if call % EPISODE == EPISODE - 1 else rows))


def _write_add(w, frames, n_steps: int) -> None:
    obs, action = frames["obs"], frames["action"][0]
    for i in range(n_steps):
        w.add(obs=obs[i & 7], action=action, reward=float(i & 255),
              done=i % EPISODE == EPISODE - 1)


def _write_rows(w, rows, n_rows: int, batched: bool) -> None:
    n = len(rows["done"])
    last = dict(rows, done=np.ones(n, np.bool_))
    obs, act, rew = rows["obs"], rows["action"], rows["reward"]
    for call in range(n_rows // n):
        cols = last if call % EPISODE == EPISODE - 1 else rows
        if batched:
            w.add_batch(**cols)
        else:
            done = cols["done"]
            for j in range(n):
                w.add(obs=obs[j], action=act[j], reward=rew[j], done=done[j])


def _minflt() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def touch_mapping(buf) -> None:
    """Read one byte per page of every column, so this process's page tables map them.

    ``create(prefault=True)`` populates the owner's mapping only; an attached
    writer takes a minor fault on the first write to each page otherwise.
    """
    for column in buf.arrays.values():
        int(column.view(np.uint8).reshape(-1)[::4096].sum())


@contextlib.contextmanager
def _attached(name: str, results, barrier=None):
    """Attach in a child; on any error tell the parent why and break the barrier."""
    buf = None
    try:
        buf = shmbuf.attach(name)
        yield buf
    except BaseException as exc:
        results.put(("error", f"{type(exc).__name__}: {exc}"))
        if barrier is not None:
            barrier.abort()
        raise
    finally:
        if buf is not None:
            buf.close()


def _ingest_worker(name, wid, mode, n_steps, rounds, barrier, results, pretouch=False):
    """Child: per round, wait at the barrier, write, report (wid, start, end, faults)."""
    with _attached(name, results, barrier) as buf, buf.writer() as w:
        rows = _w1_rows(16 if mode != "add" else 8, seed=wid)
        if pretouch:
            touch_mapping(buf)
        for _ in range(rounds):
            barrier.wait(WAIT_S)
            f0, t0 = _minflt(), time.perf_counter()
            if mode == "add":
                _write_add(w, rows, n_steps)
            else:
                _write_rows(w, rows, n_steps, batched=mode == "batch16")
            results.put((wid, t0, time.perf_counter(), _minflt() - f0))


def _queue_producer(wid, n_steps, rounds, barrier, steps_q, results):
    """Child of the DIY baseline: send each step through a multiprocessing.Queue."""
    frames = _w1_rows(8, seed=wid)
    obs, action = frames["obs"], frames["action"][0]
    for _ in range(rounds):
        barrier.wait(WAIT_S)
        t0 = time.perf_counter()
        for i in range(n_steps):
            steps_q.put((obs[i & 7], action, float(i & 255), i % EPISODE == EPISODE - 1))
        steps_q.put(None)
        results.put((wid, t0, None))


def _spin_writer(name, wid, go, stop, results, cpus=None):
    """Child: add W1 steps continuously while ``go`` is set, until ``stop``; report
    the steps written."""
    if cpus:
        os.sched_setaffinity(0, cpus)
    with _attached(name, results) as buf, buf.writer() as w:
        rows = _w1_rows(8, seed=wid)
        results.put(("ready", wid))
        steps = 0
        while not stop.is_set():
            if not go.wait(0.05):
                continue
            _write_add(w, rows, 256)
            steps += 256
        results.put(("done", steps))


def _get(q, n: int, procs) -> list:
    """``n`` messages from the children, failing fast if one reports an error or dies."""
    out, deadline = [], time.monotonic() + WAIT_S
    while len(out) < n:
        try:
            msg = q.get(timeout=0.5)
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"children died (exit codes {dead}) or timed out "
                                   f"after {WAIT_S} s") from None
            continue
        if msg[0] == "error":
            raise RuntimeError(f"child failed: {msg[1]}")
        out.append(msg)
    return out


def _barrier(barrier, results, procs) -> None:
    """The parent's barrier wait; a broken barrier reports the child's own error."""
    try:
        barrier.wait(WAIT_S)
    except threading.BrokenBarrierError:
        _get(results, 1, procs)   # raises with the child's message if it sent one
        raise


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
    ] + _pinned_rows(pinned)


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
                _queue_pipeline(cfg, ctx) as diy:
            two = _interleave(cfg, {"shm": shm, "diy": diy})
        with _writer_pipeline(cfg, ctx, buf, "batch16", cfg.batch_rows) as batch, \
                _writer_pipeline(cfg, ctx, buf, "rows1", cfg.add_rows) as single, \
                _writer_pipeline(cfg, ctx, buf, "batch16", cfg.batch_rows, True) as warm:
            three = _interleave(cfg, {"batch": batch, "single": single, "warm": warm})
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
    return [
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


# -- driver --------------------------------------------------------------------------------------
BENCHES = (("1 sampling", bench_sampling), ("2+3 ingest", bench_ingest),
           ("4 memory", bench_memory), ("5 capacity scaling", bench_scaling),
           ("6 create / first touch", bench_create))


def _git_head() -> str | None:
    """The checkout's commit, with "+dirty" when files differ from it; None outside git."""
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, text=True,
                              capture_output=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=here, text=True, capture_output=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return (head + ("+dirty" if dirty.strip() else "")) or None


def _on_sigterm(signum, frame):
    raise SystemExit(128 + signum)   # unwinds through every finally: buffers get unlinked


def run_all(cfg: Config, tracker: Tracker) -> list[Row]:
    ctx = mp.get_context("spawn")
    rows = []
    for name, bench in BENCHES:
        t0 = time.perf_counter()
        try:
            rows.extend(bench(cfg, tracker, ctx))
        except Exception as exc:   # report it in the table; the other measurements still run
            traceback.print_exc()
            rows.append(Row(name.split()[0], name, "", [], [], "-",
                            error=f"{type(exc).__name__}: {exc}"))
        print(f"[{name}: {time.perf_counter() - t0:.1f} s]", file=sys.stderr, flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller sizes, under ~2 minutes")
    ap.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write results")
    args = ap.parse_args(argv)
    cfg = QUICK if args.quick else FULL
    signal.signal(signal.SIGTERM, _on_sigterm)
    tracker, started, load0 = Tracker(), time.perf_counter(), os.getloadavg()
    if load0[0] > 0.5:
        print(f"warning: 1-min load average is {load0[0]:.2f} before the run; other work "
              "on this machine skews the figures", file=sys.stderr)
    try:
        rows = run_all(cfg, tracker)
    finally:
        leaked = tracker.leftovers()
        for name in leaked:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(SHM_DIR, name))
    wall = time.perf_counter() - started
    print_table(rows)
    load = (load0[0], os.getloadavg()[0])
    print(f"\nmode={'quick' if args.quick else 'full'}  wall={wall:.1f} s  cpus={os.cpu_count()}"
          f"  load1 before/after={load[0]:.2f}/{load[1]:.2f}  leaked segments={leaked or 'none'}")
    meta = {"mode": "quick" if args.quick else "full", "config": dataclasses.asdict(cfg),
            "wall_seconds": wall, "python": sys.version.split()[0], "numpy": np.__version__,
            "shmbuf": shmbuf.__version__, "commit": _git_head(),
            "platform": platform.platform(),
            "cpus": os.cpu_count(), "leaked_segments": leaked, "load1_before_after": load,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"meta": meta, "results": [r.to_json() for r in rows]},
                                    indent=1))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
