"""Bounded soak: 4 writers and 2 readers on one buffer, then the readers alone.

Prints steps written, windows verified, sample latency p50/p99 with writers
running and idle, and each reader's private memory at the start and end.

    python tests/helpers/soak.py --seconds 600
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time

import numpy as np

# tests/, so that ``helpers`` imports when this file is run as a script.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import shmbuf  # noqa: E402
from helpers.procs import join_all, running  # noqa: E402
from helpers.workers import SPEC, episode_steps, verify_batch  # noqa: E402


def private_kib() -> int:
    """Anonymous resident memory of this process (shared-memory pages excluded)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    return 0


def _writer(buf, writer_id, stop):
    with buf.writer() as w:
        for step in episode_steps(writer_id, 100_000_000, 50):
            if stop.is_set():
                break
            w.add(**step)


def _reader(buf, phase_busy, phase_idle, stop, results):
    """Sample and verify until ``stop``; latencies are tagged busy or idle."""
    busy, idle, windows = [], [], 0
    for _ in range(20):
        verify_batch(buf.sample_sequences(16, 16))  # warm up: touch the pages once
    rss_start = private_kib()
    while not stop.is_set():
        tag = busy if phase_busy.is_set() else idle if phase_idle.is_set() else None
        t0 = time.perf_counter()
        batch = buf.sample_sequences(16, 16)
        elapsed = time.perf_counter() - t0
        windows += verify_batch(batch)
        if tag is not None:
            tag.append(elapsed)
    results.put({"windows": windows, "busy": busy, "idle": idle,
                 "rss_start_kib": rss_start, "rss_end_kib": private_kib()})


def run(seconds: float = 60.0, n_writers: int = 4, n_readers: int = 2) -> dict:
    ctx = mp.get_context("spawn")
    stop_writers, stop_readers = ctx.Event(), ctx.Event()
    busy, idle = ctx.Event(), ctx.Event()
    results = ctx.Queue()
    with shmbuf.create(SPEC, capacity=50_000, seed=0) as buf:
        writers = [ctx.Process(target=_writer, args=(buf, i, stop_writers))
                   for i in range(n_writers)]
        readers = [ctx.Process(target=_reader, args=(buf, busy, idle, stop_readers, results))
                   for _ in range(n_readers)]
        procs = list(writers)
        with running(procs):
            buf.wait_ready(min_steps=5_000, timeout=120)
            procs += readers              # reaped with the writers
            for p in readers:
                p.start()
            busy.set()
            time.sleep(seconds * 0.6)  # the soak's duration, not a synchronisation
            stop_writers.set()
            join_all(writers, 60, expect=None)
            busy.clear()
            written = buf.stats().steps_written
            idle.set()
            time.sleep(seconds * 0.4)
            stop_readers.set()
            got = [results.get(timeout=120) for _ in readers]
            join_all(readers, 60, expect=None)
            codes = [p.exitcode for p in procs]
    lat_busy = np.concatenate([r["busy"] for r in got]) * 1e3
    lat_idle = np.concatenate([r["idle"] for r in got]) * 1e3
    return {
        "seconds": seconds, "writers": n_writers, "readers": n_readers,
        "exit_codes": codes, "steps_written": written,
        "windows_verified": sum(r["windows"] for r in got),
        "busy_p50_ms": float(np.percentile(lat_busy, 50)),
        "busy_p99_ms": float(np.percentile(lat_busy, 99)),
        "idle_p50_ms": float(np.percentile(lat_idle, 50)),
        "idle_p99_ms": float(np.percentile(lat_idle, 99)),
        "reader_rss_kib": [(r["rss_start_kib"], r["rss_end_kib"]) for r in got],
    }


def describe(r: dict) -> str:
    return (f"soak {r['seconds']:.0f}s, {r['writers']} writers + {r['readers']} readers: "
            f"{r['steps_written']} steps written, {r['windows_verified']} windows verified; "
            f"sample(16x16) p50/p99 with writers {r['busy_p50_ms']:.3f}/{r['busy_p99_ms']:.3f} ms, "
            f"idle {r['idle_p50_ms']:.3f}/{r['idle_p99_ms']:.3f} ms; reader private RSS "
            f"start->end KiB {r['reader_rss_kib']}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    args = parser.parse_args()
    print(describe(run(args.seconds)))
