"""bench_store's workload W1, its writers, and the spawned children that run them.

W1 rows (obs uint8 (3, 64, 64), action f32 (6,), reward f32, done bool),
episodes of EPISODE steps; ``Tracker`` makes and unlinks the buffers,
``children`` starts, joins and kills processes with bounded waits, and the
child entry points report to the parent through a queue.
"""
from __future__ import annotations

import contextlib
import os
import queue
import resource
import threading
import time

import numpy as np

import shmbuf

W1_SPEC = {"obs": ((3, 64, 64), np.uint8), "action": ((6,), np.float32),
           "reward": ((), np.float32), "done": ((), np.bool_)}
SMALL_SPEC = {"obs": ((16,), np.float32), "done": ((), np.bool_)}
EPISODE = 500
W1_CAPACITY = 100_000
N_WRITERS = 2
WAIT_S = 60.0           # every barrier wait, queue get and join is bounded by this
SHM_DIR = "/dev/shm"
GIB = float(1 << 30)


# -- processes and buffers ------------------------------------------------------------
class Tracker:
    """Names of the segments this run created, checked for leftovers at exit."""

    def __init__(self):
        self.names = []

    @contextlib.contextmanager
    def buffer(self, spec, capacity, **kw):
        kw.setdefault("prefault", True)   # bench_store measures prefaulted buffers
        buf = shmbuf.create(spec, capacity, **kw)
        self.names.append(buf.name)
        try:
            yield buf
        finally:
            buf.close()

    def leftovers(self) -> list[str]:
        return [n for n in self.names if os.path.exists(os.path.join(SHM_DIR, n))]


@contextlib.contextmanager
def children(ctx, target, arg_tuples, *, stop=None, barrier=None):
    """Start one spawned process per args tuple; stop, join (bounded) and kill on exit."""
    procs, grace = [], 2.0      # on error, children get 2 s to exit before the kill
    try:
        for args in arg_tuples:
            proc = ctx.Process(target=target, args=args, daemon=True)
            proc.start()
            procs.append(proc)
        yield procs
        grace = WAIT_S
    finally:
        if stop is not None:
            stop.set()
        if barrier is not None:
            barrier.abort()
        stop_children(procs, grace)


