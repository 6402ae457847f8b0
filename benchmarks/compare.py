"""shmbuf side by side with what users pick instead, every figure measured in the same run.

    python benchmarks/compare.py [--quick] [--wait-load 1.5] [--json PATH] [--png PATH]

Backends (one adapter each, ``_compare/``): the numpy gather and
contiguous-copy ceilings, the DIY multiprocessing.Queue pipeline, cpprb
MPReplayBuffer, TorchRL's shared ReplayBuffer, the seeds' single-process
designs (torchwm's Dreamer numpy ring, a deque HistoryBuffer), and shmbuf
through its core API and its Dreamer and HistoryBuffer facades.

Workloads: W1 pixel replay (ingest from 1, 2, 4 writer processes, one step
or 16 env rows per call; sample 50 x 50 time-major), W2 low-dim (64,) f32 at
capacities 10k / 1M / 10M (sample 256 x 4), W3 history (16 envs, get(8),
action_block 4, 64x64x3), and shmbuf's sample latency under 2 writers.

Every figure is the median of at least 5 repetitions with its min-max.
Sampling is measured in turn with shmbuf in the same repetitions, and the
ratio backend / shmbuf is taken per repetition; ingest rounds run backend
after backend, and the ratio is that of the medians.  A peer that is not
installed or fails is reported as such; nothing is asserted.  Children are
spawned, every wait is bounded, leftover children are killed, and every
buffer is closed (and its owner unlinks it) in ``finally``.
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
import sys
import time
from pathlib import Path

import numpy as np

import shmbuf

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
# The benchmark's own helpers import from this folder, so after the path line (E402).
from _compare import backends as cb  # noqa: E402
from _compare import report  # noqa: E402
from _compare.base import Workload  # noqa: E402
from _compare.latency import latency_rows  # noqa: E402

SHM_DIR = "/dev/shm"
RESULTS = HERE / "results"
MODES = (("add", "add, 1 step/call"), ("batch16", "16 env rows/call"),
         ("ep500", "500-step episode/call"))
UNIT = {"ep500": 500}   # rows per call of a mode (16 otherwise)


@dataclasses.dataclass(frozen=True)
class Config:
    reps: int            # repetitions per figure (>= 5)
    round_s: float       # target seconds of one ingest round
    max_rows: int        # rows per writer per ingest round, at most
    sample_s: float      # target seconds of one timed block of sample calls
    lat_calls: int       # single sample calls per latency block
    writers: tuple = (1, 2, 4)
    capacities: tuple = (10_000, 1_000_000, 10_000_000)


QUICK = Config(reps=5, round_s=0.1, max_rows=100_000, sample_s=0.05, lat_calls=40)
FULL = Config(reps=7, round_s=0.35, max_rows=400_000, sample_s=0.25, lat_calls=120)


class Tracker:
    """Names of the shmbuf segments this run created; leftovers are removed at exit."""

    def __init__(self):
        self.names = []

    def own(self, obj):
        self.names.append(obj.name)
        return obj

    def leftovers(self) -> list[str]:
        return [n for n in self.names if os.path.exists(os.path.join(SHM_DIR, n))]


figure, failure = report.figure, report.failure


@contextlib.contextmanager
def made(cls, wl, ctx, tracker):
    backend = cls(ctx, tracker)
    try:
        backend.setup(wl)
        yield backend
    finally:
        backend.teardown()


# -- W1 ingest --------------------------------------------------------------------------------
def _ingest_rates(cfg, b, n, mode) -> list[float]:
    unit = UNIT.get(mode, 16)
    rows = max(128, unit)
    for share in (0.25, 1.0):          # calibrate; also warms the pool and the buffer
        secs = b.ingest(n, mode, rows)
        per_writer = rows / secs * cfg.round_s * share
        rows = max(int(min(max(per_writer, 128), cfg.max_rows)) // unit * unit, unit)
    return [n * rows / b.ingest(n, mode, rows) for _ in range(cfg.reps)]


def _ingest_backend(cfg, wl, b) -> list[dict]:
    """Every ingest configuration of one backend; a failure is a row, never a crash."""
    figs = []
    try:
        b.setup(wl)
        setup_err = None
    except Exception as exc:  # noqa: BLE001 - reported in the table
        setup_err = failure(exc)
    for mode, mode_label in MODES:
        mode_err = None
        for n in cfg.writers:
            config = f"{mode_label}, {n} writer{'s' * (n > 1)}"
            if mode_err or setup_err:
                status, reason = (("error", f"skipped after: {mode_err}") if mode_err
                                  else setup_err)
                figs.append(figure("W1", "ingest", config, b, "rows/s", status=status,
                                   reason=reason))
                continue
            try:
                figs.append(figure("W1", "ingest", config, b, "rows/s",
                                   _ingest_rates(cfg, b, n, mode)))
            except Exception as exc:  # noqa: BLE001
                status, reason = failure(exc)
                figs.append(figure("W1", "ingest", config, b, "rows/s", status=status,
                                   reason=reason))
                if status == "error":
                    mode_err = f"{config}: {reason}"
                    b.stop_writers()      # the next configuration starts a fresh pool
    return figs


def run_w1_ingest(cfg, ctx, tracker, classes) -> list[dict]:
    wl = Workload("W1", 100_000, 50, 50, filled=False, max_writers=max(cfg.writers))
    figs = []
    for cls in classes:
        t0 = time.perf_counter()
        b = cls(ctx, tracker)
        try:
            figs += _ingest_backend(cfg, wl, b)
        finally:
            b.teardown()
        _progress(f"W1 ingest {cls.key}", t0)
    ref = {f["config"]: f["stats"] for f in figs if f["backend"] == "shmbuf" and f["stats"]}
    for f in figs:
        if f["stats"] and f["config"] in ref:
            report.set_ratio_of_medians(f, ref[f["config"]])
    return figs


# -- sampling, paired with shmbuf ---------------------------------------------------------------
def _per_call(fn, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def _calls(fn, budget: float) -> int:
    return int(min(max(budget / _per_call(fn, 1), 1), 2000))


def timed(cfg, fn, ref=None):
    """Per-call seconds of ``fn`` over cfg.reps blocks, and of ``ref`` in turn if given."""
    fn()
    cf = _calls(fn, cfg.sample_s)
    if ref is None:
        return [_per_call(fn, cf) for _ in range(cfg.reps)], None
    ref()
    cr = _calls(ref, cfg.sample_s)
    mine, theirs = [], []
    for rep in range(cfg.reps):
        pair = [(mine, fn, cf), (theirs, ref, cr)]
        for out, f, c in (pair if rep % 2 == 0 else pair[::-1]):
            out.append(_per_call(f, c))
    return mine, theirs


def sample_figures(cfg, ctx, tracker, wl, classes, ref_cls, config, measures) -> list[dict]:
    """Each backend's ``measures`` (name -> fn(backend)), in turn with the shmbuf reference."""
    figs, t_ref, ref_figs, ref_blocks = [], time.perf_counter(), {}, {}
    with contextlib.ExitStack() as stack:
        try:
            ref = stack.enter_context(made(ref_cls, wl, ctx, tracker))
        except Exception as exc:  # noqa: BLE001
            ref, ref_err = None, failure(exc)
        _progress(f"{wl.key} {config} setup {ref_cls.key}", t_ref)
        for cls in classes:
            t0 = time.perf_counter()
            if cls is ref_cls:
                for m, fn in measures.items():
                    if ref is None:
                        figs.append(figure(wl.key, m, config, cls(ctx, tracker), "s",
                                           status=ref_err[0], reason=ref_err[1]))
                    else:
                        ref_figs[m] = figure(wl.key, m, config, ref, "s",
                                             timed(cfg, lambda: fn(ref))[0])  # noqa: B023 - timed() calls it at once
                        figs.append(ref_figs[m])
                continue
            b = cls(ctx, tracker)
            try:
                b.setup(wl)
                for m, fn in measures.items():
                    try:
                        mine, theirs = timed(cfg, lambda: fn(b),  # noqa: B023 - timed() calls it at once
                                             None if ref is None else (lambda: fn(ref)))  # noqa: B023 - timed() calls it at once
                        ratios = [x / y for x, y in zip(mine, theirs)] if theirs else None
                        figs.append(figure(wl.key, m, config, b, "s", mine, ratios=ratios))
                        ref_blocks.setdefault(m, []).extend(theirs or [])
                    except Exception as exc:  # noqa: BLE001
                        status, reason = failure(exc)
                        figs.append(figure(wl.key, m, config, b, "s", status=status,
                                           reason=reason))
            except Exception as exc:  # noqa: BLE001
                status, reason = failure(exc)
                for m in measures:
                    figs.append(figure(wl.key, m, config, b, "s", status=status, reason=reason))
            finally:
                b.teardown()
            _progress(f"{wl.key} {config} {cls.key}", t0)
        for m, fig in ref_figs.items():   # shmbuf's own row: every block it ran, solo or paired
            fig.update(figure(wl.key, m, config, ref, "s",
                              fig["stats"]["values"] + ref_blocks.get(m, []),
                              ratios=[1.0]))
        if wl.key == "W1" and ref is not None:
            figs.extend(latency_rows(cfg, ctx, ref.buf, cb.NumpyGather, wl))
    return figs


