"""PlaNet's Memory and Episode (torchwm), shared: workers append episodes, the trainer samples.

Each worker records ``Episode``s as the seed does (``append`` per step, then
``terminate(final_obs)``) and appends them to the Memory it was handed; the
Memory keeps the newest ``size`` episodes across all workers.

    sample(B, tracelen) -> [x (B, tracelen+1, 3, 16, 16), u (B, tracelen, 2), r (B, tracelen),
                            t (B, tracelen)], lengths (B,)

    python examples/planet_memory.py [--workers 2] [--episodes 6]
"""
import argparse
import multiprocessing as mp

import numpy as np

import shmbuf


def env_worker(memory, seed, episodes):
    """A stand-in env: episodes of 30 to 50 steps of random 3x16x16 frames."""
    rng = np.random.default_rng(seed)
    for _ in range(episodes):
        episode = shmbuf.Episode(postprocess_fn=lambda x: x / 255.0)
        steps = int(rng.integers(30, 51))
        for t in range(steps):
            obs = rng.integers(0, 256, (3, 16, 16)).astype(np.float32)
            episode.append(obs, rng.uniform(-1, 1, 2), float(rng.normal()), t == steps - 1)
        episode.terminate(rng.integers(0, 256, (3, 16, 16)).astype(np.float32))
        memory.append([episode])
    memory.close()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--episodes", type=int, default=6, help="episodes per worker")
    args = parser.parse_args()

    # obs_shape and action_size create the shared segment now, so that it can be
    # sent to the workers before anything is appended.
    with shmbuf.Memory(size=8, steps_per_episode=50, obs_shape=(3, 16, 16), action_size=2,
                       seed=0) as memory:
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=env_worker, args=(memory, seed, args.episodes), daemon=True)
                 for seed in range(args.workers)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=120)
        (x, u, r, t), lengths = memory.sample(batch_size=16, tracelen=20)
        print(f"sample(16, tracelen=20): x {x.shape}, u {u.shape}, r {r.shape}, "
              f"t {t.shape}, lengths {lengths.shape}")
        print(f"memory.episodes: maxlen {memory.episodes.maxlen}, len "
              f"{len(memory.episodes)}; eps_lengths {list(memory.eps_lengths)}")
        newest = memory.episodes[-1]   # a terminated Episode, read from shared memory
        assert newest.x.shape == (newest.size + 1, 3, 16, 16)
        print(f"done: {len(memory)} episodes held of {args.workers * args.episodes} "
              f"appended, {memory.size} transitions, "
              f"exit codes {[p.exitcode for p in procs]}")


if __name__ == "__main__":
    main()
