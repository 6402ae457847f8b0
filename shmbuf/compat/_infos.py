"""Batched info dicts as fixed columns: schema inference, validation, checkpoint format.

A HistoryBuffer stores every info key as one column of keyed rings.  The
schema (per-env per-step shape, numpy dtype, and whether ``get`` returns
torch tensors) is fixed by ``spec=`` or by the first append; every later
append is validated against it completely before anything is written.
Pure functions: nothing here touches shared memory or a HistoryBuffer.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np

from ..protocol.layout import validate_shape
from ..writing.cast import coerce

# Characters (or bytes) of a string key inferred from shorter values.  A shared
# column has one fixed width, so a later, longer string cannot widen it in place;
# ``get`` still returns the width of the longest string it holds, as upstream.
MIN_STR_WIDTH = 32
_SCALARS = (bool, int, float, complex, str, bytes, np.generic)


@dataclasses.dataclass(frozen=True)
class KeySchema:
    """One info key: where it lives and what ``get`` gives back for it."""

    key: str
    column: str
    shape: tuple[int, ...]
    dtype: np.dtype
    torch: bool = False
    device: str = "cpu"

    def meta(self) -> list:
        return [self.key, int(self.torch), self.device]


def is_tensor(value) -> bool:
    return type(value).__module__.startswith("torch") and hasattr(value, "detach")


def _label(verb: str, key) -> str:
    return f"{verb}(info[{key!r}])"


def _native(dtype: np.dtype) -> np.dtype:
    return dtype.newbyteorder("=") if dtype.byteorder not in "=|" else dtype


def numpy_dtype(label: str, dtype) -> tuple[np.dtype, bool]:
    """A numpy dtype for ``dtype`` (numpy or torch), and whether it was torch's."""
    if type(dtype).__module__.startswith("torch"):
        import torch

        try:
            return torch.empty(0, dtype=dtype).numpy().dtype, True
        except TypeError:
            raise TypeError(f"{label}: torch dtype {dtype} has no numpy equivalent and cannot "
                            "live in shared memory; convert it (e.g. to torch.float32)") from None
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"{label}: {dtype!r} is not a numpy dtype") from None
    if dt.hasobject or dt.fields is not None or dt.subdtype is not None or dt.itemsize == 0:
        raise TypeError(f"{label}: dtype {dt} cannot live in shared memory; use a fixed-size "
                        "numeric, bool or fixed-width string dtype")
    return _native(dt), False


def block_keys(keys) -> frozenset:
    """``HistoryBuffer(block_keys=...)`` as a set of key names (a bare string is refused)."""
    if isinstance(keys, (str, bytes)):
        raise TypeError(f"block_keys must be an iterable of key names, not the string "
                        f"{keys!r}; did you mean ({keys!r},)?")
    return frozenset(keys)


def env_ids(ids, n_envs: int, verb: str, distinct: bool) -> np.ndarray:
    """``env_ids`` as int64 in ``[0, n_envs)``; negative ids count from the end, as upstream."""
    arr = np.asarray(ids)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise TypeError(f"{verb}: env_ids must be a list of ints, got {ids!r}")
    arr = arr.astype(np.int64)
    bad = (arr < -n_envs) | (arr >= n_envs)
    if bad.any():
        raise IndexError(f"{verb}: env id {arr[bad][0]} is out of range for n_envs={n_envs}")
    arr = np.where(arr < 0, arr + n_envs, arr)
    if distinct and np.unique(arr).size != arr.size:
        raise ValueError(f"{verb}: env_ids must be distinct, got {arr.tolist()}")
    return arr


def schema_from_spec(spec) -> tuple[KeySchema, ...]:
    """``{key: (per-env shape, dtype)}`` -> schema; a torch dtype makes ``get`` return torch."""
    if not isinstance(spec, Mapping) or not spec:
        raise TypeError(f"spec must be a non-empty dict of key -> (per-env shape, dtype), "
                        f"got {spec!r}")
    out = []
    for i, (key, entry) in enumerate(spec.items()):
        _check_key(key, "spec")
        if not isinstance(entry, (tuple, list)) or len(entry) != 2:
            raise TypeError(f"spec[{key!r}] must be a (per-env shape, dtype) pair, got {entry!r}")
        shape = validate_shape(key, entry[0])
        dtype, torch = numpy_dtype(f"spec[{key!r}]", entry[1])
        out.append(KeySchema(key, f"k{i}", shape, dtype, torch))
    return tuple(out)


