"""TorchRL's replay buffer over shmbuf (``shmbuf.compat.torchrl``) against TorchRL's own.

    python benchmarks/bench_torchrl.py [--steps 100000] [--rounds 3] [--frames 20000]
                                       [--parts ingest,sample,collect] [--quick] [--json PATH]

W1 steps: obs uint8 (3, 64, 64), action f32 (6,), reward f32, ("next", "done") bool,
episodes of 500 steps (trajectory ids in ("collector", "traj_ids")).  Each section pairs
shmbuf with its baseline in this process, rounds alternated, median of ``--rounds``:

1. ingest: 2 spawned writer processes each extend ``--batches`` batches of 64 W1 steps,
   steps/s in all from a barrier to the last writer's end.  shmbuf:
   ``TensorDictReplayBuffer(storage=LazyShmStorage(n), writer=ShmWriter())`` (the first
   batch a writer writes makes the columns).  Baseline: TorchRL's documented
   multi-process path, ``TensorDictReplayBuffer(storage=LazyMemmapStorage(n),
   shared=True)`` (a ``RoundRobinWriter`` under the buffer's ``multiprocessing.Lock``,
   the storage initialised by the parent before it is pickled).  Target >= 3x.
2. sample: 50 slices of 50 steps from ``--steps`` held W1 steps, ms per batch.
   ``ReplayBuffer.sample()`` with shmbuf's ``SliceSampler`` on ``ShmWriter`` data,
   against TorchRL's ``LazyTensorStorage`` with its ``SliceSampler`` (target: no
   slower), and against shmbuf's native ``Buffer.sample_sequences(50, 50)`` on the same
   data (target <= 1.3x, the one that binds).
3. collect: a DreamerV3-shaped run: ``MultiSyncCollector`` with 2 workers stepping a
   W1 pixel env (random actions) into the buffer while the trainer samples 16 slices of
   64 steps after every collector batch; frames/s collected and batches/s sampled, for
   shmbuf (``LazyShmStorage`` + ``ShmWriter`` + shmbuf's ``SliceSampler``) and for
   ``LazyTensorStorage(shared_init=True)`` in a ``shared=True`` buffer with TorchRL's
   ``SliceSampler`` (the collector's workers initialise it, as TorchRL documents).

It never asserts: it prints the table and writes the JSON.
"""
from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch
from tensordict import TensorDict
from torchrl.collectors import MultiSyncCollector
from torchrl.data import (
    Bounded,
    Composite,
    LazyMemmapStorage,
    LazyTensorStorage,
    TensorDictReplayBuffer,
    Unbounded,
)
from torchrl.data import SliceSampler as TorchRLSliceSampler
from torchrl.envs import EnvBase

from shmbuf.compat.torchrl import LazyShmStorage, ShmWriter, SliceSampler

HERE = Path(__file__).resolve().parent
DEFAULT_JSON = HERE / "results" / "bench_torchrl.json"
PARTS = ("ingest", "sample", "collect")
EPISODE = 500
SPAWN = mp.get_context("spawn")
TIMEOUT = 600


def w1(n: int, first: int = 0, seed: int = 0) -> TensorDict:
    """``n`` W1 steps from global step ``first``: episodes of ``EPISODE`` steps."""
    gen = torch.Generator().manual_seed(seed)
    step = torch.arange(first, first + n)
    return TensorDict({
        "obs": torch.randint(0, 256, (n, 3, 64, 64), dtype=torch.uint8, generator=gen),
        "action": torch.randn(n, 6, generator=gen),
        "reward": torch.randn(n, generator=gen),
        ("next", "done"): (step % EPISODE == EPISODE - 1).unsqueeze(-1),
        ("collector", "traj_ids"): step // EPISODE + 1_000_000 * seed,
    }, [n])


# -- 1. ingest ------------------------------------------------------------------------------
def _writer(rb, wid: int, batches: int, ready, go, done) -> None:
    logging.getLogger("torchrl").setLevel(logging.WARNING)
    data = [w1(64, 64 * b, seed=wid + 1) for b in range(8)]
    ready.put(wid)
    go.wait(TIMEOUT)
    for b in range(batches):
        rb.extend(data[b % 8])
    done.put(time.monotonic())


