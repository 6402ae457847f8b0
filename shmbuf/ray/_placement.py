"""Where shards run and how they are found: names, node filters, starting and ending them.

A shard's actor name is ``"<buffer name>/<node id>"`` in the buffer's Ray
namespace, so any process can find the shard of a node, two processes that
start the same shard get the same actor (``get_if_exists``), and ``connect``
lists a buffer's shards by prefix.
"""
from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from shmbuf.ray._shard import Shard

if TYPE_CHECKING:
    from ray.actor import ActorHandle

DEFAULT_NAMESPACE = "shmbuf"
_NAME = re.compile(r"^[A-Za-z0-9._-]{1,100}$")


@dataclasses.dataclass
class ShardEntry:
    """One shard as it reported itself: its node, its buffer's name, its actor."""

    node_id: str
    buffer: str
    actor: ActorHandle
    capacity: int
    chunk_size: int
    ip: str


def actor_name(rb_name: str, node: str) -> str:
    return f"{rb_name}/{node}"


def make_entry(actor, info: dict) -> ShardEntry:
    return ShardEntry(info["node_id"], info["buffer"], actor, info["capacity"],
                      info["chunk_size"], info["ip"])


def alive_nodes(resource) -> list[str]:
    """Alive nodes with ``resource`` (any node if None, none if False)."""
    if resource is False:
        return []
    return [n["NodeID"] for n in ray.nodes()
            if n.get("Alive") and (resource is None or n.get("Resources", {}).get(resource))]


def start_shards(name, namespace, spec, capacity, options, nodes, timeout,
                 node_resource=None) -> list[ShardEntry]:
    """A shard on each of ``nodes`` (pinned, detached, named); all of them or none.

    Each must report the node it was sent to; a shard that fails to start in
    ``timeout`` seconds ends the others started here.
    """
    # Shard is a Ray actor class; ray's stubs do not type its decorator (see _shard).
    actors = [Shard.options(name=actor_name(name, n), namespace=namespace, lifetime="detached",  # type: ignore[attr-defined]
                            get_if_exists=True,
                            scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False))
              .remote(name, spec, capacity, options, node_resource) for n in nodes]
    infos = [a.info.remote() for a in actors]
    entries = []
    try:
        for n, a, ref in zip(nodes, actors, infos):
            info = ray.get(ref, timeout=timeout)
            if info["node_id"] != n:
                raise RuntimeError(f"the shard meant for node {n} runs on {info['node_id']}")
            entries.append(make_entry(a, info))
    except BaseException:
        end(actors, timeout)
        raise
    return entries


def end(actors, timeout) -> None:
    """Close and kill shards (a failed start): their segments are unlinked by their owner."""
    refs = [a.close.remote() for a in actors]
    try:
        ray.wait(refs, num_returns=len(refs), timeout=timeout)
    finally:
        for a in actors:
            ray.kill(a, no_restart=True)


def check_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"name must be 1-100 letters, digits, '.', '_' or '-', got {name!r}")
    return name


def shard_actors(name: str, namespace: str) -> list:
    prefix = name + "/"
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["namespace"] == namespace and a["name"].startswith(prefix)]
    actors = []
    for n in sorted(names):
        try:
            actors.append(ray.get_actor(n, namespace=namespace))
        except ValueError:      # it died between the listing and now
            continue
    return actors
