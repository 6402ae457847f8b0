"""Writer processes for compare.py: one pool per backend, started once, told when to write.

A pool spawns ``size`` children that each open the backend's writer once
(``WRITERS[kind](handle, wid)``) and then wait for commands.  A round sends
``(mode, rows, t_start)`` to the first ``n`` children; each sleeps until
``t_start`` (CLOCK_MONOTONIC is shared by all processes), writes ``rows``
rows and reports its start and end.  Idle children block on their own
queue, so a pool of 4 measures 1, 2 and 4 writers without respawning
(TorchRL costs seconds of CPU per import).  Every wait is bounded, and
``close`` kills what did not exit.
"""
from __future__ import annotations

import queue
import time

from _store_workload import stop_children

WAIT_S = 60.0          # every get and join is bounded by this
LEAD_S = 0.03          # a round starts this long after its commands are sent
IDLE_EXIT_S = 900.0    # a child whose parent vanished exits after this long


def _sleep_until(t: float) -> None:
    while True:
        left = t - time.perf_counter()
        if left <= 0:
            return
        time.sleep(min(left, 0.002))


def _child(kind: str, handle, wid: int, commands, results) -> None:
    from .writers import WRITERS  # imported here, where the spawn child runs

    writer = None
    try:
        writer = WRITERS[kind](handle, wid)
        results.put(("ready", wid))
        while True:
            try:
                cmd = commands.get(timeout=IDLE_EXIT_S)
            except queue.Empty:
                return
            if cmd is None:
                return
            mode, rows, t_start = cmd
            _sleep_until(t_start)
            t0 = time.perf_counter()
            writer.write(mode, rows)
            results.put(("done", wid, t0, time.perf_counter()))
    except BaseException as exc:  # noqa: BLE001 - the parent reports it in the table
        results.put(("error", wid, f"{type(exc).__name__}: {exc}"))
    finally:
        if writer is not None:
            writer.close()


class WriterPool:
    """``size`` spawned writer processes of one backend; see the module doc."""

    def __init__(self, ctx, kind: str, handle, size: int):
        self.procs, self.commands = [], []
        self.results = ctx.Queue()
        try:
            for wid in range(size):
                q = ctx.Queue()
                proc = ctx.Process(target=_child, args=(kind, handle, wid, q, self.results),
                                   daemon=True)
                proc.start()
                self.procs.append(proc)
                self.commands.append(q)
                self._collect("ready", 1)   # one at a time: each maps the buffer first
        except BaseException:
            self.close()
            raise

    def _collect(self, tag: str, n: int) -> list:
        return collect(self.results, self.procs, tag, n)

    def round(self, n: int, mode: str, rows: int, consume=None) -> float:
        """Seconds from the first writer's start until all ``n * rows`` rows are stored.

        ``consume``, if given, runs in this process meanwhile (the Queue
        pipeline's trainer) and returns the time it stored the last row.
        """
        t_start = time.perf_counter() + LEAD_S
        for q in self.commands[:n]:
            q.put((mode, rows, t_start))
        end = consume() if consume is not None else 0.0
        got = self._collect("done", n)
        return max(max(g[3] for g in got), end) - min(g[2] for g in got)

    def close(self) -> None:
        for q in self.commands:
            try:
                q.put(None)
            except (OSError, ValueError):
                pass
        stop_children(self.procs)
        for q in self.commands + [self.results]:
            q.close()
            q.join_thread()
        self.procs, self.commands = [], []


def collect(results, procs, tag: str, n: int) -> list:
    """``n`` messages tagged ``tag`` from children; raise on a child's error, death or timeout."""
    out, deadline = [], time.monotonic() + WAIT_S
    while len(out) < n:
        try:
            msg = results.get(timeout=0.5)
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"child processes died (exit codes {dead}) or timed out "
                                   f"after {WAIT_S:g} s") from None
            continue
        if msg[0] == "error":
            raise RuntimeError(f"child {msg[1]} failed: {msg[2]}")
        if msg[0] == tag:
            out.append(msg)
    return out
