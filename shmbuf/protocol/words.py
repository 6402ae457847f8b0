"""Word indices of the step store's shared structures, derived once from the layout.

Chunk-entry fields as 8-byte word indices, episode-entry fields, and the
counter lines every protocol module uses; the byte table is in ``layout``.
"""
from __future__ import annotations

from .layout import CHUNK_FIELDS, COUNTERS, EPISODE_FIELDS, STARTS_BITS

_U32 = 0xFFFFFFFF
_U64 = (1 << 64) - 1
_STATE, _COUNT = CHUNK_FIELDS["state"] // 8, CHUNK_FIELDS["count"] // 8
_STREAM, _TICKET = CHUNK_FIELDS["stream"] // 8, CHUNK_FIELDS["ticket"] // 8
_NEXT, _NEXT_SEQ = CHUNK_FIELDS["next"] // 8, CHUNK_FIELDS["next_seq"] // 8
_STARTS = CHUNK_FIELDS["starts"] // 8
_STARTS_MAX = (1 << STARTS_BITS) - 1
_EPISODE_GRANULE = 1024  # episode-index entries reserved at a time (64 KiB)
# Fields of an episode entry after its seq, in the order a writer stores them.
_EPISODE_BODY = ("stream", "chunk", "chunk_seq", "offset", "length", "ep", "flags")
(_E_SEQ, _E_STREAM, _E_CHUNK, _E_CHUNK_SEQ, _E_OFFSET, _E_LENGTH, _E_EP,
 _E_FLAGS) = (EPISODE_FIELDS[f] // 8 for f in ("seq",) + _EPISODE_BODY)

# Counter lines (byte offsets in the header).
_CLOSED, _OWNER, _OWNER_STAMP = COUNTERS["closed"], COUNTERS["owner"], COUNTERS["owner_stamp"]
_STOPPED = COUNTERS["writers_stopped"]
_CLOCK = COUNTERS["clock"]
_REPLAYED, _RATE = COUNTERS["replayed"], COUNTERS["rate"]
