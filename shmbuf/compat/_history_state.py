"""HistoryBuffer checkpoints: torch tensors and plain values only, restored in order.

Layout of a state: ``entries[key]`` holds every env's live entries
concatenated, env 0 first, each env oldest first; ``lengths[e]`` says how
many belong to env ``e``.  String columns (which torch cannot hold) travel as
their raw bytes in a uint8 tensor; ``spec`` gives the dtype to read them back.
"""
from __future__ import annotations

import numpy as np

from . import _infos

FORMAT = "shmbuf-history-v1"


def _encode(arr: np.ndarray):
    import torch

    if arr.dtype.kind in "USV":
        return torch.from_numpy(np.ascontiguousarray(arr).reshape(-1).view(np.uint8).copy())
    return torch.from_numpy(np.ascontiguousarray(arr))


def _decode(label: str, value, dtype: np.dtype, shape: tuple) -> np.ndarray:
    arr = np.asarray(value)
    if dtype.kind in "USV":
        if arr.dtype != np.uint8 or arr.ndim != 1 or arr.size % (dtype.itemsize or 1):
            raise ValueError(f"{label}: expected the raw bytes of {dtype} values")
        arr = arr.view(dtype)
        per = int(np.prod(shape, dtype=np.int64))
        if arr.size % per:
            raise ValueError(f"{label}: {arr.size} values do not split into entries of {shape}")
        arr = arr.reshape((-1,) + shape)
    if arr.shape[1:] != shape or arr.dtype != dtype:
        raise ValueError(f"{label}: expected entries of shape {shape} and dtype {dtype}, "
                         f"got {arr.shape[1:]} and {arr.dtype}")
    return arr


def state_dict(buf) -> dict:
    """See ``HistoryBuffer.state_dict``."""
    import torch

    rings = buf._ensure()
    schema = buf._schema or ()
    lengths = np.zeros(buf.n_envs, np.int64)
    entries = {}
    if rings is not None:
        def every_entry(lens):   # oldest first; beyond an env's length: zero rows
            return lens[:, None] - 1 - np.arange(buf.max_len)

        arrays, lengths = rings.read(None, every_entry)
        live = np.arange(buf.max_len) < lengths[:, None]
        entries = {s.key: _encode(arrays[s.column][live]) for s in schema}
    return {
        "format": FORMAT, "facade": "HistoryBuffer",
        "n_envs": buf.n_envs, "max_len": buf.max_len, "action_block": buf.action_block,
        "block_keys": sorted(buf.block_keys),
        "keys": [s.key for s in schema],
        "spec": {s.key: [list(s.shape), s.dtype.str] for s in schema},
        "torch": {s.key: [s.torch, s.device] for s in schema},
        "lengths": torch.from_numpy(lengths.astype(np.int64)),
        "entries": entries,
    }


def _their_schema(state: dict) -> tuple:
    try:
        return tuple(
            _infos.KeySchema(key, f"k{i}", tuple(int(d) for d in state["spec"][key][0]),
                             np.dtype(state["spec"][key][1]), bool(state["torch"][key][0]),
                             str(state["torch"][key][1]))
            for i, key in enumerate(state["keys"]))
    except (KeyError, TypeError, IndexError) as exc:
        raise ValueError(f"state: malformed HistoryBuffer checkpoint ({exc!r})") from None


def load_state_dict(buf, state: dict) -> None:
    """See ``HistoryBuffer.load_state_dict``; ``state`` is already numpy."""
    if state.get("format") != FORMAT or state.get("facade") != "HistoryBuffer":
        raise ValueError(f"state: expected a HistoryBuffer checkpoint of format {FORMAT!r}, "
                         f"got format {state.get('format')!r} by {state.get('facade')!r}")
    if state.get("n_envs") != buf.n_envs:
        raise ValueError(f"state: checkpoint has n_envs={state.get('n_envs')}, this buffer "
                         f"has n_envs={buf.n_envs}")
    theirs = _their_schema(state)
    rings = buf._ensure()
    if rings is not None:
        mine = {s.key: (s.shape, s.dtype.str) for s in buf._schema}
        other = {s.key: (s.shape, s.dtype.str) for s in theirs}
        if mine != other:
            raise ValueError(f"state: checkpoint schema {other} does not match this buffer's "
                             f"{mine}")
    lengths = np.asarray(state["lengths"]).astype(np.int64)
    if lengths.shape != (buf.n_envs,) or (lengths < 0).any():
        raise ValueError(f"state['lengths']: expected {buf.n_envs} non-negative counts, "
                         f"got {lengths.tolist()}")
    total = int(lengths.sum())
    entries = {}
    for s in theirs:
        arr = _decode(f"state['entries'][{s.key!r}]", state["entries"].get(s.key), s.dtype,
                      s.shape)
        if len(arr) != total:
            raise ValueError(f"state['entries'][{s.key!r}]: {len(arr)} entries, but lengths "
                             f"add up to {total}")
        entries[s.key] = arr
    if rings is None:
        if not theirs:
            return
        if not buf._may_create():
            from .._errors import SchemaPendingError

            raise SchemaPendingError(f"HistoryBuffer {buf.name!r} has no schema yet; restore "
                                     "in the constructing process")
        buf._create(theirs)
    _replay(buf, lengths, entries)


def _replay(buf, lengths: np.ndarray, entries: dict) -> None:
    """Reset every env, then append each env's newest ``max_len`` entries in order."""
    kept = np.minimum(lengths, buf.max_len)
    first = np.cumsum(lengths) - kept
    rings = buf._rings
    rings.reset(None)
    columns = [(s.column, entries[s.key]) for s in buf._schema]
    for t in range(int(kept.max(initial=0))):
        envs = np.flatnonzero(kept > t)
        idx = first[envs] + t
        rings.append(envs, {col: arr[idx] for col, arr in columns})
