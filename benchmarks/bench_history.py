"""HistoryBuffer.get against a per-env collections.deque baseline, measured in the same run.

    python benchmarks/bench_history.py [--quick] [--json PATH]

Prints one fixed-format table and writes a JSON file (default
benchmarks/results/bench_history.json).  Every figure is the median of at
least five repetitions, with its min-max; within a repetition the baseline
and shmbuf blocks are interleaved and the ratio (baseline / shmbuf, higher is
better for shmbuf) is taken per repetition.  Targets are reported, never
asserted.  The buffer is closed (its owner unlinks it) in ``finally``.

Workload: 16 envs, get(n=8) at action_block=4; 'pixels' (16, 1, 64, 64, 3)
uint8 and 'action' (16, 1, 6) float32, a block key; 64 steps appended, so
every env is past warm-up, holds its newest 32 entries (max_len), and its
newest window is one unwrapped run of its ring (so get_view applies).

The baseline is the straightforward implementation of the documented
semantics: one deque of per-env entry dicts per env, get() looping over keys
and envs, concatenating frames and blocks and stacking envs (numpy or torch,
following the input), NaN (only) zeroed in blocks.  Torch runs on one
thread (``torch.set_num_threads(1)``), which only helps the baseline.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from shmbuf.compat.history import HistoryBuffer

N_ENVS, N, AB, MAX_LEN, STEPS = 16, 8, 4, 32, 66
TARGET = 20.0
DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "bench_history.json"


@dataclasses.dataclass(frozen=True)
class Config:
    reps: int    # repetitions per figure (>= 5)
    calls: int   # calls per timed block


QUICK = Config(reps=5, calls=40)
FULL = Config(reps=9, calls=150)


# -- the baseline -------------------------------------------------------------------
def _is_torch(x) -> bool:
    return type(x).__module__.startswith("torch")


def _cat(xs):
    if _is_torch(xs[0]):
        import torch
        return torch.stack(xs) if xs[0].ndim == 0 else torch.cat(xs)
    return np.stack(xs) if xs[0].ndim == 0 else np.concatenate(xs)


def _stack(xs):
    if _is_torch(xs[0]):
        import torch
        return torch.stack(xs)
    return np.stack(xs)


def _zero_nan(x):
    if _is_torch(x):
        import torch
        return torch.where(torch.isnan(x), torch.zeros((), dtype=x.dtype), x)
    return np.where(np.isnan(x), x.dtype.type(0), x)


class DequeHistory:
    """Per-env deques of entry dicts; get() builds the documented output with loops."""

    def __init__(self, n_envs, max_len, action_block=1, block_keys=()):
        self.ab, self.block_keys = action_block, frozenset(block_keys)
        self.envs = [collections.deque(maxlen=max_len) for _ in range(n_envs)]

    def append(self, info):
        for i, d in enumerate(self.envs):
            d.append({k: v[i].clone() if _is_torch(v) else v[i].copy() for k, v in info.items()})

    def get(self, n, env_ids=None):
        envs = self.envs if env_ids is None else [self.envs[i] for i in env_ids]
        if n <= 0 or any(len(d) == 0 for d in envs):
            return None
        out = {}
        for key in envs[0][-1]:
            if key in self.block_keys:
                if n > 1:
                    out[key] = _stack([self._blocks(d, key, n) for d in envs])
                continue
            per_env = []
            for d in envs:
                k = min(n, (len(d) - 1) // self.ab + 1)
                frames = [d[-1 - off * self.ab][key] for off in reversed(range(k))]
                per_env.append(_cat([frames[0]] * (n - k) + frames))
            out[key] = _stack(per_env)
        return out

    def _blocks(self, d, key, n):
        ab = self.ab
        k = min(n, (len(d) - 1) // ab + 1)
        blocks = []
        for i in range(k - 1):
            start = (k - 2 - i) * ab
            raw = _cat([d[-1 - off][key] for off in reversed(range(start, start + ab))])
            blocks.append(_zero_nan(raw.reshape(-1)))
        last = d[-1][key]
        if _is_torch(last):
            zero = last.new_zeros(ab * last.numel())
        else:
            zero = np.zeros(ab * last.size, last.dtype)
        return _stack([zero] * (n - 1 - len(blocks)) + blocks)


# -- measurement ------------------------------------------------------------------------
def infos(torch_in: bool):
    rng = np.random.default_rng(0)
    for t in range(STEPS):
        pixels = rng.integers(0, 255, (N_ENVS, 1, 64, 64, 3), dtype=np.uint8)
        action = rng.standard_normal((N_ENVS, 1, 6)).astype(np.float32)
        action[t % N_ENVS, 0, 0] = np.nan
        if torch_in:
            import torch
            yield {"pixels": torch.from_numpy(pixels), "action": torch.from_numpy(action)}
        else:
            yield {"pixels": pixels, "action": action}


def per_call_us(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def summarize(values) -> dict:
    vals = [float(v) for v in values]
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals)}


def same_output(a, b) -> bool:
    if a is None or b is None or a.keys() != b.keys():
        return a is b
    return all(np.array_equal(np.asarray(a[k]), np.asarray(b[k])) for k in a)


def measure(case: str, ours, base, cfg: Config) -> dict:
    ours(), base()   # warm
    t_ours, t_base, ratios = [], [], []
    for _ in range(cfg.reps):
        b = per_call_us(base, cfg.calls)
        o = per_call_us(ours, cfg.calls)
        t_base.append(b)
        t_ours.append(o)
        ratios.append(b / o)
    return {"case": case, "shmbuf_us": summarize(t_ours), "deque_us": summarize(t_base),
            "ratio": summarize(ratios)}


def run(cfg: Config) -> dict:
    rows, checks = [], {}
    for torch_in in (False, True):
        label = "torch" if torch_in else "numpy"
        buf = HistoryBuffer(N_ENVS, MAX_LEN, AB, ("action",))
        try:
            ref = DequeHistory(N_ENVS, MAX_LEN, AB, ("action",))
            for info in infos(torch_in):
                buf.append(info)
                ref.append(info)
            checks[label] = same_output(buf.get(N), ref.get(N))
            rows.append(measure(f"get(8), {label} in", lambda: buf.get(N), lambda: ref.get(N), cfg))  # noqa: B023 - measure() calls it at once
            subset = list(range(N_ENVS - 1, -1, -2))
            rows.append(measure(f"get(8, 8 env_ids), {label}", lambda: buf.get(N, subset),  # noqa: B023 - measure() calls it at once
                                lambda: ref.get(N, subset), cfg))  # noqa: B023 - measure() calls it at once
            if not torch_in:
                one = buf.get_view(N, 0) is not None
                checks["get_view contiguous"] = one
                if one:
                    rows.append(measure("get_view(8, env) zero-copy", lambda: buf.get_view(N, 0),  # noqa: B023 - measure() calls it at once
                                        lambda: ref.get(N, [0]), cfg))  # noqa: B023 - measure() calls it at once
                info = next(infos(False))
                rows.append(measure("append, 16 envs", lambda: buf.append(info),  # noqa: B023 - measure() calls it at once
                                    lambda: ref.append(info), cfg))  # noqa: B023 - measure() calls it at once
        finally:
            buf.close()
    return {"rows": rows, "checks": checks}


def table(result: dict) -> str:
    lines = [f"HistoryBuffer.get: {N_ENVS} envs, n={N}, action_block={AB}, max_len={MAX_LEN}; "
             "pixels (1,64,64,3) uint8 + action (1,6) f32 block key",
             f"{'case':<30}{'shmbuf us':>22}{'deque us':>24}{'deque/shmbuf':>20}",
             "-" * 96]
    for r in result["rows"]:
        o, b, x = r["shmbuf_us"], r["deque_us"], r["ratio"]
        lines.append(f"{r['case']:<30}"
                     f"{o['median']:>9.1f} ({o['min']:>6.1f}-{o['max']:>6.1f})"
                     f"{b['median']:>10.1f} ({b['min']:>6.1f}-{b['max']:>6.1f})"
                     f"{x['median']:>10.1f}x ({x['min']:.1f}-{x['max']:.1f})")
    get_rows = [r for r in result["rows"] if r["case"].startswith("get(8), ")]
    for r in get_rows:
        verdict = "met" if r["ratio"]["median"] >= TARGET else "NOT met"
        lines.append(f"target >= {TARGET:.0f}x for {r['case']}: {verdict} "
                     f"({r['ratio']['median']:.1f}x)")
    lines.append("outputs identical to the baseline: " +
                 ", ".join(f"{k}={v}" for k, v in result["checks"].items()))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer calls per repetition")
    ap.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write results")
    args = ap.parse_args(argv)
    cfg = QUICK if args.quick else FULL
    import torch

    torch.set_num_threads(1)   # the baseline's small cat/stack ops: threads only add jitter
    result = run(cfg)
    result["config"] = {**dataclasses.asdict(cfg), "n_envs": N_ENVS, "n": N,
                        "action_block": AB, "max_len": MAX_LEN, "target": TARGET}
    result["machine"] = {"python": sys.version.split()[0], "numpy": np.__version__,
                         "torch": torch.__version__,
                         "platform": platform.platform(), "cpus": os.cpu_count()}
    print(table(result))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