def stop_children(procs, grace: float = 10.0) -> None:
    """Join each child (bounded), then kill and reap whatever is still alive."""
    deadline = time.monotonic() + grace
    for proc in procs:
        proc.join(max(0.1, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(10)


def _w1_rows(n: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"obs": rng.integers(0, 256, (n, 3, 64, 64), dtype=np.uint8),
            "action": rng.standard_normal((n, 6)).astype(np.float32),
            "reward": rng.standard_normal(n).astype(np.float32),
            "done": np.zeros(n, np.bool_)}


def fill(buf, rows: dict, steps: int) -> None:
    """Write ``steps`` steps with add_batch(rows), episodes of EPISODE steps per stream."""
    n = len(rows["done"])
    last = dict(rows, done=np.ones(n, np.bool_))
    with buf.writer() as w:
        for call in range(-(-steps // n)):
            w.add_batch(**(last if call % EPISODE == EPISODE - 1 else rows))


def _write_add(w, frames, n_steps: int) -> None:
    obs, action = frames["obs"], frames["action"][0]
    for i in range(n_steps):
        w.add(obs=obs[i & 7], action=action, reward=float(i & 255),
              done=i % EPISODE == EPISODE - 1)


def _write_rows(w, rows, n_rows: int, batched: bool) -> None:
    n = len(rows["done"])
    last = dict(rows, done=np.ones(n, np.bool_))
    obs, act, rew = rows["obs"], rows["action"], rows["reward"]
    for call in range(n_rows // n):
        cols = last if call % EPISODE == EPISODE - 1 else rows
        if batched:
            w.add_batch(**cols)
        else:
            done = cols["done"]
            for j in range(n):
                w.add(obs=obs[j], action=act[j], reward=rew[j], done=done[j])


def _episode_rows(seed: int) -> dict:
    """One W1 episode of EPISODE steps, terminal at its last step (extend's unit)."""
    ep = _w1_rows(EPISODE, seed)
    ep["done"][-1] = True
    return ep


def _write_episodes(w, ep: dict, n_rows: int) -> None:
    for _ in range(n_rows // EPISODE):
        w.extend(**ep)


def _copy_episodes(buf, wid: int, ep: dict, n_rows: int) -> None:
    """The control of extend: copy the same bytes into the mapping, no bookkeeping.

    Each writer cycles through its own part of the columns, EPISODE rows per
    copy, like a writer process with nothing to check or publish.
    """
    arrays = buf.arrays
    part = W1_CAPACITY // N_WRITERS
    lo = (wid % N_WRITERS) * part
    for i in range(n_rows // EPISODE):
        j = lo + (i * EPISODE) % (part - EPISODE + 1)
        for name, a in arrays.items():
            a[j:j + EPISODE] = ep[name]


def _minflt() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def touch_mapping(buf) -> None:
    """Read one byte per page of every column, so this process's page tables map them.

    ``create(prefault=True)`` populates the owner's mapping only; an attached
    writer takes a minor fault on the first write to each page otherwise.
    """
    for column in buf.arrays.values():
        int(column.view(np.uint8).reshape(-1)[::4096].sum())


@contextlib.contextmanager
def _attached(name: str, results, barrier=None):
    """Attach in a child; on any error tell the parent why and break the barrier."""
    buf = None
    try:
        buf = shmbuf.attach(name)
        yield buf
    except BaseException as exc:
        results.put(("error", f"{type(exc).__name__}: {exc}"))
        if barrier is not None:
            barrier.abort()
        raise
    finally:
        if buf is not None:
            buf.close()


def _ingest_worker(name, wid, mode, n_steps, rounds, barrier, results, pretouch=False):
    """Child: per round, wait at the barrier, write, report (wid, start, end, faults)."""
    with _attached(name, results, barrier) as buf, buf.writer() as w:
        rows = _w1_rows(16 if mode != "add" else 8, seed=wid)
        if mode in ("ep500", "copy500"):
            rows = _episode_rows(seed=wid)
        if pretouch:
            touch_mapping(buf)
        for _ in range(rounds):
            barrier.wait(WAIT_S)
            f0, t0 = _minflt(), time.perf_counter()
            if mode == "add":
                _write_add(w, rows, n_steps)
            elif mode == "ep500":
                _write_episodes(w, rows, n_steps)
            elif mode == "copy500":
                _copy_episodes(buf, wid, rows, n_steps)
            else:
                _write_rows(w, rows, n_steps, batched=mode == "batch16")
            results.put((wid, t0, time.perf_counter(), _minflt() - f0))


def _queue_producer(wid, n_steps, rounds, barrier, steps_q, results):
    """Child of the DIY baseline: send each step through a multiprocessing.Queue."""
    frames = _w1_rows(8, seed=wid)
    obs, action = frames["obs"], frames["action"][0]
    for _ in range(rounds):
        barrier.wait(WAIT_S)
        t0 = time.perf_counter()
        for i in range(n_steps):
            steps_q.put((obs[i & 7], action, float(i & 255), i % EPISODE == EPISODE - 1))
        steps_q.put(None)
        results.put((wid, t0, None))


def _spin_writer(name, wid, go, stop, results, cpus=None):
    """Child: add W1 steps continuously while ``go`` is set, until ``stop``; report
    the steps written."""
    if cpus:
        os.sched_setaffinity(0, cpus)
    with _attached(name, results) as buf, buf.writer() as w:
        rows = _w1_rows(8, seed=wid)
        results.put(("ready", wid))
        steps = 0
        while not stop.is_set():
            if not go.wait(0.05):
                continue
            _write_add(w, rows, 256)
            steps += 256
        results.put(("done", steps))


def _get(q, n: int, procs) -> list:
    """``n`` messages from the children, failing fast if one reports an error or dies."""
    out, deadline = [], time.monotonic() + WAIT_S
    while len(out) < n:
        try:
            msg = q.get(timeout=0.5)
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"children died (exit codes {dead}) or timed out "
                                   f"after {WAIT_S} s") from None
            continue
        if msg[0] == "error":
            raise RuntimeError(f"child failed: {msg[1]}")
        out.append(msg)
    return out


def _barrier(barrier, results, procs) -> None:
    """The parent's barrier wait; a broken barrier reports the child's own error."""
    try:
        barrier.wait(WAIT_S)
    except threading.BrokenBarrierError:
        _get(results, 1, procs)   # raises with the child's message if it sent one
        raise
