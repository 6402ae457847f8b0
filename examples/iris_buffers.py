"""IRIS's buffers (torchwm), shared: workers collect on-policy episodes, then move them over.

Each worker fills an ``IRISOnPolicyBuffer`` (private to it, as upstream) and
transfers every step to the shared ``IRISReplayBuffer``, as the seed docs do;
the trainer samples batch-major sequences with one extra frame.

    sample_sequence() -> obs (B, L+1, 3, 32, 32) uint8, act (B, L, 4) f32, rew (B, L) f32,
                         term (B, L) f32

    python examples/iris_buffers.py [--workers 2] [--episodes 4]
"""
import argparse
import multiprocessing as mp

import numpy as np

import shmbuf


def env_worker(buffer, seed, episodes):
    """A stand-in env: episodes of 40 steps of random 3x32x32 frames."""
    rng = np.random.default_rng(seed)
    on_policy = shmbuf.IRISOnPolicyBuffer(max_steps=100)
    for _ in range(episodes):
        for t in range(40):
            obs = rng.integers(0, 256, (3, 32, 32), dtype=np.uint8)
            on_policy.add(obs, rng.uniform(-1, 1, 4).astype(np.float32), float(rng.normal()),
                          t == 39)
        for i in range(len(on_policy)):   # transfer to the main buffer, as the docs do
            buffer.add(on_policy.observations[i], on_policy.actions[i],
                       on_policy.rewards[i], on_policy.terminals[i])
        on_policy.clear()
    buffer.close()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--episodes", type=int, default=4, help="episodes per worker")
    args = parser.parse_args()

    with shmbuf.IRISReplayBuffer(size=2_000, obs_shape=(3, 32, 32), action_size=4, seq_len=10,
                                 batch_size=8, seed=0) as buffer:
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=env_worker, args=(buffer, seed, args.episodes), daemon=True)
                 for seed in range(args.workers)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=120)
        obs, act, rew, term = buffer.sample_sequence()
        print(f"sample_sequence(): obs {obs.shape}, act {act.shape}, rew {rew.shape}, "
              f"term {term.shape}")
        one = buffer.sample_single()
        print(f"sample_single(): obs {one[0].shape}, act {one[1].shape}")
        print(f"done: {len(buffer)} steps of {buffer.buffer_capacity} from {args.workers} "
              f"workers, exit codes {[p.exitcode for p in procs]}")


if __name__ == "__main__":
    main()
