"""shmbuf.ray on a loopback Ray Cluster: ingest, a trainer's waits, batch rates, fetch cost.

    python benchmarks/bench_ray.py [--quick] [--reps N] [--json PATH]

One ``ray.cluster_utils.Cluster`` on this host, every node on 127.0.0.1:
``n0`` (head; the trainer, this process, runs here), ``n1``, and ``n2``
(no shard: its writers ship blocks).  Workload W1 (``obs (3,64,64) u8``,
``action (6,) f32``, ``reward f32``, ``done bool``, episodes of 500 steps).
Side by side in the same run:

1. Ingest with 2 nodes x 2 writer actors calling ``add`` per step:
   shmbuf.ray (shared memory on each node) vs TorchRL's ``RayReplayBuffer``
   (one actor; writers call ``extend`` with 64-step TensorDicts, and ``add``
   per step) vs shmbuf.ray with one shard and all 4 writers on one node;
   and 2 writers on ``n2`` shipping blocks.
2. A trainer whose step is a 100 ms sleep (a stand-in for a GPU update)
   reading ``rb.prefetch(50, 50, depth=2)`` while half the windows live on
   ``n1``: the fraction of its time spent waiting for a batch, idle writers
   and 4 busy ones; and the same trainer calling ``sample_sequences``
   without prefetch.
3. Raw rates, back to back: global batches (with the time split into local
   sample, remote wait, remote copy), prefetched global batches, local
   batches (the local shard alone), and one remote shard's batch.
4. The remote-fetch cost per MB: a 30 MB numpy array made by an actor on
   ``n1`` and fetched by the driver on ``n0`` (object store to object store
   over loopback), next to the same array made on ``n0``.

Medians of ``--reps`` repetitions (min-max in brackets).  Ratios are
against baselines measured in the same run.  Nothing is asserted.  The
machine this ran on has 2 cores for everything: every node, every writer,
the shards and the trainer share them, so absolute numbers are CPU-bound
and say little about a real cluster; read the ratios.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")   # loopback, driver included

import numpy as np  # noqa: E402
import ray  # noqa: E402
from ray._private import ray_constants  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

if ray_constants.ENABLE_RAY_CLUSTER:   # ray came in before the variable: not loopback
    sys.exit("bench_ray: ray was imported before RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 was set; "
             "run this file as a script")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _store_workload import EPISODE, W1_SPEC  # noqa: E402

import shmbuf.ray as sray  # noqa: E402

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "bench_ray.json"
TAG = f"bench-ray-{os.getpid()}-"
MB = 1e6
T = 120                     # seconds: the bound on every ray.get
NODE = dict(node_ip_address="127.0.0.1", num_cpus=1, object_store_memory=200 << 20)
PACED_RATE = 1_000.0        # steps/s per writer: env workers that step a simulator


# -- what the actors run ---------------------------------------------------------------------
@ray.remote(num_cpus=0)
class Worker:
    """Runs one benchmark function at a time on its node."""

    def run(self, fn, *args):
        return fn(*args)


def w1_frames(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"obs": rng.integers(0, 256, (8, 3, 64, 64), dtype=np.uint8),
            "action": rng.standard_normal((8, 6)).astype(np.float32)}


def shm_writer(rb, steps: int, seed: int, stop_at: float | None = None, rate: float = 0.0):
    """``add`` per step: ``steps`` of them, or until ``stop_at``, at most ``rate`` steps/s.

    Returns (steps, start, end, mode) with wall-clock stamps (one host: one clock).
    """
    f = w1_frames(seed)
    obs, act = f["obs"], f["action"]
    w = rb.writer()
    t0 = time.time()
    i = 0
    while (i < steps) if stop_at is None else (time.time() < stop_at):
        w.add(obs=obs[i & 7], action=act[i & 7], reward=float(i & 255),
              done=i % EPISODE == EPISODE - 1)
        i += 1
        if rate and i % 50 == 0:
            ahead = t0 + i / rate - time.time()
            if ahead > 0:
                time.sleep(ahead)
    w.flush()
    t1 = time.time()
    w.close()
    return i, t0, t1, w.mode


def trl_writer(client, steps: int, chunk: int, seed: int):
    """TorchRL: ``extend`` with ``chunk``-step TensorDicts (``add`` per step if chunk == 1)."""
    import torch
    from tensordict import TensorDict

    f = w1_frames(seed)
    n = max(chunk, 1)
    idx = np.arange(n) & 7
    td = TensorDict({"obs": torch.from_numpy(f["obs"][idx]),
                     "action": torch.from_numpy(f["action"][idx]),
                     "reward": torch.zeros(n), "done": torch.zeros(n, dtype=torch.bool)},
                    batch_size=[n])
    one = td[0]
    t0 = time.time()
    for _ in range(steps // n):
        if chunk == 1:
            client.add(one)
        else:
            client.extend(td)
    return (steps // n) * n, t0, time.time(), "torchrl"


def warm(_):
    """Import what the writers use, once per worker process, before any clock runs."""
    import tensordict  # noqa: F401
    import torch  # noqa: F401
    import torchrl.data  # noqa: F401

    import shmbuf.ray  # noqa: F401
    return os.getpid()


def make_array(nbytes: int):
    return np.ones(nbytes, np.uint8)


# -- helpers ---------------------------------------------------------------------------------
def med(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "values": values}


def span_rate(got: list) -> float:
    """Steps of all writers over the span from the first start to the last end."""
    return sum(g[0] for g in got) / (max(g[2] for g in got) - min(g[1] for g in got))


def ingest(workers: list, fn, *args) -> float:
    """Aggregate steps/s of ``fn(*args, seed)`` run on every worker at once."""
    refs = [w.run.remote(fn, *args, seed) for seed, w in enumerate(workers)]
    return span_rate(ray.get(refs, timeout=T))


class Report:
    def __init__(self):
        self.rows = []

    def add(self, section: str, case: str, stats: dict, unit: str, note: str = "",
            baseline: str | None = None, ratio: float | None = None):
        self.rows.append({"section": section, "case": case, "unit": unit, **stats,
                          "baseline": baseline, "ratio": ratio, "note": note,
                          "loadavg_1m": os.getloadavg()[0]})
        span = f"[{stats['min']:.4g}-{stats['max']:.4g}]"
        extra = f"  {ratio:.2f}x {baseline}" if ratio is not None else ""
        print(f"  {case:<58} {stats['median']:>10.4g} {unit:<10} {span:<22}{extra}"
              f"{'  ' + note if note else ''}", flush=True)


# -- the sections ----------------------------------------------------------------------------
def run_ingest(rep: Report, ids: dict, w: dict, reps: int, quick: bool) -> None:
    print("1. ingest, W1, steps/s summed over the writers", flush=True)
    steps = 2_000 if quick else 8_000
    spec_cap = 20_000
    two = sray.create(W1_SPEC, spec_cap, nodes=[ids["n0"], ids["n1"]], chunk_size=256)
    one = sray.create(W1_SPEC, spec_cap, nodes=[ids["n0"]], chunk_size=256)
    shipped = sray.create(W1_SPEC, spec_cap, nodes=[ids["n0"], ids["n1"]], chunk_size=256)
    from functools import partial

    from torchrl.data import LazyTensorStorage, RayReplayBuffer
    trl = RayReplayBuffer(storage=partial(LazyTensorStorage, spec_cap), batch_size=50,
                          remote_config={"num_cpus": 0, "resources": {"n0": 1}})
    try:
        client = trl.client()
        two_nodes = w["n0"][:2] + w["n1"][:2]
        cases = {"two": (two_nodes, shm_writer, two, steps),
                 "one": (w["n0"][:4], shm_writer, one, steps),
                 "ship": (w["n2"][:2], shm_writer, shipped, steps),
                 "trl_ext": (two_nodes, trl_writer, client, steps // 4, 64),
                 "trl_add": (two_nodes, trl_writer, client, 200, 1)}
        for workers, fn, target, n, *rest in cases.values():   # warm: attach, allocate
            ingest(workers, fn, target, min(n, 256), *rest)
        rates = {k: [] for k in cases}
        for _ in range(reps):
            for k, (workers, fn, *args) in cases.items():
                rates[k].append(ingest(workers, fn, *args))
        base = med(rates["trl_ext"])["median"]
        rep.add("ingest", "shmbuf.ray, 2 nodes x 2 writers, add", med(rates["two"]), "steps/s",
                baseline="TorchRL extend(64)", ratio=med(rates["two"])["median"] / base)
        rep.add("ingest", "shmbuf.ray, 1 node x 4 writers, add (one shard)", med(rates["one"]),
                "steps/s", baseline="TorchRL extend(64)",
                ratio=med(rates["one"])["median"] / base)
        rep.add("ingest", "shmbuf.ray, 2 writers on a shard-less node, shipped",
                med(rates["ship"]), "steps/s", baseline="TorchRL extend(64)",
                ratio=med(rates["ship"])["median"] / base)
        rep.add("ingest", "TorchRL RayReplayBuffer, 2x2 writers, extend(64)",
                med(rates["trl_ext"]), "steps/s")
        rep.add("ingest", "TorchRL RayReplayBuffer, 2x2 writers, add", med(rates["trl_add"]),
                "steps/s", baseline="TorchRL extend(64)",
                ratio=med(rates["trl_add"])["median"] / base)
        rep.add("ingest", "shmbuf.ray 2x2 add vs TorchRL add", med(rates["two"]), "steps/s",
                baseline="TorchRL add", ratio=med(rates["two"])["median"] /
                med(rates["trl_add"])["median"])
    finally:
        for rb in (two, one, shipped):
            rb.close()
        trl.shutdown()


def fill(rb, w: dict, per_writer: int) -> None:
    ingest(w["n0"][:2] + w["n1"][:2], shm_writer, rb, per_writer)


def run_trainer(rep: Report, rb, w: dict, reps: int, quick: bool) -> None:
    print("2. trainer: 100 ms steps on prefetched global batches (50 x 50), half remote",
          flush=True)
    steps = 10 if quick else 40
    got = {"idle": [], "paced": [], "flat": [], "sync": []}
    writers = w["n0"][:2] + w["n1"][:2]
    for _ in range(reps):
        got["idle"].append(_train(rb, steps, prefetch=True))
        for kind, rate in (("paced", PACED_RATE), ("flat", 0.0)):
            stop_at = time.time() + steps * 0.1 + 3      # the writers outlast the trainer
            refs = [x.run.remote(shm_writer, rb, 0, 100 + s, stop_at, rate)
                    for s, x in enumerate(writers)]
            try:
                got[kind].append(_train(rb, steps, prefetch=True))
            finally:
                ray.get(refs, timeout=T)
        got["sync"].append(_train(rb, steps, prefetch=False))
    rep.add("trainer", "waiting share, prefetch depth 2, writers idle", med(got["idle"]),
            "fraction", note="target < 0.10")
    rep.add("trainer", f"waiting share, prefetch 2, 4 writers at {PACED_RATE:.0f} steps/s each",
            med(got["paced"]), "fraction", note="target < 0.10")
    rep.add("trainer", "waiting share, prefetch 2, 4 writers adding flat out",
            med(got["flat"]), "fraction", note="target < 0.10")
    rep.add("trainer", "waiting share, no prefetch (sample_sequences)", med(got["sync"]),
            "fraction")


def _train(rb, steps: int, prefetch: bool) -> float:
    t0 = time.perf_counter()
    waited = 0.0
    if prefetch:
        with rb.prefetch(50, 50, depth=2) as it:
            next(it)                               # the pipeline fills before the clock
            t0 = time.perf_counter()
            for _ in range(steps):
                s = time.perf_counter()
                next(it)
                waited += time.perf_counter() - s
                time.sleep(0.1)
    else:
        for _ in range(steps):
            s = time.perf_counter()
            rb.sample_sequences(50, 50)
            waited += time.perf_counter() - s
            time.sleep(0.1)
    return waited / (time.perf_counter() - t0)


def run_rates(rep: Report, rb, ids: dict, w: dict, reps: int, quick: bool) -> None:
    print("3. batch rates, 50 x 50 windows (30.8 MB), back to back", flush=True)
    n = 5 if quick else 12
    local_entry = next(s for s in rb.shards if s.node_id == ids["n0"])
    remote_entry = next(s for s in rb.shards if s.node_id == ids["n1"])
    local_buf = rb._attached(local_entry)
    g, pf, loc, rem, split = [], [], [], [], []
    for _ in range(reps):
        rb.timing = sray._sampler.new_timing()
        t0 = time.perf_counter()
        for _ in range(n):
            rb.sample_sequences(50, 50)
        g.append(n / (time.perf_counter() - t0))
        split.append(dict(rb.timing))
        with rb.prefetch(50, 50, depth=2) as it:
            next(it)
            t0 = time.perf_counter()
            for _ in range(n):
                next(it)
            pf.append(n / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        for _ in range(n):
            local_buf.sample_sequences(50, 50)
        loc.append(n / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        samp = 0.0
        for i in range(n):
            reply = ray.get(remote_entry.actor.sample.remote(50, 50, 0, True, i), timeout=T)
            samp += reply["__sample_s__"]
        wall = time.perf_counter() - t0
        rem.append((n / wall, samp / n, wall / n))
    lrate = med(loc)["median"]
    rep.add("rates", "global batches/s (sample_sequences)", med(g), "batches/s",
            baseline="local", ratio=med(g)["median"] / lrate)
    rep.add("rates", "global batches/s (prefetch depth 2)", med(pf), "batches/s",
            baseline="local", ratio=med(pf)["median"] / lrate)
    rep.add("rates", "local batches/s (this node's shard alone)", med(loc), "batches/s")
    rep.add("rates", "one remote shard's batches/s (actor call + fetch)",
            med([r[0] for r in rem]), "batches/s", baseline="local",
            ratio=med([r[0] for r in rem])["median"] / lrate)
    rep.add("rates", "  of which: sampling on the remote node", med([r[1] for r in rem]), "s",
            note="per batch")
    rep.add("rates", "  of which: call, transfer, deserialise", med(
        [r[2] - r[1] for r in rem]), "s", note="per batch")
    per = {k: [s[k] / max(s["batches"], 1) for s in split]
           for k in ("local_s", "remote_wait_s", "remote_copy_s", "remote_sample_s")}
    for k, label in (("local_s", "global batch: local share sampled"),
                     ("remote_sample_s", "global batch: remote share sampled (there)"),
                     ("remote_wait_s", "global batch: waiting for the remote reply"),
                     ("remote_copy_s", "global batch: copying the reply into the batch")):
        rep.add("rates", label, med(per[k]), "s", note="per batch")


def run_fetch(rep: Report, w: dict, reps: int) -> None:
    print("4. remote fetch of a 30 MB numpy array, object store to object store", flush=True)
    nbytes = 30 * 1_000_000
    far, near = [], []
    for _ in range(reps):
        for where, out in ((w["n1"][0], far), (w["n0"][0], near)):
            ref = where.run.remote(make_array, nbytes)
            ray.wait([ref], timeout=T, fetch_local=False)
            t0 = time.perf_counter()
            arr = ray.get(ref, timeout=T)
            out.append((time.perf_counter() - t0) / (nbytes / MB))
            del arr, ref
    rep.add("fetch", "n1 -> n0 (two raylets, loopback TCP)", med(far), "s/MB",
            baseline="same node", ratio=med(far)["median"] / med(near)["median"])
    rep.add("fetch", "n0 -> n0 (same object store, mapped)", med(near), "s/MB")


def report_leftovers() -> None:
    """Kill and name any Ray process or shmbuf segment of this run still there (30 s grace)."""
    needle = f"SHMBUF_BENCH_RAY_TAG={TAG}\0".encode()
    deadline = time.monotonic() + 30
    while True:
        procs = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = f.read()
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    tagged = needle in env and b"ray" in f.read()
            except OSError:
                continue
            if tagged and int(pid) != os.getpid():
                procs.append(int(pid))
        if not procs or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    segments = [n for n in os.listdir("/dev/shm") if n.startswith("shmbuf-" + TAG)]
    for pid in procs:
        os.kill(pid, signal.SIGKILL)
    for name in segments:
        os.unlink(os.path.join("/dev/shm", name))
    if procs or segments:
        print(f"LEFTOVERS (removed now): Ray processes {procs}, segments {segments}")
    else:
        print("no Ray process and no shmbuf segment of this run is left")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps and batches")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = ap.parse_args()
    c = Cluster(shutdown_at_exit=True)
    rep = Report()
    started = time.time()
    try:
        os.environ.update({"SHMBUF_NAME_TAG": TAG, "SHMBUF_BENCH_RAY_TAG": TAG})
        try:      # the nodes and every worker inherit both: leftovers are recognisable
            c.add_node(resources={"n0": 100}, include_dashboard=False, **NODE)
            nodes = {"n0": c.head_node, "n1": c.add_node(resources={"n1": 100}, **NODE),
                     "n2": c.add_node(resources={"n2": 100}, **NODE)}
        finally:
            del os.environ["SHMBUF_BENCH_RAY_TAG"]
        c.wait_for_nodes(timeout=T)
        ray.init(address=c.address, namespace=f"bench-ray-{os.getpid()}", log_to_driver=False)
        ids = {k: n.node_id for k, n in nodes.items()}
        workers = {k: [Worker.options(resources={k: 1}).remote() for _ in range(n)]
                   for k, n in (("n0", 4), ("n1", 2), ("n2", 2))}
        ray.get([x.run.remote(warm, 0) for v in workers.values() for x in v], timeout=T)
        run_ingest(rep, ids, workers, args.reps, args.quick)
        rb = sray.create(W1_SPEC, 20_000, nodes=[ids["n0"], ids["n1"]], chunk_size=256,
                         seed=0)
        try:
            fill(rb, workers, 3_000 if args.quick else 5_000)
            run_trainer(rep, rb, workers, args.reps, args.quick)
            run_rates(rep, rb, ids, workers, args.reps, args.quick)
        finally:
            rb.close()
        run_fetch(rep, workers, args.reps)
    finally:
        try:
            ray.shutdown()
        finally:
            c.shutdown()
            report_leftovers()
    print(f"load average (1 min) at the end: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cpus")
    out = {"benchmark": "bench_ray", "quick": args.quick, "reps": args.reps,
           "seconds": time.time() - started, "python": platform.python_version(),
           "ray": ray.__version__, "cpus": os.cpu_count(), "rows": rep.rows}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=1))
    print(f"wrote {args.json} ({out['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