def _check_key(key, where: str) -> None:
    if not isinstance(key, str):
        raise TypeError(f"{where}: keys must be str, got {key!r} ({type(key).__name__})")


def _kind_error(label: str, value, n_rows: int) -> TypeError:
    return TypeError(
        f"{label}: got {type(value).__name__}; HistoryBuffer stores numpy arrays and torch "
        f"tensors with a leading env dim of {n_rows}, or str/bytes/bool/int/float scalars "
        "broadcast to every env (convert lists with np.asarray)")


def _infer(key, value, column: str, n_rows: int) -> KeySchema:
    label = _label("append", key)
    if isinstance(value, _SCALARS):
        return KeySchema(key, column, (), _widened(numpy_dtype(label, np.asarray(value).dtype)[0]))
    if is_tensor(value):
        dtype = numpy_dtype(label, value.dtype)[0]
        shape, device = tuple(value.shape), str(value.device)
    elif isinstance(value, np.ndarray):
        dtype, shape, device = _widened(numpy_dtype(label, value.dtype)[0]), value.shape, "cpu"
    else:
        raise _kind_error(label, value, n_rows)
    if len(shape) == 0 or shape[0] != n_rows:
        raise ValueError(f"{label}: expected a leading env dim of {n_rows}, got shape {shape}")
    return KeySchema(key, column, tuple(shape[1:]), dtype, is_tensor(value), device)


def _widened(dtype: np.dtype) -> np.dtype:
    """A string dtype at least ``MIN_STR_WIDTH`` wide; any other dtype as it is."""
    if dtype.kind not in "US":
        return dtype
    chars = dtype.itemsize // np.dtype(dtype.kind + "1").itemsize
    return np.dtype((dtype.type, max(chars, MIN_STR_WIDTH)))


def schema_from_info(info, n_rows: int) -> tuple[KeySchema, ...]:
    """Infer the schema from a first append's info dict (validated as a whole)."""
    if not isinstance(info, Mapping) or not info:
        raise TypeError(f"append: info_dict must be a non-empty dict, got {info!r}")
    for key in info:
        _check_key(key, "append")
    return tuple(_infer(k, v, f"k{i}", n_rows) for i, (k, v) in enumerate(info.items()))


def _coerce_one(s: KeySchema, value, n_rows: int):
    label = _label("append", s.key)
    if isinstance(value, _SCALARS):
        if s.shape != ():
            raise ValueError(f"{label}: got a scalar, but the key holds per-env values of "
                             f"shape {s.shape}; pass an array of shape {(n_rows,) + s.shape}")
        arr = np.asarray(value)
        if arr.dtype.kind in "US" and s.dtype.kind == arr.dtype.kind and \
                arr.dtype.itemsize > s.dtype.itemsize:
            raise TypeError(f"{label}: {value!r} does not fit the key's fixed width {s.dtype}; "
                            "declare a wider dtype with spec=")
        return np.broadcast_to(coerce(label, arr, s.dtype, ()), (n_rows,))
    if not (is_tensor(value) or isinstance(value, np.ndarray)):
        raise _kind_error(label, value, n_rows)
    return coerce(label, value, s.dtype, (n_rows,) + s.shape)


def coerce_info(schema: tuple[KeySchema, ...], info, n_rows: int) -> dict[str, np.ndarray]:
    """``{column: (n_rows, *shape) array}`` for ``info``; raises before anything is written."""
    if not isinstance(info, Mapping):
        raise TypeError(f"append: info_dict must be a dict, got {type(info).__name__}")
    names = {s.key for s in schema}
    if info.keys() != names:
        missing = sorted(names - info.keys(), key=str)
        unknown = sorted(info.keys() - names, key=str)
        raise KeyError(f"append: missing keys {missing}, unknown keys {unknown}; this buffer's "
                       f"keys are {sorted(names)} (fixed by spec= or the first append)")
    return {s.column: _coerce_one(s, info[s.key], n_rows) for s in schema}


def schema_meta(schema: tuple[KeySchema, ...]) -> list:
    return [s.meta() for s in schema]


