"""A save on disk: its format, and reading it back for ``load``.

A save (written by ``disk.save``) is a directory that numpy alone can read:

  manifest.json   {"format": "shmbuf-save", "version": 1, "rows": n, "following": bool,
                   "spec": {column: {"shape": [...], "dtype": "<f4"}}, "done_key",
                   "capacity", "chunk_size", "meta", "source", "saved_ns"}
  COLUMN.npy      one per column: (n, *shape), the steps in the order below
  _stream.npy     (n,) int64: the stream of each step (a new id where a stream has a gap)
  _episode.npy    (n,) int64: the episode number of each step within its stream
  _ends.npy       (n,) int64: where a finished episode ends, the number it had in the
                  buffer's episode index (the order episodes ended), else -1
  _chunks.npy     (c,) int64: the first row of each saved chunk, in claim order
  _priorities.npy (n,) float32, buffers with priorities only: the priority set for each
                  step, NaN where none was (the manifest's "max_priority" is the largest
                  ever set, null if none)
  _tickets.npy    (c,) int64, buffers with priorities only (the manifest says "tickets":
                  true): the claim ticket each saved chunk's step ids name it by
                  (``shmbuf.protocol.stepids``), so that ``load`` can keep those ids
  _packed.npy     (m, 6) int64, buffers created with ``compress=`` only: one entry per
                  compressed block saved as it was in shared memory: (column's index in
                  the spec, first row, rows, byte offset in _blocks.npy, bytes, CRC-32
                  of those bytes); saves made before the CRC have 5 fields
  _blocks.npy     (b,) uint8: those blocks, back to back

A compressing buffer's chunks that are compressed in shared memory are saved
as they are: their blocks are copied to ``_blocks.npy`` (no decode, no
encode) and their rows in ``COLUMN.npy`` are left unwritten (holes, which a
file system stores as nothing, and numpy reads as zeros).  Such a save says
``"version": 2`` and names the codec under ``"packed"``, so a shmbuf that
reads only version 1 refuses it instead of loading zeros; a save with no
compressed block (every save of a buffer without ``compress=``) is version 1,
as before.  ``load`` checks every block's CRC and puts the blocks back into
the new buffer's chunks as they are, decoding only those it cannot keep
(``disk.blocks``).

``np.load("save/obs.npy", mmap_mode="r")`` maps a column without reading it.
Why this format: it is columnar like the buffer, so saving is one write per
chunk and column straight from shared memory, with no copy and no pickle;
``.npy`` is the one format every numpy reads, mmap-able, so loading (or
inspecting) a save larger than RAM works; and appending rows changes only a
fixed-size header, which the incremental mode rewrites in place.  (An
``.npz`` is a zip: no mmap for compressed members, and appending means
rewriting its directory.  HDF5 or torch.save would add a dependency or a
pickle.)

"""
from __future__ import annotations

import json
import os

import numpy as np

from .._errors import CorruptSaveError
from ..protocol.layout import normalize_spec
from .blocks import SavedBlocks
from .checkpoint import FORMAT as STATE_FORMAT

FORMAT, VERSION = "shmbuf-save", 1
PACKED_VERSION = 2  # a save holding compressed blocks (_packed.npy, _blocks.npy)
MANIFEST = "manifest.json"
STREAM, EPISODE, ENDS, CHUNKS = "_stream", "_episode", "_ends", "_chunks"
PRIORITIES, TICKETS = "_priorities", "_tickets"
PACKED, BLOCKS = "_packed", "_blocks"
ENTRY_FIELDS = 6    # of a _packed.npy entry (5 in saves made before the CRC)


# -- reading -------------------------------------------------------------------------
def bad_save(path, why: str) -> CorruptSaveError:
    """The error for a save at ``path`` that cannot be used, saying ``why``."""
    return CorruptSaveError(f"{os.fspath(path)!r} is not a usable shmbuf save: {why}")