def run_w1_sample(cfg, ctx, tracker, classes):
    wl = Workload("W1", 100_000, 50, 50, filled=True)
    return sample_figures(cfg, ctx, tracker, wl, classes, cb.ShmbufCore, "50 x 50 (L x B)",
                          {"sample": lambda b: b.sample()})


def run_w2(cfg, ctx, tracker, classes):
    figs = []
    for cap in cfg.capacities:
        wl = Workload("W2", cap, 256, 4, filled=True)
        figs += sample_figures(cfg, ctx, tracker, wl, classes, cb.ShmbufCore,
                               f"capacity {cap:,}", {"sample": lambda b: b.sample()})
    return figs


def run_w3(cfg, ctx, tracker, classes):
    wl = Workload("W3", cb.MAX_LEN, cb.N_ENVS, 8, filled=True)
    return sample_figures(cfg, ctx, tracker, wl, classes, cb.ShmbufHistory,
                          f"{cb.N_ENVS} envs, get(8), action_block {cb.AB}",
                          {"append": lambda b: b.ingest(1, "append", 1),
                           "get": lambda b: b.sample()})


# -- driver -------------------------------------------------------------------------------------
def _progress(what: str, t0: float) -> None:
    print(f"[{what}: {time.perf_counter() - t0:.1f} s, load1 {os.getloadavg()[0]:.2f}]",
          file=sys.stderr, flush=True)


