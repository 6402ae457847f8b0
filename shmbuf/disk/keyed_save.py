"""Save keyed rings (a HistoryBuffer's) to disk while workers append, and open the save.

A save is a directory like a step store's (``disk.save``), readable by numpy alone:

  manifest.json   {"format": "shmbuf-save", "version": 1, "kind": "keyed", "rows": n,
                   "n_keys": k, "max_len": m, "spec": {column: {"shape": [...],
                   "dtype": "<f4"}}, "meta": the rings' meta (a HistoryBuffer's
                   "facade", "params" and "keys"), "source", "saved_ns"}
  COLUMN.npy      one per column: (n, *shape), every key's live entries, key 0
                  first, each key oldest first (``KeyedRings.snapshot``'s order)
  _lengths.npy    (k,) int64: how many of the rows belong to each key (they add up to n)

Key ``k``'s entries are rows ``lengths[:k].sum()`` on, ``lengths[k]`` of
them; ``np.load("save/k0.npy", mmap_mode="r")`` maps a column without
reading it (a HistoryBuffer's columns ``k0, k1, ...`` are its keys in the
order of ``meta["keys"]``).

While workers append: the keys are copied a group at a time, each group as
``read`` copies (validated against concurrent appends, retried when
lapped), and written out before the next group is copied.  So a save holds
at most ``GROUP_BYTES`` of entries in memory (or one key's ``max_len``
entries, if more), never the whole buffer again; each key's entries are
whole and consecutive, and different groups are copied at slightly
different moments.  ``manifest.json`` is written last, through a rename.
"""
from __future__ import annotations

import os
import time

import numpy as np

from ..protocol.layout import normalize_spec
from .save import _Column, _prepare_dir, _write_manifest
from .saved import FORMAT, VERSION, bad_save, open_column, read_json, saved_by

KIND = "keyed"
LENGTHS = "_lengths"
GROUP_BYTES = 1 << 24  # entries copied at once while saving


def save(rings, path, *, overwrite: bool = False, durable: bool = False) -> int:
    """Write the live entries of keyed ``rings`` to the directory ``path``; return how many.

    Raises SaveExistsError as ``Buffer.save`` (``overwrite``); ``durable``
    fsyncs the files before the manifest names them.
    """
    path = os.fspath(path)
    spec = rings.spec
    _prepare_dir(path, overwrite)
    columns = {name: _Column(os.path.join(path, name + ".npy"), dtype, shape)
               for name, (shape, dtype) in spec.items()}
    lengths_file = _Column(os.path.join(path, LENGTHS + ".npy"), np.int64, ())
    files = [*columns.values(), lengths_file]
    try:
        entry = sum(int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
                    for shape, dtype in spec.values())
        group = max(1, GROUP_BYTES // max(1, entry * rings.max_len))
        rows = 0
        for first in range(0, rings.n_keys, group):
            keys = np.arange(first, min(first + group, rings.n_keys), dtype=np.int64)
            lengths, entries = rings.snapshot(keys)
            for name, column in columns.items():
                column.write(rows, entries[name])
            lengths_file.write(first, lengths)
            rows += int(lengths.sum())
        for column in columns.values():
            column.commit(rows)
        lengths_file.commit(rings.n_keys)
        if durable:
            for file in files:
                file.sync()
    finally:
        for file in files:
            file.close()
    _write_manifest(path, {
        "format": FORMAT, "version": VERSION, "kind": KIND, "rows": rows,
        "n_keys": rings.n_keys, "max_len": rings.max_len,
        "spec": {name: {"shape": list(shape), "dtype": dtype.str}
                 for name, (shape, dtype) in spec.items()},
        "meta": rings.meta, "source": rings.name, "saved_ns": time.time_ns()}, durable)
    return rows


def open_save(path, made_by: str) -> tuple[dict, np.ndarray, dict[str, np.ndarray]]:
    """``(manifest, lengths, {column: entries})`` of a save made by ``made_by``, memory-mapped.

    ``made_by``: the ``facade`` its meta must name.  Every file is checked
    against the manifest before anything is returned.

    Raises:
        FileNotFoundError: no directory at ``path``.
        CorruptSaveError: not a save of keyed rings made by ``made_by`` (the
            message names who made it), or incomplete, truncated or tampered with.
    """
    manifest = read_json(path)
    meta = manifest.get("meta")
    if manifest.get("kind") != KIND or not isinstance(meta, dict) or meta.get("facade") != made_by:
        raise bad_save(path, f"it was saved by {saved_by(manifest)}, not by a {made_by}; "
                         "load it with that class's load, or shmbuf.load")
    for key, least in (("rows", 0), ("n_keys", 1), ("max_len", 1)):
        value = manifest.get(key)
        if type(value) is not int or value < least:
            raise bad_save(path, f"manifest field {key!r} is {value!r}")
    try:
        spec = normalize_spec({k: (tuple(v["shape"]), v["dtype"])
                               for k, v in manifest["spec"].items()})
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        raise bad_save(path, f"its schema is invalid ({exc!r})") from None
    manifest["spec"] = spec
    rows, n_keys, max_len = manifest["rows"], manifest["n_keys"], manifest["max_len"]
    lengths = np.array(open_column(path, LENGTHS, np.dtype(np.int64), (), n_keys))
    if (lengths < 0).any() or (lengths > max_len).any() or int(lengths.sum()) != rows:
        raise bad_save(path, f"{LENGTHS}.npy does not give {n_keys} keys 0 to {max_len} entries "
                         f"adding up to the manifest's {rows} rows")
    columns = {name: open_column(path, name, dtype, shape, rows)
               for name, (shape, dtype) in spec.items()}
    return manifest, lengths, columns


def holds_keyed(path) -> bool:
    """True if the save at ``path`` is one of keyed rings (the manifest says so)."""
    return read_json(path).get("kind") == KIND
