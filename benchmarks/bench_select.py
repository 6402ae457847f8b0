"""What each sampling regime costs per batch, against Uniform in the same run.

    python benchmarks/bench_select.py [--quick] [--json PATH]

Buffers of 10^4, 10^5 and 10^6 held steps of a small row (an int64 and the
done flag), written by 16 env streams (``add_batch``) in episodes of 100
steps, the buffer full and recycling.  Each repetition times one
``sample_sequences(50, 50, select=...)`` per regime, interleaved, after a
warm-up batch (Recency's per-chunk envelope is built once, then refreshed
per batch for the chunks written since).  Writers are idle while it times,
so Recency refreshes nothing: the figure is its steady cost without ingest.
Printed: the median time per batch in microseconds and its ratio to Uniform
at the same size, then each regime's growth from the smallest size to the
largest.  Nothing is asserted.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np

import shmbuf
from shmbuf.select import AgeBuckets, Mixture, Recency, Uniform

SIZES = (10_000, 100_000, 1_000_000)
ENVS, EPISODE = 16, 100
SPEC = {"x": ((), np.int64), "done": ((), np.bool_)}
REGIMES = {
    "Uniform()": Uniform(),
    "Recency(1.0)": Recency(1.0),
    "Recency(3.0)": Recency(3.0),
    "AgeBuckets(IRIS)": AgeBuckets([1 / 8, 1 / 8, 1 / 4, 1 / 2]),
    "Mixture(0.5 U, 0.5 R)": Mixture([(0.5, Uniform()), (0.5, Recency(1.0))]),
}
DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "bench_select.json"


def _fill(capacity: int) -> shmbuf.Buffer:
    buf = shmbuf.create(SPEC, capacity, seed=0)
    steps = capacity * 5 // 4 // ENVS           # full, and a quarter recycled
    with buf.writer() as w:
        for i in range(steps):
            w.add_batch(x=np.full(ENVS, i), done=np.full(ENVS, i % EPISODE == EPISODE - 1))
    return buf


def run(reps: int, sizes) -> dict:
    results = {}
    for size in sizes:
        with _fill(size) as buf:
            rng = np.random.default_rng(0)
            for sel in REGIMES.values():
                buf.sample_sequences(50, 50, select=sel, rng=rng)   # warm-up
            times = {k: [] for k in REGIMES}
            for _ in range(reps):
                for k, sel in REGIMES.items():
                    t0 = time.perf_counter()
                    buf.sample_sequences(50, 50, select=sel, rng=rng)
                    times[k].append(time.perf_counter() - t0)
            results[size] = {k: statistics.median(v) * 1e6 for k, v in times.items()}
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions, two sizes")
    ap.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = ap.parse_args()
    sizes = SIZES[:2] if args.quick else SIZES
    results = run(30 if args.quick else 200, sizes)
    print(f"{'regime':24s}" + "".join(f"{s:>22,d}" for s in sizes) + "   growth")
    for k in REGIMES:
        cells = "".join(f"{results[s][k]:10.0f} us {results[s][k] / results[s]['Uniform()']:5.2f}x"
                        for s in sizes)
        growth = results[sizes[-1]][k] / results[sizes[0]][k]
        print(f"{k:24s}{cells}   {growth:5.2f}x")
    print("(per batch of 50 windows of 50 steps: median us, and the ratio to Uniform at that "
          "size; growth: largest size over smallest)")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"machine": platform.platform(), "results": {
        str(s): r for s, r in results.items()}}, indent=1))


if __name__ == "__main__":
    main()
