"""Saving a buffer to disk: Buffer.save against the machine's own write speeds, same run.

    python benchmarks/bench_save.py [--quick] [--mib N] [--dir PATH] [--json PATH]

Fills a W1 buffer (obs uint8 (3, 64, 64), action f32 (6,), reward f32, done
bool; episodes of 500 steps) of about N MiB, then measures, each the median of
``reps`` repetitions (min-max shown), on the file system of ``--dir`` (default:
a fresh directory under benchmarks/results, on the same disk as the repo):

  save       Buffer.save(path): every live chunk written from shared memory,
             validated, into the page cache (no fsync), manifest renamed in
  plain      the same number of bytes as one private numpy array, np.save'd:
             the best a page-cache write of this data can do (baseline)
  disk       the same bytes written and fsync'd: the disk's own write speed
  durable    Buffer.save(path, durable=True): fsync'd before the manifest
  busy       Buffer.save while 2 writer processes keep adding (recycling)

Ratios are save / plain and durable / disk.  Targets (reported, not
asserted): save >= 500 MB/s to the page cache.  MB is 10**6 bytes.
Everything written is removed at the end, and the buffer is closed (the
owner unlinks it) in ``finally``.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import numpy as np

import shmbuf

HERE = Path(__file__).resolve().parent
DEFAULT_JSON = HERE / "results" / "bench_save.json"
SPEC = {"obs": ((3, 64, 64), np.uint8), "action": ((6,), np.float32),
        "reward": ((), np.float32), "done": ((), np.bool_)}
ROW_BYTES = 3 * 64 * 64 + 6 * 4 + 4 + 1 + 8 + 8  # columns + the saved _episode and _stream
EPISODE = 500
TARGET_MB_S = 500


def fill(buf, rows: int) -> None:
    """``rows`` W1 steps in 4 streams, written with Writer.extend in runs of one episode."""
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 255, (EPISODE, 3, 64, 64), dtype=np.uint8)
    done = np.zeros(EPISODE, np.bool_)
    done[-1] = True
    writers = [buf.writer() for _ in range(4)]
    try:
        for i in range(rows // EPISODE):
            run = {"obs": frames, "action": np.full((EPISODE, 6), i, np.float32),
                   "reward": np.arange(EPISODE, dtype=np.float32), "done": done}
            w = writers[i % 4]
            if hasattr(w, "extend"):
                w.extend(**run)
            else:
                for t in range(EPISODE):
                    w.add(**{k: v[t] for k, v in run.items()})
    finally:
        for w in writers:
            w.close()


def busy_writer(name: str, stop) -> None:
    buf = shmbuf.attach(name)
    frame = np.zeros((3, 64, 64), np.uint8)
    with buf.writer() as w:
        t = 0
        while not stop.is_set():
            w.add(obs=frame, action=np.zeros(6, np.float32), reward=0.0, done=t % EPISODE == 0)
            t += 1


def timed(fn, reps: int, setup=None) -> list[float]:
    out = []
    for _ in range(reps):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def fsync_dir(path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="256 MiB, 3 repetitions")
    parser.add_argument("--mib", type=int, default=None, help="buffer size (default 1024)")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (a disk)")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = parser.parse_args()
    mib = args.mib or (256 if args.quick else 1024)
    reps = args.reps or (3 if args.quick else 5)
    capacity = mib * 2**20 // (3 * 64 * 64)
    parent = args.dir or HERE / "results"
    parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench_save-", dir=parent))
    results = {}
    ctx = mp.get_context("spawn")
    buf = shmbuf.create(SPEC, capacity, seed=0)
    try:
        fill(buf, capacity)
        rows = len(buf)
        nbytes = rows * ROW_BYTES
        target = work / "save"

        def clean():
            shutil.rmtree(target, ignore_errors=True)
            (work / "plain.npy").unlink(missing_ok=True)

        def plain(data):
            np.save(work / "plain.npy", data)

        def disk(data):
            with open(work / "plain.npy", "wb") as f:
                f.write(memoryview(data).cast("B"))
                f.flush()
                os.fsync(f.fileno())
            fsync_dir(work)

        private = np.frombuffer(np.random.default_rng(1).bytes(nbytes), np.uint8)
        results["save"] = timed(lambda: buf.save(target), reps, clean)
        results["plain"] = timed(partial(plain, private), reps, clean)
        results["disk"] = timed(partial(disk, private), reps, clean)
        results["durable"] = timed(lambda: buf.save(target, durable=True), reps, clean)
        del private
        stop = ctx.Event()
        procs = [ctx.Process(target=busy_writer, args=(buf.name, stop)) for _ in range(2)]
        for p in procs:
            p.start()
        try:
            buf.wait_ready(1, timeout=60)
            busy_bytes = []

            def busy():
                n = buf.save(target)
                busy_bytes.append(n * ROW_BYTES)

            results["busy"] = timed(busy, reps, clean)
        finally:
            stop.set()
            for p in procs:
                p.join(60)
                if p.is_alive():
                    p.kill()
        clean()
    finally:
        buf.close()
        shutil.rmtree(work, ignore_errors=True)

    def rate(key, n=None):
        return [(n or nbytes) / t / 1e6 for t in results[key]]

    rates = {k: rate(k) for k in ("save", "plain", "disk", "durable")}
    rates["busy"] = [b / t / 1e6 for b, t in zip(busy_bytes, results["busy"])]
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(f"bench_save: {rows} W1 steps, {nbytes / 1e6:.0f} MB per save, {reps} repetitions, "
          f"on {parent} ({platform.node()}, Python {platform.python_version()}, "
          f"numpy {np.__version__})")
    print(f"{'measurement':<44} {'MB/s median':>12} {'min-max':>15} {'ratio':>8}")
    rows_out = [
        ("Buffer.save, page cache", "save", f"{med['save'] / med['plain']:.2f}x plain"),
        ("np.save of one private array (plain)", "plain", ""),
        ("the same bytes written + fsync (disk)", "disk", ""),
        ("Buffer.save(durable=True)", "durable", f"{med['durable'] / med['disk']:.2f}x disk"),
        ("Buffer.save while 2 writers add", "busy", f"{med['busy'] / med['save']:.2f}x idle"),
    ]
    for label, key, ratio in rows_out:
        lo, hi = min(rates[key]), max(rates[key])
        print(f"{label:<44} {med[key]:>12.0f} {lo:>7.0f}-{hi:<7.0f} {ratio:>8}")
    print(f"target: save >= {TARGET_MB_S} MB/s to the page cache: "
          f"{'met' if med['save'] >= TARGET_MB_S else 'MISSED'} ({med['save']:.0f} MB/s, "
          f"{med['save'] / med['disk']:.1f}x this disk's own write speed)")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"rows": rows, "bytes": nbytes, "reps": reps,
                                     "mb_s": rates, "median_mb_s": med,
                                     "dir": str(parent), "python": sys.version}, indent=1))


if __name__ == "__main__":
    main()
