"""tests/helpers/procs.py: every child a test starts is joined, or killed and reaped.

Real children of each kind the suite starts: ``multiprocessing`` under fork,
spawn and forkserver, the ``multiprocess`` package, and ``subprocess.Popen``.
The children that would never finish wait on an event with a long timeout, so
only the helper's kill ends them in time.
"""
import multiprocessing as mp
import os
import signal
import subprocess
import sys

import multiprocess
import pytest
from helpers.procs import join_all, reap, running, wait_pid

LONG = 600   # what a hung child would wait; the tests end far sooner or fail by timeout


def _exit_with(code: int) -> None:
    sys.exit(code)


def _wait_for(event) -> None:
    event.wait(LONG)


CONTEXTS = [pytest.param(lambda m=m: mp.get_context(m), id=m)
            for m in ("fork", "spawn", "forkserver")]
CONTEXTS.append(pytest.param(lambda: multiprocess.get_context("spawn"), id="multiprocess"))


@pytest.mark.slow
@pytest.mark.parametrize("get_ctx", CONTEXTS)
def test_children_that_finish_are_joined_and_a_hung_one_is_killed(get_ctx):
    ctx = get_ctx()
    never = ctx.Event()
    procs = [ctx.Process(target=_exit_with, args=(c,)) for c in (0, 3)]
    with pytest.raises(RuntimeError, match="the test failed"):
        with running(procs) as same:
            assert same is procs and all(p.pid is not None for p in procs)
            assert join_all(procs, expect=None) == [0, 3]
            procs.append(ctx.Process(target=_wait_for, args=(never,)))
            procs[-1].start()
            raise RuntimeError("the test failed")
    assert [p.exitcode for p in procs] == [0, 3, -signal.SIGKILL]


@pytest.mark.slow
def test_join_all_names_the_codes_it_did_not_expect():
    ctx = mp.get_context("fork")
    never = ctx.Event()
    procs = [ctx.Process(target=_exit_with, args=(0,)), ctx.Process(target=_wait_for,
                                                                    args=(never,))]
    with running(procs, timeout=0):
        with pytest.raises(AssertionError, match=r"codes \[0, None\], expected 0 from each"):
            join_all(procs, timeout=1)
        never.set()
        join_all(procs)
    with running([ctx.Process(target=_exit_with, args=(5,))]) as one:
        with pytest.raises(AssertionError, match=r"codes \[5\], expected 0"):
            join_all(one)


@pytest.mark.slow
def test_a_normal_exit_gives_children_time_to_finish_before_any_kill():
    ctx = mp.get_context("fork")
    go = ctx.Event()
    with running([ctx.Process(target=_wait_for, args=(go,))]) as procs:
        go.set()                  # it finishes after the block has ended
    assert procs[0].exitcode == 0


def test_popen_children_and_unstarted_processes():
    child = subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({LONG})"])
    unstarted = mp.get_context("fork").Process(target=_exit_with, args=(0,))
    reap([child, unstarted])
    assert child.returncode == -signal.SIGKILL and unstarted.pid is None
    with running([subprocess.Popen([sys.executable, "-c", "raise SystemExit(4)"])]) as procs:
        assert join_all(procs, expect=4) == [4]


def test_wait_pid_reaps_a_forked_child_and_kills_a_hung_one():
    r, w = os.pipe()
    done = os.fork()
    if done == 0:
        os._exit(3)
    hung = os.fork()
    if hung == 0:
        os.close(w)
        os.read(r, 1)      # blocks until the parent closes its end: never, here
        os._exit(0)
    try:
        assert wait_pid(done, 30) == 3
        assert wait_pid(hung, 0.2) is None              # still blocked: killed and reaped
        with pytest.raises(ChildProcessError):
            os.waitpid(hung, os.WNOHANG)                # nothing left to reap
    finally:
        os.close(r)
        os.close(w)
