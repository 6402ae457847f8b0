"""A trainer fed by spawned env workers through shmbuf, with prefetch and a small torch model.

Env workers (spawned processes) run a tiny pixel env and write steps into a shared
buffer.  The trainer learns to predict each step's reward from its frame with a small
conv net, on batches that ``buf.prefetch`` samples in a background thread while the
model computes.  It prints a progress line and runs in well under a minute on a CPU.

The buffer holds a train ratio (``shmbuf.RateLimit``): each batch replays
``batch_size * length`` steps, and the workers and the trainer wait for each other so
that the steps replayed stay within one batch of ``train_ratio`` times the steps the
workers added (after ``min_steps``), however fast each side runs.  The progress lines
print the ratio achieved.  ``--train-ratio 0`` turns the limit off.

    python examples/train_prefetch.py [--workers 2] [--env-steps 3000] [--train-steps 100]
                                      [--train-ratio 8]

Note: this module imports torch only inside ``train``.  A spawned worker re-imports
the main module; if torch were imported at the top, every worker would pay about
1.5 s (and the memory) for a library it never uses.  Keep worker code torch-free.
"""
import argparse
import multiprocessing as mp
import sys
import time

import numpy as np

import shmbuf

SPEC = {
    "obs": ((3, 32, 32), np.uint8),
    "action": ((2,), np.float32),
    "reward": ((), np.float32),
    "done": ((), np.bool_),
}


def frame_of(pos: np.ndarray) -> np.ndarray:
    """A 3x32x32 frame with a bright 6x6 square at ``pos`` (y, x)."""
    frame = np.zeros((3, 32, 32), np.uint8)
    y, x = pos.astype(int)
    frame[:, y - 3:y + 3, x - 3:x + 3] = 255
    return frame


def env_worker(name: str, seed: int, steps: int, episode_len: int = 100) -> None:
    """Push a square around at random; reward is closeness to the centre.  No torch here."""
    rng = np.random.default_rng(seed)
    with shmbuf.attach(name) as buf, buf.writer() as w:
        pos = rng.uniform(4, 28, 2)
        for t in range(steps):
            action = rng.uniform(-2, 2, 2).astype(np.float32)
            reward = 1.0 - np.abs(pos - 16).sum() / 24
            done = t % episode_len == episode_len - 1
            try:
                w.add(obs=frame_of(pos), action=action, reward=reward, done=done)
            except shmbuf.WritersStoppedError:
                return   # the trainer is done (a rate-limited add may be waiting for it)
            pos = rng.uniform(4, 28, 2) if done else np.clip(pos + action, 3, 29)


def train(buf, steps: int, batch_size: int, length: int, log) -> float:
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 4, stride=2), nn.ReLU(), nn.Conv2d(8, 16, 4, stride=2),
                          nn.ReLU(), nn.Flatten(), nn.Linear(16 * 6 * 6, 1))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    t0, loss = time.perf_counter(), float("nan")
    # device=None: CUDA when available (pinned buffers, side-stream copies), else CPU.
    with buf.prefetch(batch_size, length, depth=2) as batches:
        device = batches.device
        model.to(device)
        for step, batch in zip(range(1, steps + 1), batches):
            # (L, B, 3, 32, 32) uint8 -> (L*B, 3, 32, 32) float; the batch is valid until
            # the next one is taken, and these ops copy what they need.
            obs = batch["obs"].flatten(0, 1).float() / 255
            target = batch["reward"].flatten()
            loss_t = nn.functional.mse_loss(model(obs).squeeze(1), target)
            opt.zero_grad()
            loss_t.backward()
            opt.step()
            loss = loss_t.item()
            if step % 25 == 0 or step == steps:
                rate = step / (time.perf_counter() - t0)
                limit = buf.stats().rate
                ratio = f"  train ratio {limit.ratio:5.2f}" if limit else ""
                log(f"step {step:4d}/{steps}  loss {loss:.4f}  buffer {len(buf):6d} steps  "
                    f"{rate:5.1f} batches/s{ratio}")
    return loss


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--env-steps", type=int, default=3000, help="steps per worker")
    ap.add_argument("--train-steps", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--length", type=int, default=8)
    ap.add_argument("--capacity", type=int, default=20_000)
    ap.add_argument("--train-ratio", type=float, default=8.0,
                    help="replayed steps per env step (0: no limit)")
    args = ap.parse_args(argv)
    ctx = mp.get_context("spawn")
    min_steps = args.batch_size * args.length
    limit = shmbuf.RateLimit(args.train_ratio, min_steps=min_steps, writer_timeout=60) \
        if args.train_ratio else None
    with shmbuf.create(SPEC, capacity=args.capacity, rate_limit=limit) as buf:
        procs = [ctx.Process(target=env_worker, args=(buf.name, seed, args.env_steps))
                 for seed in range(args.workers)]
        try:
            for p in procs:
                p.start()
            buf.wait_ready(min_steps=min_steps, timeout=60)
            loss = train(buf, args.train_steps, args.batch_size, args.length,
                         lambda line: print(line, flush=True))
            s = buf.stats()
            if limit is None:
                for p in procs:
                    p.join(60)
        finally:
            buf.stop_writers()   # workers still writing, or waiting on the rate limit, stop
            for p in procs:
                p.join(60)
                if p.is_alive():
                    p.kill()
                    p.join(60)
        codes = [p.exitcode for p in procs]
        ratio = (f", train ratio {s.rate.ratio:.2f} (target {s.rate.train_ratio:g}, "
                 f"{s.rate.replayed} replayed / {s.rate.inserted - min_steps} added)"
                 if s.rate else "")
        print(f"done: {args.train_steps} training steps, final loss {loss:.4f}, "
              f"{s.steps_written} env steps from {args.workers} workers{ratio}, "
              f"exit codes {codes}")
    return 0 if codes == [0] * args.workers else 1


if __name__ == "__main__":
    sys.exit(main())
