"""Spawn targets for tests/test_gym_actors.py (importable by name in a spawned child)."""
import functools

import gymnasium as gym
import numpy as np

from shmbuf.gym import run_actor


def linear_policy(obs, weights):
    """CartPole: push right when ``obs @ w`` is positive (w all zeros: always left)."""
    return int(obs @ weights["w"] > 0) if weights is not None else 0


def cartpole_actor(buffer, block, stop, seed, out):
    got = run_actor(functools.partial(gym.make, "CartPole-v1"), buffer, linear_policy,
                    params=block, stop=stop, seed=seed)
    out.put(got)


def read_versions(block, n_reads, out):
    """Read ``n_reads`` times while the parent publishes; report torn reads and versions."""
    block.wait_version(1, timeout=30)
    torn, seen = 0, set()
    for _ in range(n_reads):
        version, params = block.read()
        seen.add(version)
        values = np.concatenate([v.reshape(-1).astype(np.float64) for v in params.values()])
        torn += int(not (values == version).all())
    out.put((torn, len(seen)))


def actor_until_stopped(buffer, seed, out):
    """run_actor with neither steps nor stop: it ends when the trainer stops the writers."""
    out.put(run_actor(functools.partial(gym.make, "CartPole-v1"), buffer,
                      lambda obs, weights: 0, seed=seed))
