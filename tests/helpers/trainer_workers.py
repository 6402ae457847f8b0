"""Children for the trainer-side tests (random streams, datasets, checkpoints).

No torch import here: a spawned child that imports torch pays about 1.5 s.
"""
import os

import numpy as np

from helpers.procs import reap

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


class Writers:
    """Spawned ``write_until`` writers: started on enter, stopped, joined and killed on exit."""

    def __init__(self, buf, n: int, max_steps: int, episode_len: int, timeout: float = 60.0):
        import multiprocessing as mp

        from helpers.workers import write_until

        ctx = mp.get_context("spawn")
        self.timeout = timeout
        self.stop, self.ready = ctx.Event(), ctx.Semaphore(0)
        self.procs = [ctx.Process(target=write_until, args=(buf, i, self.stop, self.ready,
                                                            max_steps, episode_len))
                      for i in range(n)]

    def __enter__(self):
        try:
            for p in self.procs:
                p.start()
            for _ in self.procs:
                assert self.ready.acquire(timeout=self.timeout), "a writer never started"
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc):
        self.stop.set()
        reap(self.procs, self.timeout)
        self.procs, self.stop, self.ready = [], None, None
