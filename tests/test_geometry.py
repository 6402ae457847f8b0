"""The geometry the C extensions read: one named table (protocol.geometry) that C and
Python agree on field by field, and that refuses a wrong or missing field loudly."""
import struct

import numpy as np
import pytest

from shmbuf.protocol import _atomic, _prio, _rows, _window_check
from shmbuf.protocol import layout as L
from shmbuf.protocol.geometry import geometry_of, pack

EXTENSIONS = (_atomic, _window_check, _prio, _rows)


def _layout(priorities=False):
    return L.plan({"x": ((), np.float32)}, 100, chunk_size=10, done_key=None,
                  priorities=priorities)


@pytest.fixture(params=[False, True], ids=["plain", "priorities"])
def lay(request):
    return _layout(request.param)


def test_every_extension_compiles_the_same_struct():
    fields = _atomic.GEOMETRY_FIELDS
    for ext in EXTENSIONS:
        assert ext.GEOMETRY_FIELDS == fields, ext.__name__
        assert ext.GEOMETRY_SIZE == _atomic.GEOMETRY_SIZE
        assert ext.GEOMETRY_MAGIC == _atomic.GEOMETRY_MAGIC
    # The table tiles the struct: no gap, no overlap, nothing outside it.
    end = 0
    for name, offset, fmt, count in fields:
        assert offset == end, name
        end = offset + struct.calcsize(f"<{count}{fmt}")
    assert end == _atomic.GEOMETRY_SIZE
    assert len({f[0] for f in fields}) == len(fields)


def test_python_names_every_field_that_c_declares(lay):
    c_names = {f[0] for f in _atomic.GEOMETRY_FIELDS} - {"magic"}
    assert set(geometry_of(lay)) == c_names


def test_each_extension_reads_every_field_as_python_packed_it(lay):
    named = geometry_of(lay)
    mm = bytearray(lay.total_bytes)
    for ext in EXTENSIONS:
        read = ext.read_geometry(pack(named), mm)
        assert read.pop("magic") == _atomic.GEOMETRY_MAGIC
        assert read == named, ext.__name__


def test_the_named_geometry_is_the_layout():
    lay = _layout(priorities=True)
    g = geometry_of(lay)
    assert (g["chunks_at"], g["n_chunks"], g["chunk_size"], g["capacity"]) == (
        lay.chunks_offset, lay.n_chunks, lay.chunk_size, lay.capacity)
    assert g["entry_bytes"] == L.CHUNK_ENTRY
    assert {f: g[f"entry_{f}"] for f in ("state", "count", "next", "next_seq", "starts",
                                          "ticket")} == {
        f: L.CHUNK_FIELDS[f] for f in ("state", "count", "next", "next_seq", "starts", "ticket")}
    assert g["ep_at"] == lay.column(L.EP_COLUMN).offset
    assert g["prio_rows_at"] == lay.column(L.PRIORITY_COLUMN).offset
    for word in ("ticket", "clock", "closed", "replayed"):
        assert g[word] == L.COUNTERS[word]
    assert g["prio_max"] == L.COUNTERS["max_priority"]
    for f in ("flags", "ratio", "min_steps", "tolerance", "base"):
        assert g[f"rate_{f}"] == L.COUNTERS["rate"] + L.RATE_FIELDS[f]
    # The state word's slot field, as the Python side packs it.
    state = L.pack_chunk_state(3, False, 5, 7)
    assert (state >> g["slot_shift"]) & 0x7FFF == 5 and g["no_slot"] == L.NO_SLOT
    assert g["n_trees"] == len(lay.priority_trees) >= 1
    max_levels = dict((f[0], f[3]) for f in _atomic.GEOMETRY_FIELDS)["level_nodes"]
    for t, (exponent, levels) in enumerate(lay.priority_trees):
        assert g["tree_exponent"][t] == exponent
        assert g["n_levels"] == len(levels)
        for d, (at, n) in enumerate(levels):
            assert g["tree_level_at"][t * max_levels + d] == at
            assert g["level_nodes"][d] == n


