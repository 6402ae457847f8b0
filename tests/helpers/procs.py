"""Child processes in tests: started, joined within a timeout, killed if they hang.

Every test that starts a process must end it, whatever happens: a child left
running holds segments, semaphores and the test session itself.  Here that is
done once, for ``multiprocessing`` and ``multiprocess`` processes of any start
method (fork, spawn, forkserver), for ``subprocess.Popen`` children, and for
bare ``os.fork`` pids (``wait_pid``, ``kill_pid``)::

    procs = [ctx.Process(target=work, args=(buf, i)) for i in range(3)]
    with running(procs):
        ...                          # the test, while they run
        join_all(procs)              # each exited with 0, within TIMEOUT

On leaving the block every child is reaped: when the block ended normally the
children get ``timeout`` seconds to finish, then whatever still runs is sent
SIGKILL and joined; when it raised, they are killed at once (a failing test
does not wait for children that may be waiting for it).  A test whose subject
is a kill keeps that kill in the test; ``running`` only cleans up.
"""
from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import time

TIMEOUT = 60.0    # seconds a group of children has to finish
KILL_WAIT = 10.0  # seconds to reap a child after SIGKILL


def _started(p) -> bool:
    return isinstance(p, subprocess.Popen) or p.pid is not None


def _alive(p) -> bool:
    return p.poll() is None if isinstance(p, subprocess.Popen) else p.is_alive()


def _join(p, timeout: float) -> None:
    if isinstance(p, subprocess.Popen):
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout)
    else:
        p.join(timeout)


def exitcode(p) -> int | None:
    """Its exit status (negative: the signal that ended it); None while it runs."""
    return p.poll() if isinstance(p, subprocess.Popen) else p.exitcode


def join_all(procs, timeout: float = TIMEOUT, expect: int | None = 0) -> list:
    """Join every child within ``timeout`` seconds, one deadline for them all.

    Unless ``expect`` is None, assert that each exited with ``expect`` (a
    child still running after ``timeout`` shows as None).  Returns the exit
    codes; nothing is killed here (``running`` and ``reap`` do that).
    """
    deadline = time.monotonic() + timeout
    for p in procs:
        _join(p, max(0.0, deadline - time.monotonic()))
    codes = [exitcode(p) for p in procs]
    if expect is not None:
        assert codes == [expect] * len(codes), (
            f"child exit codes {codes}, expected {expect} from each "
            f"(None: still running after {timeout} s)")
    return codes


def reap(procs, grace: float = 0.0) -> None:
    """Give the started children ``grace`` seconds to finish, then SIGKILL and join the rest.

    Children never started are skipped.  A child that survives SIGKILL for
    ``KILL_WAIT`` seconds is left alone rather than raising over the error
    that is being unwound.
    """
    procs = [p for p in procs if _started(p)]
    deadline = time.monotonic() + grace
    for p in procs:
        _join(p, max(0.0, deadline - time.monotonic()))
    for p in procs:
        if _alive(p):
            p.kill()
            _join(p, KILL_WAIT)


def wait_pid(pid: int, timeout: float = TIMEOUT) -> int | None:
    """Reap the forked child ``pid`` (``os.fork``) once it exits within ``timeout``: its
    exit code (negative: the signal that ended it), or None if it still ran then, in
    which case it was sent SIGKILL and reaped (``kill_pid``)."""
    pidfd = os.pidfd_open(pid)
    try:
        ready, _, _ = select.select([pidfd], [], [], timeout)
    finally:
        os.close(pidfd)
    if not ready:
        kill_pid(pid)
        return None
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def kill_pid(pid: int) -> None:
    """Send the forked child ``pid`` SIGKILL (if it still runs) and reap it."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)   # SIGKILL cannot be caught: this returns at once


@contextlib.contextmanager
def running(procs: list, timeout: float = TIMEOUT):
    """Start each child of ``procs`` not yet started; on exit reap them all (see above).

    Yields ``procs`` itself: children appended to it inside the block (started
    there, in the order the test needs) are reaped too.
    """
    ok = False
    try:
        for p in procs:
            if not _started(p):
                p.start()
        yield procs
        ok = True
    finally:
        reap(procs, timeout if ok else 0.0)


@contextlib.contextmanager
def bounded_pool(ctx, processes: int, timeout: float = TIMEOUT):
    """``ctx.Pool(processes)``; on exit every worker is joined or killed within ``timeout``.

    ``Pool.__exit__`` calls ``terminate()``, which joins the workers with no
    timeout: a worker that never exits (a fork of the threaded test process can
    inherit a lock another thread held) would hang the whole run.  Here the
    workers are told to finish (``close``), then reaped.
    """
    pool = ctx.Pool(processes)
    try:
        yield pool
    finally:
        workers = list(pool._pool)   # the worker processes; Pool has no public accessor
        pool.close()
        reap(workers, timeout)
        pool.terminate()   # the handler threads; the workers are gone already
