"""A multiprocessing Pool whose shutdown is bounded, for tests.

``Pool.__exit__`` calls ``terminate()``, which joins the workers with no
timeout: a worker that never exits (a fork of the threaded test process can
inherit a lock another thread held) would hang the whole run.  Here the
workers are told to finish (``close``), joined with a deadline, and killed
if they are still there.
"""
import contextlib
import time

TIMEOUT = 60


@contextlib.contextmanager
def bounded_pool(ctx, processes: int, timeout: float = TIMEOUT):
    """``ctx.Pool(processes)``; on exit every worker is joined or killed within ``timeout``."""
    pool = ctx.Pool(processes)
    try:
        yield pool
    finally:
        workers = list(pool._pool)   # the worker processes; Pool has no public accessor
        pool.close()
        deadline = time.monotonic() + timeout
        for p in workers:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in workers:
            if p.is_alive():
                p.kill()
                p.join(10)
        pool.terminate()   # the handler threads; the workers are gone already