def _ingest_once(rb, batches: int) -> float:
    ready, done, go = SPAWN.Queue(), SPAWN.Queue(), SPAWN.Event()
    procs = [SPAWN.Process(target=_writer, args=(rb, w, batches, ready, go, done))
             for w in range(2)]
    for p in procs:
        p.start()
    try:
        for _ in procs:
            ready.get(timeout=TIMEOUT)
        start = time.monotonic()
        go.set()
        end = max(done.get(timeout=TIMEOUT) for _ in procs)
        for p in procs:
            p.join(TIMEOUT)
        return 2 * 64 * batches / (end - start)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(10)


def bench_ingest(args) -> dict:
    cap = 2 * 64 * args.batches + 64
    ours, theirs = [], []
    for _ in range(args.rounds):
        storage = LazyShmStorage(cap)
        try:
            ours.append(_ingest_once(TensorDictReplayBuffer(storage=storage,
                                                            writer=ShmWriter()),
                                     args.batches))
        finally:
            storage.close()
        with tempfile.TemporaryDirectory() as scratch:
            rb = TensorDictReplayBuffer(storage=LazyMemmapStorage(cap, scratch_dir=scratch),
                                        shared=True)
            rb.extend(w1(64))          # a shared buffer's storage must exist before pickling
            theirs.append(_ingest_once(rb, args.batches))
            del rb
    return _pair("ingest steps/s, 2 writers x 64-step batches", ours, theirs, ">= 3x",
                 higher_is_better=True)


