"""DreamerV3's loop shape on a shared replay: actor processes add, a learner samples.

    python examples/dreamerv3_replay.py [--steps N] [--actors N]

Each actor process runs a gymnasium CartPole and adds every step with
``is_first``, ``is_last`` and ``is_terminal`` straight into the shared
``Replay`` (no replay server).  The learner samples batches, pushes
priorities, and writes a context key (a stand-in for the world model's
latent) back into the sampled steps with ``update``; it prints the replay
ratio from ``stats()``.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp

import gymnasium as gym
import numpy as np

from shmbuf.compat.embodied import Mixture, Prioritized, Replay, Uniform

LENGTH, BATCH, LATENT = 16, 8, 4
SPEC = {
    "vector": ((4,), np.float32),
    "action": ((), np.int64),
    "reward": ((), np.float32),
    "is_first": ((), bool),
    "is_last": ((), bool),
    "is_terminal": ((), bool),
    "latent": ((LATENT,), np.float32),   # replay context, written back by the learner
}


def actor(replay: Replay, worker: int, steps: int, done) -> None:
    env = gym.make("CartPole-v1")
    obs, _ = env.reset(seed=worker)
    first, rng = True, np.random.default_rng(worker)
    for _ in range(steps):
        action = int(rng.integers(2))
        nxt, reward, terminated, truncated, _ = env.step(action)
        last = terminated or truncated
        replay.add({"vector": obs, "action": action, "reward": reward, "is_first": first,
                    "is_last": last, "is_terminal": terminated,
                    "latent": np.zeros(LATENT, np.float32)}, worker=worker)
        obs, first = nxt, last
        if last:
            obs, _ = env.reset()
    env.close()
    done.put(worker)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=2000, help="steps per actor")
    ap.add_argument("--actors", type=int, default=4)
    ap.add_argument("--updates", type=int, default=50)
    args = ap.parse_args(argv)
    selector = Mixture({"uniform": Uniform(), "priority": Prioritized(maxfrac=0.5)},
                       {"uniform": 0.5, "priority": 0.5})
    ctx = mp.get_context("spawn")
    with Replay(LENGTH, capacity=args.actors * args.steps, selector=selector,
                spec=SPEC) as replay:
        done = ctx.Queue()
        procs = [ctx.Process(target=actor, args=(replay, w, args.steps, done))
                 for w in range(args.actors)]
        try:
            for p in procs:
                p.start()
            for _ in range(args.updates):   # the learner, while the actors add
                data = replay.sample(BATCH)
                loss = np.abs(data["reward"] - data["reward"].mean()) + 0.1
                latent = data["vector"]   # stands in for the world model's state
                replay.update({"stepid": data["stepid"], "priority": loss,
                               "latent": latent})
            print(f"sample({BATCH}): vector {data['vector'].shape} {data['vector'].dtype}, "
                  f"is_first {data['is_first'].shape}, stepid {data['stepid'].shape} "
                  f"{data['stepid'].dtype}")
            print(f"update(): priority {loss.shape} and latent {latent.shape} written back, "
                  f"{args.updates} times")
            for _ in procs:
                done.get(timeout=120)
            for p in procs:
                p.join(timeout=60)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(5)
        stats = replay.stats()
        print(f"done: {stats['items']} items from {args.actors} actors, {stats['samples']} "
              f"samples, replay ratio {stats['replay_ratio']:.3f}, exit codes "
              f"{[p.exitcode for p in procs]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
