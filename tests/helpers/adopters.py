"""Adopters that race: processes that call ``attach(name, own=True)`` at the same moment.

Forked (not spawned), so that they start within microseconds of each other
and the owner record's compare-and-swap really is contested.
"""
from __future__ import annotations

import json
import os
import select
import time

import shmbuf
from helpers.procs import kill_pid, wait_pid

TIMEOUT = 60

PARAM_OWNER = """
    import numpy as np, time
    from shmbuf.params import ParamBlock
    block = ParamBlock.create({{"w": np.zeros(3, np.float32)}}, name={name!r})
    block.publish({{"w": np.full(3, 7, np.float32)}})
    print(block.name, flush=True)
    while True:
        time.sleep(1)
"""


def dead_owner(code: str, tag: str) -> str:
    """The name of a segment made by ``code`` (run with ``name=`` filled in, printing the
    name when ready) whose process was then SIGKILLed.

    The name carries this test session's pid (conftest's leak check); the
    caller adopts or removes it.
    """
    from helpers.stop_workers import Script

    name = f"shmbuf-test-{tag}-{os.getpid()}-{os.urandom(3).hex()}"
    owner = Script(code.format(name=name))
    try:
        assert owner.line() == name
        return name
    finally:
        owner.close()  # SIGKILL: nothing is cleaned up


def dead_owner_param_block() -> str:
    """A parameter block (version 1: w = 7) whose trainer was SIGKILLed (``dead_owner``)."""
    return dead_owner(PARAM_OWNER, "params")


def rival_adopters(adopt, n: int = 4) -> list[dict]:
    """Fork ``n`` processes that call ``adopt()`` at the same moment; their results.

    Each result is ``{"won": pid}`` or ``{"lost": message}`` (OwnerAliveError).
    The winner closes what it adopted (and so unlinks it) once every child
    has reported; every child is reaped, or killed, before this returns.
    """
    go_r, go_w = os.pipe()
    out_r, out_w = os.pipe()
    done_r, done_w = os.pipe()
    pids: list[int] = []
    try:
        for _ in range(n):
            pid = os.fork()
            if pid == 0:  # a restarted trainer
                code = 1
                try:
                    os.read(go_r, 1)  # all start together
                    try:
                        adopted, result = adopt(), {"won": os.getpid()}
                    except shmbuf.OwnerAliveError as exc:
                        adopted, result = None, {"lost": str(exc)}
                    os.write(out_w, (json.dumps(result) + "\n").encode())
                    if adopted is not None:
                        os.read(done_r, 1)
                        adopted.close()
                    code = 0
                finally:
                    os._exit(code)
            pids.append(pid)
        os.write(go_w, b"x" * n)
        results = [json.loads(line) for line in _lines(out_r, n)]
        os.write(done_w, b"x")
        while pids:
            assert _exit_code(pids[0]) == 0, results
            pids.pop(0)
        return results
    finally:
        for pid in pids:
            kill_pid(pid)
        for fd in (go_r, go_w, out_r, out_w, done_r, done_w):
            os.close(fd)


def _lines(fd: int, n: int, timeout: float = TIMEOUT) -> list[bytes]:
    """The first ``n`` lines written to pipe ``fd``; AssertionError if they take too long."""
    data, deadline = b"", time.monotonic() + timeout
    while data.count(b"\n") < n:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise AssertionError(f"not all {n} children reported within {timeout} s; "
                                 f"got {data!r}")
        data += os.read(fd, 65536)
    return data.split(b"\n")[:n]


def _exit_code(pid: int, timeout: float = TIMEOUT) -> int:
    """Reap child ``pid``; its exit code (negative: the signal); AssertionError on a hang
    (the child is killed and reaped first)."""
    code = wait_pid(pid, timeout)
    assert code is not None, f"child {pid} still ran {timeout} s on"
    return code
