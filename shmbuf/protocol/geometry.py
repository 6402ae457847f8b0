"""The geometry the C extensions read, named once and packed by name.

``geometry_of(layout)`` is the one Python-side source: a dict from each
field name of the C struct ``ShmGeometry`` (``shmbuf_words.h``) to its value,
all taken from ``protocol.layout``.  ``pack`` turns it into the bytes every
extension's functions take, placing each value at the offset that C's own
field table (``_atomic.GEOMETRY_FIELDS``: name, offset, struct format, count)
gives for its name, so neither side depends on a field's position.  A missing,
unknown or ill-typed field is a ValueError naming it; C refuses bytes of
another size or magic.
"""
from __future__ import annotations

import struct
from typing import Any, Mapping

from . import _atomic
from .layout import (
    CHUNK_ENTRY,
    CHUNK_FIELDS,
    COUNTERS,
    EP_COLUMN,
    NO_SLOT,
    PRIORITY_COLUMN,
    RATE_FIELDS,
    SLOT_SHIFT,
    STARTS_BITS,
    Layout,
)

# Set by ``pack`` from C's constant, never by a caller.
_MAGIC = "magic"


def _fields() -> dict[str, tuple[int, str, int]]:
    """C's field table: name -> (offset, struct format, count)."""
    return {name: (offset, fmt, count) for name, offset, fmt, count in _atomic.GEOMETRY_FIELDS}


def _padded(values, count: int, what: str) -> tuple:
    values = tuple(values)
    if len(values) > count:
        raise ValueError(f"geometry: {what} has {len(values)} entries; C holds at most {count}")
    return values + (0,) * (count - len(values))


def geometry_of(layout: Layout) -> dict[str, Any]:
    """The named geometry of one step store: every field C reads, from ``layout``.

    Args:
        layout: the store's ``protocol.layout.Layout``.

    Returns:
        A dict from each ``ShmGeometry`` field name (except ``magic``) to an int,
        or for the tree tables a tuple as long as C's array.  Priority fields
        are 0 for a store without priorities.

    Raises:
        ValueError: the layout has more priority trees or levels than C holds.

    Example:
        >>> pack(geometry_of(layout))   # what Ring.geometry holds
    """
    fields = _fields()
    max_trees = fields["tree_exponent"][2]
    max_levels = fields["level_nodes"][2]
    trees = layout.priority_trees
    levels = [lv for _, lv in trees]
    if any(len(lv) != len(levels[0]) or [n for _, n in lv] != [n for _, n in levels[0]]
           for lv in levels):
        raise ValueError("geometry: the priority trees' levels differ in shape")
    level_at: list[int] = []
    for lv in levels:
        level_at += _padded((at for at, _ in lv), max_levels, "a priority tree's levels")
    blocks = layout.n_chunks * layout.blocks_per_chunk
    return {
        "chunks_at": layout.chunks_offset,
        "n_chunks": layout.n_chunks,
        "chunk_size": layout.chunk_size,
        "capacity": layout.capacity,
        "entry_bytes": CHUNK_ENTRY,
        "entry_state": CHUNK_FIELDS["state"],
        "entry_count": CHUNK_FIELDS["count"],
        "entry_next": CHUNK_FIELDS["next"],
        "entry_next_seq": CHUNK_FIELDS["next_seq"],
        "entry_starts": CHUNK_FIELDS["starts"],
        "entry_ticket": CHUNK_FIELDS["ticket"],
        "starts_bits": STARTS_BITS,
        "slot_shift": SLOT_SHIFT,
        "no_slot": NO_SLOT,
        "ep_at": layout.column(EP_COLUMN).offset,
        "ticket": COUNTERS["ticket"],
        "clock": COUNTERS["clock"],
        "closed": COUNTERS["closed"],
        "stopped": COUNTERS["writers_stopped"],
        "replayed": COUNTERS["replayed"],
        **{f"rate_{f}": COUNTERS["rate"] + RATE_FIELDS[f]
           for f in ("flags", "ratio", "min_steps", "tolerance", "base")},
        "prio_rows_at": layout.column(PRIORITY_COLUMN).offset if layout.priorities else 0,
        "prio_blocks_at": layout.priority_blocks_offset,
        "prio_prev_at": layout.priority_prev_offset,
        "prio_block": layout.priority_block,
        "prio_blocks_per_chunk": layout.blocks_per_chunk,
        "prio_n_blocks": blocks,
        "prio_max": COUNTERS["max_priority"],
        "n_trees": len(trees),
        "n_levels": len(levels[0]) if trees else 0,
        "tree_exponent": _padded((float(e) for e, _ in trees), max_trees, "priority_trees"),
        "tree_level_at": _padded(level_at, max_trees * max_levels, "priority_trees"),
        "level_nodes": _padded((n for _, n in levels[0]) if trees else (), max_levels,
                               "a priority tree's levels"),
    }


def pack(values: Mapping[str, Any]) -> bytes:
    """The bytes the C extensions take for ``values`` (``geometry_of``'s dict).

    Args:
        values: one value per ``ShmGeometry`` field but ``magic``: an int, or
            a sequence of exactly the field's count for an array field.

    Returns:
        ``_atomic.GEOMETRY_SIZE`` bytes, each value at its field's offset.

    Raises:
        ValueError: a field is missing or unknown, or a value does not fit
            its field's type and count (named in the message).

    Example:
        >>> geometry = pack(geometry_of(layout))
        >>> _window_check.find(mm, geometry, ...)
    """
    fields = _fields()
    missing = sorted(set(fields) - set(values) - {_MAGIC})
    unknown = sorted(set(values) - set(fields) | ({_MAGIC} & set(values)))
    if missing or unknown:
        raise ValueError(f"geometry: missing fields {missing}, unknown fields {unknown}; "
                         f"expected exactly {sorted(set(fields) - {_MAGIC})}")
    out = bytearray(_atomic.GEOMETRY_SIZE)
    for name, (offset, fmt, count) in fields.items():
        value = _atomic.GEOMETRY_MAGIC if name == _MAGIC else values[name]
        items: Any = (value,) if count == 1 and not isinstance(value, (tuple, list)) else value
        try:
            if len(items) != count:
                raise ValueError(f"{len(items)} values for {count}")
            struct.pack_into(f"<{count}{fmt}", out, offset, *items)
        except (TypeError, ValueError, struct.error) as e:
            raise ValueError(f"geometry field {name!r} = {value!r} does not fit "
                             f"{count} x {fmt!r}: {e}") from None
    return bytes(out)
