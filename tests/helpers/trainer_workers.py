"""Children for the trainer-side tests (random streams, datasets, checkpoints).

No torch import here: a spawned child that imports torch pays about 1.5 s.
"""
import os

import numpy as np

COUNTER_SPEC = {"x": ((), np.int64), "done": ((), np.bool_)}


def fill_counter(buf, n: int, episode_len: int = 0) -> None:
    """``n`` steps with x = 0, 1, 2, ... (one stream); episodes of ``episode_len`` if > 0."""
    with buf.writer() as w:
        for i in range(n):
            w.add(x=i, done=bool(episode_len) and i % episode_len == episode_len - 1)


def draw_steps(buf, n: int, results) -> None:
    """Report (pid, the x of ``n`` steps drawn from the buffer's own stream)."""
    results.put((os.getpid(), buf.sample_steps(n)["x"].tolist()))


def draw_steps_pool(args):
    """Pool variant: the buffer arrives pickled in ``args``."""
    buf, n = args
    return os.getpid(), buf.sample_steps(n)["x"].tolist()


def write_counter_forever(name: str, stop, episode_len: int) -> None:
    """Attach and add x = 0, 1, ... with episodes of ``episode_len`` until ``stop`` is set."""
    import shmbuf

    with shmbuf.attach(name) as buf, buf.writer() as w:
        i = 0
        while not stop.is_set():
            w.add(x=i, done=i % episode_len == episode_len - 1)
            i += 1
