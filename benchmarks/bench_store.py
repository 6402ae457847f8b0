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
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np
from _store_cases import bench_create, bench_ingest, bench_memory, bench_sampling, bench_scaling
from _store_report import Row, print_table
from _store_workload import SHM_DIR, Tracker

import shmbuf

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
    episode_rows: int      # rows per writer per repetition of extend (multiple of 500)
    ring_steps: int        # in-process numpy ring add() steps per repetition


QUICK = Config(reps=5, lat_calls=40, ingest_steps=15_000, queue_steps=3_000, batch_rows=32_000,
               add_rows=8_000, mem_steps=10_000, scale_calls=300, big_capacity=10_000_000,
               create_gib=0.5, touch_capacity=10_000, episode_rows=20_000, ring_steps=15_000)
FULL = Config(reps=9, lat_calls=200, ingest_steps=40_000, queue_steps=8_000, batch_rows=96_000,
              add_rows=24_000, mem_steps=10_000, scale_calls=1000, big_capacity=10_000_000,
              create_gib=1.0, touch_capacity=30_000, episode_rows=60_000, ring_steps=40_000)

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