# -- 2. sample ------------------------------------------------------------------------------
def _timed(fn, calls: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e3


def bench_sample(args) -> dict:
    ours_rb = TensorDictReplayBuffer(storage=LazyShmStorage(args.steps), writer=ShmWriter(),
                                     sampler=SliceSampler(num_slices=50), batch_size=2500)
    plain_rb = TensorDictReplayBuffer(storage=LazyTensorStorage(args.steps),
                                      sampler=TorchRLSliceSampler(num_slices=50),
                                      batch_size=2500)
    try:
        for first in range(0, args.steps, EPISODE):
            episode = w1(EPISODE, first, seed=first // EPISODE % 7)
            episode["collector", "traj_ids"] = torch.full((EPISODE,), first // EPISODE)
            ours_rb.extend(episode)
            plain_rb.extend(episode)
        buf = ours_rb.storage.buffer
        ours, theirs, native = [], [], []
        for _ in range(args.rounds):
            ours.append(_timed(ours_rb.sample, args.calls))
            theirs.append(_timed(plain_rb.sample, max(3, args.calls // 5)))
            native.append(_timed(lambda: buf.sample_sequences(50, 50), args.calls))
        return {**_pair("sample 50x50 ms, vs TorchRL LazyTensorStorage + SliceSampler", ours,
                        theirs, "<= 1x", higher_is_better=False, key="vs_torchrl"),
                **_pair("sample 50x50 ms, vs native sample_sequences(50, 50)", ours, native,
                        "<= 1.3x", higher_is_better=False, key="vs_native")}
    finally:
        ours_rb.storage.close()


# -- 3. collect ------------------------------------------------------------------------------
class PixelEnv(EnvBase):
    """W1 steps: a uint8 (3, 64, 64) frame, 6 float actions, episodes of 500 steps."""

    def __init__(self):
        super().__init__(batch_size=torch.Size([]))
        self.observation_spec = Composite(obs=Unbounded(shape=(3, 64, 64), dtype=torch.uint8))
        self.action_spec = Bounded(low=-1.0, high=1.0, shape=(6,))
        self.reward_spec = Unbounded(shape=(1,))
        self.t = 0
        self.frame = torch.zeros(3, 64, 64, dtype=torch.uint8)

    def _reset(self, tensordict=None):
        self.t = 0
        return TensorDict({"obs": self.frame.clone(), "done": torch.zeros(1, dtype=torch.bool),
                           "terminated": torch.zeros(1, dtype=torch.bool)}, [])

    def _step(self, tensordict):
        self.t += 1
        done = torch.tensor([self.t >= EPISODE])
        return TensorDict({"obs": self.frame.add(self.t % 256), "reward": torch.ones(1),
                           "done": done, "terminated": done.clone()}, [])

    def _set_seed(self, seed):
        return seed


def _collect_once(rb, frames: int) -> tuple[float, float]:
    collector = MultiSyncCollector([PixelEnv, PixelEnv], policy=None, frames_per_batch=256,
                                   total_frames=frames, replay_buffer=rb)
    batches = 0
    start = time.perf_counter()
    try:
        for _ in collector:
            if len(rb) >= 2 * 64:
                for _ in range(2):
                    rb.sample()
                    batches += 1
    finally:
        collector.shutdown()
    took = time.perf_counter() - start
    return frames / took, batches / took


def bench_collect(args) -> dict:
    ours, theirs = [], []
    for _ in range(args.rounds):
        storage = LazyShmStorage(args.frames)
        try:
            rb = TensorDictReplayBuffer(storage=storage, writer=ShmWriter(),
                                        sampler=SliceSampler(slice_len=64), batch_size=1024)
            ours.append(_collect_once(rb, args.frames))
        finally:
            storage.close()
        rb = TensorDictReplayBuffer(storage=LazyTensorStorage(args.frames, shared_init=True),
                                    sampler=TorchRLSliceSampler(slice_len=64), batch_size=1024,
                                    shared=True)
        theirs.append(_collect_once(rb, args.frames))
        del rb
    frames = _pair("collect frames/s, 2 workers + trainer", [o[0] for o in ours],
                   [t[0] for t in theirs], "reported", higher_is_better=True, key="frames")
    batches = _pair("trainer batches/s meanwhile (16x64)", [o[1] for o in ours],
                    [t[1] for t in theirs], "reported", higher_is_better=True, key="batches")
    return {**frames, **batches}


# -- the report ------------------------------------------------------------------------------
def _pair(label, ours, theirs, target, *, higher_is_better, key="result") -> dict:
    """Medians of the paired rounds and the median of their per-round ratios."""
    ratios = [o / t for o, t in zip(ours, theirs)]
    entry = {"label": label, "shmbuf": statistics.median(ours),
             "baseline": statistics.median(theirs), "ratio": statistics.median(ratios),
             "ratio_range": [min(ratios), max(ratios)], "rounds": len(ours), "target": target,
             "higher_is_better": higher_is_better}
    print(f"{label:<62} {entry['shmbuf']:>11.1f} {entry['baseline']:>11.1f} "
          f"{entry['ratio']:>7.2f}x [{min(ratios):.2f}-{max(ratios):.2f}]  {target}",
          flush=True)
    return {key: entry}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100_000, help="W1 steps held (sample)")
    parser.add_argument("--batches", type=int, default=200, help="64-step batches per writer")
    parser.add_argument("--frames", type=int, default=20_000, help="collector frames per run")
    parser.add_argument("--calls", type=int, default=20, help="sample calls per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument("--quick", action="store_true", help="small sizes (minutes)")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.batches, args.frames, args.calls = 20_000, 60, 4_096, 10
    logging.getLogger("torchrl").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message="A SliceSampler is used with a multi-process")
    load = os.getloadavg()[0]
    print(f"{'':<62} {'shmbuf':>11} {'baseline':>11} {'ratio':>8}  target")
    if load > 0.5 * (os.cpu_count() or 1):
        print(f"(load average {load:.1f} on {os.cpu_count()} cores: other work skews figures)")
    results = {"args": {k: str(v) for k, v in vars(args).items()}, "load": load}
    parts = args.parts.split(",")
    for part, fn in (("ingest", bench_ingest), ("sample", bench_sample),
                     ("collect", bench_collect)):
        if part in parts:
            results[part] = fn(args)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=1))
    left = [n for n in os.listdir("/dev/shm") if n.startswith("shmbuf-")]
    print(f"json: {args.json}; shmbuf segments in /dev/shm now: {len(left)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
