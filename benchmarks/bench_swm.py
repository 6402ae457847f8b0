"""stable-worldmodel's data API over shmbuf: the shm:// reader, ReplayBuffer.sample, collectors.

    python benchmarks/bench_swm.py [--episodes 60] [--steps 100] [--rounds 3]
                                   [--batches 30] [--dir PATH] [--json PATH]

Needs stable-worldmodel (its data layer and HDF5 format: h5py, hdf5plugin).
Data: episodes of ``--steps`` rows of swm's row convention, ``pixels`` uint8
(64, 64, 3), ``action`` f32 (2,), ``proprio`` f32 (4,), ``reward`` f32, the
same arrays in every row of the table; each measurement pairs shmbuf with its
baseline in this process, rounds alternated, median of ``--rounds``:

1. Loader: ``DataLoader(dataset, batch_size=64, shuffle=True, num_workers=2)``
   over ``load_dataset(path, num_steps=4, frameskip=5)`` (swm's benchmark
   setting), clips/s over ``--batches`` batches after the workers delivered
   their first.  Baseline: the same episodes in a file written by swm's HDF5
   writer, through swm's HDF5 reader.  Target: shm:// >= 3x.  Then the total
   Pss of trainer + workers (``/proc/PID/smaps_rollup``) after an epoch over
   the shm:// dataset, less the same loader's Pss over an epoch that reads
   its first 4 clips again and again, divided by the table's bytes; and the
   Pss of the segment's own mappings in those processes, over the same bytes.
   Target <= 1.1x.
2. Sample: ``ReplayBuffer.sample(64, history_len=4)``, shmbuf's (shared)
   against swm's in-RAM buffer holding the same episodes; ms per call.
   Target: at most 1.2x swm's time.
3. Collectors: ``write_episode`` of whole episodes into one shared
   ReplayBuffer of 20 episodes' room, 2 processes against 1 (forked, started
   together, each writing ``--write-episodes`` episodes) once the ring has
   wrapped (so the segment's pages exist: first-touch page faults are the
   Memory section's business); steps/s in all.  Target >= 1.7x.  Also each
   side's CPU seconds over wall seconds: below 1.0, the writers waited for a
   core (a machine busy with other work cannot show the scaling).

4. Compressed: ``ReplayBuffer(..., compress=Compress("pixels"))`` holding
   ``--episodes`` episodes of real Atari frames (Breakout, then MsPacman, played
   by a random policy: ``_atari``, ale-py) against an uncompressed
   ``ReplayBuffer`` holding the same episodes, rounds alternated:
   ``sample(64, history_len=4)`` ms per call with every window in hot chunks
   (``hot_steps`` = the capacity: nothing is ever compressed) and with every
   sealed chunk compressed (``hot_steps=0``, then ``compact()``); and the
   ``pixels`` column's raw bytes over the bytes its compressed blocks hold in
   /dev/shm (``stats().compression.ratio``).
   Skipped (and said so) where ale-py or zstandard is missing.

``--parts loader,sample,writers,compressed`` runs those sections alone.

It never asserts: it prints the table and writes the JSON.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from stable_worldmodel.data import ReplayBuffer as SwmReplayBuffer
from stable_worldmodel.data import load_dataset
from stable_worldmodel.data.format import get_format

import shmbuf
import shmbuf.compat.swm as cs
from shmbuf.compat import _swm_table

HERE = Path(__file__).resolve().parent
DEFAULT_JSON = HERE / "results" / "bench_swm.json"
PARTS = ("loader", "sample", "writers", "compressed")


def episode(n: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    action = rng.standard_normal((n, 2)).astype(np.float32)
    action[-1] = np.nan
    reward = rng.standard_normal(n).astype(np.float32)
    reward[0] = np.nan
    return {"pixels": rng.integers(0, 256, (n, 64, 64, 3), dtype=np.uint8), "action": action,
            "proprio": rng.standard_normal((n, 4)).astype(np.float32), "reward": reward}


def pss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1])
    raise RuntimeError(f"no Pss line for pid {pid}")


class _Repeated(torch.utils.data.Dataset):
    """The first clips of ``ds`` over and over: the same loader, with (almost) no data."""

    def __init__(self, ds, n: int):
        self.ds, self.n = ds, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return self.ds[i % 4]


def _loader(ds):
    return torch.utils.data.DataLoader(ds, batch_size=64, shuffle=True, num_workers=2,
                                       persistent_workers=True, timeout=300)


def clips_per_s(ds, batches: int) -> float:
    it = iter(_loader(ds))
    try:
        for _ in range(2):
            next(it)                       # both workers started and delivered
        t = time.perf_counter()
        for _ in range(batches):
            next(it)
        return batches * 64 / (time.perf_counter() - t)
    finally:
        it._shutdown_workers()


def mapping_pss_kib(pid: int, name: str) -> int:
    """Pss of the mappings of segment ``name`` in process ``pid``."""
    total, inside = 0, False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            first = line.split(maxsplit=1)[0]
            if "-" in first and not first.endswith(":"):     # a mapping's header line
                inside = line.rstrip().endswith("/" + name)
            elif inside and first == "Pss:":
                total += int(line.split()[1])
    return total


def loader_pss(ds, batches: int, name: str | None = None) -> tuple[int, int]:
    """(total Pss of trainer + workers, the part that maps segment ``name``) in bytes."""
    it = iter(_loader(ds))
    try:
        for _ in range(batches):
            next(it)
        pids = [os.getpid()] + [w.pid for w in it._workers]
        seg = sum(mapping_pss_kib(p, name) for p in pids) if name else 0
        return sum(pss_kib(p) for p in pids) << 10, seg << 10
    finally:
        it._shutdown_workers()


def loader_part(tmp: Path, name: str, eps: list, rounds: int, batches: int) -> dict:
    h5 = tmp / "bench.h5"
    with get_format("hdf5").open_writer(h5, mode="overwrite") as w:
        w.write_episodes(eps)
    with cs.ShmWriter(f"shm://{name}", mode="overwrite") as w:
        w.write_episodes(eps)
    kw = {"num_steps": 4, "frameskip": 5}
    shm_ds, h5_ds = load_dataset(f"shm://{name}", **kw), load_dataset(str(h5), **kw)
    shm, hdf = [], []
    for _ in range(rounds):
        shm.append(clips_per_s(shm_ds, batches))
        hdf.append(clips_per_s(h5_ds, batches))
    buf = shmbuf.attach(name)
    rows = sum(len(e["reward"]) for e in eps)
    data = rows * sum(a[0].nbytes for a in buf.arrays.values())   # the rows held, not capacity
    buf.close()
    epoch = -(-len(shm_ds) // 64)
    empty, _ = loader_pss(_Repeated(shm_ds, len(shm_ds)), epoch)
    full, segment = loader_pss(shm_ds, epoch, name)
    shm_ds.close()
    return {"shm_clips_s": shm, "hdf5_clips_s": hdf,
            "ratio": statistics.median(shm) / statistics.median(hdf),
            "data_bytes": data, "pss_empty": empty, "pss_shm": full,
            "pss_ratio": (full - empty) / data, "pss_segment": segment,
            "segment_ratio": segment / data}


def sample_part(eps: list, rounds: int, calls: int) -> dict:
    ours = cs.ReplayBuffer(max_steps=sum(len(e["reward"]) for e in eps), history_len=4)
    theirs = SwmReplayBuffer(max_steps=ours.max_steps, history_len=4)
    try:
        for ep in eps:
            ours.write_episode(ep)
            theirs.write_episode(ep)
        times: dict[str, list] = {"shmbuf": [], "swm": []}
        for _ in range(rounds):
            for key, rb in (("shmbuf", ours), ("swm", theirs)):
                rb.sample(64)
                t = time.perf_counter()
                for _ in range(calls):
                    rb.sample(64, history_len=4)
                times[key].append((time.perf_counter() - t) / calls * 1e3)
    finally:
        ours.close()
    return {"shmbuf_ms": times["shmbuf"], "swm_ms": times["swm"],
            "ratio": statistics.median(times["shmbuf"]) / statistics.median(times["swm"])}


def atari_episodes(episodes: int, steps: int) -> list:
    """``episodes`` episodes of ``steps`` real frames (64, 64, 3): Breakout, then MsPacman."""
    sys.path.insert(0, str(HERE))
    import _atari

    half = episodes * steps // 2
    frames = np.concatenate([_atari.play("Breakout", half, seed=1)[0],
                             _atari.play("MsPacman", episodes * steps - half, seed=2)[0]])
    frames = np.ascontiguousarray(frames.transpose(0, 2, 3, 1))   # swm's frames are HWC
    eps = []
    for e in range(episodes):
        ep = episode(steps, 10_000 + e)
        ep["pixels"] = frames[e * steps:(e + 1) * steps]
        eps.append(ep)
    return eps


def compressed_part(episodes: int, steps: int, rounds: int, calls: int) -> dict:
    """Section 4: sample times of compressing ReplayBuffers, hot and cold, against raw."""
    try:
        import zstandard  # noqa: F401

        eps = atari_episodes(episodes, steps)
    except ImportError as exc:
        return {"skipped": f"{type(exc).__name__}: {exc}"}
    cap = episodes * steps
    made = {"raw": cs.ReplayBuffer(max_steps=cap, history_len=4),
            # hot_steps = the capacity: no chunk is ever cold, every read is raw
            "hot": cs.ReplayBuffer(max_steps=cap, history_len=4,
                                   compress=shmbuf.Compress("pixels", hot_steps=cap)),
            # hot_steps = 0 and compact(): every sealed chunk compressed
            "cold": cs.ReplayBuffer(max_steps=cap, history_len=4,
                                    compress=shmbuf.Compress("pixels", hot_steps=0))}
    out: dict = {}
    try:
        for ep in eps:
            for rb in made.values():
                rb.write_episode(ep)
        cold = made["cold"]._table.attached("bench")
        cold.compact(timeout=600)
        c = cold.stats().compression
        out.update(packed_chunks=c.compressed_chunks, raw_chunks=c.raw_chunks,
                   raw_bytes=c.raw_bytes, stored_bytes=c.stored_bytes, ratio=c.ratio,
                   hot_packed_chunks=made["hot"]._table.attached("bench").stats()
                   .compression.compressed_chunks)
        times: dict[str, list] = {k: [] for k in made}
        for _ in range(rounds):
            for key, rb in made.items():
                rb.sample(64)
                t = time.perf_counter()
                for _ in range(calls):
                    rb.sample(64, history_len=4)
                times[key].append((time.perf_counter() - t) / calls * 1e3)
        med = statistics.median
        for key in ("hot", "cold"):
            out[key] = {"compressed_ms": times[key], "raw_ms": times["raw"],
                        "ratio": med(times[key]) / med(times["raw"])}
    finally:
        for rb in made.values():
            rb.close()
    return out


def _writer(rb, seed: int, episodes: int, steps: int, go, out) -> None:
    eps = [episode(steps, seed * 1000 + i) for i in range(episodes)]
    rb.write_episode(eps[-1])   # attached, a writer slot claimed, the pages mapped: untimed
    go.wait(timeout=120)
    t, c = time.perf_counter(), time.process_time()
    for ep in eps:
        rb.write_episode(ep)
    out.put((time.perf_counter() - t, time.process_time() - c))


def write_rate(procs: int, episodes: int, steps: int) -> tuple[float, float]:
    """(steps/s of ``procs`` writers in steady state: the ring has wrapped, its pages exist;
    the writers' CPU seconds over their wall seconds: 1.0 when each had a core to itself)."""
    ctx = mp.get_context("fork")
    rb = cs.ReplayBuffer(max_steps=20 * steps)
    for i in range(25):                 # fills the ring once: page faults happen here
        rb.write_episode(episode(steps, i))
    go, out = ctx.Barrier(procs + 1), ctx.Queue()
    ps = [ctx.Process(target=_writer, args=(rb, i, episodes, steps, go, out))
          for i in range(procs)]
    try:
        for p in ps:
            p.start()
        t = time.perf_counter()
        go.wait(timeout=120)
        got = [out.get(timeout=300) for _ in ps]
        wall = time.perf_counter() - t
        for p in ps:
            p.join(timeout=60)
    finally:
        for p in ps:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
        rb.close()
    return procs * episodes * steps / wall, sum(c for _, c in got) / sum(w for w, _ in got)


def writer_part(rounds: int, episodes: int, steps: int) -> dict:
    one, two, cpu1, cpu2 = [], [], [], []
    for _ in range(rounds):
        rate, cpu = write_rate(1, episodes, steps)
        one.append(rate)
        cpu1.append(cpu)
        rate, cpu = write_rate(2, episodes, steps)
        two.append(rate)
        cpu2.append(cpu)
    med = statistics.median
    return {"one_steps_s": one, "two_steps_s": two, "one_cpu_share": cpu1,
            "two_cpu_share": cpu2, "ratio": med(two) / med(one),
            # steps per CPU second of writing: equal when two writers slow each other not at all
            "per_cpu_ratio": (med(two) / (2 * med(cpu2))) / (med(one) / med(cpu1))}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--episodes", type=int, default=60)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batches", type=int, default=30)
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--write-episodes", type=int, default=40)
    p.add_argument("--dir", type=Path, default=None)
    p.add_argument("--json", type=Path, default=DEFAULT_JSON)
    p.add_argument("--parts", default=",".join(PARTS),
                   help=f"sections to run, separated by commas (default: {','.join(PARTS)})")
    args = p.parse_args(argv)
    parts = args.parts.split(",")
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        p.error(f"--parts: unknown {unknown}; choose from {list(PARTS)}")
    warnings.filterwarnings("ignore", message="This DataLoader will create")
    eps = [episode(args.steps, s) for s in range(args.episodes)]
    name = f"shmbuf-bench-swm-{os.getpid()}"
    loader = sample = writers = compressed = None
    if "loader" in parts:
        try:
            with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
                loader = loader_part(Path(tmp), name, eps, args.rounds, args.batches)
        finally:
            _swm_table.remove(name)
    if "sample" in parts:
        sample = sample_part(eps, args.rounds, args.calls)
    if "writers" in parts:
        writers = writer_part(args.rounds, args.write_episodes, args.steps)
    if "compressed" in parts:
        compressed = compressed_part(args.episodes, args.steps, args.rounds, args.calls)
    med = statistics.median
    print(f"{'measurement':<44} {'shmbuf':>10} {'baseline':>10} {'ratio':>7} {'target':>8}")
    if loader is not None:
        print(f"{'DataLoader(2 workers) clips/s vs HDF5':<44} "
              f"{med(loader['shm_clips_s']):10.0f} "
              f"{med(loader['hdf5_clips_s']):10.0f} {loader['ratio']:6.2f}x {'>= 3x':>8}")
        print(f"{'  total Pss - empty, / data (MiB)':<44} "
              f"{(loader['pss_shm'] - loader['pss_empty']) / 2**20:10.0f} "
              f"{loader['data_bytes'] / 2**20:10.0f} {loader['pss_ratio']:6.2f}x "
              f"{'<= 1.1x':>8}")
        print(f"{'  Pss of the segment mappings, / data (MiB)':<44} "
              f"{loader['pss_segment'] / 2**20:10.0f} "
              f"{loader['data_bytes'] / 2**20:10.0f} {loader['segment_ratio']:6.2f}x")
    if sample is not None:
        print(f"{'ReplayBuffer.sample(64, 4) ms vs swm':<44} {med(sample['shmbuf_ms']):10.2f} "
              f"{med(sample['swm_ms']):10.2f} {sample['ratio']:6.2f}x {'<= 1.2x':>8}")
    if writers is not None:
        print(f"{'write_episode steps/s, 2 procs vs 1':<44} "
              f"{med(writers['two_steps_s']):10.0f} "
              f"{med(writers['one_steps_s']):10.0f} {writers['ratio']:6.2f}x {'>= 1.7x':>8}")
        print(f"{'  writers: CPU s / wall s (1.00: a core each)':<44} "
              f"{med(writers['two_cpu_share']):10.2f} {med(writers['one_cpu_share']):10.2f}")
        print(f"{'  steps per writer CPU second, 2 procs vs 1':<44} {'':>10} {'':>10} "
              f"{writers['per_cpu_ratio']:6.2f}x")
    if compressed is not None and "skipped" in compressed:
        print(f"compressed section skipped: {compressed['skipped']}")
    elif compressed is not None:
        for key, label in (("hot", "hot"), ("cold", "cold")):
            r = compressed[key]
            print(f"{'sample(64, 4) ms, compress= vs raw, ' + label:<44} "
                  f"{med(r['compressed_ms']):10.2f} {med(r['raw_ms']):10.2f} "
                  f"{r['ratio']:6.2f}x")
        print(f"{'  pixels of cold chunks: compressed vs raw MiB':<44} "
              f"{compressed['stored_bytes'] / 2**20:10.1f} "
              f"{compressed['raw_bytes'] / 2**20:10.1f} {compressed['ratio']:6.0f}x")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"loader": loader, "sample": sample, "writers": writers,
                                     "compressed": compressed,
                                     "episodes": args.episodes, "steps": args.steps,
                                     "cpus": os.cpu_count(), "python": sys.version.split()[0],
                                     "shmbuf": shmbuf.__version__}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
