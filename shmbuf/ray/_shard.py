"""One shard: a Ray actor on one node that owns that node's shmbuf buffer.

The actor creates the buffer in its own node's ``/dev/shm`` and reports the
node id it observes itself running on; everything else (the table of
shards, the writers' choice between shared memory and shipping, the
sampler's choice between a zero-copy read and a remote call) trusts that
report, never the node the actor was asked to go to.

Calls run in three concurrency groups so that a sample never waits behind a
queue of ingested chunks: ``ingest`` (one thread, so each remote writer's
blocks are written by one thread), ``sample`` (two threads), and the default
group (info, stats, close).  Ray does not promise that a threaded actor runs
one caller's calls in order (a call whose argument is still being fetched
can be overtaken), so every shipped block carries a sequence number and a
block that arrives early waits in ``_Inbox`` for its predecessors.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time

import numpy as np
import ray

import shmbuf
from shmbuf.ray import _ids
from shmbuf.ray._count import sample_kwargs, weight

log = logging.getLogger("shmbuf.ray")

INGEST, SAMPLE = "ingest", "sample"
REMOTE_IDLE_S = 600.0   # a shipping writer silent this long loses its stream (and slot)
META_KEY = "shmbuf.ray"


def node_id() -> str:
    """The hex id of the Ray node this process runs on (Ray must be initialised)."""
    return ray.get_runtime_context().get_node_id()


class _Inbox:
    """One remote writer's blocks, applied strictly in sequence order."""

    def __init__(self, writer):
        self.writer = writer
        self.next_seq = 0
        self.early: dict[int, tuple] = {}
        self.last_used = time.monotonic()


