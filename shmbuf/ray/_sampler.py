"""Global batches: split across shards, local part from shared memory, the rest over Ray.

A batch of ``B`` windows is split by one multinomial draw over the shards,
with probabilities proportional to each shard's valid starts (``_count``),
then each shard draws its share uniformly over its own valid starts: so the
batch is uniform over all valid windows of all shards, and no window spans
two shards (each is drawn inside one shard's buffer).  With
``uniform="episodes"`` the weights are the shards' eligible finished
episodes and each shard draws per episode, so every eligible episode of
every shard is equally likely.  With ``Prioritized`` the weights are the
shards' total scores.  A ``Mixture`` is split by its fractions first, then
each component over the shards by that component's weights
(``_count.modes``); a shard draws each of its parts with that component.

``plan`` makes the split and sends the remote requests at once; ``finish``
samples the local share (zero-copy from this node's shard), waits for the
remote replies (numpy arrays read in place from the object store) and copies
each into its slice of the output.  The prefetcher keeps several plans in
flight, so remote shards sample while the trainer trains.

A remote shard's count comes back with each reply it sends; a count older
than ``COUNT_MAX_AGE_S`` is refreshed by a call that is not waited for.  A
split may thus use counts up to one batch (or one second) old: writers only
add windows, so this under-weights the freshest few steps of a shard.
Counts are kept per ``(length, tail, mode)``: a step count is not an
episode count, nor a score.
"""
from __future__ import annotations

import dataclasses
import threading
import time
from typing import TYPE_CHECKING

import numpy as np
import ray

from shmbuf import NotEnoughDataError
from shmbuf.ray import _ids
from shmbuf.ray._count import sample_kwargs, weight
from shmbuf.ray._errors import ShardLostError, is_loss

if TYPE_CHECKING:
    from shmbuf.ray._placement import ShardEntry

COUNT_MAX_AGE_S = 1.0
_VALID, _SAMPLE_S = "__valid__", "__sample_s__"


@dataclasses.dataclass
class Part:
    shard: ShardEntry
    n: int
    ref: ray.ObjectRef | None = None   # the remote reply; None for the local shard
    mode: object = "steps"             # "steps", "episodes" or a Prioritized (_count.modes)


@dataclasses.dataclass
class Plan:
    batch_size: int
    length: int
    tail: int
    time_major: bool
    parts: list
    ids: bool = False   # the batch has "ids": each part's are tagged with its shard (_ids)

    def what(self, part: Part) -> tuple:
        """The key of a part's counts: ``(length, tail, mode)``."""
        return (self.length, self.tail, part.mode)


class Counts:
    """The latest count of each remote shard, per ``what = (length, tail, mode)``."""

    def __init__(self):
        self._known: dict = {}       # (node, *what) -> (count, monotonic time)
        self._asked: dict = {}       # (node, *what) -> (shard, ref of a count call)
        self._lock = threading.Lock()   # a prefetch thread and the caller may both sample

    def put(self, node: str, what: tuple, count: int) -> None:
        self._known[(node,) + what] = (float(count), time.monotonic())

    def get(self, shards, what: tuple, timeout: float, lost) -> list[float]:
        """One count per shard: cached, refreshed in the background when old.

        Shards never counted are asked and waited for (once, in parallel).
        ``lost(shard, exc)`` is called for a shard that fails to answer.
        """
        self._collect(lost)
        now, missing = time.monotonic(), []
        with self._lock:
            for s in shards:
                key = (s.node_id,) + what
                have = self._known.get(key)
                if have is None:
                    missing.append(s)
                elif now - have[1] > COUNT_MAX_AGE_S and key not in self._asked:
                    self._asked[key] = (s, s.actor.count.remote(*what))
        if missing:
            refs = [s.actor.count.remote(*what) for s in missing]
            for s, ref in zip(missing, refs):
                try:
                    self.put(s.node_id, what, ray.get(ref, timeout=timeout))
                except Exception as exc:
                    if not is_loss(exc):
                        raise
                    lost(s, exc)
                    self.put(s.node_id, what, 0)
        return [self._known[(s.node_id,) + what][0] for s in shards]

    def _collect(self, lost) -> None:
        """Take the answers of background count calls that have arrived."""
        with self._lock:
            asked = list(self._asked.items())
        if not asked:
            return
        refs = [ref for _, (_, ref) in asked]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        arrived = set(ready)
        for key, (shard, ref) in asked:
            if ref in arrived:
                with self._lock:
                    if self._asked.pop(key, None) is None:
                        continue
                try:
                    self.put(key[0], key[1:], ray.get(ref, timeout=0))
                except Exception as exc:
                    if not is_loss(exc):
                        raise
                    lost(shard, exc)


def plan(rb, batch_size: int, length: int, tail: int, time_major: bool,
         rng: np.random.Generator, exclude=(), mix: tuple = ((1.0, "steps"),),
         ids: bool = False) -> Plan:
    """Split a batch over the modes of ``mix`` (``_count.modes``), each over the live
    shards, and send the remote requests."""
    shards = [s for s in rb._live() if s.node_id not in exclude]
    if not shards:
        raise ShardLostError(f"{rb!r} has no live shard left to sample from")
    if ids:
        _ids.check_unique(shards)
    fractions = np.array([f for f, _ in mix])
    per_mode = ([batch_size] if len(mix) == 1
                else rng.multinomial(batch_size, fractions / fractions.sum()).tolist())
    parts = []
    for (_, mode), n in zip(mix, per_mode):
        if n:
            parts += _split(rb, shards, int(n), length, tail, time_major, rng, mode, ids)
    return Plan(batch_size, length, tail, time_major, parts, ids)