def read_json(path) -> dict:
    """The manifest of the save at ``path``, of this format and version; not checked further.

    Raises FileNotFoundError (no directory) or CorruptSaveError.
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(2, f"no shmbuf save at {path!r} (not a directory)")
    try:
        with open(os.path.join(path, MANIFEST), "rb") as f:
            manifest = json.loads(f.read(1 << 20).decode())
    except FileNotFoundError:
        raise bad_save(path, f"it has no {MANIFEST} (a save that never finished?)") from None
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise bad_save(path, f"{MANIFEST} is not readable JSON ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise bad_save(path, f"{MANIFEST} is not a {FORMAT!r} manifest")
    if manifest.get("version") not in (VERSION, PACKED_VERSION):
        raise bad_save(path, f"it has save format version {manifest.get('version')!r} but this "
                         f"shmbuf reads versions {VERSION} and {PACKED_VERSION}")
    return manifest


def saved_by(manifest: dict) -> str:
    """Who made the save of ``manifest``: a facade's name, or the plain kind."""
    meta = manifest.get("meta")
    made_by = meta.get("facade") if isinstance(meta, dict) else None
    if made_by:
        return str(made_by)
    return "plain keyed rings" if manifest.get("kind") else "a plain shmbuf Buffer"


def read_manifest(path) -> dict:
    """The checked manifest of a step store's save at ``path``; CorruptSaveError if off."""
    manifest = read_json(path)
    if manifest.get("kind") is not None:
        raise bad_save(path, f"it was saved by {saved_by(manifest)} (kind "
                         f"{manifest['kind']!r}), not by a step store; load it with that "
                         "class's load, or shmbuf.load")
    for key, kind in (("rows", int), ("chunks", int), ("capacity", int), ("chunk_size", int),
                      ("meta", dict), ("spec", dict)):
        value = manifest.get(key)
        if not isinstance(value, kind) or isinstance(value, bool) or (
                kind is int and value < (0 if key in ("rows", "chunks") else 1)):  # type: ignore[operator]  # an int
            raise bad_save(path, f"manifest field {key!r} is {value!r}")
    try:
        manifest["spec"] = normalize_spec({k: (tuple(v["shape"]), v["dtype"])
                                           for k, v in manifest["spec"].items()})
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        raise bad_save(path, f"its schema is invalid ({exc})") from None
    done = manifest.get("done_key")
    if done is not None and (done not in manifest["spec"] or manifest["spec"][done][0] != ()):
        raise bad_save(path, f"done_key {done!r} is not a scalar column of its schema")
    return manifest


def open_column(path, name: str, dtype: np.dtype, shape: tuple, rows: int,
                 mode: str = "r") -> np.ndarray:
    """``rows`` rows of ``name``.npy, memory-mapped (``mode``: "r", or "c" copy-on-write),
    after checking its header and size."""
    file = os.path.join(os.fspath(path), name + ".npy")
    try:
        with open(file, "rb") as f:
            version = np.lib.format.read_magic(f)
            header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                      else np.lib.format.read_array_header_2_0)
            got_shape, fortran, got_dtype = header(f)
            offset = f.tell()
        size = os.path.getsize(file)
    except FileNotFoundError:
        raise bad_save(path, f"{name}.npy is missing") from None
    except (OSError, ValueError, SyntaxError, TypeError) as exc:
        raise bad_save(path, f"{name}.npy is not a readable .npy file ({exc})") from None
    if got_dtype != dtype or fortran or tuple(got_shape[1:]) != shape or not got_shape:
        raise bad_save(path, f"{name}.npy holds {got_dtype} {tuple(got_shape)}, but the manifest "
                         f"says {dtype} (n, *{shape}): the schema does not match")
    need = offset + rows * dtype.itemsize * int(np.prod(shape, dtype=np.int64))
    if got_shape[0] < rows or size < need:
        raise bad_save(path, f"{name}.npy is truncated: it holds {got_shape[0]} rows in {size} "
                         f"bytes, the manifest names {rows} ({need} bytes)")
    if rows == 0:
        return np.empty((0,) + shape, dtype)
    return np.memmap(file, dtype, mode, offset, (rows,) + shape)  # type: ignore[call-overload]  # "r" or "c"