# ray's stubs type remote() for functions only (no actor options such as concurrency_groups).
@ray.remote(num_cpus=0, max_restarts=0, concurrency_groups={INGEST: 1, SAMPLE: 2})  # type: ignore[call-overload]
class Shard:
    """The actor; made by ``ShardedBuffer`` (see ``shmbuf.ray``), not by users."""

    def __init__(self, rb_name: str, spec: dict, capacity: int, options: dict,
                 node_resource: str | None = None):
        self._node = node_id()
        self._rb = rb_name
        self._options, self._node_resource = dict(options), node_resource
        options = dict(options)
        self._idle_s = float(options.pop("remote_idle_s", REMOTE_IDLE_S))
        meta = {META_KEY: rb_name, "node_id": self._node}
        self._buf = shmbuf.create(spec, capacity, meta=meta, **options)
        self._rng = np.random.default_rng()
        self._inboxes: dict[str, _Inbox] = {}
        self._retired: dict[str, int] = {}     # key -> next seq of a writer gone idle
        self._carried: dict[str, dict] = {}    # key -> its early blocks when a stop hit it
        self._lock = threading.Lock()
        self._received = {"blocks": 0, "steps": 0, "samples": 0, "sampled_windows": 0}
        self._last_rate = (time.monotonic(), 0, 0)
        self._closed = False
        log.info("shard of %s on node %s: buffer %s", rb_name, self._node, self._buf.name)

    def info(self) -> dict:
        """Who and where: the node id this actor observes, its buffer's name and geometry."""
        return {"node_id": self._node, "buffer": self._buf.name, "pid": os.getpid(),
                "host": socket.gethostname(), "ip": ray.util.get_node_ip_address(),
                "capacity": self._buf.capacity, "chunk_size": self._buf.chunk_size,
                "spec": self._buf.spec, "options": self._options,
                "node_resource": self._node_resource}

    # -- ingest: whole blocks from writers on nodes without a shard ---------------------
    @ray.method(concurrency_group=INGEST)
    def ingest(self, key: str, seq: int, columns: dict, cuts: list) -> int:
        """Write one block ``{col: (n_streams, T, ...)}`` of remote writer ``key``.

        ``cuts`` are ``(p, env)``: an ``end_episode(env)`` after ``p`` rows of
        the block.  Returns the steps of this writer applied so far.
        """
        with self._lock:
            self._check_open()
            box = self._inboxes.get(key)
            if box is None:
                box = self._inboxes[key] = _Inbox(self._buf.writer())
                box.next_seq = self._retired.pop(key, 0)
                box.early.update(self._carried.pop(key, {}))
            box.early[seq] = (columns, cuts)
            while box.next_seq in box.early:
                cols, cs = box.early.pop(box.next_seq)
                try:
                    _write_block(box.writer, cols, cs)
                except shmbuf.WritersStoppedError:
                    self._refuse(key, box)
                    raise shmbuf.WritersStoppedError(
                        f"the shard of {self._rb!r} on node {self._node}: writers are "
                        "stopped (stop_writers); the steps of this writer's block from the "
                        "first one the stop caught were refused") from None
                box.next_seq += 1
                rows = int(np.prod(next(iter(cols.values())).shape[:2]))
                self._received["blocks"] += 1
                self._received["steps"] += rows
            box.last_used = time.monotonic()
            self._retire_idle(box.last_used)
            return box.writer.steps

    def _retire_idle(self, now: float) -> None:
        """Seal the streams of remote writers silent for ``remote_idle_s`` (held lock).

        A shipping writer that died without ``close()`` would hold a writer
        slot of this buffer for good; after the idle time its slot is freed.
        If it was only slow, its next block opens a new stream (its episode
        is cut there: no window spans the gap) and the sequence goes on.
        """
        for key, box in list(self._inboxes.items()):
            if now - box.last_used > self._idle_s:
                box.writer.close()
                self._retired[key] = max(box.early, default=box.next_seq - 1) + 1
                del self._inboxes[key]

    def _refuse(self, key: str, box: _Inbox) -> None:
        """A stop caught remote writer ``key`` in block ``box.next_seq`` (held lock): seal
        its streams, as for an idle writer, so that what it writes after
        ``resume_writers`` opens new ones (no window spans the refused steps).  Blocks
        that came early stay queued for its next call, which writes or refuses them."""
        box.writer.close()
        self._retired[key] = box.next_seq + 1
        self._carried[key] = box.early
        del self._inboxes[key]

    def stop_writers(self) -> None:
        """``Buffer.stop_writers`` of this shard's buffer (the default group: an ingest
        waiting for the rate limit wakes and raises)."""
        self._check_open()
        self._buf.stop_writers()

    def resume_writers(self) -> None:
        """``Buffer.resume_writers`` of this shard's buffer."""
        self._check_open()
        self._buf.resume_writers()

    @ray.method(concurrency_group=INGEST)
    def release(self, key: str) -> None:
        """Remote writer ``key`` closed: seal its streams and free its writer slot."""
        with self._lock:
            box = self._inboxes.pop(key, None)
            if box is not None:
                box.writer.close()

    # -- sampling -----------------------------------------------------------------------
    @ray.method(concurrency_group=SAMPLE)
    def sample(self, n: int, length: int, tail: int, time_major: bool, seed: int,
               mode="steps", ids: bool = False) -> dict:
        """``n`` windows drawn here, as one contiguous batch, plus this shard's fresh count.

        ``mode`` is ``"steps"``, ``"episodes"`` (``sample_sequences``' ``uniform``)
        or a ``Prioritized`` selector; the count is the weight of that mode
        (``_count.weight``).

        The reply is ``{col: array, "__valid__": int, "__sample_s__": float}`` (the
        count, and the seconds this call took here); the arrays travel
        through the object store and are read zero-copy where they land.
        """
        self._check_open()
        t0 = time.perf_counter()
        batch = self._buf.sample_sequences(n, length, tail=tail, time_major=time_major,
                                           rng=seed, ids=ids, **sample_kwargs(mode))
        self._received["samples"] += 1
        self._received["sampled_windows"] += n
        batch["__valid__"] = weight(self._buf, length, tail, mode, self._rng)
        batch["__sample_s__"] = time.perf_counter() - t0
        return batch

    @ray.method(concurrency_group=SAMPLE)
    def update_priorities(self, ids: np.ndarray, priorities: np.ndarray) -> int:
        """``Buffer.update_priorities`` on this shard (the ids' local parts, checked by the
        caller: ``_ids``)."""
        self._check_open()
        return self._buf.update_priorities(_ids.for_shard(ids, self._buf), priorities)

    @ray.method(concurrency_group=SAMPLE)
    def count(self, length: int, tail: int, mode="steps") -> float:
        """This shard's weight now: valid window starts, eligible finished episodes
        (``"episodes"``) or its total score (a ``Prioritized``); exact when small,
        else estimated."""
        self._check_open()
        return weight(self._buf, length, tail, mode, self._rng)

    # -- counters and lifecycle -----------------------------------------------------------
    def stats(self) -> dict:
        self._check_open()
        with self._lock:
            self._retire_idle(time.monotonic())
        s = self._buf.stats()
        now = time.monotonic()
        t0, w0, b0 = self._last_rate
        served = self._received["samples"]
        self._last_rate = (now, s.steps_written, served)
        dt = now - t0
        rate = (s.steps_written - w0) / dt if dt > 0 else 0.0
        sample_rate = (served - b0) / dt if dt > 0 else 0.0
        return {"node_id": self._node, "buffer": self._buf.name, "capacity": s.capacity,
                "live_steps": s.live_steps, "steps_written": s.steps_written,
                "episodes": s.episodes, "writers": s.writers,
                "writers_stopped": s.writers_stopped,
                "remote_writers": len(self._inboxes), "ingest_steps_per_s": rate,
                "samples_per_s": sample_rate,
                "blocks_received": self._received["blocks"],
                "steps_received": self._received["steps"],
                "samples_served": self._received["samples"],
                "windows_served": self._received["sampled_windows"]}

    def close(self) -> bool:
        """Close every remote writer's stream and the buffer (which unlinks its segment)."""
        with self._lock:
            if self._closed:
                return False
            self._closed = True
            for box in self._inboxes.values():
                box.writer.close()
            self._inboxes.clear()
            self._buf.close()
            log.info("shard of %s on node %s closed", self._rb, self._node)
            return True

    def _check_open(self) -> None:
        if self._closed:
            raise shmbuf.BufferClosedError(
                f"the shard of {self._rb!r} on node {self._node} was closed")


def _write_block(writer, columns: dict, cuts: list) -> None:
    """Append a block ``(n, T, ...)``, cutting episodes where ``cuts`` say.

    One remote stream (``n == 1``) goes to the writer's own stream, a run at
    a time with ``Writer.extend``; ``n`` streams go row by row in time
    through ``add_batch`` (one shard stream per remote stream).  Either way
    the block's episodes and stream boundaries are kept.
    """
    first = next(iter(columns.values()))
    n, steps = first.shape[:2]
    at: dict[int, list[int]] = {}
    for p, env in cuts:
        at.setdefault(int(p), []).append(int(env))
    if n == 1:
        start = 0
        for p in sorted(set(at) | {steps}):
            if p > start:
                writer.extend(**{c: a[0, start:p] for c, a in columns.items()})
            if p in at:
                writer.end_episode()
            start = p
        return
    for t in range(steps + 1):
        for env in at.get(t, ()):
            try:
                writer.end_episode(env=env)
            except IndexError:
                pass  # nothing written to that stream yet: nothing to cut
        if t < steps:
            writer.add_batch(**{c: a[:, t] for c, a in columns.items()})