def schema_from_meta(meta: list, spec: dict) -> tuple[KeySchema, ...]:
    """Rebuild the schema of an attached buffer from its metadata and column spec."""
    out = []
    for i, (key, torch, device) in enumerate(meta):
        shape, dtype = spec[f"k{i}"]
        out.append(KeySchema(key, f"k{i}", tuple(shape), np.dtype(dtype), bool(torch), device))
    return tuple(out)


# -- checkpoints: torch tensors and plain values only ------------------------------------
CHECKPOINT_FORMAT = "shmbuf-history-v1"


def checkpoint(schema: tuple[KeySchema, ...], params: dict, lengths: np.ndarray,
               entries: dict) -> dict:
    """A HistoryBuffer state from ``KeyedRings.snapshot()``'s ``(lengths, {column: entries})``.

    ``entries[key]`` holds every env's live entries concatenated, env 0
    first, each env oldest first.  String columns (which torch cannot hold)
    travel as their raw bytes in a uint8 tensor; ``spec`` gives the dtype.
    """
    import torch

    def tensor(arr):
        if arr.dtype.kind in "USV":
            arr = np.ascontiguousarray(arr).reshape(-1).view(np.uint8).copy()
        return torch.from_numpy(np.ascontiguousarray(arr))

    return {"format": CHECKPOINT_FORMAT, "facade": "HistoryBuffer", **params,
            "keys": [s.key for s in schema],
            "spec": {s.key: [list(s.shape), s.dtype.str] for s in schema},
            "torch": {s.key: [s.torch, s.device] for s in schema},
            "lengths": torch.from_numpy(np.asarray(lengths, np.int64)),
            "entries": {s.key: tensor(entries[s.column]) for s in schema}}


def read_checkpoint(state: dict, n_envs: int) -> tuple[tuple[KeySchema, ...], np.ndarray, dict]:
    """``(schema, lengths, {key: entries})`` of a numpy ``checkpoint``.

    Raises ValueError if ``state`` is not one.
    """
    if state.get("format") != CHECKPOINT_FORMAT or state.get("facade") != "HistoryBuffer":
        raise ValueError(f"state: expected a HistoryBuffer checkpoint of format "
                         f"{CHECKPOINT_FORMAT!r}, got format {state.get('format')!r} by "
                         f"{state.get('facade')!r}")
    if state.get("n_envs") != n_envs:
        raise ValueError(f"state: checkpoint has n_envs={state.get('n_envs')}, this buffer "
                         f"has n_envs={n_envs}")
    try:
        schema = tuple(
            KeySchema(key, f"k{i}", tuple(int(d) for d in state["spec"][key][0]),
                      np.dtype(state["spec"][key][1]), bool(state["torch"][key][0]),
                      str(state["torch"][key][1]))
            for i, key in enumerate(state["keys"]))
    except (KeyError, TypeError, IndexError) as exc:
        raise ValueError(f"state: malformed HistoryBuffer checkpoint ({exc!r})") from None
    lengths = np.asarray(state["lengths"]).astype(np.int64)
    if lengths.shape != (n_envs,) or (lengths < 0).any():
        raise ValueError(f"state['lengths']: expected {n_envs} non-negative counts, "
                         f"got {lengths.tolist()}")
    total = int(lengths.sum())
    entries = {}
    for s in schema:
        label = f"state['entries'][{s.key!r}]"
        arr = np.asarray(state["entries"].get(s.key))
        if s.dtype.kind in "USV":
            if arr.dtype != np.uint8 or arr.ndim != 1 or arr.size % (s.dtype.itemsize or 1):
                raise ValueError(f"{label}: expected the raw bytes of {s.dtype} values")
            arr = arr.view(s.dtype)
            per = int(np.prod(s.shape, dtype=np.int64))
            if arr.size % per:
                raise ValueError(f"{label}: {arr.size} values do not split into entries of "
                                 f"{s.shape}")
            arr = arr.reshape((-1,) + s.shape)
        if arr.shape[1:] != s.shape or arr.dtype != s.dtype:
            raise ValueError(f"{label}: expected entries of shape {s.shape} and dtype "
                             f"{s.dtype}, got {arr.shape[1:]} and {arr.dtype}")
        if len(arr) != total:
            raise ValueError(f"{label}: {len(arr)} entries, but lengths add up to {total}")
        entries[s.key] = arr
    return schema, lengths, entries
