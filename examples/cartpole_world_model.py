"""Four actor processes play CartPole with the current policy; a trainer fits a world model.

Each actor (``shmbuf.gym.run_actor``) builds its own env, records every step
straight into the shared buffer through ``RecordEpisodes``, and picks up the
policy's newest weights from a ``shmbuf.params.ParamBlock`` between steps: no
pipe, no queue.  Meanwhile the trainer

- fits a small torch world model on sequences sampled by a prefetch thread:
  from ``obs[t]`` and ``action[t+1]`` (the action taken there, in shmbuf.gym's
  step convention) it predicts ``obs[t+1]``, ``reward[t+1]`` and ``done[t+1]``;
- improves the policy (logistic, 5 weights) with REINFORCE on the newest whole
  episodes (``iter_episodes``) and publishes it to the actors.

The buffer holds DreamerV3's train ratio (``shmbuf.RateLimit``, ``--train-ratio``):
each batch replays 64 x 8 steps, and actors and trainer wait for each other so that
the steps replayed stay within a batch of ``train_ratio`` times the steps the actors
recorded after the first 2,000.  The progress lines print the ratio achieved.

    python examples/cartpole_world_model.py            # about a minute on 2 cores
    python examples/cartpole_world_model.py --quick    # a few seconds (CI)
"""
import argparse
import multiprocessing as mp
import os
import time

import gymnasium as gym
import numpy as np

import shmbuf
from shmbuf.gym import run_actor, spec_for
from shmbuf.params import ParamBlock

LENGTH = 8  # rows per sampled window: 7 transitions


class Policy:
    """Push right with probability sigmoid(obs @ w + b); the actors' copy, in numpy."""

    def __init__(self, seed):
        self.rng = np.random.default_rng(seed)

    def __call__(self, obs, weights):
        logit = float(obs @ weights["w"] + weights["b"])
        return int(self.rng.random() < 1.0 / (1.0 + np.exp(-logit)))


def make_env():
    return gym.make("CartPole-v1")


def actor(buf, block, seed):
    os.nice(5)  # the trainer first: actors have more than enough data to give
    # Runs until the trainer calls buf.stop_writers(), waiting on the rate limit or not.
    run_actor(make_env, buf, Policy(seed), params=block, seed=seed)


def world_model():
    """(obs, action) -> (next obs, reward, done logit): an MLP that predicts the change of obs."""
    import torch

    class WorldModel(torch.nn.Module):
        def __init__(self, hidden=64):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(4 + 2, hidden), torch.nn.ELU(),
                                           torch.nn.Linear(hidden, hidden), torch.nn.ELU(),
                                           torch.nn.Linear(hidden, 4 + 2))

        def forward(self, obs, action):
            onehot = torch.nn.functional.one_hot(action.long(), 2)
            out = self.net(torch.cat([obs, onehot], -1))
            return obs + out[..., :4], out[..., 4], out[..., 5]

    return WorldModel()


def world_model_loss(model, batch):
    """One-step losses on every transition of every window (time-major, one episode each)."""
    import torch.nn.functional as F

    obs, action = batch["obs"], batch["action"]
    next_obs, reward, done = model(obs[:-1], action[1:])   # action[t+1] was taken at obs[t]
    return (F.mse_loss(next_obs, obs[1:]) + F.mse_loss(reward, batch["reward"][1:])
            + F.binary_cross_entropy_with_logits(done, batch["done"][1:].float()))


def reinforce(policy, optimiser, episodes, gamma=0.99):
    """One REINFORCE step on whole episodes: row t+1's action was taken at obs[t]."""
    import torch

    obs, act, adv = [], [], []
    for ep in episodes:
        rewards = ep["reward"][1:].astype(np.float64)
        returns = np.zeros_like(rewards)
        running = 0.0
        for t in range(len(rewards) - 1, -1, -1):
            running = rewards[t] + gamma * running
            returns[t] = running
        obs.append(ep["obs"][:-1])
        act.append(ep["action"][1:])
        adv.append(returns)
    adv = np.concatenate(adv)
    adv = (adv - adv.mean()) / (adv.std() + 1e-8)
    logits = policy(torch.from_numpy(np.concatenate(obs))).squeeze(-1)
    target = torch.from_numpy(np.concatenate(act).astype(np.float32))
    logp = -torch.nn.functional.binary_cross_entropy_with_logits(logits, target, reduction="none")
    loss = -(logp * torch.from_numpy(adv.astype(np.float32))).mean()
    optimiser.zero_grad()
    loss.backward()
    optimiser.step()


