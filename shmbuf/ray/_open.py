"""``shmbuf.ray.create`` and ``connect``: start the shards of a buffer, or reach them again.

In a module of their own so that ``shmbuf.ray.dreamer`` can build on them
while the package re-exports both (no import cycle).
"""
from __future__ import annotations

import logging
import uuid

import ray

from shmbuf.protocol.layout import plan
from shmbuf.ray._buffer import ShardedBuffer
from shmbuf.ray._errors import ShardedBufferNotFoundError, is_loss
from shmbuf.ray._placement import (
    DEFAULT_NAMESPACE,
    alive_nodes,
    check_name,
    make_entry,
    shard_actors,
    start_shards,
)

log = logging.getLogger("shmbuf.ray")
_OPTIONS = ("chunk_size", "max_writers", "done_key", "episode_slots", "prefault", "priorities",
            "remote_idle_s", "rate_limit")
_PLANNED = ("chunk_size", "max_writers", "done_key", "episode_slots", "priorities")  # plan's


def create(spec: dict, capacity_per_shard: int, *, name: str | None = None,
           namespace: str = DEFAULT_NAMESPACE, nodes: list[str] | None = None,
           node_resource: str | None = None, seed=None, timeout_s: float = 60.0,
           **buffer_options) -> ShardedBuffer:
    """Start one shard per alive node (or per node of ``nodes``); the caller owns them.

    Args:
        spec: ``{column: (shape, dtype)}``, as ``shmbuf.create``.
        capacity_per_shard: steps each shard holds.
        name: the buffer's name, by which ``connect`` finds it again
            (letters, digits, ``._-``); generated if None.
        namespace: the Ray namespace of the shard actors.
        nodes: node ids to put shards on; default every alive node (that
            has ``node_resource``, if given).
        node_resource: only nodes advertising this custom resource get a
            shard, now and at ``refresh()``.
        seed: seed of this handle's generator (the split and the shards' draws).
        timeout_s: bound on every call to a shard (start, fetch, flush).
        **buffer_options: ``chunk_size``, ``max_writers``, ``done_key``,
            ``episode_slots``, ``prefault``, ``priorities`` of ``shmbuf.create``; and
            ``remote_idle_s`` (600): a shipping writer that sends nothing for
            that long has its shard stream sealed and its writer slot freed
            (a later block opens a new stream, cutting its episode there).
            ``rate_limit`` (a ``shmbuf.RateLimit``): every shard holds it
            on its own steps, with the same semantics as one buffer: a
            shard's share of a global batch waits for that shard's inserts,
            and its writers (local or shipped) for its samples.  Shares
            follow valid windows, not insert rates, so the global ratio is
            the sum of the shards' (each within its own band: the global lag
            is within shards x tolerance); a shard whose writers run slower
            than its share holds the global batch back.

    Raises:
        ValueError / TypeError: a bad name or option, or a spec that shmbuf.create
            refuses (a done_key that is not a column, say), before any shard starts;
            a shard named like this exists.
        ray.exceptions.GetTimeoutError: a shard did not start in time (the
            others were closed).

    Example:
        >>> rb = sray.create({"obs": ((3, 64, 64), np.uint8), "done": ((), bool)},
        ...                  capacity_per_shard=100_000, name="run-7")
    """
    unknown = sorted(set(buffer_options) - set(_OPTIONS))
    if unknown:
        raise ValueError(f"unknown options {unknown}; shmbuf.ray.create takes {_OPTIONS}")
    # Each shard runs shmbuf.create: refuse what it would refuse (a done_key that is not a
    # column, say) here, before any actor starts.
    plan(spec, capacity_per_shard, **{k: v for k, v in buffer_options.items() if k in _PLANNED})
    if not ray.is_initialized():
        raise RuntimeError("shmbuf.ray.create needs a Ray connection: call ray.init(...) first")
    name = check_name(name or f"rb-{uuid.uuid4().hex[:12]}")
    if shard_actors(name, namespace):
        raise ValueError(f"a sharded buffer named {name!r} already exists in namespace "
                         f"{namespace!r}; shmbuf.ray.connect({name!r}) reaches it")
    targets = list(nodes) if nodes is not None else alive_nodes(node_resource)
    resource = node_resource if nodes is None else False   # False: refresh adds none
    entries = start_shards(name, namespace, spec, capacity_per_shard, buffer_options,
                            targets, timeout_s, resource)
    return ShardedBuffer(name, namespace, spec, capacity_per_shard, buffer_options, resource,
                         entries, owner=True, seed=seed, timeout_s=timeout_s)


def connect(name: str, *, namespace: str = DEFAULT_NAMESPACE, own: bool = False, seed=None,
            timeout_s: float = 60.0) -> ShardedBuffer:
    """Reach the live shards of buffer ``name`` again (a restarted trainer, a monitor).

    Args:
        own: take ownership: this handle's ``close()`` ends the shards.

    Raises:
        ShardedBufferNotFoundError: no live shard of that name in ``namespace``.

    Example:
        >>> rb = sray.connect("run-7", own=True)
    """
    check_name(name)
    actors = shard_actors(name, namespace)
    refs = [a.info.remote() for a in actors]
    entries, infos = [], []
    for a, ref in zip(actors, refs):
        try:
            infos.append(ray.get(ref, timeout=timeout_s))
        except Exception as exc:   # a node dying right now: connect to the others
            if not is_loss(exc):
                raise
            log.warning("shmbuf.ray.connect(%r): a shard did not answer (%s); skipped",
                        name, type(exc).__name__)
            continue
        entries.append(make_entry(a, infos[-1]))
    if not entries:
        raise ShardedBufferNotFoundError(
            f"no live shard of {name!r} in Ray namespace {namespace!r}: it was closed, its "
            "nodes died, or it lives in another namespace or cluster")
    first = infos[0]
    return ShardedBuffer(name, namespace, first["spec"], first["capacity"], first["options"],
                         first["node_resource"], entries, owner=own, seed=seed,
                         timeout_s=timeout_s)
