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
import queue as queue_mod
import signal
import statistics
import subprocess
import sys
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
WAIT_S = 120.0          # every barrier wait, queue get and join is bounded by this
SHM_DIR = "/dev/shm"
GIB = float(1 << 30)
MIB = float(1 << 20)
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


QUICK = Config(reps=5, lat_calls=30, ingest_steps=15_000, queue_steps=3_000, batch_rows=32_000,
               add_rows=8_000, mem_steps=10_000, scale_calls=100, big_capacity=10_000_000,
               create_gib=0.5, touch_capacity=10_000)
FULL = Config(reps=7, lat_calls=80, ingest_steps=40_000, queue_steps=8_000, batch_rows=96_000,
              add_rows=24_000, mem_steps=10_000, scale_calls=300, big_capacity=10_000_000,
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
        if not s or not b:
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
        print(f"  {row.key}: baseline = {row.baseline_label}")


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
    procs = []
    try:
        for args in arg_tuples:
            proc = ctx.Process(target=target, args=args, daemon=True)
            proc.start()
            procs.append(proc)
        yield procs
    finally:
        if stop is not None:
            stop.set()
        if barrier is not None:
            barrier.abort()
        deadline = time.monotonic() + WAIT_S
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


def _ingest_worker(buf, wid, mode, n_steps, rounds, barrier, results):
    """Child: per round, wait at the barrier, write, report (wid, start, end)."""
    w = None
    try:
        w = buf.writer()
        rows = _w1_rows(16 if mode != "add" else 8, seed=wid)
        for _ in range(rounds):
            barrier.wait(WAIT_S)
            t0 = time.perf_counter()
            if mode == "add":
                _write_add(w, rows, n_steps)
            else:
                _write_rows(w, rows, n_steps, batched=mode == "batch16")
            results.put((wid, t0, time.perf_counter()))
    finally:
        if w is not None:
            w.close()
        buf.close()


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


def _spin_writer(buf, wid, stop, results):
    """Child: add W1 steps continuously until ``stop``; report steps and seconds."""
    w = None
    try:
        w = buf.writer()
        rows = _w1_rows(8, seed=wid)
        results.put(("ready", wid))
        t0, steps = time.perf_counter(), 0
        while not stop.is_set():
            _write_add(w, rows, 256)
            steps += 256
        results.put(("done", steps, time.perf_counter() - t0))
    finally:
        if w is not None:
            w.close()
        buf.close()


def _get(q, n: int) -> list:
    return [q.get(timeout=WAIT_S) for _ in range(n)]


# -- 1. sampling: shmbuf vs numpy gather, idle and under writes -------------------------
def _numpy_gather(arrays: dict, rng, batch: int, length: int) -> dict:
    starts = rng.integers(0, W1_CAPACITY - length + 1, batch)
    idx = starts[None, :] + np.arange(length)[:, None]   # (L, B): time-major
    return {k: np.take(a, idx, axis=0) for k, a in arrays.items()}


def _latencies(fn, calls: int) -> np.ndarray:
    out = np.empty(calls)
    for i in range(calls):
        t0 = time.perf_counter()
        fn()
        out[i] = time.perf_counter() - t0
    return out


def _latency_blocks(cfg, sample, gather) -> dict:
    """Interleaved blocks of single calls; per block: mean, p50, p99 of each side."""
    sample(), gather()      # warm the allocator and the page tables
    got = {"shm": [], "np": []}
    for rep in range(cfg.reps):
        order = (("shm", sample), ("np", gather)) if rep % 2 == 0 else \
            (("np", gather), ("shm", sample))
        for side, fn in order:
            got[side].append(_latencies(fn, cfg.lat_calls))
    stat = {"mean": np.mean, "p50": np.median, "p99": lambda a: np.percentile(a, 99)}
    return {f"{side}_{name}": [float(f(b)) for b in blocks]
            for side, blocks in got.items() for name, f in stat.items()}


def bench_sampling(cfg, tracker, ctx) -> list[Row]:
    with tracker.buffer(W1_SPEC, W1_CAPACITY, seed=0) as buf:
        fill(buf, _w1_rows(16, seed=99), int(W1_CAPACITY * 1.1))
        live = buf.stats().live_steps
        arrays = {k: np.array(v) for k, v in buf.arrays.items()}
        rng = np.random.default_rng(1)
        sample = lambda: buf.sample_sequences(50, 50)          # noqa: E731
        gather = lambda: _numpy_gather(arrays, rng, 50, 50)   # noqa: E731
        idle = _latency_blocks(cfg, sample, gather)
        busy, writer_rate = _under_writes(cfg, ctx, buf, sample, gather)
    extra = {"live_steps_at_start": live, "writer_steps_per_s_total": writer_rate}
    label = "sample_sequences(50,50) W1"
    return [
        Row("1a", f"1a {label}, idle: time/call", "s", idle["shm_mean"], idle["np_mean"],
            "numpy np.take of (L,B) indices from an in-process array, same run",
            ("ratio", "<=", 1.3), extra=extra),
        Row("1b", f"1b {label}, 2 writers adding: time/call", "s", busy["shm_mean"],
            busy["np_mean"], "the same numpy gather while the same 2 writers add",
            ("ratio", "<=", 1.3), extra=extra),
        Row("1c", "1c sample p50 latency: under writes vs idle", "s", busy["shm_p50"],
            idle["shm_p50"], "shmbuf sample p50 with no writer running",
            ("ratio", "<=", 1.3), paired=False, extra=extra),
        Row("1d", "1d sample p99 latency: under writes vs idle", "s", busy["shm_p99"],
            idle["shm_p99"], "shmbuf sample p99 with no writer running",
            ("ratio", "<=", 1.3), paired=False, extra=extra),
        Row("1e", "1e numpy gather p50: under writes vs idle (ctrl)", "s", busy["np_p50"],
            idle["np_p50"], "numpy gather p50 with no writer running (CPU-contention control)",
            None, paired=False, extra=extra),
    ]


def _under_writes(cfg, ctx, buf, sample, gather):
    stop, results = ctx.Event(), ctx.Queue()
    args = [(buf, wid, stop, results) for wid in range(N_WRITERS)]
    with children(ctx, _spin_writer, args, stop=stop) as procs:
        _get(results, N_WRITERS)                      # both writers are adding
        time.sleep(0.2)
        busy = _latency_blocks(cfg, sample, gather)
        stop.set()
        done = _get(results, N_WRITERS)
        for proc in procs:
            proc.join(WAIT_S)
    return busy, sum(steps / secs for _, steps, secs in done)


# -- 2 and 3. ingest from 2 writer processes -----------------------------------------------
def _rounds_rate(cfg, ctx, buf, mode, n_steps) -> list[float]:
    """Total steps/s of N_WRITERS children, barrier to last end, one warm-up round."""
    rounds = cfg.reps + 1
    barrier, results = ctx.Barrier(N_WRITERS + 1), ctx.Queue()
    args = [(buf, wid, mode, n_steps, rounds, barrier, results) for wid in range(N_WRITERS)]
    rates = []
    with children(ctx, _ingest_worker, args, barrier=barrier):
        for _ in range(rounds):
            barrier.wait(WAIT_S)
            got = _get(results, N_WRITERS)
            span = max(t1 for _, _, t1 in got) - min(t0 for _, t0, _ in got)
            rates.append(N_WRITERS * n_steps / span)
    return rates[1:]


def _queue_rate(cfg, ctx) -> list[float]:
    """DIY baseline: producers -> multiprocessing.Queue -> parent -> numpy ring."""
    ring = {k: np.zeros((W1_CAPACITY,) + shape, dtype) for k, (shape, dtype) in W1_SPEC.items()}
    rounds, n = cfg.reps + 1, cfg.queue_steps
    barrier, steps_q, results = ctx.Barrier(N_WRITERS + 1), ctx.Queue(), ctx.Queue()
    args = [(wid, n, rounds, barrier, steps_q, results) for wid in range(N_WRITERS)]
    rates, pos = [], 0
    obs, act, rew, done = ring["obs"], ring["action"], ring["reward"], ring["done"]
    with children(ctx, _queue_producer, args, barrier=barrier):
        for _ in range(rounds):
            barrier.wait(WAIT_S)
            t0, live = time.perf_counter(), N_WRITERS
            while live:
                item = steps_q.get(timeout=WAIT_S)
                if item is None:
                    live -= 1
                    continue
                obs[pos], act[pos], rew[pos], done[pos] = item
                pos = (pos + 1) % W1_CAPACITY
            t1 = time.perf_counter()
            starts = [t for _, t, _ in _get(results, N_WRITERS)]
            rates.append(N_WRITERS * n / (t1 - min(starts + [t0])))
    return rates[1:]


def bench_ingest(cfg, tracker, ctx) -> list[Row]:
    with tracker.buffer(W1_SPEC, W1_CAPACITY) as buf:
        add = _rounds_rate(cfg, ctx, buf, "add", cfg.ingest_steps)
        batch = _rounds_rate(cfg, ctx, buf, "batch16", cfg.batch_rows)
        single = _rounds_rate(cfg, ctx, buf, "rows1", cfg.add_rows)
    diy = _queue_rate(cfg, ctx)
    return [
        Row("2", "2 ingest Writer.add W1, 2 procs: steps/s", "/s", add, diy,
            "2 procs -> multiprocessing.Queue -> parent -> numpy ring (steps/s)",
            ("ratio", ">=", 5), paired=False),
        Row("3", "3 add_batch(16 rows) W1, 2 procs: rows/s", "/s", batch, single,
            "the same rows with add() one at a time, 2 procs (rows/s)",
            ("shmbuf", ">=", 500e3), paired=False),
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
        Row("4t", f"4t 'torch' in sys.modules of writer: {'YES' if torch else 'no'}", "",
            [], [], "-", None, error=None if not torch else "torch was imported",
            extra={"torch_imported_by_writer": torch, "met": not torch}),
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
        fill(small, _small_rows(16), int(small_cap * 1.1))
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
        extra = {"fill_seconds": fill_s, "live_steps_big": big.stats().live_steps}
    return [
        Row("5", f"5 sample_sequences(256,4) small cols: cap {big_cap:.0e} vs 1e4", "s",
            got["big"], got["small"], "the same call on a full 10k-step buffer",
            ("ratio", "<=", 1.2), extra=extra),
        Row("5c", f"5c numpy gather (256,4) obs: cap {big_cap:.0e} vs 1e4 (ctrl)", "s",
            got["np_big"], got["np_small"], "numpy gather from a 10k-row array (cache control)",
            None),
    ]


# -- 6. create() and first touch ---------------------------------------------------------------
def _w1_bytes(capacity: int) -> int:
    row = sum(int(np.prod(s)) * np.dtype(d).itemsize for s, d in W1_SPEC.values()) + 8
    return row * capacity


def bench_create(cfg, tracker, ctx) -> list[Row]:
    capacity = int(cfg.create_gib * GIB / _w1_bytes(1))
    per_gib = {True: [], False: []}
    for rep in range(cfg.reps):
        for prefault in ((True, False) if rep % 2 == 0 else (False, True)):
            t0 = time.perf_counter()
            with tracker.buffer(W1_SPEC, capacity, prefault=prefault) as buf:
                dt = time.perf_counter() - t0
                size = os.path.getsize(os.path.join(SHM_DIR, buf.name))
            per_gib[prefault].append(dt / (size / GIB))
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
    tracker, started = Tracker(), time.perf_counter()
    try:
        rows = run_all(cfg, tracker)
    finally:
        leaked = tracker.leftovers()
        for name in leaked:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(SHM_DIR, name))
    wall = time.perf_counter() - started
    print_table(rows)
    print(f"\nmode={'quick' if args.quick else 'full'}  wall={wall:.1f} s  cpus={os.cpu_count()}"
          f"  leaked segments={leaked or 'none'}")
    meta = {"mode": "quick" if args.quick else "full", "config": dataclasses.asdict(cfg),
            "wall_seconds": wall, "python": sys.version.split()[0], "numpy": np.__version__,
            "shmbuf": shmbuf.__version__, "platform": platform.platform(),
            "cpus": os.cpu_count(), "leaked_segments": leaked,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"meta": meta, "results": [r.to_json() for r in rows]},
                                    indent=1))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
