"""The segment layout: the header table, plan(), and decode_header on hostile bytes.

Pure math; nothing here touches /dev/shm except the create() argument checks,
which must fail before any system call.
"""
import keyword
import math
import re
import struct

import numpy as np
import pytest
from helpers.shm import own_entries
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import shmbuf
from shmbuf._errors import CorruptSegmentError, LayoutVersionError
from shmbuf.protocol import layout as L

# Deterministic: the same examples on every run and on every machine.  The fuzzers
# skip shrinking so that a failure is reported in seconds; their inputs are small
# structured values that read well unshrunk.
PROPS = settings(max_examples=100, derandomize=True, database=None, deadline=None,
                 suppress_health_check=[HealthCheck.too_slow])
FUZZ = settings(PROPS, max_examples=300,
                phases=[Phase.explicit, Phase.reuse, Phase.generate])

SPEC = {
    "obs": ((3, 8, 8), np.uint8),
    "action": ((6,), np.float32),
    "reward": ((), np.float32),
    "done": ((), np.bool_),
}
U64 = 2**64 - 1
SIZES = {"Q": 8, "q": 8, "I": 4}


# -- the docstring table and the dicts agree -------------------------------------
def _doc_table():
    """(offset or None, name, rest of line) for every row of the byte table."""
    rows = []
    for line in L.__doc__.splitlines():
        m = re.match(r"^\s+(\d+|\.\.)  (\S+(?: \S+)?)\s{2,}(.+)$", line)
        if m:
            off = None if m[1] == ".." else int(m[1])
            rows.append((off, m[2], m[3].strip()))
    return rows


def _doc_fields():
    """{name: (offset, format, meaning)} of the fixed-size rows (Q, q, I)."""
    out = {}
    for off, name, rest in _doc_table():
        fmt, _, meaning = rest.partition(" ")
        if off is not None and fmt in SIZES:
            out[name] = (off, fmt, meaning.strip())
    return out


def _doc_row(name):
    (row,) = [r for r in _doc_table() if r[1] == name]
    return row


def test_doc_table_header_fields_match_HEADER_FIELDS():
    doc = {n: (off, "<" + fmt) for n, (off, fmt, meaning) in _doc_fields().items()
           if not meaning.startswith("atomic:")}
    assert doc == L.HEADER_FIELDS


def test_doc_table_counters_match_COUNTERS():
    fields = _doc_fields()
    doc = {n: off for n, (off, fmt, meaning) in fields.items() if meaning.startswith("atomic:")}
    assert doc == L.COUNTERS
    assert all(fields[n][1] == "Q" for n in L.COUNTERS)


def test_doc_table_column_table_matches_COLUMN_STRUCT():
    off, _, rest = _doc_row("column table")
    assert off == L.COLUMN_TABLE
    m = re.match(r"n_columns x (\d+) B: (.+)$", rest)
    assert m, rest
    assert int(m[1]) == L.COLUMN_ENTRY
    parts = [p.strip().split() for p in m[2].split(",")]
    assert [name for name, _ in parts] == ["name", "dtype", "ndim", "shape", "offset",
                                           "row_bytes"]
    assert "<" + "".join(fmt for _, fmt in parts) == L.COLUMN_STRUCT.format
    assert L.COLUMN_STRUCT.size <= L.COLUMN_ENTRY
    assert L.COLUMN_STRUCT.size == 64 + 32 + 8 * (3 + L.MAX_NDIM)


@pytest.mark.parametrize("row, entry, fields", [
    ("writer slots", L.SLOT_ENTRY, L.SLOT_FIELDS),
    ("chunk table", L.CHUNK_ENTRY, L.CHUNK_FIELDS),
])
def test_doc_table_slot_and_chunk_entries(row, entry, fields):
    off, _, rest = _doc_row(row)
    assert off is None
    m = re.match(r"\w+ x (\d+) B, see (\w+)$", rest)
    assert m, rest
    assert int(m[1]) == entry == L.LINE  # one cache line per entry
    assert m[2] == ("SLOT_FIELDS" if fields is L.SLOT_FIELDS else "CHUNK_FIELDS")
    offs = sorted(fields.values())
    assert len(set(offs)) == len(offs)
    assert all(o % 8 == 0 and o + 8 <= entry for o in offs)


def test_doc_table_rows_are_in_offset_order():
    offs = [off for off, _, _ in _doc_table() if off is not None]
    assert offs == sorted(offs) and len(set(offs)) == len(offs)
    assert _doc_table()[0][1] == "magic" and _doc_table()[1][1] == "version"


def test_doc_table_meta_area():
    off, _, rest = _doc_row("meta")
    m = re.match(r"JSON utf-8, at most (\d+) bytes", rest)
    assert m, rest
    assert (off, int(m[1])) == (L.META, L.MAX_META)
    assert f"at {L.META}, or past {L.MAX_META} bytes in the meta room" in \
        _doc_fields()["meta_bytes"][2]
    assert _doc_row("meta room")[2].startswith("JSON metadata longer than")
    assert L.META % L.LINE == 0
    assert max(L.COUNTERS.values()) + L.LINE <= L.META
    assert L.META + L.MAX_META <= L.COLUMN_TABLE


def test_magic_reads_as_documented():
    assert struct.pack("<Q", L.MAGIC) == b"SHMBUF\x00\x01"
    assert L.HEADER_FIELDS["magic"] == (0, "<Q")
    assert L.HEADER_FIELDS["version"][0] == 8


