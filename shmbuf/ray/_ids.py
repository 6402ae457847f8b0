"""Step ids across shards: which shard holds a step, in the id's top bits.

A shard's own ids (``Buffer.sample_sequences(..., ids=True)``) carry that
buffer's tag above a local part (``shmbuf.protocol.stepids``).  A sharded
batch keeps the local part, which stays below ``2 ** LOCAL_BITS``, and puts
``tag << LOCAL_BITS`` above it instead, where ``tag`` is a 24-bit hash of the
shard's segment name, the same in every process, so any handle (the
trainer's, a DataLoader worker's) routes an id back to the shard that holds
its step, which gets its own tag back (``for_shard``).  Two live shards with
the same tag are refused when ids are asked for (about one chance in 80,000
with 16 shards).
"""
from __future__ import annotations

import zlib

import numpy as np

from shmbuf.protocol.stepids import LOCAL_MASK, TAG_SHIFT

LOCAL_BITS = 39
TAG_BITS = 24
_LOCAL = (1 << LOCAL_BITS) - 1


def tag_of(buffer_name: str) -> int:
    return zlib.crc32(buffer_name.encode()) & ((1 << TAG_BITS) - 1)


def check_unique(shards) -> None:
    """ValueError if two of ``shards`` (ShardEntry) would tag their ids alike."""
    seen: dict = {}
    for s in shards:
        other = seen.setdefault(tag_of(s.buffer), s.buffer)
        if other != s.buffer:
            raise ValueError(f"ids=True: shards {other!r} and {s.buffer!r} hash to the same "
                             "id tag; recreate the sharded buffer under another name")


def tagged(ids: np.ndarray, buffer_name: str) -> None:
    """Make the shard's own ``ids`` sharded ones, in place: its local part, tagged with
    the shard."""
    np.bitwise_and(ids, np.int64(LOCAL_MASK), out=ids)
    if ids.size and int(ids.max()) > _LOCAL:
        raise ValueError(f"shard {buffer_name!r} has claimed more chunks than a sharded id "
                         f"can number (local ids reach {int(ids.max())})")
    ids |= np.int64(tag_of(buffer_name) << LOCAL_BITS)


def for_shard(local: np.ndarray, buf) -> np.ndarray:
    """The local parts ``local`` (``split``) as the ids shard ``buf`` (a Buffer) issued."""
    return local | np.int64(buf.port.id_tag << TAG_SHIFT)


def split(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(tag, local id) of each sharded id."""
    return ids >> LOCAL_BITS, ids & _LOCAL