def _packed_entries(path, manifest: dict) -> np.ndarray:
    """The checked ``(m, 6)`` (or, saved before the CRC, ``(m, 5)``) entries of a version 2
    save's compressed blocks (else none)."""
    if manifest["version"] != PACKED_VERSION:
        return np.empty((0, ENTRY_FIELDS), np.int64)
    info = manifest.get("packed")
    ok = isinstance(info, dict) and all(
        isinstance(info.get(k), int) and not isinstance(info.get(k), bool) and info[k] >= 0
        for k in ("blocks", "bytes", "block_rows"))
    if not ok or not isinstance(info.get("codec"), str):   # type: ignore[union-attr]
        raise bad_save(path, f"manifest field 'packed' is {info!r}")
    assert isinstance(info, dict)
    from ..sampling.codec import CODECS
    if info["codec"] not in CODECS:
        raise bad_save(path, f"its blocks use codec {info['codec']!r}, which this shmbuf does not "
                         f"know (it knows {sorted(CODECS)})")
    width = _entry_width(path)
    table = open_column(path, PACKED, np.dtype(np.int64), (width,), info["blocks"])
    col, first, n, off, length = (table[:, i] for i in range(5))
    if len(table) and ((col < 0).any() or (col >= len(manifest["spec"])).any()
                       or (first < 0).any() or (n <= 0).any()
                       or (first + n > manifest["rows"]).any() or (off < 0).any()
                       or (length < 0).any() or (off + length > info["bytes"]).any()):
        raise bad_save(path, f"{PACKED}.npy names blocks outside the rows or outside "
                         f"{BLOCKS}.npy")
    return np.asarray(table)


def _entry_width(path) -> int:
    """The fields of an entry of ``_packed.npy``: 6, or 5 in a save made before the CRC."""
    try:
        with open(os.path.join(os.fspath(path), PACKED + ".npy"), "rb") as f:
            version = np.lib.format.read_magic(f)
            header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                      else np.lib.format.read_array_header_2_0)
            shape = header(f)[0]
    except (OSError, ValueError, SyntaxError, TypeError):
        return ENTRY_FIELDS   # _open_column says what is wrong with it
    return 5 if tuple(shape[1:]) == (5,) else ENTRY_FIELDS


def open_save(path) -> tuple[dict, dict]:
    """(manifest, state): the save as ``Buffer.restore`` takes it, memory-mapped."""
    manifest = read_manifest(path)
    rows = manifest["rows"]
    packed = _packed_entries(path, manifest)
    names = list(manifest["spec"])
    unpacked = {names[i] for i in np.unique(packed[:, 0]).tolist()}
    # A column with compressed blocks is mapped copy-on-write: the blocks that are decoded
    # (not kept compressed) write only the rows they fill (in private memory), and the
    # file stays as it is.
    columns = {k: open_column(path, k, dt, shape, rows, "c" if k in unpacked else "r")
               for k, (shape, dt) in manifest["spec"].items()}
    saved = None
    if len(packed):
        info = manifest["packed"]
        saved = SavedBlocks(path, info["codec"], info["block_rows"], packed,
                            open_column(path, BLOCKS, np.dtype(np.uint8), (), info["bytes"]),
                            names)
        saved.check(columns)   # before anything is created: a damaged save creates nothing
    i8 = np.dtype(np.int64)
    stream = open_column(path, STREAM, i8, (), rows)
    episode = open_column(path, EPISODE, i8, (), rows)
    ends = open_column(path, ENDS, i8, (), rows)
    chunks = open_column(path, CHUNKS, i8, (), manifest["chunks"])
    if len(chunks) and (chunks[0] != 0 or (np.diff(chunks) <= 0).any() or chunks[-1] >= rows):
        raise bad_save(path, f"{CHUNKS}.npy does not list increasing chunk starts within the rows")

    state: dict = {"format": STATE_FORMAT,
                   "spec": {k: (list(shape), dt.str)
                            for k, (shape, dt) in manifest["spec"].items()},
                   "columns": columns, "stream": stream, "episode": episode, "ends": ends,
                   "chunks": chunks}
    if saved is not None:
        state["packed"] = saved   # restore puts them back compressed (or decodes them)
    if manifest.get("priorities") is True:
        state["priorities"] = open_column(path, PRIORITIES, np.dtype(np.float32), (), rows)
        top = manifest.get("max_priority")
        if top is not None and (isinstance(top, bool) or not isinstance(top, (int, float))):
            raise bad_save(path, f"manifest field 'max_priority' is {top!r}")
        state["max_priority"] = None if top is None else float(top)
        if manifest.get("tickets") is True:
            state["tickets"] = open_column(path, TICKETS, i8, (), manifest["chunks"])
    return manifest, state


def rate_limit_of(path, manifest: dict):
    """The manifest's ``RateLimit`` (or None); CorruptSaveError if it is not one."""
    from ..writing.ratelimit import RateLimit

    spec = manifest.get("rate_limit")
    if spec is None:
        return None
    try:
        return RateLimit(**spec)
    except (TypeError, ValueError) as exc:
        raise bad_save(path, f"its rate_limit {spec!r} is not a RateLimit ({exc})") from None
