"""Paired before/after timings of two shmbuf source trees, in one run.

    python benchmarks/versus.py --base REV [--head REV] [--reps N]

Builds each revision in a temporary git worktree (``build_ext --inplace``),
then runs the same small workload in a fresh process per tree, alternating
base and head in every repetition so that drift in the machine's load hits
both alike.  Prints, per case, the median time of each side and the median
of the per-repetition ratios head / base (below 1: head is faster), with
their min-max.  The workload uses only API that both sides have: create,
add, add_batch, sample_sequences, sample_steps.  Nothing is asserted; the
JSON goes to benchmarks/results/versus.json.

Cases (W1 frames: obs uint8 (3, 64, 64), action f32 (6,), reward, done;
capacity 10k, episodes of 500 steps, one process):
  add                one step per call, one stream
  add_batch x16      16 env rows per call
  sample 256x4       sample_sequences(256, 4) on a full buffer
  sample 50x50       sample_sequences(50, 50)
  sample_steps 256   sample_steps(256)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"

WORKLOAD = r'''
import json, time
import numpy as np
import shmbuf

spec = {"obs": ((3, 64, 64), np.uint8), "action": ((6,), np.float32),
        "reward": ((), np.float32), "done": ((), np.bool_)}
frame, act = np.zeros((3, 64, 64), np.uint8), np.zeros(6, np.float32)
out = {}

def timed(name, call, n):
    call()
    t = time.perf_counter()
    for _ in range(n):
        call()
    out[name] = (time.perf_counter() - t) / n

with shmbuf.create(spec, 10_000, seed=0) as buf:
    w = buf.writer()
    step = [0]
    def add():
        step[0] += 1
        w.add(obs=frame, action=act, reward=0.0, done=step[0] % 500 == 0)
    timed("add", add, 20_000)
    frames, acts = np.zeros((16, 3, 64, 64), np.uint8), np.zeros((16, 6), np.float32)
    rew, dones = np.zeros(16, np.float32), np.zeros(16, np.bool_)
    wb = buf.writer()
    timed("add_batch x16", lambda: wb.add_batch(obs=frames, action=acts, reward=rew,
                                                done=dones), 2_000)
    timed("sample 256x4", lambda: buf.sample_sequences(256, 4), 2_000)
    timed("sample 50x50", lambda: buf.sample_sequences(50, 50), 200)
    timed("sample_steps 256", lambda: buf.sample_steps(256), 2_000)
    w.close(); wb.close()
print(json.dumps(out))
'''


def build(rev: str, where: Path) -> Path:
    if Path(rev).is_dir():
        return Path(rev).resolve()
    tree = where / rev.replace("/", "_")
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-f", str(tree), rev],
                   check=True, capture_output=True)
    subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace", "-q"], cwd=tree,
                   check=True, capture_output=True)
    return tree


def run(tree: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree))
    done = subprocess.run([sys.executable, "-c", WORKLOAD], env=env, cwd=tree,
                          capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise RuntimeError(f"workload failed in {tree}:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="git revision measured as the baseline")
    ap.add_argument("--head", default="HEAD", help="git revision measured against it, or a "
                    "directory holding a built source tree (e.g. . for the working tree)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json", type=Path, default=RESULTS / "versus.json")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="shmbuf-versus-") as tmp:
        trees = {}
        try:
            trees = {side: build(rev, Path(tmp)) for side, rev in
                     (("base", args.base), ("head", args.head))}
            runs = {"base": [], "head": []}
            for rep in range(args.reps):
                order = ("base", "head") if rep % 2 == 0 else ("head", "base")
                for side in order:
                    runs[side].append(run(trees[side]))
        finally:
            for tree in trees.values():
                if tree.parent != Path(tmp):
                    continue  # a directory given as it is: not ours to remove
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                                str(tree)], capture_output=True)
    report = {"base": args.base, "head": args.head, "reps": args.reps, "cases": {}}
    print(f"base {args.base}  head {args.head}  {args.reps} alternating repetitions")
    print(f"{'case':<18} {'base us':>9} {'head us':>9} {'head/base':>10} {'min-max':>13}")
    for case in runs["base"][0]:
        base = [r[case] for r in runs["base"]]
        head = [r[case] for r in runs["head"]]
        ratios = [h / b for h, b in zip(head, base)]
        row = {"base_us": statistics.median(base) * 1e6, "head_us": statistics.median(head) * 1e6,
               "ratio": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
        report["cases"][case] = row
        print(f"{case:<18} {row['base_us']:>9.1f} {row['head_us']:>9.1f} {row['ratio']:>10.2f} "
              f"{row['min']:>6.2f}-{row['max']:<6.2f}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