def _split(rb, shards, batch_size: int, length: int, tail: int, time_major: bool, rng,
           mode, ids: bool = False) -> list:
    """``batch_size`` windows of ``mode`` split over ``shards`` by their weights."""
    local = rb._local_shard()
    what = (length, tail, mode)
    counts = np.zeros(len(shards), np.float64)
    remote = [i for i, s in enumerate(shards) if s is not local]
    if remote:
        got = rb._counts.get([shards[i] for i in remote], what, rb._timeout, rb._lost)
        counts[remote] = got
    for i, s in enumerate(shards):
        if s is local and rb._local_alive(s):
            counts[i] = weight(rb._attached(s), length, tail, mode, rng)
        elif s is local or not rb._is_live(s):
            counts[i] = 0
    total = counts.sum()
    if total <= 0:
        held = ("a valid window" if mode == "steps" else
                f"a finished episode of at least {length - tail} steps" if mode == "episodes"
                else f"a window with a score above 0 under {mode!r}")
        raise NotEnoughDataError(
            f"no shard of {rb!r} holds {held} (windows of length {length}, tail {tail}) "
            f"yet: {len(shards)} live shards; wait for the writers (rb.wait_ready) or ask "
            "for shorter windows")
    split = rng.multinomial(batch_size, counts / total)
    parts = []
    for s, n in zip(shards, split):
        if not n:
            continue
        ref = None
        if s is not local:
            seed = int(rng.integers(1 << 63))
            ref = s.actor.sample.remote(int(n), length, tail, time_major, seed, mode, ids)
        parts.append(Part(s, int(n), ref, mode))
    return parts


def finish(rb, p: Plan, out: dict, rng: np.random.Generator, timing: dict) -> dict:
    """Fill ``out`` (``{col: array}`` of the batch's shape) from the plan's parts."""
    offset = 0
    for part in sorted(p.parts, key=lambda q: q.ref is not None):   # local first
        _fill(rb, p, part, _slices(out, offset, part.n, p.time_major), rng, timing)
        offset += part.n
    timing["batches"] += 1
    return out


def _fill(rb, p: Plan, part: Part, dest: dict, rng, timing: dict, exclude=()) -> None:
    t0 = time.perf_counter()
    if part.ref is None:
        try:
            _sample_local(rb, p, part, dest, rng)
        except NotEnoughDataError:     # its windows were recycled since it was counted
            _redo(rb, p, part, dest, rng, timing, exclude + (part.shard.node_id,))
            return
        timing["local_s"] += time.perf_counter() - t0
        timing["local_windows"] += part.n
        if p.ids:
            _ids.tagged(dest["ids"], part.shard.buffer)
        return
    try:
        reply = ray.get(part.ref, timeout=rb._timeout)
    except Exception as exc:
        if isinstance(exc, NotEnoughDataError):     # the count was stale: no window now
            rb._counts.put(part.shard.node_id, p.what(part), 0)
        elif is_loss(exc):
            rb._lost(part.shard, exc)
        else:
            raise
        _redo(rb, p, part, dest, rng, timing, exclude + (part.shard.node_id,))
        return
    t1 = time.perf_counter()
    rb._counts.put(part.shard.node_id, p.what(part), reply.pop(_VALID))
    timing["remote_sample_s"] += reply.pop(_SAMPLE_S)
    for k, v in reply.items():
        np.copyto(dest[k], v)
        timing["remote_bytes"] += v.nbytes
    if p.ids:
        _ids.tagged(dest["ids"], part.shard.buffer)
    t2 = time.perf_counter()
    timing["remote_wait_s"] += t1 - t0
    timing["remote_copy_s"] += t2 - t1
    timing["remote_windows"] += part.n


def _redo(rb, p: Plan, part: Part, dest: dict, rng, timing: dict, exclude: tuple) -> None:
    """Draw a failed part's windows again from the other shards."""
    sub = plan(rb, part.n, p.length, p.tail, p.time_major, rng, exclude, ((1.0, part.mode),),
               p.ids)
    offset = 0
    for q in sorted(sub.parts, key=lambda q: q.ref is not None):
        _fill(rb, sub, q, _slices(dest, offset, q.n, p.time_major), rng, timing, exclude)
        offset += q.n


def _sample_local(rb, p: Plan, part: Part, dest: dict, rng) -> None:
    buf = rb._attached(part.shard)
    seed = int(rng.integers(1 << 63))
    if all(a.flags.c_contiguous for a in dest.values()):
        buf.sample_sequences(part.n, p.length, tail=p.tail, time_major=p.time_major,
                             out=dest, rng=seed, ids=p.ids, **sample_kwargs(part.mode))
        return
    batch = buf.sample_sequences(part.n, p.length, tail=p.tail, time_major=p.time_major,
                                 rng=seed, ids=p.ids, **sample_kwargs(part.mode))
    for k, v in batch.items():
        np.copyto(dest[k], v)


def _slices(out: dict, offset: int, n: int, time_major: bool) -> dict:
    if time_major:
        return {k: a[:, offset:offset + n] for k, a in out.items()}
    return {k: a[offset:offset + n] for k, a in out.items()}


def new_timing() -> dict:
    return {"batches": 0, "local_windows": 0, "remote_windows": 0, "remote_bytes": 0,
            "local_s": 0.0, "remote_wait_s": 0.0, "remote_copy_s": 0.0,
            "remote_sample_s": 0.0}
