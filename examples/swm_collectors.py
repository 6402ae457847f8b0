"""stable-worldmodel collectors and a trainer sharing one ReplayBuffer.

Four collector processes each run their own swm ``World`` and call
``world.collect(writer=rb, ...)`` on the same shared ``ReplayBuffer``; the
trainer samples it through a DataLoader with 2 workers, drawing clips by
recency (``as_sampler(Recency())``), while the collectors are still writing.

    ReplayBuffer(max_steps=20_000, history_len=4, sampler=as_sampler(Recency()))
    sample(16) -> pixels (16, 4, 32, 32, 3) uint8, action (16, 4, 2) f32, ...

    python examples/swm_collectors.py [--collectors 4] [--episodes 6] [--batches 30]

Needs stable-worldmodel (``pip install stable-worldmodel``) with a torchvision
that imports (swm's ``World`` imports it).
"""
import argparse
import multiprocessing as mp
import time
from typing import ClassVar

import gymnasium as gym
import numpy as np
import torch

ENV_ID = "shmbuf_example/Reach-v0"


class Reach(gym.Env):
    """A dot pushed towards the centre by 2-D actions; frames drawn with numpy."""

    metadata: ClassVar[dict] = {"render_modes": ["rgb_array"]}

    def __init__(self, render_mode=None, size=32):
        self.render_mode, self.size = render_mode, size
        self.observation_space = gym.spaces.Box(0, 1, (2,), np.float32)
        self.action_space = gym.spaces.Box(-1, 1, (2,), np.float32)
        self.pos = np.zeros(2, np.float32)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.pos = self.np_random.uniform(0, 1, 2).astype(np.float32)
        return self.pos.copy(), {}

    def step(self, action):
        self.pos = np.clip(self.pos + 0.05 * np.asarray(action, np.float32), 0, 1)
        dist = float(np.abs(self.pos - 0.5).sum())
        return self.pos.copy(), -dist, dist < 0.05, False, {}

    def render(self):
        frame = np.zeros((self.size, self.size, 3), np.uint8)
        i, j = (self.pos * (self.size - 1)).astype(int)
        frame[max(i - 1, 0):i + 2, max(j - 1, 0):j + 2] = 255
        return frame


def register():
    if ENV_ID not in gym.registry:
        gym.register(ENV_ID, entry_point=Reach)


def collector(rb, index, episodes, steps):
    """One collector process: its own World, writing finished episodes into ``rb``."""
    from stable_worldmodel import World
    from stable_worldmodel.policy import RandomPolicy

    register()
    world = World(ENV_ID, num_envs=2, image_shape=(32, 32), max_episode_steps=steps,
                  goal_conditioned=False)
    world.set_policy(RandomPolicy(seed=index))
    try:
        world.collect(writer=rb, episodes=episodes, seed=1000 * index, progress=False)
    finally:
        world.close()


class Batches(torch.utils.data.IterableDataset):
    """``n`` batches of ``rb.sample(batch_size)``, split over the DataLoader's workers.

    ``rb`` pickles to its name: each worker attaches to the same memory.
    (torch is imported at the top: swm's World, in every collector, imports it anyway.)
    """

    def __init__(self, rb, n, batch_size):
        self.rb, self.n, self.batch_size = rb, n, batch_size

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        share = self.n // info.num_workers + (info.id < self.n % info.num_workers)
        for _ in range(share):
            yield self.rb.sample(self.batch_size)


def trainer(rb, batches, batch_size):
    """Sample through 2 DataLoader workers; fit a linear map from frames to the next action."""
    loader = torch.utils.data.DataLoader(Batches(rb, batches, batch_size), batch_size=None,
                                         num_workers=2, multiprocessing_context="spawn",
                                         timeout=120)
    model = torch.nn.Linear(32 * 32 * 3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    first = last = None
    shapes = None
    steps = 0
    for batch in loader:
        steps += 1
        shapes = shapes or {k: (tuple(v.shape), str(v.dtype).replace("torch.", ""))
                            for k, v in batch.items()}
        frames = batch["pixels"][:, -1].reshape(batch_size, -1).float() / 255
        target = torch.nan_to_num(batch["action"][:, -1])   # swm's last row has no action
        loss = torch.nn.functional.mse_loss(model(frames), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        first = loss.item() if first is None else first
        last = loss.item()
    return steps, shapes, first, last


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--collectors", type=int, default=4)
    parser.add_argument("--episodes", type=int, default=6, help="per collector")
    parser.add_argument("--steps", type=int, default=40, help="max steps per episode")
    parser.add_argument("--batches", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args()

    from shmbuf.compat.swm import ReplayBuffer, as_sampler
    from shmbuf.select import Recency

    register()
    rb = ReplayBuffer(max_steps=20_000, history_len=4, sampler=as_sampler(Recency()))
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=collector, args=(rb, i, args.episodes, args.steps))
             for i in range(args.collectors)]
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + 300
        while rb.num_valid_ends(4) < args.batch_size:       # the first episodes land
            if time.monotonic() > deadline or not any(p.is_alive() for p in procs):
                if rb.num_valid_ends(4) >= 1:
                    break
                raise SystemExit("no episode arrived from the collectors")
            time.sleep(0.05)
        seen_at_start = rb.num_episodes
        n, shapes, first, last = trainer(rb, args.batches, args.batch_size)
        described = ", ".join(f"{k} {s} {d}" for k, (s, d) in sorted(shapes.items()))
        print(f"sample({args.batch_size}): {described}")
        print(f"trained {n} batches while collecting ({seen_at_start} episodes held at the "
              f"first batch); loss {first:.3f} -> {last:.3f}")
        for p in procs:
            p.join(timeout=300)
        print(f"done: {rb.num_episodes} episodes, {rb.num_steps_stored} steps from "
              f"{args.collectors} collectors, exit codes {[p.exitcode for p in procs]}")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
        rb.close()


if __name__ == "__main__":
    main()