def test_a_missing_or_unknown_field_is_named():
    good = geometry_of(_layout())
    missing = dict(good)
    del missing["entry_count"]
    with pytest.raises(ValueError, match=r"missing fields \['entry_count'\]"):
        pack(missing)
    with pytest.raises(ValueError, match=r"unknown fields \['entry_cuont'\]"):
        pack({**good, "entry_cuont": 8})
    with pytest.raises(ValueError, match=r"unknown fields \['magic'\]"):
        pack({**good, "magic": 1})


@pytest.mark.parametrize("field, value", [
    ("chunk_size", 10.5),                    # not an integer
    ("entry_count", "8"),
    ("chunks_at", 2**63),                    # outside int64
    ("tree_exponent", (1.0,)),               # an array of the wrong length
    ("level_nodes", 3),
])
def test_a_value_that_does_not_fit_its_field_is_named(field, value):
    with pytest.raises(ValueError, match=f"geometry field '{field}'"):
        pack({**geometry_of(_layout()), field: value})


def test_c_refuses_what_pack_did_not_make():
    lay = _layout(priorities=True)
    mm = bytearray(lay.total_bytes)
    good = pack(geometry_of(lay))
    old_tuple = (lay.chunks_offset, lay.n_chunks, lay.chunk_size, lay.capacity)
    for ext in EXTENSIONS:
        with pytest.raises(TypeError, match="geometry must be the .* bytes"):
            ext.read_geometry(old_tuple, mm)
        with pytest.raises(ValueError, match="geometry must be the .* bytes"):
            ext.read_geometry(good[:-8], mm)
        with pytest.raises(ValueError, match="wrong magic"):
            ext.read_geometry(b"\0" * 8 + good[8:], mm)
        with pytest.raises(ValueError, match="does not fit the buffer"):
            ext.read_geometry(good, mm[:lay.chunks_offset])
    with pytest.raises(TypeError, match="geometry must be"):
        _prio.mass(mm, old_tuple, 0, 1.0)
    with pytest.raises(ValueError, match="geometry"):
        _window_check.seek(mm, good[:-8], *(np.zeros(1, np.int64),) * 5)


def test_each_extension_checks_the_fields_it_reads():
    lay = _layout(priorities=True)
    mm = bytearray(lay.total_bytes)
    good = geometry_of(lay)
    bad_entry = pack({**good, "entry_ticket": L.CHUNK_ENTRY})
    bad_clock = pack({**good, "clock": lay.total_bytes})
    bad_tree = pack({**good, "level_nodes": (1,) + good["level_nodes"][1:]})
    for call in (lambda g: _window_check.seek(mm, g, *(np.zeros(1, np.int64),) * 5),
                 lambda g: _prio.mass(mm, g, 0, 1.0),
                 lambda g: _atomic.RateGate(mm, g)):
        for bad in (bad_entry, bad_clock):
            with pytest.raises(ValueError, match="geometry"):
                call(bad)
    with pytest.raises(ValueError, match="priority geometry"):
        _prio.mass(mm, bad_tree, 0, 1.0)
    with pytest.raises(ValueError, match="priority geometry"):   # a store without priorities
        _prio.mass(mm, pack(geometry_of(_layout())), 0, 1.0)


def test_the_appender_takes_its_arguments_by_name():
    lay = _layout()
    mm = bytearray(lay.total_bytes)
    n = np.zeros(1, np.int64)
    cap = np.zeros(lay.capacity, np.int64)
    kw = dict(names=("x",), views=(np.zeros(lay.capacity, np.float32),), ep_view=cap,
              t_view=cap.copy(), done=-1, fill=n, base=n.copy(), rows=n.copy(),
              count_off=n.copy(), ep=n.copy(), left=n.copy(), steps_off=0)
    geometry = pack(geometry_of(lay))
    assert isinstance(_atomic.Appender(mm, geometry, **kw), _atomic.Appender)
    for name in kw:
        with pytest.raises(TypeError, match=f"missing keyword argument '{name}'"):
            _atomic.Appender(mm, geometry, **{k: v for k, v in kw.items() if k != name})
    with pytest.raises(TypeError):
        _atomic.Appender(mm, geometry, *kw.values())           # never by position
    with pytest.raises(ValueError, match="geometry"):
        _atomic.Appender(mm, pack({**geometry_of(lay), "closed": 3}), **kw)
