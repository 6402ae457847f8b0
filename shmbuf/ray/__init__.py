"""shmbuf past one machine: one shard per node on Ray, sampled as one buffer.

Each shard is a named, detached Ray actor pinned to its node; it owns that
node's shmbuf buffer.  Writers on a node with a shard attach to it by name
and write through shared memory; writers elsewhere ship whole blocks of
steps to a shard.  ``sample_sequences`` draws each batch uniformly over the
valid windows of all shards: this node's share is read zero-copy, the
others' shares are sampled on their nodes and cross the network as one
batch each.

Needs ``pip install 'shmbuf[ray]'``; ``import shmbuf`` never imports Ray.

Example:
    >>> import ray, shmbuf.ray as sray
    >>> rb = sray.create(spec, capacity_per_shard=1_000_000, name="run-7")
    >>> batch = rb.sample_sequences(50, 50)
    >>> rb = sray.connect("run-7")     # a restarted trainer
"""
from __future__ import annotations

import ray  # noqa: F401  # first: without the ray extra, the ImportError names ray itself

from shmbuf.ray._buffer import ShardedBuffer, ShardStats
from shmbuf.ray._errors import ShardedBufferNotFoundError, ShardLostError
from shmbuf.ray._open import connect, create
from shmbuf.ray._placement import ShardEntry
from shmbuf.ray._writers import LocalWriter, ShippingWriter
from shmbuf.ray.dreamer import ReplayBuffer

__all__ = ["create", "connect", "ShardedBuffer", "ShardEntry", "ShardStats",
           "LocalWriter", "ShippingWriter", "ReplayBuffer", "ShardLostError",
           "ShardedBufferNotFoundError"]
