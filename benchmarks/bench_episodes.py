"""Per-episode sampling stays flat as the number of held episodes grows.

    python benchmarks/bench_episodes.py [--quick] [--json PATH]

PlaNet's ``Memory.sample`` draws each held episode with equal probability
and a uniform start within it.  Before the core had an episode index, the
facade counted every committed row on each call, so the cost grew with the
buffer (7x from 10 to 1,000 episodes of 100 steps).  This benchmark fills a
Memory (and a plain buffer sampled with ``uniform="episodes"``) with 10, 100
and 1,000 episodes of 100 steps and times ``Memory.sample(16, 10)`` (and
``sample_sequences(16, 11, uniform="episodes")``) on each, interleaved within
every repetition.  The ratio printed is each size's time over the
10-episode time of the same repetition; the target is at most 1.3 at 1,000
episodes.  Medians of the repetitions, with min-max.  Nothing is asserted.

Two observation sizes: 8 float32 values, where the index is all that could
grow, and 3x64x64 uint8 frames, where the gather itself slows down once the
data no longer fits in the caches (10 episodes are 12 MB, 1,000 are 1.2 GB).
The control row "numpy gather" copies the same number of random rows out of
a private array of the same size: what memory alone does to the cost.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

import shmbuf

SIZES = (10, 100, 1000)
STEPS = 100
OBS_KINDS = {"vec8 f32": ((8,), np.float32), "3x64x64 u8": ((3, 64, 64), np.uint8)}
TARGET = 1.3
DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "bench_episodes.json"


def _episode(rng, shape, dtype) -> shmbuf.Episode:
    ep = shmbuf.Episode()
    frame = rng.integers(0, 255, shape).astype(dtype)
    for t in range(STEPS):
        ep.append(frame, np.zeros(6, np.float32), 0.0, t == STEPS - 1)
    ep.terminate(frame)
    return ep


def _fill_memory(n: int, episode, shape, dtype) -> shmbuf.Memory:
    memory = shmbuf.Memory(n, steps_per_episode=STEPS, obs_shape=shape, action_size=6,
                           obs_dtype=dtype, seed=0)
    for _ in range(n):
        memory.append([episode])
    return memory


def _fill_buffer(n: int, shape, dtype) -> shmbuf.Buffer:
    spec = {"obs": (shape, dtype), "action": ((6,), np.float32), "done": ((), np.bool_)}
    buf = shmbuf.create(spec, n * STEPS * 5 // 4 + 1024, seed=0)
    frames = np.zeros((STEPS,) + shape, dtype)
    with buf.writer() as w:
        for _ in range(n):
            for t in range(STEPS):
                w.add(obs=frames[t], action=np.zeros(6, np.float32), done=t == STEPS - 1)
    return buf


def _time(call, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - start) / calls


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = parser.parse_args(argv)
    reps, calls = (5, 50) if args.quick else (9, 200)
    made = []
    rng = np.random.default_rng(1)
    try:
        cases = {n: {} for n in SIZES}
        for kind, (shape, dtype) in OBS_KINDS.items():
            episode = _episode(rng, shape, dtype)
            for n in SIZES:
                memory = _fill_memory(n, episode, shape, dtype)
                buf = _fill_buffer(n, shape, dtype)
                made += [memory, buf]
                private = np.ones((n * (STEPS + 1),) + shape, dtype)
                cases[n][f"Memory.sample(16, 10), {kind}"] = lambda m=memory: m.sample(16, 10)
                cases[n][f"uniform='episodes' (16, 11), {kind}"] = \
                    lambda b=buf: b.sample_sequences(16, 11, uniform="episodes")
                cases[n][f"numpy gather 16x11 rows, {kind}"] = \
                    lambda a=private: a.take(rng.integers(0, len(a), (11, 16)), axis=0)
        names = list(cases[SIZES[0]])
        times = {(name, n): [] for name in names for n in SIZES}
        for _ in range(reps):
            for name in names:
                for n in SIZES:
                    cases[n][name]()   # warm
                    times[name, n].append(_time(cases[n][name], calls))
    finally:
        for obj in made:
            obj.close()
    report = {"python": sys.version.split()[0], "machine": platform.machine(),
              "reps": reps, "calls": calls, "target_ratio_at_1000": TARGET, "rows": []}
    print(f"{'case':<44} {'episodes':>8} {'median us':>10} {'ratio to 10':>12} {'min-max':>13}")
    for name in names:
        for n in SIZES:
            ratios = [t / b for t, b in zip(times[name, n], times[name, SIZES[0]])]
            med = statistics.median(times[name, n]) * 1e6
            r = statistics.median(ratios)
            print(f"{name:<44} {n:>8} {med:>10.1f} {r:>12.2f} "
                  f"{min(ratios):>6.2f}-{max(ratios):<6.2f}")
            report["rows"].append({"case": name, "episodes": n, "median_us": med,
                                   "ratio_to_10": r, "ratio_min": min(ratios),
                                   "ratio_max": max(ratios)})
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))
    print(f"target: ratio at 1000 episodes <= {TARGET}; JSON: {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
