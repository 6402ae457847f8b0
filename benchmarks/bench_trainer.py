"""The trainer's data path: prefetch overlap, DataLoader throughput, host-to-device copies.

    python benchmarks/bench_trainer.py [--quick] [--json PATH]

Workload W1 (benchmarks/_store_workload.py): obs (3, 64, 64) uint8, action (6,) f32,
reward, done; episodes of 500 steps; capacity 100k; batches of 50 windows of 50 steps.

1. Overlap.  A trainer loop alternates taking a batch with a compute step (a torch matmul,
   which releases the GIL, sized to cost one W1 50x50 sample; torch uses one thread, so
   the two cores belong to the sampler and the compute).  Step time, relative to the
   compute step alone: with ``buf.prefetch(depth=2)`` (target <= 1.15x) and with a plain
   ``sample_sequences`` per step (about 2x).  Also: whether ``np.take`` holds the GIL
   (how far a pure-Python loop gets while a thread gathers, relative to idle).
2. DataLoader.  Batches per second of ``DataLoader(buf.dataset(50, 50), num_workers=2,
   batch_size=None)`` against the same ``sample_sequences`` calls spread over 2 spawned
   processes (target >= 90%), in alternating rounds (5, or 3 with --quick); the ratio is
   the median of the rounds' ratios.  Also (2c) the trainer's time to unpickle one
   batch: shmbuf's handoff against the same batch as torch shared storages.
3. CUDA, where available: ``prefetch(device="cuda")`` against ``pin_memory()`` +
   ``.to(device)`` of each sampled batch.
4. What a spawned worker pays for ``import torch`` at the top of its module: a fresh
   interpreter importing torch against one importing shmbuf (wall time, resident memory).

Prints a fixed-format table and writes JSON (default benchmarks/results/bench_trainer.json).
Ratios compare figures measured in the same run; nothing here asserts.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np
from _store_workload import W1_CAPACITY, W1_SPEC, Tracker, _w1_rows, children, fill
from _trainer_workload import direct_sampler

import shmbuf

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "bench_trainer.json"
B, L = 50, 50


def _median_time(fn, n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def gil_stalls(buf) -> dict:
    """The longest stall of a Python loop while another thread runs one long C call.

    A call that holds the GIL stalls the loop for its whole duration; one that
    releases it stalls it only as long as the OS scheduler does.  Measured for
    one np.take of a large batch (the sampler's gather) and, as controls from
    the same run, ``sum(range(n))`` (holds the GIL) and hashlib over a large
    buffer (releases it), each sized to take about as long as the gather.
    """
    import hashlib

    src = buf.arrays["obs"]
    idx = np.random.default_rng(0).integers(0, len(src), (L, 16 * B))
    out = np.empty((L, 16 * B) + src.shape[1:], src.dtype)
    np.take(src, idx, axis=0, out=out, mode="clip")   # pages of out mapped first

    def timed(fn):
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    take_s = timed(lambda: np.take(src, idx, axis=0, out=out, mode="clip"))
    n = max(1, int(1e6 * take_s / timed(lambda: sum(range(10**6)))))
    blob = bytes(max(1, int((1 << 24) * take_s / timed(lambda: hashlib.sha256(bytes(1 << 24))))))
    calls = {"np_take": lambda: np.take(src, idx, axis=0, out=out, mode="clip"),
             "holds_gil": lambda: sum(range(n)),
             "releases_gil": lambda: hashlib.sha256(blob).digest()}
    result = {"call_ms": take_s * 1e3}
    for name, call in calls.items():
        done = threading.Event()
        # Bound now: a thread that outlives join(60) must not set the next call's event.
        th = threading.Thread(target=lambda c=call, d=done: (c(), d.set()))
        last, worst = time.perf_counter(), 0.0
        th.start()
        while not done.is_set():
            now = time.perf_counter()
            worst, last = max(worst, now - last), now
        th.join(60)
        result[name] = worst * 1e3
    return result


def overlap(buf, steps: int) -> dict:
    import torch

    torch.set_num_threads(1)
    out = {k: np.empty((L, B) + s, d) for k, (s, d) in W1_SPEC.items()}
    a = torch.randn(256, 256)
    ratios = []
    for _ in range(9):   # interleaved, so that a change of load hits both alike
        sample_s = _median_time(lambda: buf.sample_sequences(B, L, out=out), 3)
        ratios.append(sample_s / _median_time(lambda: a @ a, 9))
    reps = max(1, round(statistics.median(ratios)))
    sample_s = _median_time(lambda: buf.sample_sequences(B, L, out=out), 15)

    def compute():
        for _ in range(reps):
            a @ a

    compute_s = _median_time(compute, 15)

    def loop(take):
        t0 = time.perf_counter()
        for _ in range(steps):
            take()
            compute()
        return (time.perf_counter() - t0) / steps

    alone = loop(lambda: None)
    plain = loop(lambda: buf.sample_sequences(B, L, out=out))
    with buf.prefetch(B, L, depth=2, device="cpu") as it:
        next(it)
        prefetched = loop(lambda: next(it))
    return {"sample_ms": sample_s * 1e3, "compute_ms": compute_s * 1e3,
            "step_alone_ms": alone * 1e3, "step_plain_ms": plain * 1e3,
            "step_prefetch_ms": prefetched * 1e3, "plain_ratio": plain / alone,
            "prefetch_ratio": prefetched / alone, "gil": gil_stalls(buf)}


def _direct_rate(buf, n_batches: int) -> float:
    """Batches per second of ``n_batches`` sample_sequences calls split over 2 processes."""
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    per = n_batches // 2
    with children(ctx, direct_sampler, [(buf.name, B, L, per, barrier, results)] * 2,
                  barrier=barrier) as procs:
        got = [results.get(timeout=120) for _ in procs]
    return sum(n for _, _, n in got) / (max(e for _, e, _ in got) - min(s for s, _, _ in got))


def handoff_cost(reps: int = 40) -> dict:
    """The trainer's time to unpickle one W1 batch that a DataLoader worker sent.

    shmbuf's handoff (``shmbuf.feed.handoff``: a few ints; the pool was mapped by
    the first batch) against the same batch as torch shared-memory tensors,
    pickled the way a worker's result queue does (``ForkingPickler``: each
    storage's descriptor goes through multiprocessing's resource sharer).
    Both are pickled and unpickled in this process; the sharer's socket round
    trip is the same as between processes.
    """
    import pickle
    from multiprocessing.reduction import ForkingPickler

    import torch
    import torch.multiprocessing  # noqa: F401 - registers torch's reductions

    from shmbuf.feed.handoff import SlotPool

    lead = (L, B)
    pool = SlotPool(W1_SPEC, lead)
    pickle.loads(pickle.dumps(pool.handoff(0)))    # the first batch carries the memfd
    shared = {k: torch.from_numpy(np.zeros(lead + s, d)).share_memory_()
              for k, (s, d) in W1_SPEC.items()}

    def unpickle(make) -> float:
        times = []
        for _ in range(reps):
            data = make()
            t0 = time.perf_counter()
            batch = pickle.loads(data)
            times.append(time.perf_counter() - t0)
            del batch
        return statistics.median(times)

    mine = unpickle(lambda: pickle.dumps(pool.handoff(0)))
    theirs = unpickle(lambda: bytes(ForkingPickler.dumps(shared)))
    return {"handoff_ms": mine * 1e3, "torch_storages_ms": theirs * 1e3,
            "storages": len(shared)}


def dataloader(buf, tracker, n_batches: int, rounds: int) -> dict:
    """Direct and DataLoader rates, alternated ``rounds`` times (a change of load hits both)."""
    import torch
    from torch.utils.data import DataLoader

    loader = DataLoader(buf.dataset(B, L), batch_size=None, num_workers=2,
                        multiprocessing_context="spawn", persistent_workers=True, timeout=120)
    it = iter(loader)
    for _ in range(6):      # workers started, imported torch, attached, warmed up
        next(it)
    direct, loaded = [], []
    for _ in range(rounds):
        direct.append(_direct_rate(buf, n_batches))
        t0 = time.perf_counter()
        for _ in range(n_batches):
            batch = next(it)
        loaded.append(n_batches / (time.perf_counter() - t0))
        assert isinstance(batch["obs"], torch.Tensor)
        del batch
    del it, loader
    ratios = [b / a for a, b in zip(direct, loaded)]
    return {"direct_batches_per_s": statistics.median(direct),
            "dataloader_batches_per_s": statistics.median(loaded),
            "ratio": statistics.median(ratios), "ratios": ratios,
            "direct_runs": direct, "dataloader_runs": loaded}


def cuda_copy(buf, n_batches: int) -> dict:
    import torch

    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device on this machine"}
    dev = torch.device("cuda")

    def plain():
        batch = buf.sample_sequences(B, L)
        return {k: torch.from_numpy(v).pin_memory().to(dev, non_blocking=True)
                for k, v in batch.items()}

    plain()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n_batches):
        plain()
    torch.cuda.synchronize()
    plain_rate = n_batches / (time.perf_counter() - t0)
    with buf.prefetch(B, L, depth=2, device=dev) as it:
        next(it)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n_batches):
            batch = next(it)
            batch["obs"].sum()
        torch.cuda.synchronize()
        pre_rate = n_batches / (time.perf_counter() - t0)
    return {"plain_batches_per_s": plain_rate, "prefetch_batches_per_s": pre_rate,
            "ratio": pre_rate / plain_rate}


def import_cost(reps: int = 5) -> dict:
    """Median wall time and resident memory after a fresh interpreter imports torch, or shmbuf.

    The memory is VmRSS from /proc (ru_maxrss would carry over the forking parent's peak).
    """
    import subprocess

    code = ("import re, time; t = time.perf_counter(); import {m}; s = time.perf_counter() - t; "
            "print(s, re.search(r'VmRSS:\\s+(\\d+)', open('/proc/self/status').read())[1])")
    out = {}
    for module in ("torch", "shmbuf"):
        runs = []
        for _ in range(reps):
            got = subprocess.run([sys.executable, "-c", code.format(m=module)], check=True,
                                 capture_output=True, text=True, timeout=120)
            seconds, kib = got.stdout.split()
            runs.append((float(seconds), int(kib) / 1024))
        out[module] = {"s": statistics.median(r[0] for r in runs),
                       "rss_mib": statistics.median(r[1] for r in runs)}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps, under a minute")
    ap.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write results")
    args = ap.parse_args(argv)
    steps, batches = (40, 60) if args.quick else (150, 300)
    load0 = os.getloadavg()[0]
    tracker = Tracker()
    with tracker.buffer(W1_SPEC, W1_CAPACITY) as buf:
        fill(buf, _w1_rows(16, 0), 40_000)
        ov = overlap(buf, steps)
        dl = dataloader(buf, tracker, batches, rounds=3 if args.quick else 5)
        cu = cuda_copy(buf, batches)
    imp = import_cost(3 if args.quick else 5)
    ho = handoff_cost(20 if args.quick else 40)
    rows = [
        ("1a", "compute step alone (matmul, 1 thread)", f"{ov['step_alone_ms']:.2f} ms", "1.00x",
         ""),
        ("1b", "step with prefetch(depth=2)", f"{ov['step_prefetch_ms']:.2f} ms",
         f"{ov['prefetch_ratio']:.2f}x", "<= 1.15x"),
        ("1c", "step with sample_sequences", f"{ov['step_plain_ms']:.2f} ms",
         f"{ov['plain_ratio']:.2f}x", "~2x"),
        ("1d", f"longest Python stall, {ov['gil']['call_ms']:.0f} ms np.take in a thread",
         f"{ov['gil']['np_take']:.1f} ms", "",
         f"controls: GIL held {ov['gil']['holds_gil']:.0f} ms,"
         f" released {ov['gil']['releases_gil']:.1f} ms"),
        ("2a", "direct sample_sequences, 2 processes", f"{dl['direct_batches_per_s']:.1f} b/s",
         "1.00x", ""),
        ("2b", "DataLoader(buf.dataset), 2 workers", f"{dl['dataloader_batches_per_s']:.1f} b/s",
         f"{dl['ratio']:.2f}x", ">= 0.90x (median of paired rounds: "
                                + " ".join(f"{r:.2f}" for r in dl["ratios"]) + ")"),
    ]
    rows.append(("2c", "trainer unpickles a worker's batch: handoff", f"{ho['handoff_ms']:.3f} ms",
                 "", f"vs {ho['storages']} torch shared storages: "
                     f"{ho['torch_storages_ms']:.2f} ms"))
    if "skipped" in cu:
        rows.append(("3", "CUDA host-to-device", cu["skipped"], "", ""))
    else:
        rows.append(("3", "prefetch(device='cuda') vs pin_memory()+to()",
                     f"{cu['prefetch_batches_per_s']:.1f} b/s", f"{cu['ratio']:.2f}x", ""))
    rows.append(("4", "a fresh interpreter's 'import torch'",
                 f"{imp['torch']['s']:.2f} s, {imp['torch']['rss_mib']:.0f} MiB",
                 f"{imp['torch']['s'] / imp['shmbuf']['s']:.0f}x",
                 f"vs 'import shmbuf': {imp['shmbuf']['s']:.2f} s, "
                 f"{imp['shmbuf']['rss_mib']:.0f} MiB"))
    print(f"{'row':<4} {'measurement':<46} {'value':>18} {'ratio':>7}  target")
    for r in rows:
        print(f"{r[0]:<4} {r[1]:<46} {r[2]:>18} {r[3]:>7}  {r[4]}")
    print(f"\nsample {ov['sample_ms']:.2f} ms, compute {ov['compute_ms']:.2f} ms; "
          f"cpus={os.cpu_count()} load1 before/after={load0:.2f}/{os.getloadavg()[0]:.2f}; "
          f"leaked segments={tracker.leftovers() or 'none'}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"overlap": ov, "dataloader": dl, "cuda": cu, "imports": imp,
                                     "handoff": ho, "quick": args.quick,
                                     "shmbuf": shmbuf.__version__,
                                     "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}, indent=1))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
