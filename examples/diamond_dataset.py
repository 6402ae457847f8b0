"""DIAMOND's ReplayBuffer and SequenceDataset (torchwm), shared: a worker adds, a DataLoader reads.

The worker adds HWC uint8 transitions with their ``next_obs``; the trainer
draws batches from a ``DataLoader`` over a ``SequenceDataset`` (its worker
processes read the live shared buffer), samples single steps, and
checkpoints with ``state_dict`` through ``torch.save``.

    loader batch -> obs_seq (B, 5, 3, 32, 32) f32 in [0, 1], action_seq (B, 5, 2),
                    rewards (B, 5) f32, dones (B, 5) bool, next_obs (B, 3, 32, 32),
                    burn_in_obs (B, 4, 3, 32, 32)

    python examples/diamond_dataset.py [--steps 300] [--loader-workers 1]
"""
import argparse
import multiprocessing as mp
import os
import tempfile

import numpy as np

import shmbuf


def env_worker(rb, seed, steps):
    """A stand-in env: random 32x32x3 frames, episodes of 50 steps."""
    rng = np.random.default_rng(seed)
    obs = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
    for t in range(steps):
        next_obs = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
        rb.add(obs, rng.uniform(-1, 1, 2).astype(np.float32), float(rng.normal()),
               t % 50 == 49, next_obs)
        obs = next_obs
    rb.close()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--loader-workers", type=int, default=1)
    args = parser.parse_args()

    import torch  # the trainer's import only: the spawned env worker never pays for it

    with shmbuf.DiamondReplayBuffer(capacity=1_000, obs_shape=(32, 32, 3), action_dim=2,
                                    seed=0) as rb:
        worker = mp.get_context("spawn").Process(target=env_worker, args=(rb, 0, args.steps),
                                                 daemon=True)
        worker.start()
        worker.join(timeout=120)
        print(f"size {rb.size}, position {rb.position}, is_ready(200) {rb.is_ready(200)}")
        dataset = shmbuf.SequenceDataset(rb, sequence_length=5, burn_in=4, seed=0)
        loader = torch.utils.data.DataLoader(
            dataset, batch_size=8, shuffle=True, num_workers=args.loader_workers,
            multiprocessing_context="spawn" if args.loader_workers else None)
        batch = next(iter(loader))
        print("loader batch: " + ", ".join(f"{k} {tuple(v.shape)}"
                                            for k, v in sorted(batch.items())))
        step = rb.sample(32)
        print(f"sample(32): obs {tuple(step['obs'].shape)}, dones {step['dones'].dtype}")
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "buffer.pt")
            torch.save(rb.state_dict(), path)
            with shmbuf.DiamondReplayBuffer(capacity=1_000, obs_shape=(32, 32, 3),
                                            action_dim=2) as restored:
                restored.load_state_dict(torch.load(path, weights_only=True))
                assert len(restored) == len(rb)
        print(f"done: {len(rb)} steps, batches of {len(batch['obs_seq'])} sequences from "
              f"{args.loader_workers} loader workers, checkpoint restored, "
              f"exit code {worker.exitcode}")


if __name__ == "__main__":
    main()
