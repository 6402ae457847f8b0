"""DreamerV3's replay speed test: upstream's ``Replay`` against ``shmbuf.compat.embodied``.

    python benchmarks/bench_embodied.py [--upstream PATH] [--full] [--json PATH]

Workload (DreamerV3's ``embodied/perf/test_replay.py``, ``test_speed``):
steps of ``image`` uint8 (64, 64, 3), ``vector`` f32 (1024,), ``action``
f32 (12,) and the three flags, added round-robin by 8 workers into a
replay of length 32, chunksize 1024; then single-item samples
(``sample(1)``), and the same items per second at DreamerV3's batch size
(``sample(16)``).  ``--full`` uses upstream's sizes (200k inserts,
capacity 100k, 100k samples); the default is a fifth of them.

Both sides run in this process, one after the other (their order swapped in
every repetition), with the same steps; each figure is the median of the
repetitions, and the ratios (shmbuf / upstream) are taken per repetition.
Upstream is imported from a DreamerV3 checkout (``--upstream``, default
``$DREAMERV3`` or ``../dreamerv3``) and needs its ``elements`` package; if
that fails the table says so and only shmbuf is measured.

The third figure is the bare copy of the same bytes, measured on shmbuf's
filled store right after its samples: per sample, a fresh array per key
filled by one slice of 32 consecutive rows at a random place of the store's
columns (the 526 KB a sample copies, with nothing drawn or checked); shmbuf's
samples per second are set against it per repetition (target >= 0.8).

Also measured, shmbuf only: ``update`` of priorities and one context key
for a 16 x 64 batch, and 4 actor processes adding 64x64x3 frames against
one.  Targets are printed, never asserted.  Every buffer is closed in
``finally``.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from shmbuf.compat.embodied import Replay

STEP = {
    "image": np.zeros((64, 64, 3), np.uint8),
    "vector": np.zeros(1024, np.float32),
    "action": np.zeros(12, np.float32),
    "is_first": np.array(False),
    "is_last": np.array(False),
    "is_terminal": np.array(False),
}
WORKERS, LENGTH, CHUNK = 8, 32, 1024
_FACADE_COLUMNS = ("item", "stream", "pos")   # the facade's own columns, not the keys'
BATCH = 16   # DreamerV3's batch size: items per second also at sample(16)
DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "bench_embodied.json"


def upstream_replay(path: str | None):
    """(upstream's Replay class, None) or (None, why it could not be imported)."""
    root = Path(path or os.environ.get("DREAMERV3") or Path(__file__).parents[2] / "dreamerv3")
    core = root / "embodied" / "core"
    if not (core / "replay.py").exists():
        return None, f"no DreamerV3 checkout at {root} (give --upstream PATH)"
    try:
        # The core package alone: embodied/__init__ pulls in the whole agent stack.
        spec = importlib.util.spec_from_file_location(
            "_upstream_core", core / "__init__.py", submodule_search_locations=[str(core)])
        package = importlib.util.module_from_spec(spec)
        sys.modules["_upstream_core"] = package
        for name in ("chunk", "limiters", "selectors", "replay"):
            sub = importlib.util.spec_from_file_location(f"_upstream_core.{name}",
                                                         core / f"{name}.py")
            module = importlib.util.module_from_spec(sub)
            sys.modules[f"_upstream_core.{name}"] = module
            sub.loader.exec_module(module)
        return sys.modules["_upstream_core.replay"].Replay, None
    except Exception as exc:   # noqa: BLE001 - said in the table (no 'elements', most often)
        return None, f"upstream Replay not importable from {root}: {exc!r}"


def bare_copy(replay, samples: int, batch: int = 1) -> float:
    """Samples (of ``batch`` items) per second of a bare slice copy of the bytes a sample
    copies: per sample, one fresh array per key, one 32-row slice per item."""
    arrays = replay.buffer.arrays
    columns = [arrays[name] for name in replay.buffer.spec if name not in _FACADE_COLUMNS]
    rng = np.random.default_rng(0)
    starts = rng.integers(0, len(columns[0]) - LENGTH, (samples, batch)).tolist()
    start = time.perf_counter()
    for row in starts:
        for column in columns:
            out = np.empty((batch, LENGTH) + column.shape[1:], column.dtype)
            for i, at in enumerate(row):
                out[i] = column[at:at + LENGTH]
    return samples / (time.perf_counter() - start)


def speed(make, inserts: int, samples: int, bare: bool = False) -> dict:
    replay = make()
    try:
        start = time.perf_counter()
        for _ in range(inserts // WORKERS):
            for worker in range(WORKERS):
                replay.add(STEP, worker)
        added = time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(samples):
            replay.sample(1)
        sampled = time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(samples // BATCH):
            replay.sample(BATCH)
        batched = time.perf_counter() - start
        copies = {}
        if bare:   # the same bytes, copied with nothing drawn or checked, in the same store
            copies = {"bare_samples_per_s": bare_copy(replay, samples),
                      f"bare_batch{BATCH}_items_per_s":
                          bare_copy(replay, samples // BATCH, BATCH) * BATCH}
    finally:
        close = getattr(replay, "close", None)
        if close is not None:
            close()
    return {"inserts_per_s": inserts / added, "samples_per_s": samples / sampled,
            f"batch{BATCH}_items_per_s": (samples // BATCH) * BATCH / batched, **copies}


def update_ms(calls: int = 200) -> float:
    replay = Replay(64, 20_000, chunksize=256, spec={
        "image": ((64, 64, 3), np.uint8), "deter": ((512,), np.float32),
        "is_first": ((), bool)})
    try:
        step = {"image": STEP["image"], "deter": np.zeros(512, np.float32), "is_first": False}
        for _ in range(4000):
            replay.add(step)
        data = replay.sample(16)
        update = {"stepid": data["stepid"], "priority": np.ones((16, 64), np.float32),
                  "deter": np.ones((16, 64, 512), np.float32)}
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            replay.update(update)
            times.append(time.perf_counter() - start)
        return 1e3 * statistics.median(times)
    finally:
        replay.close()


def _actor(replay, worker: int, steps: int, ready, go) -> None:
    frame = {"image": np.zeros((64, 64, 3), np.uint8), "is_first": np.array(False)}
    replay.add(frame, worker)
    ready.put(worker)
    go.wait(60)
    for _ in range(steps - 1):
        replay.add(frame, worker)


def actors_rate(n: int, steps: int) -> float:
    """Steps per second added by ``n`` spawned actor processes together."""
    ctx = mp.get_context("spawn")
    replay = Replay(16, n * steps, chunksize=256,
                    spec={"image": ((64, 64, 3), np.uint8), "is_first": ((), bool)})
    procs = []
    try:
        ready, go = ctx.Queue(), ctx.Event()
        procs = [ctx.Process(target=_actor, args=(replay, w, steps, ready, go))
                 for w in range(n)]
        for p in procs:
            p.start()
        for _ in procs:
            ready.get(timeout=120)
        start = time.perf_counter()
        go.set()
        for p in procs:
            p.join(timeout=600)
        return n * (steps - 1) / (time.perf_counter() - start)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        replay.close()


def median(values):
    return statistics.median(values) if values else float("nan")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--upstream", help="a DreamerV3 checkout (default $DREAMERV3)")
    ap.add_argument("--full", action="store_true", help="upstream's sizes (needs ~4 GB)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = ap.parse_args(argv)
    scale = 1 if args.full else 5
    inserts, capacity, samples = 200_000 // scale, 100_000 // scale, 100_000 // scale
    Upstream, why = upstream_replay(args.upstream)
    rows = {"shmbuf": [], "upstream": []}
    for rep in range(args.reps):
        sides = [("shmbuf", lambda: speed(lambda: Replay(LENGTH, capacity, chunksize=CHUNK),
                                          inserts, samples, bare=True))]
        if Upstream is not None:
            sides.append(("upstream", lambda: speed(
                lambda: Upstream(LENGTH, capacity, chunksize=CHUNK), inserts, samples)))
        for side, run in (sides if rep % 2 == 0 else sides[::-1]):
            rows[side].append(run())
    result = {"inserts": inserts, "capacity": capacity, "samples": samples,
              "upstream_error": why}
    print(f"DreamerV3 speed test: {WORKERS} workers, length {LENGTH}, chunksize {CHUNK}, "
          f"{inserts} inserts, capacity {capacity}, {samples} samples; median of {args.reps}; "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"{'':22}{'shmbuf':>12}{'upstream':>12}{'ratio':>9}  target")
    for key in ("inserts_per_s", "samples_per_s", f"batch{BATCH}_items_per_s"):
        mine = [r[key] for r in rows["shmbuf"]]
        theirs = [r[key] for r in rows["upstream"]]
        ratios = [a / b for a, b in zip(mine, theirs)]
        result[key] = {"shmbuf": median(mine), "upstream": median(theirs),
                       "ratio": median(ratios), "runs": {"shmbuf": mine, "upstream": theirs}}
        spread = f"  (ratios {min(ratios):.2f}-{max(ratios):.2f})" if ratios else ""
        target = {"inserts_per_s": ">= 2", "samples_per_s": ">= 1.5"}.get(key, "-   ")
        print(f"{key:22}{median(mine):12.0f}{median(theirs):12.0f}{median(ratios):9.2f}  "
              f"{target}{spread}")
    if why:
        print(f"upstream not measured: {why}")
    print(f"{'':22}{'shmbuf':>12}{'bare copy':>12}{'ratio':>9}  target")
    for key, bare_key in (("samples_per_s", "bare_samples_per_s"),
                          (f"batch{BATCH}_items_per_s", f"bare_batch{BATCH}_items_per_s")):
        mine = [r[key] for r in rows["shmbuf"]]
        bare = [r[bare_key] for r in rows["shmbuf"]]
        ratios = [a / b for a, b in zip(mine, bare)]
        result[bare_key] = {"bare": median(bare), "ratio": median(ratios), "runs": bare}
        target = ">= 0.8" if key == "samples_per_s" else "-     "
        print(f"{key:22}{median(mine):12.0f}{median(bare):12.0f}{median(ratios):9.2f}  "
              f"{target}  (ratios {min(ratios):.2f}-{max(ratios):.2f})")
    theirs = [r["samples_per_s"] for r in rows["upstream"]]
    bare = [r["bare_samples_per_s"] for r in rows["shmbuf"]]
    if theirs:
        ratios = [a / b for a, b in zip(bare, theirs)]
        print(f"bare copy / upstream, samples_per_s: {median(ratios):.2f} "
              f"(ratios {min(ratios):.2f}-{max(ratios):.2f})")
    result["update_ms"] = update_ms()
    print(f"update (priority + one context key, 16 x 64): {result['update_ms']:.3f} ms  "
          "(target <= 1 ms)")
    steps = 20_000 // scale * 2
    one, four = actors_rate(1, steps), actors_rate(4, steps)
    result["actors"] = {"one_per_s": one, "four_per_s": four, "ratio": four / one}
    print(f"64x64x3 frames added: 1 actor {one:.0f}/s, 4 actors {four:.0f}/s, ratio "
          f"{four / one:.2f}  (target >= 3 with spare cores; {os.cpu_count()} CPUs here)")
    result["machine"] = {"python": platform.python_version(), "cpus": os.cpu_count(),
                         "load_1min": os.getloadavg()[0]}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