def test_header_fields_do_not_overlap_and_are_aligned():
    spans = sorted((off, off + struct.calcsize(fmt)) for off, fmt in L.HEADER_FIELDS.values())
    for (_a0, a1), (b0, _) in zip(spans, spans[1:]):
        assert a1 <= b0, f"header fields overlap at {b0}"
    for off, fmt in L.HEADER_FIELDS.values():
        assert off % struct.calcsize(fmt) == 0
    header_end = spans[-1][1]
    first_counter = min(L.COUNTERS.values())
    assert header_end <= first_counter
    # The header's last line is not the first counter's line.
    assert (header_end - 1) // L.LINE < first_counter // L.LINE


def test_every_counter_owns_a_cache_line():
    own = {n: off for n, off in L.COUNTERS.items() if n not in L.SHARES_LINE}
    lines = [off // L.LINE for off in own.values()]
    assert all(off % L.LINE == 0 for off in own.values())
    assert len(set(lines)) == len(lines)
    for name, host in L.SHARES_LINE.items():   # a word read with its host, in its line
        assert L.COUNTERS[name] // L.LINE == L.COUNTERS[host] // L.LINE
        assert L.COUNTERS[name] % 8 == 0 and L.COUNTERS[name] != L.COUNTERS[host]
    assert max(L.COUNTERS.values()) + L.LINE <= L.COLUMN_TABLE
    assert L.COLUMN_TABLE % L.LINE == 0 and L.COLUMN_ENTRY % L.LINE == 0


def test_layout_field_helpers_use_the_tables():
    lay = L.plan(SPEC, 100, chunk_size=10, max_writers=3)
    for f, off in L.SLOT_FIELDS.items():
        assert lay.slot_field(2, f) == lay.slots_offset + 2 * L.SLOT_ENTRY + off
    for f, off in L.CHUNK_FIELDS.items():
        assert lay.chunk_field(9, f) == lay.chunks_offset + 9 * L.CHUNK_ENTRY + off


@pytest.mark.slow
@PROPS
@given(seq=st.integers(0, 2**32 - 1), sealed=st.booleans(), slot=st.integers(0, L.NO_SLOT),
       lease=st.integers(0, 2**16 - 1))
def test_chunk_state_round_trip(seq, sealed, slot, lease):
    state = L.pack_chunk_state(seq, sealed, slot, lease)
    assert 0 <= state <= U64
    assert L.unpack_chunk_state(state) == (seq, sealed, slot, lease)


# -- plan() ------------------------------------------------------------------
DTYPES = ["|u1", "|i1", "<i2", "<u2", "<i4", ">i4", "<i8", "<u8", "<f2", "<f4", "<f8",
          "|b1", "<c8", "|S3", "<U2", "<M8[s]"]
names = st.text("abcdefghijklmnopqrstuvwxyz0123456789_", min_size=1, max_size=12).map(
    lambda s: "c" + s if s[0].isdigit() or s[0] == "_" or keyword.iskeyword(s) else s)
shapes = st.lists(st.integers(1, 6), max_size=3).map(tuple)
entries = st.tuples(shapes, st.sampled_from(DTYPES).map(np.dtype))


@st.composite
def plans(draw, max_capacity=10**6):
    spec = draw(st.dictionaries(names, entries, min_size=1, max_size=5))
    if draw(st.booleans()):
        spec["done"] = ((), np.dtype(bool))
    capacity = draw(st.integers(1, max_capacity))
    chunk_size = draw(st.none() | st.integers(1, capacity))
    max_writers = draw(st.integers(1, 300))
    return spec, capacity, chunk_size, max_writers


def done_of(spec):
    """The done_key a spec needs: "done" if it has that column, else an explicit None."""
    return "done" if "done" in spec else None


def check_layout(lay, spec, capacity, chunk_size, max_writers):
    """Every rule plan() promises, from the spec alone."""
    k = L.default_chunk_size(capacity) if chunk_size is None else chunk_size
    assert (lay.capacity, lay.chunk_size, lay.max_writers) == (capacity, k, max_writers)
    assert lay.n_chunks * lay.chunk_size >= capacity > (lay.n_chunks - 1) * lay.chunk_size
    last = lay.n_chunks - 1
    assert lay.chunk_rows(0) == min(k, capacity)
    assert 1 <= lay.chunk_rows(last) <= k
    assert last * k + lay.chunk_rows(last) == capacity
    assert [c.name for c in lay.columns] == list(spec) + list(L.INTERNAL_COLUMNS)
    assert lay.columns[-1].shape == () and lay.columns[-1].dtype == np.dtype("<i8")
    for col in lay.user_columns:
        shape, dtype = spec[col.name]
        assert (col.shape, col.dtype) == (tuple(shape), np.dtype(dtype))
    assert lay.slots_offset == L.COLUMN_TABLE + len(lay.columns) * L.COLUMN_ENTRY
    assert lay.chunks_offset == lay.slots_offset + max_writers * L.SLOT_ENTRY
    end = lay.chunks_offset + lay.n_chunks * L.CHUNK_ENTRY
    for col in lay.columns:
        assert col.row_bytes == math.prod(col.shape) * col.dtype.itemsize
        assert col.offset % L.PAGE == 0
        assert col.offset >= end, f"column {col.name} overlaps what precedes it"
        end = col.offset + col.row_bytes * capacity
    assert end <= lay.total_bytes and lay.total_bytes % L.PAGE == 0
    assert lay.total_bytes - end < L.PAGE
    expect_done = list(spec).index("done") if "done" in spec else -1
    assert lay.done_column == expect_done


@pytest.mark.slow
@PROPS
@given(plans())
def test_plan_properties(case):
    spec, capacity, chunk_size, max_writers = case
    lay = L.plan(spec, capacity, chunk_size=chunk_size, max_writers=max_writers,
                 done_key=done_of(spec))
    check_layout(lay, spec, capacity, chunk_size, max_writers)


@pytest.mark.parametrize("capacity, chunk", [
    (1, 1), (15, 1), (64, 1), (100, 1), (1000, 15), (10_000, 156), (32_767, 511),
    (32_768, 512), (10**6, 512),
])
def test_default_chunk_size(capacity, chunk):
    lay = L.plan(SPEC, capacity)
    assert lay.chunk_size == chunk
    if capacity >= 64:
        assert lay.n_chunks >= 64


def test_small_capacity_gets_small_chunks():
    lay = L.plan(SPEC, 50)
    assert lay.chunk_size < 16 and lay.n_chunks >= 16
    assert lay.chunk_rows(lay.n_chunks - 1) == 50 - (lay.n_chunks - 1) * lay.chunk_size


def test_done_key_rules():
    assert L.plan(SPEC, 10).done_column == 3
    assert L.plan(SPEC, 10, done_key=None).done_column == -1
    assert L.plan(SPEC, 10, done_key="reward").done_column == 2
    no_done = {k: v for k, v in SPEC.items() if k != "done"}
    assert L.plan(no_done, 10, done_key=None).done_column == -1
    with pytest.raises(ValueError, match=r"done_key 'done' is not a column .*done_key=None"):
        L.plan(no_done, 10)   # the default names a column too: only None means none


# -- encode_header -> decode_header ------------------------------------------------
@pytest.mark.slow
@PROPS
@given(plans(), st.integers(0, 2**32), st.integers(0, 2**40), st.integers(0, U64))
def test_header_round_trip(case, pid, start, created):
    spec, capacity, chunk_size, max_writers = case
    lay = L.plan(spec, capacity, chunk_size=chunk_size, max_writers=max_writers,
                 done_key=done_of(spec))
    header = L.encode_header(lay, pid, start, created)
    assert len(header) == lay.slots_offset
    got, owner = L.decode_header(header, lay.total_bytes, "seg")
    assert got == lay
    assert (owner["owner_pid"], owner["owner_start"], owner["created_ns"]) == (pid, start, created)


def test_round_trip_keeps_big_endian_and_string_dtypes():
    spec = {"a": ((2,), ">i4"), "s": ((), "|S7"), "u": ((3,), "<U5"), "t": ((), "<M8[ms]")}
    lay = L.plan(spec, 33, done_key=None)
    got, _ = L.decode_header(L.encode_header(lay, 1, 2, 3), lay.total_bytes, "seg")
    assert got == lay
    assert [c.dtype.str for c in got.user_columns] == [">i4", "|S7", "<U5", "<M8[ms]"]


# -- decode_header rejects what does not add up ------------------------------------------
SMALL = {"obs": ((3, 8, 8), np.uint8), "reward": ((), np.float32), "done": ((), np.bool_)}


def _segment_bytes(spec=SMALL, capacity=64, **kw):
    """A whole (small) segment image with a valid header, and its layout."""
    lay = L.plan(spec, capacity, **{"done_key": done_of(spec), **kw})
    buf = bytearray(lay.total_bytes)
    header = L.encode_header(lay, 1234, 5678, 9)
    buf[:len(header)] = header
    return buf, lay


def _col_off(i, field, dim=0):
    """Byte offset of ``field`` of column table entry ``i``."""
    base = L.COLUMN_TABLE + i * L.COLUMN_ENTRY
    return base + {"name": 0, "dtype": 64, "ndim": 96, "shape": 104 + 8 * dim,
                   "offset": 168, "row_bytes": 176}[field]


def _set_field(buf, field, value):
    off, fmt = L.HEADER_FIELDS[field]
    struct.pack_into(fmt, buf, off, value)


def _decode(buf, size=None, name="seg-x"):
    return L.decode_header(bytes(buf), len(buf) if size is None else size, name)


def test_valid_image_decodes():
    buf, lay = _segment_bytes()
    assert _decode(buf)[0] == lay


@pytest.mark.parametrize("size", [0, 1, 8, 100, L.COLUMN_TABLE - 1])
def test_decode_rejects_too_small(size):
    with pytest.raises(CorruptSegmentError, match=rf"'seg-x'.*{size} bytes"):
        L.decode_header(b"\xff" * size, size, "seg-x")


def test_decode_rejects_wrong_magic():
    buf, _ = _segment_bytes()
    buf[0:8] = b"NOTSHMBF"
    with pytest.raises(CorruptSegmentError, match="'seg-x'.*magic") as info:
        _decode(buf)
    assert not isinstance(info.value, LayoutVersionError)


@pytest.mark.parametrize("version", [0, L.LAYOUT_VERSION + 1, 2**32 - 1])
def test_decode_rejects_wrong_version(version):
    buf, _ = _segment_bytes()
    _set_field(buf, "version", version)
    with pytest.raises(LayoutVersionError) as info:
        _decode(buf)
    msg = str(info.value)
    assert "'seg-x'" in msg
    assert f"version {version}" in msg and f"version {L.LAYOUT_VERSION}" in msg
    assert isinstance(info.value, CorruptSegmentError) and isinstance(info.value, ValueError)


@pytest.mark.parametrize("delta", [-L.PAGE, -1, 1, L.PAGE])
def test_decode_rejects_total_bytes_mismatch(delta):
    buf, lay = _segment_bytes()
    size = lay.total_bytes + delta
    image = bytes(buf[:size]) if delta < 0 else bytes(buf) + bytes(delta)
    with pytest.raises(CorruptSegmentError, match=rf"'seg-x'.*{lay.total_bytes}.*{size}"):
        _decode(image)


def _poke_name(buf, i, raw):
    buf[_col_off(i, "name"):_col_off(i, "name") + 64] = raw.ljust(64, b"\0")


def _poke_dtype(buf, i, raw):
    buf[_col_off(i, "dtype"):_col_off(i, "dtype") + 32] = raw.ljust(32, b"\0")


def _poke_meta(buf, raw):
    buf[L.META:L.META + len(raw)] = raw
    _set_field(buf, "meta_bytes", len(raw))


def _poke_u64(field, i=0, dim=0):
    def poke(buf, value):
        struct.pack_into("<Q", buf, _col_off(i, field, dim), value % 2**64)
    return poke


def _add_u64(field, i=0, dim=0, delta=1):
    def poke(buf):
        old = struct.unpack_from("<Q", buf, _col_off(i, field, dim))[0]
        struct.pack_into("<Q", buf, _col_off(i, field, dim), (old + delta) % 2**64)
    return poke


CORRUPTIONS = {
    "name reserved": lambda b: _poke_name(b, 0, b"_obs"),
    "name keyword": lambda b: _poke_name(b, 0, b"class"),
    "name empty": lambda b: _poke_name(b, 0, b""),
    "name not utf8": lambda b: _poke_name(b, 0, b"\xff\xfe"),
    "name with NUL": lambda b: _poke_name(b, 0, b"ob\0s"),
    "name 64 bytes": lambda b: _poke_name(b, 0, b"o" * 64),
    "dtype object": lambda b: _poke_dtype(b, 1, b"|O"),
    "dtype garbage": lambda b: _poke_dtype(b, 1, b"zz"),
    "dtype empty": lambda b: _poke_dtype(b, 1, b""),
    "dtype structured": lambda b: _poke_dtype(b, 1, b"i2,i2"),
    "dtype subarray": lambda b: _poke_dtype(b, 1, b"(2,)<f2"),
    "dtype zero size": lambda b: _poke_dtype(b, 1, b"|V0"),
    "dtype not utf8": lambda b: _poke_dtype(b, 1, b"\xff"),
    "dtype wider": lambda b: _poke_dtype(b, 1, b"<f8"),
    "ndim 9": lambda b: _poke_u64("ndim")(b, 9),
    "ndim huge": lambda b: _poke_u64("ndim")(b, U64),
    "ndim one less": _add_u64("ndim", delta=-1),
    "ndim one more": _add_u64("ndim"),
    "shape dim 0": lambda b: _poke_u64("shape", dim=1)(b, 0),
    "shape dim +1": _add_u64("shape", dim=2),
    "offset +page": _add_u64("offset", delta=L.PAGE),
    "offset -page": _add_u64("offset", i=1, delta=-L.PAGE),
    "row_bytes +1": _add_u64("row_bytes"),
    "ep name": lambda b: _poke_name(b, 3, b"_eq"),
    "ep dtype": lambda b: _poke_dtype(b, 3, b"<i4"),
    "ep shape": lambda b: _poke_u64("ndim", i=3)(b, 1),
    "t name": lambda b: _poke_name(b, 4, b"_u"),
    "t dtype": lambda b: _poke_dtype(b, 4, b"<u8"),
    "ep and t swapped": lambda b: (_poke_name(b, 3, b"_t"), _poke_name(b, 4, b"_ep")),
    "n_columns 0": lambda b: _set_field(b, "n_columns", 0),
    "n_columns 1": lambda b: _set_field(b, "n_columns", 1),
    "n_columns 3": lambda b: _set_field(b, "n_columns", 3),
    "n_columns 4": lambda b: _set_field(b, "n_columns", 4),
    "n_columns 6": lambda b: _set_field(b, "n_columns", 6),
    "n_columns 65": lambda b: _set_field(b, "n_columns", 65),
    "n_columns max": lambda b: _set_field(b, "n_columns", 2**32 - 1),
    "done index 99": lambda b: _set_field(b, "done_column", 99),
    "done index -2": lambda b: _set_field(b, "done_column", -2),
    "done index of _ep": lambda b: _set_field(b, "done_column", 3),
    "done index of _t": lambda b: _set_field(b, "done_column", 4),
    "done index of obs": lambda b: _set_field(b, "done_column", 0),
    "capacity 0": lambda b: _set_field(b, "capacity", 0),
    "capacity +1": lambda b: _set_field(b, "capacity", 65),
    "capacity huge": lambda b: _set_field(b, "capacity", U64),
    "chunk_size 0": lambda b: _set_field(b, "chunk_size", 0),
    "chunk_size > capacity": lambda b: _set_field(b, "chunk_size", 65),
    "chunk_size other": lambda b: _set_field(b, "chunk_size", 5),
    "n_chunks +1": lambda b: _set_field(b, "n_chunks", 17),
    "max_writers 0": lambda b: _set_field(b, "max_writers", 0),
    "max_writers moves the chunk table": lambda b: _set_field(b, "max_writers", 1000),
    "max_writers huge": lambda b: _set_field(b, "max_writers", U64),
    "kind 2": lambda b: _set_field(b, "kind", 2),
    "kind huge": lambda b: _set_field(b, "kind", U64),
    "meta_bytes too big": lambda b: _set_field(b, "meta_bytes", L.MAX_META + 1),
    "meta_bytes huge": lambda b: _set_field(b, "meta_bytes", U64),
    "meta_bytes 0": lambda b: _set_field(b, "meta_bytes", 0),
    "meta_bytes 1": lambda b: _set_field(b, "meta_bytes", 1),
    "meta not JSON": lambda b: _poke_meta(b, b"{nope"),
    "meta not utf8": lambda b: _poke_meta(b, b'{"\xff": 1}'),
    "meta a list": lambda b: _poke_meta(b, b"[1, 2]"),
    "meta a string": lambda b: _poke_meta(b, b'"hi"'),
}


@pytest.mark.parametrize("corrupt", list(CORRUPTIONS.values()), ids=list(CORRUPTIONS))
def test_decode_rejects_corrupted_entries(corrupt):
    buf, _ = _segment_bytes(chunk_size=4)
    corrupt(buf)
    with pytest.raises(CorruptSegmentError, match="'seg-x'"):
        _decode(buf)


# Bugs found by fuzzing: each input below made decode_header raise something
# other than CorruptSegmentError, or accept a header that does not add up.
@pytest.mark.parametrize("dtype", [b"|01", b",", b",f4", b"<,4"])
def test_decode_rejects_dtype_field_numpy_cannot_parse(dtype):
    """One flipped byte turns b'|u1' into b'|01', which np.dtype answers with SyntaxError."""
    buf, _ = _segment_bytes()
    _poke_dtype(buf, 0, dtype)
    with pytest.raises(CorruptSegmentError, match="'seg-x'"):
        _decode(buf)


def test_decode_rejects_duplicate_column_names():
    """Duplicate names shrink the parsed table, so done_column indexes past its end."""
    spec = {"a": ((), np.float32), "b": ((), np.float32), "c": ((), np.float32),
            "done": ((), np.bool_)}
    buf, lay = _segment_bytes(spec, 64)
    assert lay.done_column == 3
    _poke_name(buf, 1, b"a")
    _poke_name(buf, 2, b"a")
    with pytest.raises(CorruptSegmentError, match="'seg-x'"):
        _decode(buf)


@pytest.mark.parametrize("raw", [b"[" * 1024, b"[" * 512 + b"]" * 512,
                                 b'{"a":' * 200 + b"1" + b"}" * 200],
                         ids=["1024 open brackets", "512 nested lists", "200 nested dicts"])
def test_decode_rejects_deeply_nested_meta(raw):
    """1024 bytes of JSON can nest deeper than json.loads recurses (RecursionError)."""
    buf, _ = _segment_bytes()
    _poke_meta(buf, raw[:L.MAX_META])
    try:
        lay, owner = _decode(buf)
    except CorruptSegmentError as exc:
        assert "'seg-x'" in str(exc)
    else:
        assert isinstance(owner["meta"], dict)


@pytest.mark.parametrize("bit", [62, 63])
def test_decode_rejects_shape_dim_with_a_high_bit_flipped(bit):
    """(3, 8, 8) -> (3, 2**62 + 8, 8): row_bytes wraps to the same 192 in int64."""
    buf, _ = _segment_bytes()
    off = _col_off(0, "shape", dim=1)
    buf[off + 7] ^= 1 << (bit - 56)
    with pytest.raises(CorruptSegmentError, match="'seg-x'"):
        _decode(buf)


# -- fuzz: decode_header never raises anything but CorruptSegmentError -----------------
# Strategies draw small structured values (so a failure prints readably) and the
# tests build the bytes.  Known offenders found this way are pinned above.
def assert_decodes_sanely(buf, size, name="fuzz"):
    """Either a self-consistent Layout, or CorruptSegmentError naming the segment."""
    try:
        lay, owner = L.decode_header(buf, size, name)
    except CorruptSegmentError as exc:
        assert repr(name) in str(exc)
        return None
    assert lay.total_bytes == size
    user = {c.name: (c.shape, c.dtype) for c in lay.user_columns}
    done = lay.columns[lay.done_column].name if lay.done_column >= 0 else None
    assert lay == L.plan(user, lay.capacity, chunk_size=lay.chunk_size,
                         max_writers=lay.max_writers, done_key=done,
                         episode_slots=lay.episode_slots)
    for col in lay.columns:
        assert col.row_bytes == math.prod(col.shape) * col.dtype.itemsize, col
        assert col.offset + col.row_bytes * lay.capacity <= lay.total_bytes, col
    assert {"owner_pid", "owner_start", "created_ns"} <= set(owner)
    return lay


@pytest.mark.slow
@FUZZ
@given(st.binary(max_size=L.COLUMN_TABLE + 600))
def test_fuzz_random_bytes(data):
    assert_decodes_sanely(data, len(data))


u64s = st.one_of(st.integers(0, 16), st.sampled_from([2**31, 2**32 - 1, 2**32, 2**62,
                                                     2**63 - 1, 2**63, U64]),
                 st.integers(0, U64))
DTYPE_FIELDS = st.one_of(st.sampled_from([d.encode() for d in DTYPES]),
                         st.sampled_from([b"|O", b"", b"i4,i4", b"(2,)i4", b"|V0", b"<i8",
                                          b"|u1", b"S", b"U0", b"M8[D]"]),
                         st.binary(max_size=32))
NAME_FIELDS = st.one_of(st.sampled_from([b"obs", b"done", b"_ep", b"", b"\xff", b"class",
                                         b"a" * 64, b"reward"]),
                        st.binary(max_size=64))
column_entries = st.tuples(NAME_FIELDS, DTYPE_FIELDS, st.one_of(st.integers(0, 9), u64s),
                           st.lists(st.one_of(st.integers(1, 8), u64s),
                                    min_size=L.MAX_NDIM, max_size=L.MAX_NDIM),
                           u64s, u64s)
header_values = st.fixed_dictionaries({
    f: (st.integers(-1, 2**63 - 1) if fmt == "<q" else
        u64s.map(lambda v, fmt=fmt: v % (2**32 if fmt == "<I" else 2**64)))
    for f, (_, fmt) in L.HEADER_FIELDS.items()
    if f not in ("magic", "version", "total_bytes")})


@pytest.mark.slow
@FUZZ
@given(head=header_values, columns=st.lists(column_entries, max_size=6),
       extra=st.integers(0, 2 * L.COLUMN_ENTRY),
       meta=st.sampled_from([None, b"{}", b'{"a": [1, 2]}', b"[]", b"{"]))
def test_fuzz_forged_column_tables(head, columns, extra, meta):
    """Correct magic, version and size; everything else hostile."""
    size = L.COLUMN_TABLE + len(columns) * L.COLUMN_ENTRY + extra
    buf = bytearray(size)
    for field, value in head.items():
        _set_field(buf, field, value)
    _set_field(buf, "magic", L.MAGIC)
    _set_field(buf, "version", L.LAYOUT_VERSION)
    _set_field(buf, "total_bytes", size)
    if meta is not None:  # mostly a valid kind and metadata, to reach the columns
        _set_field(buf, "kind", L.KIND_STORE)
        _poke_meta(buf, meta)
        _set_field(buf, "n_columns", len(columns))
    for i, (cname, dtype, ndim, shape, offset, row_bytes) in enumerate(columns):
        L.COLUMN_STRUCT.pack_into(buf, L.COLUMN_TABLE + i * L.COLUMN_ENTRY,
                                  cname, dtype, ndim, *shape, offset, row_bytes)
    assert_decodes_sanely(bytes(buf), size)


small_plans = st.tuples(
    st.dictionaries(names, st.tuples(st.lists(st.integers(1, 4), max_size=2).map(tuple),
                                     st.sampled_from(DTYPES).map(np.dtype)),
                    min_size=1, max_size=3),
    st.booleans(), st.integers(1, 64), st.integers(1, 64), st.integers(1, 8))


def _image(params):
    """(bytearray of a whole valid segment, header length) for ``small_plans``."""
    spec, with_done, capacity, chunk_size, max_writers = params
    if with_done:
        spec = {**spec, "done": ((), np.dtype(bool))}
    lay = L.plan(spec, capacity, chunk_size=min(chunk_size, capacity),
                 max_writers=max_writers, done_key=done_of(spec))
    buf = bytearray(lay.total_bytes)
    header = L.encode_header(lay, 77, 88, 99)
    buf[:len(header)] = header
    return buf, len(header)


@pytest.mark.slow
@FUZZ
@given(small_plans, st.integers(0), st.integers(1, 255))
def test_fuzz_one_byte_changed(params, where, xor):
    buf, header_len = _image(params)
    buf[where % header_len] ^= xor
    assert_decodes_sanely(bytes(buf), len(buf))


@pytest.mark.slow
@FUZZ
@given(small_plans, st.integers(0))
def test_fuzz_one_bit_flipped(params, where):
    buf, header_len = _image(params)
    bit = where % (8 * header_len)
    buf[bit // 8] ^= 1 << (bit % 8)
    assert_decodes_sanely(bytes(buf), len(buf))


@pytest.mark.slow
@FUZZ
@given(small_plans, st.sampled_from(sorted(L.HEADER_FIELDS)), u64s)
def test_fuzz_one_header_field_replaced(params, field, value):
    buf, _ = _image(params)
    off, fmt = L.HEADER_FIELDS[field]
    struct.pack_into("<I" if fmt == "<I" else "<Q", buf, off,
                     value % (2**32 if fmt == "<I" else 2**64))
    assert_decodes_sanely(bytes(buf), len(buf))


@pytest.mark.slow
@FUZZ
@given(small_plans, st.integers(0, 3),
       st.sampled_from(["name", "dtype", "ndim", "shape", "offset", "row_bytes"]),
       st.integers(0, L.MAX_NDIM - 1), st.data())
def test_fuzz_one_column_field_replaced(params, i, field, dim, data):
    buf, _ = _image(params)
    i %= L.read_field(buf, "n_columns")
    if field == "name":
        _poke_name(buf, i, data.draw(NAME_FIELDS, label="name"))
    elif field == "dtype":
        _poke_dtype(buf, i, data.draw(DTYPE_FIELDS, label="dtype"))
    else:
        _poke_u64(field, i, dim)(buf, data.draw(u64s, label="value"))
    assert_decodes_sanely(bytes(buf), len(buf))


# -- argument validation of plan() and create() ---------------------------------------
def _with(**changes):
    spec = dict(SPEC)
    for k, v in changes.items():
        if v is None:
            del spec[k]
        else:
            spec[k] = v
    return spec


def _many_columns(n):
    return {f"c{i}": ((), np.float32) for i in range(n)}


# (id, spec, capacity, keyword arguments, exception, text the message must contain)
BAD_ARGS = [
    ("spec list", [("obs", ((3,), np.uint8))], 10, {}, TypeError, "spec"),
    ("spec None", None, 10, {}, TypeError, "spec"),
    ("spec empty", {}, 10, {}, TypeError, "spec"),
    ("spec too many columns", _many_columns(63), 10, {}, ValueError, "spec"),
    ("entry not a pair", _with(obs=((3, 8, 8),)), 10, {}, TypeError, "spec['obs']"),
    ("entry a string", _with(obs="uint8"), 10, {}, TypeError, "spec['obs']"),
    ("entry a triple", _with(obs=((3,), np.uint8, 1)), 10, {}, TypeError, "spec['obs']"),
    ("name leading underscore", {"_obs": ((), np.uint8)}, 10, {}, ValueError, "'_obs'"),
    ("name _ep", {"_ep": ((), np.int64)}, 10, {}, ValueError, "'_ep'"),
    ("name keyword", {"class": ((), np.uint8)}, 10, {}, ValueError, "'class'"),
    ("name too long", {"a" * 64: ((), np.uint8)}, 10, {}, ValueError, "63 bytes"),
    ("name too long utf8", {"\u00e9" * 32: ((), np.uint8)}, 10, {}, ValueError, "63 bytes"),
    ("name not identifier", {"ob s": ((), np.uint8)}, 10, {}, ValueError, "'ob s'"),
    ("name digit first", {"1obs": ((), np.uint8)}, 10, {}, ValueError, "'1obs'"),
    ("name empty", {"": ((), np.uint8)}, 10, {}, ValueError, "spec"),
    ("name not str", {5: ((), np.uint8)}, 10, {}, ValueError, "spec"),
    ("dtype object", _with(obs=((3,), object)), 10, {}, TypeError, "spec['obs']"),
    ("dtype structured", _with(obs=((3,), "i4,i4")), 10, {}, TypeError, "spec['obs']"),
    ("dtype subarray", _with(obs=((3,), "(2,)i4")), 10, {}, TypeError, "spec['obs']"),
    ("dtype zero size", _with(obs=((3,), "S0")), 10, {}, TypeError, "spec['obs']"),
    ("dtype unknown", _with(obs=((3,), "notadtype")), 10, {}, TypeError, "spec['obs']"),
    ("dtype numpy SyntaxError", _with(obs=((3,), ",")), 10, {}, TypeError, "spec['obs']"),
    ("dtype numpy ValueError", _with(obs=((3,), "(99999999999,99999999999)i1")), 10, {},
     TypeError, "spec['obs']"),
    ("shape zero dim", _with(obs=((3, 0), np.uint8)), 10, {}, ValueError, "spec['obs']"),
    ("shape negative dim", _with(obs=((-3,), np.uint8)), 10, {}, ValueError, "spec['obs']"),
    ("shape float dim", _with(obs=((3.0,), np.uint8)), 10, {}, TypeError, "spec['obs']"),
    ("shape bool dim", _with(obs=((True,), np.uint8)), 10, {}, TypeError, "spec['obs']"),
    ("shape None", _with(obs=(None, np.uint8)), 10, {}, TypeError, "spec['obs']"),
    ("shape 9 dims", _with(obs=((1,) * 9, np.uint8)), 10, {}, ValueError, "spec['obs']"),
    ("capacity 0", SPEC, 0, {}, ValueError, "capacity"),
    ("capacity negative", SPEC, -5, {}, ValueError, "capacity"),
    ("capacity huge", SPEC, 2**40 + 1, {}, ValueError, "capacity"),
    ("capacity 2**64", SPEC, 2**64, {}, ValueError, "capacity"),
    ("capacity float", SPEC, 10.0, {}, TypeError, "capacity"),
    ("capacity bool", SPEC, True, {}, TypeError, "capacity"),
    ("capacity str", SPEC, "10", {}, TypeError, "capacity"),
    ("capacity None", SPEC, None, {}, TypeError, "capacity"),
    ("chunk_size > capacity", SPEC, 10, {"chunk_size": 11}, ValueError, "chunk_size"),
    ("chunk_size 0", SPEC, 10, {"chunk_size": 0}, ValueError, "chunk_size"),
    ("chunk_size negative", SPEC, 10, {"chunk_size": -1}, ValueError, "chunk_size"),
    ("chunk_size float", SPEC, 10, {"chunk_size": 2.0}, TypeError, "chunk_size"),
    ("chunk_size bool", SPEC, 10, {"chunk_size": True}, TypeError, "chunk_size"),
    ("max_writers 0", SPEC, 10, {"max_writers": 0}, ValueError, "max_writers"),
    ("max_writers huge", SPEC, 10, {"max_writers": L.NO_SLOT}, ValueError, "max_writers"),
    ("max_writers bool", SPEC, 10, {"max_writers": True}, TypeError, "max_writers"),
    ("done_key missing", SPEC, 10, {"done_key": "terminal"}, ValueError, "done_key"),
    ("done_key non-scalar", SPEC, 10, {"done_key": "obs"}, ValueError, "done_key"),
    ("done_key non-scalar 2", SPEC, 10, {"done_key": "action"}, ValueError, "done_key"),
    ("done_key internal", SPEC, 10, {"done_key": "_ep"}, ValueError, "done_key"),
]
# Shapes whose byte count does not fit in int64: plan() used to wrap them
# silently (to 0, -1 or a negative size) and return a nonsense layout.
HUGE_SHAPES = [
    ("shape 2**62 x 4", _with(obs=((2**62, 4), np.uint8)), 10, {}, ValueError, "spec['obs']"),
    ("shape 2**63", _with(obs=((2**63,), np.uint8)), 10, {}, ValueError, "spec['obs']"),
    ("shape 2**64-1", _with(obs=((2**64 - 1,), np.uint8)), 10, {}, ValueError, "spec['obs']"),
    ("shape 2**40 x 2**40", _with(obs=((2**40, 2**40), np.uint8)), 10, {}, ValueError,
     "spec['obs']"),
]


def _ids(rows):
    return [r[0] for r in rows]


@pytest.mark.parametrize("case, spec, capacity, kw, exc, text", BAD_ARGS + HUGE_SHAPES,
                         ids=_ids(BAD_ARGS + HUGE_SHAPES))
def test_plan_rejects_bad_arguments(case, spec, capacity, kw, exc, text):
    with pytest.raises(exc) as info:
        L.plan(spec, capacity, **kw)
    assert text in str(info.value)


@pytest.mark.parametrize("case, spec, capacity, kw, exc, text", BAD_ARGS + HUGE_SHAPES,
                         ids=_ids(BAD_ARGS + HUGE_SHAPES))
def test_create_rejects_bad_arguments_and_leaves_nothing(case, spec, capacity, kw, exc, text):
    before = own_entries()
    with pytest.raises(exc) as info:
        shmbuf.create(spec, capacity, **kw).close()
    assert text in str(info.value)
    assert own_entries() == before


@pytest.mark.parametrize("name, exc", [
    ("a/b", ValueError), ("/abc", ValueError), ("a\0b", ValueError), ("x" * 201, ValueError),
    ("", ValueError), (".hidden", ValueError), ("a b", ValueError), (5, TypeError),
])
def test_create_rejects_bad_name_and_leaves_nothing(name, exc):
    before = own_entries()
    with pytest.raises(exc, match="name"):
        shmbuf.create(SPEC, 10, name=name).close()
    assert own_entries() == before


def test_boundary_arguments_are_accepted():
    L.plan({"a" * 63: ((), np.uint8)}, 1, done_key=None)
    L.plan(_many_columns(L.MAX_COLUMNS - len(L.INTERNAL_COLUMNS)), 2**40, chunk_size=2**40,
           max_writers=L.NO_SLOT - 1, done_key=None)
    L.plan({"obs": ((1,) * L.MAX_NDIM, np.uint8)}, 1, chunk_size=1, done_key=None)
    L.plan({"obs": (np.array([3, 4]), np.uint8)}, 5, done_key=None)  # any int sequence
    L.plan({"obs": (7, np.uint8)}, 5, done_key=None)                  # a bare int: 1-d


# -- one owner for the protocol ---------------------------------------------------
PROTOCOL_PACKAGE = "protocol/"  # the one package that loads and stores shared words


def _imports_of(path):
    import ast

    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.module:
                yield node.module.lstrip(".")
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names)


def test_only_the_protocol_modules_import_atomic():
    import pathlib

    root = pathlib.Path(shmbuf.__file__).parent
    users = {p.relative_to(root).with_suffix("").as_posix() for p in root.rglob("*.py")
             if any(name in ("_atomic", "shmbuf.protocol._atomic") or name.endswith("._atomic")
                    for name in _imports_of(p))}
    outside = sorted(u for u in users if not u.startswith(PROTOCOL_PACKAGE))
    assert outside == [], f"{outside} import _atomic"
    assert "protocol/ring" in users and "protocol/keyed" in users


def test_c_reads_the_chunk_fields_that_layout_defines():
    from shmbuf.protocol import _window_check
    from shmbuf.protocol.ring import Ring

    lay = L.plan({"x": ((), np.float32)}, 100, chunk_size=10, done_key=None)
    mm = bytearray(lay.total_bytes)
    read = _window_check.read_geometry(Ring(memoryview(mm), lay).geometry, mm)
    assert read["entry_bytes"] == L.CHUNK_ENTRY
    for field in ("state", "count", "next", "next_seq", "starts", "ticket"):
        assert read[f"entry_{field}"] == L.CHUNK_FIELDS[field]
    assert read["starts_bits"] == L.STARTS_BITS  # the width of a row offset in the starts word
    assert L.STARTS_UNTRACKED == 2**64 - 1 and 2 * L.STARTS_BITS + 2 == 64


def test_c_refuses_a_geometry_whose_fields_leave_the_entry():
    from shmbuf.protocol import _window_check
    from shmbuf.protocol.geometry import geometry_of, pack

    lay = L.plan({"x": ((), np.float32)}, 100, chunk_size=10, done_key=None)
    mm = bytearray(lay.total_bytes)
    good = geometry_of(lay)
    ok = np.zeros(1, np.bool_)
    for bad in ({"entry_state": L.CHUNK_ENTRY}, {"entry_bytes": 4}, {"entry_next": 3}):
        with pytest.raises(ValueError, match="geometry"):
            _window_check.unchanged(mm, pack({**good, **bad}), np.zeros((1, 1), np.int64),
                               np.zeros((1, 1), np.int64), 1, ok)
