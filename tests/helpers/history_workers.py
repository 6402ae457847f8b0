"""Processes around one HistoryBuffer for the lifecycle tests: workers, and owners that die.

Entries are ``keyed_workers.history_info``'s: every field of an entry is a
function of its step ``t`` (and env), so a reader can check each one.
Workers report through a pipe end (no named semaphores in /dev/shm).
"""
from __future__ import annotations

import numpy as np

import shmbuf
from helpers.keyed_workers import history_info, pixels_for
from shmbuf.compat.history import HistoryBuffer

# Per-env shapes of history_info's keys; spec= lets workers append before the owner.
SPEC = {"pixels": ((1, 4, 4, 3), np.uint8), "step": ((), np.int64),
        "action": ((1, 2), np.float32)}

# A program that owns a HistoryBuffer named NAME, appends steps 1..5 to env 0,
# prints the name, and waits to be killed.
OWNER = """
    import time
    from shmbuf import HistoryBuffer
    from helpers.history_workers import SPEC
    from helpers.keyed_workers import history_info
    buf = HistoryBuffer(4, 8, spec=SPEC, name={name!r})
    for t in range(1, 6):
        buf.append(history_info([0], t), env_ids=[0])
    print(buf.name, flush=True)
    while True:
        time.sleep(1)
"""


def until_closed(buf: HistoryBuffer, envs, report, op: str = "append") -> None:
    """``op`` ("append" steps 1, 2, ... to ``envs``, or "get") until BufferClosedError.

    Sends ``"running"`` after 10 calls, then ``["closed", calls, message]``,
    or ``["error", repr]`` if anything else stopped it.
    """
    calls = 0
    try:
        while True:
            calls += 1
            if op == "append":
                buf.append(history_info(envs, calls), env_ids=envs)
            else:
                buf.get(2, envs)
            if calls == 10:
                report.send("running")
    except shmbuf.BufferClosedError as exc:
        report.send(["closed", calls, str(exc)])
    except BaseException as exc:
        report.send(["error", calls, repr(exc)])
        raise
    finally:
        buf.close()


def attach_until_closed(name: str, envs, report) -> None:
    """``until_closed`` appending, on a handle attached by name (the owner is a script)."""
    until_closed(HistoryBuffer.attach(name), envs, report)


def check_entries(out: dict, envs) -> None:
    """Every entry of ``get``'s ``out`` derives from one step, and each env's steps increase."""
    for row, env in enumerate(envs):
        steps = out["step"][row]
        assert (np.diff(steps) >= 0).all(), f"env {env}: steps {steps.tolist()}"
        assert (out["pixels"][row] == pixels_for([env] * len(steps), steps)[:, 0]).all()
        assert out["action"][row].tolist() == [[env, t] for t in steps.tolist()]


def check_saved(lengths, entries: dict, envs) -> None:
    """Saved entries (``snapshot`` order): each from one step, consecutive per env."""
    first = np.concatenate([[0], np.cumsum(lengths)])
    for env in envs:
        rows = slice(first[env], first[env + 1])
        steps = entries["step"][rows]
        if not len(steps):
            continue
        assert (np.diff(steps) == 1).all(), f"env {env}: saved steps {steps.tolist()}"
        n = len(steps)
        assert (entries["pixels"][rows] == pixels_for([env] * n, steps)).all(), "torn entry"
        assert entries["action"][rows].reshape(n, 2).tolist() == [[env, t] for t in steps]


def dead_owner_history(tag: str = "hist") -> str:
    """A HistoryBuffer (env 0: steps 1..5) whose owner was SIGKILLed (``dead_owner``)."""
    from helpers.adopters import dead_owner

    return dead_owner(OWNER, tag)
