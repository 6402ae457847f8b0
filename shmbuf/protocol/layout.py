"""Where every byte of a segment lives: the header table and the column layout.

Pure math and struct packing; no I/O.  The whole segment, in one table
(offsets in bytes; Q = u64, q = i64, I = u32, all little-endian):

  off  field          fmt  meaning
    0  magic          Q    b"SHMBUF\\0\\1" read as little-endian u64
    8  version        I    LAYOUT_VERSION of the shmbuf that created the segment
   12  n_columns      I    entries in the column table (user columns + "_ep", "_t")
   16  total_bytes    Q    size of the whole segment
   24  capacity       Q    rows per column
   32  chunk_size     Q    rows per chunk; the last chunk may be shorter
   40  n_chunks       Q    ceil(capacity / chunk_size)
   48  max_writers    Q    entries in the writer slot table
   56  done_column    q    table index of the terminal column, -1 if none
   64  owner_pid      Q    pid of the creating process (the owner now: the owner record at 704)
   72  owner_start    Q    its start time in clock ticks after boot (/proc/PID/stat #22)
   80  created_ns     Q    wall clock at create, time.time_ns()
   88  kind           Q    0: step store (chunks of streams); 1: keyed rings (a ring per key)
   96  meta_bytes     Q    length of the JSON metadata: at 1024, or past 1024 bytes in the meta room
  104  chunks_at      Q    offset of the chunk table (checks max_writers and the column table)
  112  episode_slots  Q    entries in the episode index
  120  episodes_at    Q    offset of the episode index
  128  ticket         Q    atomic: chunk claims so far; ticket % n_chunks is next to recycle
  192  next_stream    Q    atomic: stream ids handed out so far
  256  evicted        Q    atomic: committed steps dropped by recycling
  320  clock          Q    atomic: steps ever published; a step's number is its row's _t
  384  samples        Q    atomic: sample calls served
  448  replayed       Q    atomic: the rate limiter's budget: steps replayed (B*L per batch), by CAS
  512  serial         Q    atomic: serial numbers handed out by Buffer.next_serial()
  576  rate           Q    atomic: the rate limiter, 8 words (RATE_FIELDS): flags, train ratio,
                           min_steps, writer timeout (constants), tolerance (only widens),
                           seconds waited per side (ns), inserted base (set by a restore)
  640  episode_ticket  Q   atomic: episodes logged so far; entry i lives at i % episode_slots
  704  owner          Q    atomic: owner record, lease << 32 | pid; adoption takes it by CAS
  768  owner_stamp    Q    atomic: the owner's start time << 16 | low 16 bits of its lease
  832  closed         Q    atomic: 0 while open; reason << 32 | pid of who closed it (CLOSED_BY)
  840  writers_stopped  Q  atomic: 0, or the pid that stopped the writers
  896  sampled_rows   Q    atomic: rows (steps) returned by sample calls
  960  max_priority   Q    atomic: 1 << 32 | float32 bits of the largest priority ever set;
                           0: none yet
 1024  meta           JSON utf-8, at most 1024 bytes here: who made the buffer, its parameters
 2048  column table  n_columns x 256 B: name 64s, dtype 32s, ndim Q, shape 8Q, offset Q, row_bytes Q
   ..  writer slots   max_writers x 64 B, see SLOT_FIELDS
   ..  chunk table    n_chunks x 64 B, see CHUNK_FIELDS
   ..  episode index  episode_slots x 64 B, see EPISODE_FIELDS
   ..  meta room      JSON metadata longer than 1024 bytes (up to META_LIMIT), sized at create
   ..  columns        capacity x row_bytes each, each starting on a page boundary; the
                      user's, then the internal _ep (a row's episode number in its
                      stream) and _t (its clock number: the publish order, buffer-wide)
   ..  priority trees with priorities=True only, see PRIORITY_REGIONS

Every atomic counter, slot, chunk and episode entry owns a 64-byte cache
line, so that writers touching different entries never share a line
(but writers_stopped, which shares closed's on purpose: ``SHARES_LINE``).  The
magic is written last, with release order, by ``header.publish_header``: an
attacher that sees it sees the whole header.  Only the modules of
``protocol/`` load or store the atomic words (``ring`` the step store's,
``keyed`` its own); everything else calls them.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import keyword
import math
import struct
from typing import Any

import numpy as np

from .._args import check_int
from .._errors import CorruptSegmentError, LayoutVersionError
from ..posix.space import PAGE

MAGIC = int.from_bytes(b"SHMBUF\x00\x01", "little")
LAYOUT_VERSION = 4
KIND_STORE, KIND_KEYED = 0, 1
# What each kind holds, and what attaches to it: for error messages.
KINDS = {KIND_STORE: ("a step store", "shmbuf.attach"),
         KIND_KEYED: ("keyed rings (a HistoryBuffer)", "shmbuf.HistoryBuffer.attach")}
LINE = 64
MAX_NDIM = 8
MAX_COLUMNS = 64
MAX_NAME_BYTES = 63
MAX_COLUMN_BYTES = 1 << 46
DEFAULT_CHUNK_SIZE = 512
DEFAULT_MAX_WRITERS = 128
EP_COLUMN = "_ep"
T_COLUMN = "_t"
# Columns of every step store after the user's, in this order: written by the
# protocol (protocol.ring), never by users.
INTERNAL_COLUMNS = (EP_COLUMN, T_COLUMN)
PRIORITY_COLUMN = "_p"

# Priorities (create(..., priorities=True)).  The internal column "_p" holds
# one word per row: tag << 32 | float32 bits, where tag names the claim of the
# row's chunk (TAG of the chunk's ticket); a word whose tag is not the chunk's
# current one was never set for this step, which then has the largest priority
# ever set (max_priority), or 1.0 before any.  Writers never write it.
# After the columns, page-aligned, come PRIORITY_REGIONS:
#   blocks  2 words per block of PRIORITY_BLOCK rows of a chunk (a chunk has
#           ceil(chunk_size / block) of them): tag << 32 | rows set since the
#           claim, and tag << 32 | float32 bits of the largest value set since
#           the claim
#   prev    2 words per chunk: its stream's previous chunk + 1 (0: none) and
#           that chunk's seq, stored by the writer before it links the chunk
#   trees   one 16-ary tree over the blocks per exponent of TREE_EXPONENTS,
#           leaves first, one word per node: count << 40 | version << 32 |
#           float32 bits.  A leaf is count 1 (the block holds a step never set:
#           its bound is the largest priority) or count 0 and max ** exponent;
#           a node holds the sum of its children's counts and values.  A draw
#           with exponent e uses the tree of the largest exponent <= e.
#           _prio.c keeps them.
PRIORITY_BLOCK = 128
PRIORITY_FANOUT = 16
PRIORITY_MAX_BLOCKS = (1 << 24) - 1
TREE_EXPONENTS = (0.5, 0.8, 1.0)
PRIORITY_REGIONS = ("blocks", "prev", "trees")


def tag_of(ticket: int) -> int:
    """The 32-bit tag of a chunk claim: bit 31 set, so a zero word has no tag."""
    return (ticket & 0x7FFFFFFF) | 0x80000000

# (offset, struct format) of each fixed header field; the table above in code.
HEADER_FIELDS = {
    "magic": (0, "<Q"),
    "version": (8, "<I"),
    "n_columns": (12, "<I"),
    "total_bytes": (16, "<Q"),
    "capacity": (24, "<Q"),
    "chunk_size": (32, "<Q"),
    "n_chunks": (40, "<Q"),
    "max_writers": (48, "<Q"),
    "done_column": (56, "<q"),
    "owner_pid": (64, "<Q"),
    "owner_start": (72, "<Q"),
    "created_ns": (80, "<Q"),
    "kind": (88, "<Q"),
    "meta_bytes": (96, "<Q"),
    "chunks_at": (104, "<Q"),
    "episode_slots": (112, "<Q"),
    "episodes_at": (120, "<Q"),
}
COUNTERS = {"ticket": 128, "next_stream": 192, "evicted": 256, "clock": 320, "samples": 384,
            "replayed": 448, "serial": 512, "rate": 576,
            "episode_ticket": 640, "owner": 704, "owner_stamp": 768, "closed": 832,
            "sampled_rows": 896, "max_priority": 960, "writers_stopped": 840}
# The one word that shares a line on purpose: writers load it beside "closed" on
# every add, so the two cost one cache line (and nobody stores either often).
SHARES_LINE = {"writers_stopped": "closed"}
# The rate limiter's line (at COUNTERS["rate"]): flags (RATE_ON, RATE_BLOCK_WRITERS,
# RATE_AUTO_TOLERANCE), train_ratio and writer_timeout as IEEE double bits (timeout:
# all ones for None), min_steps, tolerance as double bits (auto: train_ratio, then
# widened to the largest batch),
# the nanoseconds samplers and writers spent waiting (fetch-add), and a restore's
# base (int64 two's complement: inserted = clock + base).  Constants are written
# with the header, before its magic is published; 0 flags: no limit.
RATE_FIELDS = {"flags": 0, "ratio": 8, "min_steps": 16, "writer_timeout": 24, "tolerance": 32,
               "sample_wait_ns": 40, "insert_wait_ns": 48, "base": 56}
RATE_ON, RATE_BLOCK_WRITERS, RATE_AUTO_TOLERANCE = 1, 2, 4   # auto: widened to the largest batch
NO_TIMEOUT = (1 << 64) - 1

# Who set the closed word (its bits 32-63), for the message writers get.
CLOSED_BY = {1: "its owner", 2: "'shmbuf rm'", 3: "'shmbuf gc' (its owner was dead)"}
CLOSED_OWNER, CLOSED_RM, CLOSED_GC = 1, 2, 3
META = 1024
MAX_META = 1024          # metadata that fits in the header; longer gets a room of its own
META_LIMIT = 64 << 20    # the longest metadata a buffer keeps (a space's bounds, say)
COLUMN_TABLE = 2048
COLUMN_ENTRY = 256
COLUMN_STRUCT = struct.Struct("<64s32sQ8QQQ")

# Writer slot entry: state = lease << 32 | pid (pid 0: free).  steps and
# episodes are cumulative over every writer that ever held the slot: a new
# holder continues from the value it finds, so nothing is ever moved.
SLOT_ENTRY = 64
SLOT_FIELDS = {"state": 0, "start_time": 8, "steps": 16, "streams": 24, "episodes": 32}

# Chunk entry: state packs seq (bits 32-63; odd while the chunk is being reset),
# sealed (bit 31; the owner has moved on), owner slot (bits 16-30) and the low
# 16 bits of that slot's lease.  next is successor chunk index + 1 (0: none).
CHUNK_ENTRY = 64
CHUNK_FIELDS = {"state": 0, "count": 8, "next": 16, "next_seq": 24, "stream": 32, "ticket": 40,
                "starts": 48, "pin": 56}   # pin: 0, or a write_steps' stamp (protocol.pins)
NO_SLOT = 0x7FFF
SLOT_SHIFT = 16      # the owner slot's position in the state word
SEALED = 1 << 31

# A chunk's episode starts (``starts``): the rows of the chunk at which an
# episode begins that continues a step of the same stream, i.e. where the
# _ep column changes.  Bits 0-30: the first such row; bits 31-61: the last;
# bits 62-63: how many (saturating at 3, "three or more").  0 when there is
# none.  STARTS_UNTRACKED (a chunk of 2**31 rows or more) means "read _ep".
# The writer stores it (release) before the count that publishes the row;
# the sampler reads it after the count and decides most windows from this
# one word instead of two loads of the _ep column (_window_check.c).
STARTS_BITS = 31
STARTS_UNTRACKED = (1 << 64) - 1

# Episode index entry, one per finished episode, written by the writer that
# ended it (see Ring.log_episode): seq is 2i+1 while entry i is written and
# 2i+2 once published; the episode starts at row ``offset`` of ``chunk``
# (whose state seq was ``chunk_seq``) and runs ``length`` steps along its
# stream; ``ep`` is its number in the stream's ``_ep`` column; flags bit 0 is
# set when it ended on a terminal step (clear: cut by end_episode).
EPISODE_ENTRY = 64
EPISODE_FIELDS = {"seq": 0, "stream": 8, "chunk": 16, "chunk_seq": 24, "offset": 32,
                  "length": 40, "ep": 48, "flags": 56}
TERMINAL = 1


def pack_chunk_state(seq: int, sealed: bool, slot: int, lease: int) -> int:
    return (((seq & 0xFFFFFFFF) << 32) | (SEALED if sealed else 0) | (slot << SLOT_SHIFT)
            | (lease & 0xFFFF))


def unpack_chunk_state(state: int) -> tuple[int, bool, int, int]:
    """``(seq, sealed, slot, lease)`` of one chunk state word."""
    return state >> 32, bool(state & SEALED), (state >> SLOT_SHIFT) & NO_SLOT, state & 0xFFFF


def chunk_seqs(states: np.ndarray) -> np.ndarray:
    """The seq field (int64) of each chunk state word of ``states`` (uint64)."""
    return (np.asarray(states, np.uint64) >> np.uint64(32)).astype(np.int64)


def chunks_sealed(states: np.ndarray) -> np.ndarray:
    """True where a chunk state word of ``states`` (uint64) has its sealed bit."""
    return (np.asarray(states, np.uint64) & np.uint64(SEALED)) != 0


@dataclasses.dataclass(frozen=True)
class Column:
    """One column: per-step shape and dtype, and where its rows start."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int
    row_bytes: int


