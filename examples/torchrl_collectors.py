"""TorchRL's multi-process collector writing straight into shared memory.

Two collector workers (``MultiSyncCollector``) each step their own CartPole
and extend the replay buffer themselves: its storage is a ``LazyShmStorage``
and its writer a ``ShmWriter``, so each worker appends to a stream of its own
in shared memory, with no lock, and no frame goes through this process.  The
trainer here samples slices while the workers write.

    TensorDictReplayBuffer(storage=LazyShmStorage(50_000), writer=ShmWriter(),
                           sampler=SliceSampler(slice_len=8), batch_size=128)
    rb.sample() -> TensorDict [128]: 16 slices of 8 steps, each from one episode
        observation (128, 4) f32, action (128, 2) i64, ("next", "reward") (128, 1), ...

    python examples/torchrl_collectors.py [--workers 2] [--frames 20000] [--quick]

Needs the torchrl extra (``pip install 'shmbuf[torchrl]'``) and gymnasium.
"""
import argparse
import time

import torch
from torchrl.collectors import MultiSyncCollector
from torchrl.data import TensorDictReplayBuffer
from torchrl.envs import GymEnv

from shmbuf.compat.torchrl import LazyShmStorage, ShmWriter, SliceSampler


def make_env():
    return GymEnv("CartPole-v1")


def check_slices(batch, slices: int, length: int) -> None:
    """Every slice lies in one episode and its steps follow each other."""
    traj = batch["collector", "traj_ids"].view(slices, length)
    assert (traj == traj[:, :1]).all(), "a slice crossed two trajectories"
    obs, nxt = batch["observation"].view(slices, length, -1), batch["next", "observation"]
    assert torch.equal(obs[:, 1:], nxt.view(slices, length, -1)[:, :-1]), "a gap in a slice"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--frames", type=int, default=20_000)
    parser.add_argument("--quick", action="store_true", help="a short run (for the tests)")
    args = parser.parse_args(argv)
    frames = 2_000 if args.quick else args.frames
    slices, length = 16, 8

    storage = LazyShmStorage(50_000)
    rb = TensorDictReplayBuffer(storage=storage, writer=ShmWriter(),
                                sampler=SliceSampler(slice_len=length),
                                batch_size=slices * length)
    collector = MultiSyncCollector([make_env] * args.workers, policy=None,
                                   frames_per_batch=200 * args.workers,
                                   total_frames=frames, replay_buffer=rb)
    start, batches = time.perf_counter(), 0
    try:
        for i, _ in enumerate(collector):   # the workers extend rb; nothing comes back here
            if len(rb) >= slices * length:
                for _ in range(4):          # "train": draw batches while the workers write
                    check_slices(rb.sample(), slices, length)
                    batches += 1
            if i % 5 == 0:
                print(f"  {len(rb):6d} steps held, {batches:4d} batches sampled", flush=True)
    finally:
        collector.shutdown()
    stats = storage.buffer.stats()
    took = time.perf_counter() - start
    print(f"done: {stats.steps_written} frames from {args.workers} workers in "
          f"{stats.streams} streams, {batches} batches of {slices}x{length} checked, "
          f"{stats.steps_written / took:.0f} frames/s")
    storage.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
