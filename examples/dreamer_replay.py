"""Dreamer's ReplayBuffer (torchwm), shared: env workers add, the trainer samples.

The calls are the seed's (``ReplayBuffer(size, obs_shape, action_size)``,
``add({"image": obs}, action, reward, done)``, ``sample()``); what shmbuf adds
is that the buffer pickles to its name, so spawned workers add to it directly.

    sample() -> obs (L, B, 3, 64, 64) uint8, act (L, B, 6) f32, rew (L, B) f32, term (L, B) f32

    python examples/dreamer_replay.py [--workers 2] [--steps 400]
"""
import argparse
import multiprocessing as mp

import numpy as np

import shmbuf


def env_worker(rb, seed, steps):
    """A stand-in env: random frames, episodes of 100 steps."""
    rng = np.random.default_rng(seed)
    for t in range(steps):
        obs = rng.integers(0, 256, (3, 64, 64), dtype=np.uint8)
        action = rng.uniform(-1, 1, 6).astype(np.float32)
        rb.add({"image": obs}, action, float(rng.normal()), float(t % 100 == 99))
    rb.close()   # this process's handle; the trainer's buffer lives on


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=400, help="steps per worker")
    args = parser.parse_args()

    with shmbuf.ReplayBuffer(size=5_000, obs_shape=(3, 64, 64), action_size=6, seq_len=20,
                             batch_size=16, seed=0) as rb:
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=env_worker, args=(rb, seed, args.steps), daemon=True)
                 for seed in range(args.workers)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=120)
        obs, act, rew, term = rb.sample()
        print(f"sample(): obs {obs.shape} {obs.dtype}, act {act.shape}, rew {rew.shape}, "
              f"term {term.shape} {term.dtype}")
        # A window may end on a terminal step but never continues past one.
        assert not term[:-1].any()
        print(f"done: {rb.steps} steps from {args.workers} workers, {rb.episodes} episodes, "
              f"exit codes {[p.exitcode for p in procs]}")


if __name__ == "__main__":
    main()
