"""Dreamer ``ReplayBuffer.sample()`` against torchwm's single-process numpy ring, same run.

    python benchmarks/bench_dreamer.py [--quick] [--json PATH]

Workload: size 100k, obs uint8 (3, 64, 64), action f32 (6,), seq_len 50,
batch_size 50, episodes of 500 steps; both buffers get the same 110k steps
(so both have wrapped).  The baseline, ``UpstreamRing``, is torchwm 0.4.2's
ring written out here: a Python loop over the batch drawing start indices
with ``np.random.randint``, then one fancy-indexed gather.  It ignores
terminals; shmbuf's windows never cross an episode, which is checked on every
timed batch (outside the timed region).

Every figure is the median of at least 5 repetitions, with its min-max; in
each repetition the two sides are called in turn, so the ratio (shmbuf /
baseline) is taken per repetition.  Targets are printed, never asserted.
The buffer is closed (and so unlinked) in ``finally``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from shmbuf.compat.dreamer import ReplayBuffer

SIZE, OBS, ACTION, SEQ_LEN, BATCH = 100_000, (3, 64, 64), 6, 50, 50
EPISODE = 500
TARGET = 1.2            # shmbuf / baseline, at most
DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "bench_dreamer.json"


class UpstreamRing:
    """torchwm's Dreamer ring as documented: one process, global np.random, no terminal check."""

    def __init__(self, size, obs_shape, action_size, seq_len, batch_size):
        self.size, self.seq_len, self.batch_size = size, seq_len, batch_size
        self.idx, self.full, self.steps, self.episodes = 0, False, 0, 0
        self.observations = np.empty((size, *obs_shape), dtype=np.uint8)
        self.actions = np.empty((size, action_size), dtype=np.float32)
        self.rewards = np.empty((size,), dtype=np.float32)
        self.terminals = np.empty((size,), dtype=np.float32)

    def add(self, obs, ac, rew, done):
        self.observations[self.idx] = obs["image"]
        self.actions[self.idx] = ac
        self.rewards[self.idx] = rew
        self.terminals[self.idx] = done
        self.idx = (self.idx + 1) % self.size
        self.full = self.full or self.idx == 0
        self.steps += 1
        self.episodes += 1 if done else 0

    def _sample_idx(self, L):
        upper = (self.size if self.full else self.idx) - L
        while True:
            start = np.random.randint(0, upper)
            idxs = np.arange(start, start + L) % self.size
            if self.idx not in idxs[1:]:
                return idxs

    def sample(self):
        n, L = self.batch_size, self.seq_len
        vec = np.asarray([self._sample_idx(L) for _ in range(n)]).transpose().reshape(-1)
        obs = self.observations[vec]
        return (obs.reshape(L, n, *obs.shape[1:]), self.actions[vec].reshape(L, n, -1),
                self.rewards[vec].reshape(L, n), self.terminals[vec].reshape(L, n))


def fill(buffers, n_steps: int) -> None:
    """The same ``n_steps`` transitions into every buffer: reward = step number."""
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 256, (16, *OBS), dtype=np.uint8)
    action = rng.standard_normal(ACTION).astype(np.float32)
    for i in range(n_steps):
        obs, done = {"image": frames[i & 15]}, float(i % EPISODE == EPISODE - 1)
        for buf in buffers:
            buf.add(obs, action, float(i), done)


def check_windows(batch) -> None:
    """shmbuf's windows: contiguous steps, never past a terminal (reported, not asserted)."""
    _, _, rew, term = batch
    contiguous = (np.diff(rew, axis=0) == 1).all()
    if not contiguous or term[:-1].any():
        raise RuntimeError("shmbuf returned a window that crosses an episode or a gap")


def crossing_fraction(ring: UpstreamRing, n_batches: int = 20) -> float:
    """Share of the baseline's windows that cross an episode boundary (its known bug)."""
    crossed = 0
    for _ in range(n_batches):
        crossed += int(ring.sample()[3][:-1].any(axis=0).sum())
    return crossed / (n_batches * ring.batch_size)


def timed(fn, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def measure(rb: ReplayBuffer, ring: UpstreamRing, reps: int, calls: int) -> dict:
    for _ in range(3):   # warm the allocator and page tables
        check_windows(rb.sample())
        ring.sample()
    shm, base = [], []
    for rep in range(reps):
        pair = [("shm", rb.sample), ("base", ring.sample)]
        for side, fn in (pair if rep % 2 == 0 else pair[::-1]):
            (shm if side == "shm" else base).append(timed(fn, calls))
        check_windows(rb.sample())
    return {"shmbuf": shm, "baseline": base, "ratio": [s / b for s, b in zip(shm, base)]}


def summary(values) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "n": len(values), "values": list(values)}


def print_table(result: dict, crossing: float) -> None:
    s, b, r = (summary(result[k]) for k in ("shmbuf", "baseline", "ratio"))

    def ms(d):
        return f"{d['median'] * 1e3:.2f} [{d['min'] * 1e3:.2f}-{d['max'] * 1e3:.2f}] ms"

    heads = ("measurement", "shmbuf", "baseline", "ratio", "target", "met?")
    widths = (44, 26, 26, 20, 8, 4)
    cells = (f"Dreamer sample() L={SEQ_LEN} B={BATCH} 3x64x64", ms(s), ms(b),
             f"{r['median']:.3g} [{r['min']:.3g}-{r['max']:.3g}]", f"<= {TARGET:g}x",
             "yes" if r["median"] <= TARGET else "NO")
    line = "  ".join(f"{h:<{w}}" for h, w in zip(heads, widths))
    print(line)
    print("-" * len(line))
    print("  ".join(f"{c:<{w}}" for c, w in zip(cells, widths)))
    print()
    print("  baseline = torchwm 0.4.2 Dreamer ReplayBuffer (numpy ring, one process), same run")
    print(f"  baseline windows crossing an episode boundary: {crossing:.1%} "
          "(shmbuf: 0%, checked on every repetition)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="5 repetitions of 10 calls")
    ap.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write results")
    args = ap.parse_args(argv)
    reps, calls = (5, 10) if args.quick else (7, 30)
    load = os.getloadavg()[0]
    if load > 0.5:
        print(f"warning: 1-minute load average is {load:.2f}; figures may be noisy",
              file=sys.stderr)
    np.random.seed(0)
    rb = ReplayBuffer(SIZE, OBS, ACTION, SEQ_LEN, BATCH, seed=0)
    try:
        ring = UpstreamRing(SIZE, OBS, ACTION, SEQ_LEN, BATCH)
        t0 = time.perf_counter()
        fill((rb, ring), int(SIZE * 1.1))
        print(f"filled both buffers with {int(SIZE * 1.1)} steps in "
              f"{time.perf_counter() - t0:.1f} s; shmbuf holds {rb.buffer.stats().live_steps}")
        result = measure(rb, ring, reps, calls)
        crossing = crossing_fraction(ring)
    finally:
        rb.close()
    print_table(result, crossing)
    meta = {"python": sys.version.split()[0], "numpy": np.__version__,
            "machine": platform.machine(), "cpus": os.cpu_count(), "load_1min": load,
            "reps": reps, "calls_per_rep": calls, "size": SIZE, "obs": OBS,
            "seq_len": SEQ_LEN, "batch_size": BATCH, "episode": EPISODE}
    out = {"meta": meta, "unit": "s/call", "ratio_is": "shmbuf / baseline, per repetition",
           "target": f"ratio <= {TARGET}", "baseline_crossing_fraction": crossing,
           **{k: summary(v) for k, v in result.items()}}
    out["met"] = out["ratio"]["median"] <= TARGET
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