@dataclasses.dataclass(frozen=True)
class Layout:
    """Every offset of a segment, derived from the schema and the sizes."""

    capacity: int
    chunk_size: int
    n_chunks: int
    max_writers: int
    columns: tuple[Column, ...]
    done_column: int
    slots_offset: int
    chunks_offset: int
    total_bytes: int
    episode_slots: int = 0
    episodes_offset: int = 0
    priority_block: int = 0               # rows per block; 0: no priorities
    priority_blocks_offset: int = 0
    priority_prev_offset: int = 0
    priority_trees: tuple = ()            # (exponent, ((offset, nodes) per level)) per tree
    meta_offset: int = META               # where the metadata lives (META: in the header)
    pack: Any = None                      # protocol.packing.PackPlan of a compressing buffer

    @property
    def priorities(self) -> bool:
        return self.priority_block > 0

    @property
    def blocks_per_chunk(self) -> int:
        return -(-self.chunk_size // self.priority_block) if self.priority_block else 0

    def column(self, name: str) -> Column:
        for col in self.columns:
            if col.name == name:
                return col
        raise KeyError(name)

    @functools.cached_property   # a frozen Layout: worked out once (every sample asks)
    def user_columns(self) -> tuple[Column, ...]:
        return tuple(c for c in self.columns if c.name not in INTERNAL_COLUMNS
                     and c.name != PRIORITY_COLUMN)

    @functools.cached_property
    def user_row_bytes(self) -> int:
        """Bytes of one step of the user's columns."""
        return sum(c.row_bytes for c in self.user_columns)

    def spec(self) -> dict:
        """``{column: (shape, dtype)}`` of the user's columns, as given to ``create``."""
        return {c.name: (c.shape, c.dtype) for c in self.user_columns}

    def chunk_field(self, chunk: int, field: str) -> int:
        return self.chunks_offset + chunk * CHUNK_ENTRY + CHUNK_FIELDS[field]

    def episode_field(self, entry: int, field: str) -> int:
        return self.episodes_offset + entry * EPISODE_ENTRY + EPISODE_FIELDS[field]

    def slot_field(self, slot: int, field: str) -> int:
        return self.slots_offset + slot * SLOT_ENTRY + SLOT_FIELDS[field]

    def chunk_rows(self, chunk: int) -> int:
        return min(self.chunk_size, self.capacity - chunk * self.chunk_size)


def _align(n: int, to: int) -> int:
    return -(-n // to) * to


def validate_column_name(name) -> str:
    if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name):
        raise ValueError(f"spec: column name {name!r} must be a Python identifier")
    if name.startswith("_"):
        raise ValueError(f"spec: column name {name!r} may not start with '_' (reserved)")
    if len(name.encode()) > MAX_NAME_BYTES:
        raise ValueError(f"spec: column name {name!r} is longer than {MAX_NAME_BYTES} bytes")
    return name


def validate_dtype(name: str, dtype) -> np.dtype:
    try:
        dt = np.dtype(dtype)
    except (TypeError, ValueError, SyntaxError) as exc:
        raise TypeError(f"spec[{name!r}]: {dtype!r} is not a numpy dtype") from exc
    if dt.hasobject or dt.fields is not None or dt.subdtype is not None or dt.itemsize == 0:
        raise TypeError(
            f"spec[{name!r}]: dtype {dt} cannot live in shared memory; "
            "use a fixed-size numeric, bool or fixed-width string dtype")
    return dt


def validate_shape(name: str, shape) -> tuple[int, ...]:
    if isinstance(shape, (int, np.integer)) and not isinstance(shape, bool):
        shape = (shape,)
    try:
        dims = tuple(shape)
    except TypeError as exc:
        raise TypeError(f"spec[{name!r}]: shape {shape!r} must be a tuple of ints") from exc
    if len(dims) > MAX_NDIM:
        raise ValueError(f"spec[{name!r}]: shape {dims} has more than {MAX_NDIM} dims")
    return tuple(check_int(f"spec[{name!r}] shape", d) for d in dims)


def normalize_spec(spec) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Check a ``{name: (shape, dtype)}`` schema and return it normalised."""
    if not isinstance(spec, dict) or not spec:
        raise TypeError(f"spec must be a non-empty dict of name -> (shape, dtype), got {spec!r}")
    most = MAX_COLUMNS - len(INTERNAL_COLUMNS)
    if len(spec) > most:
        raise ValueError(f"spec has {len(spec)} columns; at most {most} are supported")
    out = {}
    for name, entry in spec.items():
        validate_column_name(name)
        if not isinstance(entry, (tuple, list)) or len(entry) != 2:
            raise TypeError(f"spec[{name!r}] must be a (shape, dtype) pair, got {entry!r}")
        out[name] = (validate_shape(name, entry[0]), validate_dtype(name, entry[1]))
    return out


def default_chunk_size(capacity: int) -> int:
    """512 rows, or fewer so that a buffer has at least 64 chunks.

    Every live stream holds one partly filled chunk, so S streams leave up to
    S chunks' worth of rows unfilled: with 64 chunks, 16 env streams still
    keep at least 75% of the capacity filled.
    """
    return max(1, min(DEFAULT_CHUNK_SIZE, capacity // 64))


MAX_DEFAULT_EPISODE_SLOTS = 1 << 22  # 256 MiB of index


def default_episode_slots(capacity: int) -> int:
    """Room to index every episode of at least 8 steps (1024 to 4M entries, at most capacity)."""
    return min(capacity, MAX_DEFAULT_EPISODE_SLOTS, max(1024, capacity // 8))


def priority_block(chunk_size: int, n_chunks: int) -> int:
    """Rows per priority block: PRIORITY_BLOCK, doubled until the blocks fit a tree count."""
    block = min(PRIORITY_BLOCK, chunk_size)
    while n_chunks * -(-chunk_size // block) > PRIORITY_MAX_BLOCKS:
        if block >= chunk_size:
            raise ValueError(f"priorities=True: {n_chunks} chunks are more than the "
                             f"{PRIORITY_MAX_BLOCKS} a priority tree indexes; use a larger "
                             "chunk_size")
        block = min(2 * block, chunk_size)
    return block


def _priority_regions(cursor: int, chunk_size: int, n_chunks: int):
    """(block rows, blocks offset, prev offset, trees, end) from ``cursor`` on; trees:
    per exponent of TREE_EXPONENTS, ``(exponent, ((offset, nodes) per level, leaves first))``."""
    block = priority_block(chunk_size, n_chunks)
    n_blocks = n_chunks * -(-chunk_size // block)
    blocks_at = cursor
    prev_at = blocks_at + 16 * n_blocks
    at, trees = _align(prev_at + 16 * n_chunks, LINE), []
    for exponent in TREE_EXPONENTS:
        n, levels = n_blocks, []
        while True:
            levels.append((at, n))
            at = _align(at + 8 * n, LINE)
            if n == 1:
                break
            n = -(-n // PRIORITY_FANOUT)
        trees.append((exponent, tuple(levels)))
    return block, blocks_at, prev_at, tuple(trees), _align(at, PAGE)


def plan(spec, capacity, *, chunk_size=None, max_writers=DEFAULT_MAX_WRITERS,
         done_key="done", episode_slots=None, priorities=False, meta_bytes: int = 0,
         packing: tuple[tuple[str, ...], int] | None = None) -> Layout:
    """Lay out a segment for ``spec``; raises on any bad argument.

    ``meta_bytes``: the length of the metadata's JSON; past ``MAX_META`` it
    gets a room of its own after the episode index.  ``packing``: a
    compressing buffer's (packed column names, rows per block); its packing
    area comes after everything else, so nothing else moves.
    """
    columns_in = normalize_spec(spec)
    capacity = check_int("capacity", capacity, 1, 1 << 40)
    if chunk_size is None:
        chunk_size = default_chunk_size(capacity)
    chunk_size = check_int("chunk_size", chunk_size, 1, capacity)
    max_writers = check_int("max_writers", max_writers, 1, NO_SLOT - 1)
    if done_key is not None:
        if done_key not in columns_in:
            # Never dropped silently: a terminal flag under another name would
            # otherwise end no episode, and windows would cross episode ends.
            raise ValueError(
                f"done_key {done_key!r} is not a column of the spec, whose columns are "
                f"{sorted(columns_in)}; pass done_key='<column>' naming the per-step flag "
                "whose true value ends an episode, or done_key=None for a buffer without "
                "episodes (no window is then ever cut at an episode end)")
        if columns_in[done_key][0] != ():
            raise ValueError(f"done_key {done_key!r} must name a per-step scalar column, "
                             f"but its shape is {columns_in[done_key][0]}")
    if episode_slots is None:
        episode_slots = default_episode_slots(capacity)
    episode_slots = check_int("episode_slots", episode_slots, 1, 1 << 32)
    n_chunks = math.ceil(capacity / chunk_size)
    slots_offset = COLUMN_TABLE + (len(columns_in) + len(INTERNAL_COLUMNS) + bool(priorities)) \
        * COLUMN_ENTRY
    chunks_offset = slots_offset + max_writers * SLOT_ENTRY
    episodes_offset = chunks_offset + n_chunks * CHUNK_ENTRY
    meta_bytes = check_int("meta_bytes", meta_bytes, 0, META_LIMIT)
    cursor = episodes_offset + episode_slots * EPISODE_ENTRY
    meta_offset = META if meta_bytes <= MAX_META else cursor
    cursor = _align(cursor + (meta_bytes if meta_bytes > MAX_META else 0), PAGE)
    columns = []
    internal = [(PRIORITY_COLUMN, ((), np.dtype("<u8")))] if priorities else []
    entries = list(columns_in.items()) + internal + [(c, ((), np.dtype("<i8")))
                                                     for c in INTERNAL_COLUMNS]
    for name, (shape, dtype) in entries:
        row_bytes = math.prod(shape) * dtype.itemsize
        if row_bytes * capacity > MAX_COLUMN_BYTES:
            raise ValueError(f"spec[{name!r}]: {capacity} rows of shape {shape} and dtype "
                             f"{dtype} need {row_bytes * capacity} bytes; at most "
                             f"{MAX_COLUMN_BYTES} per column")
        columns.append(Column(name, dtype, shape, cursor, row_bytes))
        cursor = _align(cursor + row_bytes * capacity, PAGE)
    done = [c.name for c in columns].index(done_key) if done_key is not None else -1
    prio: tuple = (0, 0, 0, ())
    if priorities:
        *prio, cursor = _priority_regions(cursor, chunk_size, n_chunks)
    layout = Layout(capacity, chunk_size, n_chunks, max_writers, tuple(columns), done,
                    slots_offset, chunks_offset, cursor, episode_slots, episodes_offset, *prio)
    layout = dataclasses.replace(layout, meta_offset=meta_offset)
    if packing is None:
        return layout
    from .packing import plan_packing
    names, block_rows = packing
    by_name = {c.name: c for c in columns}
    pack = plan_packing(layout.total_bytes, n_chunks, chunk_size, capacity, block_rows,
                        [(n, by_name[n].offset, by_name[n].row_bytes) for n in names])
    return dataclasses.replace(layout, total_bytes=pack.total_bytes, pack=pack)


def packing_of(meta: dict) -> tuple[tuple[str, ...], int] | None:
    """The ``plan(packing=...)`` argument that a buffer's metadata records, or None."""
    entry = meta.get("compress")
    if entry is None:
        return None
    return tuple(entry["columns"]), int(entry["block_rows"])


def encode_meta(meta) -> bytes:
    """``meta`` as JSON bytes; raises if it is not plain data of at most ``META_LIMIT`` bytes."""
    try:
        raw = json.dumps(meta if meta is not None else {}, sort_keys=True).encode()
    except (TypeError, ValueError) as exc:
        raise TypeError(f"meta must be JSON-serialisable plain data, got {meta!r} "
                        f"({exc})") from None
    if len(raw) > META_LIMIT:
        raise ValueError(f"meta is {len(raw)} bytes as JSON; a buffer keeps at most "
                         f"{META_LIMIT} bytes of metadata: keep large data in a column or a "
                         "file and its name in meta")
    return raw


def encode_header(layout: Layout, owner_pid: int, owner_start: int, created_ns: int,
                  kind: int = 0, meta: bytes = b"{}", rate: dict | None = None) -> bytes:
    """The fixed header and the column table, ready to copy to offset 0.

    ``rate``: the rate limiter's words (``{RATE_FIELDS name: u64}``), if any.
    """
    out = bytearray(layout.slots_offset)
    if layout.meta_offset == META:   # else the creator writes it to its room first
        out[META:META + len(meta)] = meta
    values = {
        "magic": MAGIC, "version": LAYOUT_VERSION, "n_columns": len(layout.columns),
        "total_bytes": layout.total_bytes, "capacity": layout.capacity,
        "chunk_size": layout.chunk_size, "n_chunks": layout.n_chunks,
        "max_writers": layout.max_writers, "done_column": layout.done_column,
        "owner_pid": owner_pid, "owner_start": owner_start, "created_ns": created_ns,
        "kind": kind, "meta_bytes": len(meta), "chunks_at": layout.chunks_offset,
        "episode_slots": layout.episode_slots, "episodes_at": layout.episodes_offset,
    }
    for field, (off, fmt) in HEADER_FIELDS.items():
        struct.pack_into(fmt, out, off, values[field])
    # The first owner record (lease 1), published with the rest of the header.
    struct.pack_into("<Q", out, COUNTERS["owner"], 1 << 32 | owner_pid)
    struct.pack_into("<Q", out, COUNTERS["owner_stamp"], owner_start << 16 | 1)
    for field, value in (rate or {}).items():
        struct.pack_into("<Q", out, COUNTERS["rate"] + RATE_FIELDS[field], value)
    for i, col in enumerate(layout.columns):
        shape = list(col.shape) + [0] * (MAX_NDIM - len(col.shape))
        COLUMN_STRUCT.pack_into(out, COLUMN_TABLE + i * COLUMN_ENTRY, col.name.encode(),
                                col.dtype.str.encode(), len(col.shape), *shape,
                                col.offset, col.row_bytes)
    return bytes(out)


def read_field(buf, field: str) -> int:
    off, fmt = HEADER_FIELDS[field]
    return struct.unpack_from(fmt, buf, off)[0]


def decode_header(buf, segment_bytes: int, name: str) -> tuple[Layout, dict]:
    """Parse and check the header of segment ``name``; trust nothing in it.

    Returns the layout and the owner fields.  Raises CorruptSegmentError (or
    LayoutVersionError) naming the segment and what does not add up.
    """
    def bad(why):
        return CorruptSegmentError(f"segment {name!r} is not a usable shmbuf buffer: {why}")

    if segment_bytes < COLUMN_TABLE:
        raise bad(f"it is {segment_bytes} bytes, smaller than a header ({COLUMN_TABLE})")
    head = {f: read_field(buf, f) for f in HEADER_FIELDS}
    if head["magic"] != MAGIC:
        raise bad(f"magic is {head['magic']:#018x}, expected {MAGIC:#018x}")
    if head["version"] != LAYOUT_VERSION:
        raise LayoutVersionError(
            f"segment {name!r} has layout version {head['version']} but this shmbuf reads "
            f"version {LAYOUT_VERSION}; create a new buffer or use a matching shmbuf")
    if head["total_bytes"] != segment_bytes:
        raise bad(f"header says {head['total_bytes']} bytes but the segment has {segment_bytes}")
    n_columns = head["n_columns"]
    if (not len(INTERNAL_COLUMNS) + 1 <= n_columns <= MAX_COLUMNS
            or COLUMN_TABLE + n_columns * COLUMN_ENTRY > segment_bytes):
        raise bad(f"column count {n_columns} is out of range")
    spec = {}
    for i in range(n_columns):
        raw = COLUMN_STRUCT.unpack_from(buf, COLUMN_TABLE + i * COLUMN_ENTRY)
        try:
            cname = raw[0].rstrip(b"\0").decode()
            dtype = np.dtype(raw[1].rstrip(b"\0").decode())
        except (UnicodeDecodeError, TypeError, ValueError, SyntaxError) as exc:
            raise bad(f"column {i} has an unreadable name or dtype ({exc})") from None
        ndim = raw[2]
        if ndim > MAX_NDIM:
            raise bad(f"column {cname!r} claims {ndim} dims")
        spec[cname] = (tuple(raw[3:3 + ndim]), dtype, raw[11], raw[12])
    internal = list(spec)[-len(INTERNAL_COLUMNS):]
    if internal != list(INTERNAL_COLUMNS) or any(
            spec[c][:2] != ((), np.dtype("<i8")) for c in INTERNAL_COLUMNS):
        raise bad(f"the internal columns {INTERNAL_COLUMNS} are missing or malformed")
    priorities = PRIORITY_COLUMN in spec
    if priorities and (list(spec).index(PRIORITY_COLUMN) != len(spec) - len(INTERNAL_COLUMNS) - 1
                       or spec[PRIORITY_COLUMN][:2] != ((), np.dtype("<u8"))):
        raise bad("the internal priority column is misplaced or malformed")
    user = {k: v[:2] for k, v in spec.items()
            if k not in INTERNAL_COLUMNS and k != PRIORITY_COLUMN}
    done = head["done_column"]
    if len(spec) != n_columns:
        raise bad("its column table repeats a column name")
    done_key = (list(spec)[done] if 0 <= done < n_columns - len(INTERNAL_COLUMNS) - priorities
                else None)
    if done != -1 and done_key is None:
        raise bad(f"done column index {done} is out of range")
    kw: dict[str, Any] = dict(chunk_size=head["chunk_size"], max_writers=head["max_writers"],
                              done_key=done_key, episode_slots=head["episode_slots"],
                              priorities=priorities, meta_bytes=head["meta_bytes"])
    try:
        layout = plan(user, head["capacity"], **kw)
    except (TypeError, ValueError) as exc:
        raise bad(f"its schema or sizes are invalid ({exc})") from None
    if head["kind"] not in (0, 1):
        raise bad(f"kind {head['kind']} is out of range")
    at = layout.meta_offset
    try:
        meta = json.loads(bytes(buf[at:at + head["meta_bytes"]]).decode())
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise bad(f"its metadata is not JSON ({exc})") from None
    if not isinstance(meta, dict):
        raise bad(f"its metadata is {type(meta).__name__}, expected an object")
    try:   # a compressing buffer's settings (in its metadata) add the packing area
        packing = packing_of(meta)
        if packing is not None:
            layout = plan(user, head["capacity"], **kw, packing=packing)
    except (TypeError, ValueError, KeyError) as exc:
        raise bad(f"its compression settings are invalid ({exc})") from None
    stored = [(c.offset, c.row_bytes) for c in layout.columns]
    if stored != [v[2:] for v in spec.values()]:
        raise bad("column offsets do not match the layout they describe")
    if (layout.n_chunks, layout.total_bytes, layout.chunks_offset, layout.episodes_offset) != (
            head["n_chunks"], head["total_bytes"], head["chunks_at"], head["episodes_at"]):
        raise bad("chunk count, episode index or total size does not match the layout")
    owner: dict = {k: head[k] for k in ("owner_pid", "owner_start", "created_ns", "kind")}
    owner["meta"] = meta
    return layout, owner