def weights_of(policy):
    return {"w": policy.weight.detach().numpy()[0], "b": policy.bias.detach().numpy()[0]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--actors", type=int, default=4)
    parser.add_argument("--updates", type=int, default=3000,
                        help="world-model updates (a policy update every 10)")
    parser.add_argument("--quick", action="store_true", help="300 updates (CI)")
    parser.add_argument("--capacity", type=int, default=100_000)
    parser.add_argument("--train-ratio", type=float, default=32.0,
                        help="replayed steps per recorded step (DreamerV3's Atari value)")
    args = parser.parse_args()
    updates = 300 if args.quick else args.updates
    import torch  # here, not at the top: the spawned actors never import torch

    torch.manual_seed(0)
    torch.set_num_threads(1)

    policy = torch.nn.Linear(4, 1)
    torch.nn.init.zeros_(policy.weight)
    torch.nn.init.zeros_(policy.bias)           # a coin flip to begin with
    policy_opt = torch.optim.Adam(policy.parameters(), lr=0.05)
    model = world_model()
    model_opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    ctx = mp.get_context("spawn")
    limit = shmbuf.RateLimit(args.train_ratio, min_steps=2_000, writer_timeout=60)
    with shmbuf.create(spec_for(make_env()), capacity=args.capacity, seed=0,
                       rate_limit=limit) as buf, \
            ParamBlock.create(weights_of(policy)) as block:
        block.publish(weights_of(policy))
        procs = [ctx.Process(target=actor, args=(buf, block, seed))
                 for seed in range(args.actors)]
        try:
            for p in procs:
                p.start()
            buf.wait_ready(min_steps=2_000, timeout=120)
            start, losses, returns = time.perf_counter(), [], []
            with buf.prefetch(64, LENGTH, device="cpu") as batches:
                for update, batch in zip(range(1, updates + 1), batches):
                    loss = world_model_loss(model, batch)
                    model_opt.zero_grad()
                    loss.backward()
                    model_opt.step()
                    losses.append(loss.item())
                    episodes = list(buf.iter_episodes(newest=16)) if update % 10 == 0 else []
                    if episodes:
                        reinforce(policy, policy_opt, episodes)
                        block.publish(weights_of(policy))
                        returns.append(np.mean([ep["reward"].sum() for ep in episodes]))
                    if update % max(updates // 10, 1) == 0 and returns:
                        s = buf.stats()
                        print(f"update {update:5d}  world-model loss {np.mean(losses[-50:]):.4f}  "
                              f"return {returns[-1]:6.1f}  policy v{block.version():<4d} "
                              f"env steps {s.steps_written:7d}  train ratio {s.rate.ratio:5.1f}  "
                              f"{time.perf_counter() - start:5.1f} s", flush=True)
            s, held = buf.stats(), len(buf.episodes())
        finally:
            buf.stop_writers()   # every actor's next add (or the one waiting) ends its loop
            for p in procs:
                p.join(timeout=60)
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(timeout=10)
        returns = returns or [float("nan")]
        print(f"done: {updates} updates, {s.steps_written} env steps from {args.actors} actors, "
              f"{held} episodes, policy v{block.version()}, return "
              f"{returns[0]:.1f} -> {np.mean(returns[-5:]):.1f}, world-model loss "
              f"{np.mean(losses[:20]):.3f} -> {np.mean(losses[-50:]):.4f}, train ratio "
              f"{s.rate.ratio:.2f} (target {s.rate.train_ratio:g}), "
              f"exit codes {[p.exitcode for p in procs]}")


if __name__ == "__main__":
    main()