def _on_sigterm(signum, frame):
    raise SystemExit(128 + signum)   # unwinds every finally: children killed, buffers unlinked


def wait_for_load(limit: float, most_s: float) -> dict:
    start, load = time.monotonic(), os.getloadavg()[0]
    while load > limit and time.monotonic() - start < most_s:
        print(f"load1 {load:.2f} > {limit}; waiting", file=sys.stderr, flush=True)
        time.sleep(30)
        load = os.getloadavg()[0]
    return {"waited_s": round(time.monotonic() - start), "load1": load, "limit": limit,
            "gave_up": load > limit}


def machine() -> dict:
    with open("/proc/meminfo") as f:
        mem_kib = int(f.readline().split()[1])
    versions = {}
    for mod in ("cpprb", "torch", "torchrl", "tensordict", "matplotlib"):
        try:
            from importlib.metadata import version
            versions[mod] = version(mod)
        except Exception:  # noqa: BLE001 - not installed
            versions[mod] = None
    try:
        import subprocess

        head = subprocess.run(["git", "-C", str(HERE), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(HERE), "status", "--porcelain", "--",
                                "../shmbuf"], capture_output=True, text=True,
                               timeout=10).stdout.strip()
        versions["shmbuf_commit"] = head + ("+uncommitted" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        versions["shmbuf_commit"] = None
    return {"cpus": os.cpu_count(), "ram_gib": round(mem_kib / 2**20, 1),
            "python": sys.version.split()[0], "numpy": np.__version__,
            "shmbuf": shmbuf.__version__, "platform": platform.platform(), **versions}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="shorter blocks; under 3 min on 2 cores")
    ap.add_argument("--only", default="w1i,w1s,w2,w3", help="comma list of w1i,w1s,w2,w3")
    ap.add_argument("--backends", default="", help="comma list of backend keys (default all)")
    ap.add_argument("--wait-load", type=float, default=0.0,
                    help="before each workload, wait until the 1-min load is below this "
                         "(30 min at most in all)")
    ap.add_argument("--json", type=Path, default=RESULTS / "compare.json")
    ap.add_argument("--png", type=Path, default=RESULTS / "compare.png")
    ap.add_argument("--md", type=Path, default=RESULTS / "compare.md")
    args = ap.parse_args(argv)
    cfg = QUICK if args.quick else FULL
    keys = set(filter(None, args.backends.split(",")))
    classes = [c for c in cb.BACKENDS if not keys or c.key in keys]
    signal.signal(signal.SIGTERM, _on_sigterm)
    # TorchRL's shared buffer takes its lock and write cursor from the default start
    # method.  Spawn keeps every backend's writers alike; under fork, TorchRL's extend()
    # hung in the children once torch had started its thread pool in this process.
    mp.set_start_method("spawn", force=True)
    ctx, tracker = mp.get_context("spawn"), Tracker()
    load0, started, figs, sections = os.getloadavg(), time.perf_counter(), [], []
    commit0 = machine()["shmbuf_commit"]
    runs = {"w1i": run_w1_ingest, "w1s": run_w1_sample, "w2": run_w2, "w3": run_w3}
    budget = time.monotonic() + 1800          # at most 30 min of waiting in all
    try:
        for key in args.only.split(","):
            waited = (wait_for_load(args.wait_load, max(0.0, budget - time.monotonic()))
                      if args.wait_load else None)
            before = os.getloadavg()[0]
            figs += runs[key](cfg, ctx, tracker, classes)
            sections.append({"section": key, "load_wait": waited, "load1_start": before,
                             "load1_end": os.getloadavg()[0]})
    finally:
        leaked = tracker.leftovers()
        for name in leaked:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(SHM_DIR, name))
    meta = {"mode": "quick" if args.quick else "full", "config": dataclasses.asdict(cfg),
            "command": " ".join(["python", "benchmarks/compare.py"] + (argv or sys.argv[1:])),
            "wall_seconds": round(time.perf_counter() - started, 1), "machine": machine(),
            "shmbuf_commit_at_start": commit0,
            "load1_before_after": [load0[0], os.getloadavg()[0]], "sections": sections,
            "leaked_segments": leaked, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "ratio_is": "backend / shmbuf in the figure's unit; paired = per repetition"}
    targets = report.targets(figs)
    print(report.table(figs, targets, meta))
    for path in (args.json, args.png, args.md):
        path.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"meta": meta, "figures": figs, "targets": targets},
                                    indent=1))
    args.md.write_text(report.markdown(figs, targets, meta))
    chart = report.chart(figs, args.png)
    print(f"wrote {args.json}, {args.md}" + (f", {args.png}" if chart is None else
                                             f"; no chart ({chart})"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
