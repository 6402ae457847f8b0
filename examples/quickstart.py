"""A trainer and env workers sharing one shmbuf replay buffer.

Each worker runs a tiny synthetic pixel env (a bright square drifting across
a 3x64x64 frame) and writes its steps straight into shared memory.  The
trainer samples time-major batches of sequences meanwhile and checks that
every window stays inside one episode of one worker.

    python examples/quickstart.py [--workers 2] [--steps 4000]
"""
import argparse
import multiprocessing as mp
import time

import numpy as np

import shmbuf

SPEC = {
    "obs": ((3, 64, 64), np.uint8),
    "action": ((6,), np.float32),
    "reward": ((), np.float32),
    "done": ((), np.bool_),
}


class SquareEnv:
    """A 3x64x64 frame with a square that the action pushes around."""

    def __init__(self, seed: int, episode_len: int = 200):
        self.rng = np.random.default_rng(seed)
        self.episode_len = episode_len
        self.reset()

    def reset(self):
        self.t = 0
        self.pos = self.rng.integers(8, 56, size=2).astype(np.float32)
        return self._frame()

    def _frame(self):
        frame = np.zeros((3, 64, 64), np.uint8)
        y, x = self.pos.astype(int)
        frame[:, y - 4:y + 4, x - 4:x + 4] = 255
        return frame

    def step(self, action):
        self.pos = np.clip(self.pos + action[:2], 4, 60)
        self.t += 1
        reward = float(-np.abs(self.pos - 32).sum() / 64)
        return self._frame(), reward, self.t >= self.episode_len


def env_worker(buf, seed, steps):
    env = SquareEnv(seed)
    rng = np.random.default_rng(seed)
    obs = env.reset()
    with buf.writer() as w:
        for _ in range(steps):
            action = rng.uniform(-1, 1, 6).astype(np.float32)
            next_obs, reward, done = env.step(action)
            w.add(obs=obs, action=action, reward=reward, done=done)
            obs = env.reset() if done else next_obs


def wait_for_workers(buf, procs, min_steps, timeout=120.0):
    """Print each change while the spawned workers start, until ``min_steps`` are held.

    A spawned worker imports numpy and shmbuf before its first step, which
    takes a second or more: say so, then report each worker as it joins.
    """
    deadline = time.monotonic() + timeout
    seen = (-1, -1)
    while True:
        s = buf.stats()
        now = (s.writers, s.steps_written)
        if now != seen and (now[0] != seen[0] or s.steps_written >= min_steps):
            print(f"  {s.writers}/{len(procs)} workers writing, {s.steps_written:6d} steps "
                  "written", flush=True)
            seen = now
        if s.steps_written >= min_steps:
            return
        if not any(p.is_alive() for p in procs):
            raise RuntimeError(f"the workers exited after {s.steps_written} steps, "
                               f"exit codes {[p.exitcode for p in procs]}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {s.steps_written} steps after {timeout} s")
        try:
            buf.wait_ready(min_steps=min_steps, timeout=0.05)
        except TimeoutError:
            pass


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4000, help="steps per worker")
    parser.add_argument("--capacity", type=int, default=20_000)
    args = parser.parse_args()

    ctx = mp.get_context("spawn")
    with shmbuf.create(SPEC, capacity=args.capacity, seed=0) as buf:
        print(f"buffer {buf.name}: {args.capacity} steps of {SPEC['obs'][0]} frames; "
              f"starting {args.workers} env workers", flush=True)
        procs = [ctx.Process(target=env_worker, args=(buf, seed, args.steps))
                 for seed in range(args.workers)]
        try:
            for p in procs:
                p.start()
            wait_for_workers(buf, procs, min_steps=min(1_000, args.workers * args.steps))
            print("training: sampling 16 windows of 50 steps per batch", flush=True)
            start, batches = time.perf_counter(), 0
            total = args.workers * args.steps
            # Train while the workers write (10 batches at least), not while they exit.
            while batches < 10 or (buf.stats().steps_written < total
                                   and any(p.is_alive() for p in procs)):
                batch = buf.sample_sequences(batch_size=16, length=50)
                done = batch["done"]  # (L, B): only the last step may be terminal
                assert not done[:-1].any(), "a window crossed an episode boundary"
                batches += 1
                if batches % 10 == 0:
                    s = buf.stats()
                    writing = (f"workers writing {s.writers}" if s.steps_written < total
                               else "every step written")
                    print(f"  batch {batches:5d}  {time.perf_counter() - start:5.1f} s  "
                          f"written {s.steps_written:6d}  held {s.live_steps:6d}  {writing}",
                          flush=True)
            for p in procs:
                p.join(timeout=60)
            elapsed = time.perf_counter() - start
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(timeout=10)
        s = buf.stats()
        print(f"done: {s.steps_written} steps from {args.workers} workers, "
              f"{batches} batches of {batch['obs'].shape} sampled in {elapsed:.1f} s, "
              f"exit codes {[p.exitcode for p in procs]}")


if __name__ == "__main__":
    main()
