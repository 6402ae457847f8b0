"""Many readers, one copy: load an offline dataset into shared memory once, then train on it
with a 4-worker DataLoader and, in a second part, with 2 trainer processes at once.

The dataset is a stable-worldmodel HDF5 file (one dataset per column plus ep_len and
ep_offset); without --file the script first records a small one from a toy pixel env.
``shmbuf.datasets.from_swm_hdf5`` copies it into one buffer.  Every DataLoader worker and
every trainer process then attaches to that buffer by name and samples windows from the
same pages: no per-worker copy of the dataset, no file reopened per worker.

    python examples/offline_dataloader.py [--file data.h5] [--episodes 40] [--batches 40]

(``shmbuf import swm:data.h5 --name X`` does the load from a shell and holds the buffer
while trainers elsewhere ``shmbuf.attach("X")``.)  Needs the datasets extra (h5py) and torch.
"""
import argparse
import multiprocessing as mp
import os
import sys
import tempfile

import numpy as np

import shmbuf
from shmbuf.datasets import from_swm_hdf5


def record(path: str, episodes: int, length: int, seed: int = 0) -> None:
    """A toy pixel env's episodes in stable-worldmodel's layout (h5py only)."""
    import h5py

    rng = np.random.default_rng(seed)
    n = episodes * length
    pos = rng.uniform(2, 14, (n, 2))
    frames = np.zeros((n, 3, 16, 16), np.uint8)
    for i, (y, x) in enumerate(pos.astype(int)):
        frames[i, :, y - 2:y + 2, x - 2:x + 2] = 255
    with h5py.File(path, "w") as f:
        f["pixels"] = frames
        f["action"] = rng.uniform(-1, 1, (n, 2)).astype(np.float32)
        f["reward"] = (1 - np.abs(pos - 8).sum(1) / 12).astype(np.float32)  # near the centre
        f["terminated"] = np.zeros(n, bool)
        f["ep_len"] = np.full(episodes, length, np.int32)
        f["ep_offset"] = np.arange(episodes, dtype=np.int64) * length


def train(loader, steps: int):
    """A linear reward model on the frames: (first loss, last loss, batches, batch shape)."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(3 * 16 * 16, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses, shape = [], None
    for _, batch in zip(range(steps), loader):
        x = batch["pixels"].float().flatten(2) / 255           # (L, B, 768)
        loss = ((model(x).squeeze(-1) - batch["reward"]) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        shape = tuple(batch["pixels"].shape)
    return losses[0], losses[-1], len(losses), shape


def loader_over(buf, batches: int, workers: int, seed: int):
    import torch

    return torch.utils.data.DataLoader(buf.dataset(16, 8, batches=batches, seed=seed),
                                       batch_size=None, num_workers=workers)


def trainer(name: str, rank: int, batches: int, workers: int, out) -> None:
    """A second trainer process: attach by name, train on its own DataLoader."""
    with shmbuf.attach(name) as buf:
        first, last, n, _ = train(loader_over(buf, batches, workers, seed=rank), batches)
    out.put((rank, n, first, last))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--file", help="a stable-worldmodel .h5 file (default: record one)")
    p.add_argument("--episodes", type=int, default=40)
    p.add_argument("--length", type=int, default=50)
    p.add_argument("--batches", type=int, default=40)
    p.add_argument("--trainer-workers", type=int, default=0,
                   help="DataLoader workers of each of the 2 trainer processes")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.file or os.path.join(tmp, "toy.h5")
        if args.file is None:
            record(path, args.episodes, args.length)
        with from_swm_hdf5(path, seed=0) as buf:            # the one copy; we own it
            held = buf.episodes()
            size = sum(a.nbytes for a in buf.arrays.values())
            print(f"loaded once: {len(held.index)} episodes, {len(buf)} steps into "
                  f"{buf.name} ({size / 2**20:.1f} MiB of columns)")

            first, last, n, shape = train(loader_over(buf, args.batches, 4, seed=0),
                                          args.batches)
            print(f"DataLoader(4 workers): {n} batches of pixels {shape} uint8, "
                  f"loss {first:.3f} -> {last:.3f}")

            # Spawned, as another program would be: it knows only the buffer's name.  (Not
            # fork: torch's thread pools, used above, do not survive a fork.)
            ctx = mp.get_context("spawn")
            out = ctx.Queue()
            procs = [ctx.Process(target=trainer, args=(buf.name, rank, args.batches,
                                                       args.trainer_workers, out))
                     for rank in range(2)]
            try:
                for proc in procs:
                    proc.start()
                results = sorted(out.get(timeout=300) for _ in procs)
                for rank, n, first, last in results:
                    print(f"trainer {rank}: {n} batches, loss {first:.3f} -> {last:.3f}")
            finally:
                for proc in procs:
                    proc.join(timeout=60)
                    if proc.is_alive():
                        proc.kill()
                        proc.join(timeout=60)
            codes = [proc.exitcode for proc in procs]
            print(f"done: one copy of {len(buf)} steps, read by 4 DataLoader workers and 2 "
                  f"trainer processes, exit codes {codes}")
    return 0 if codes == [0, 0] else 1


if __name__ == "__main__":
    sys.exit(main())
