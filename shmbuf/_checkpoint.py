"""Copy a buffer's live steps out, oldest first, and write them back.

The copy is validated chunk by chunk like a sample: a chunk recycled while
it was copied is dropped (its steps are gone by then anyway).  Restoring
replays the steps through writers, one per original stream, in the original
order, so episode cuts, stream boundaries and FIFO order survive; a
checkpoint larger than the target keeps its newest steps.
"""
from __future__ import annotations

import numpy as np

from typing import Any

from ._layout import EP_COLUMN
from ._ring import Ring

FORMAT = "shmbuf-steps-v1"


def snapshot(ring: Ring, views: dict[str, np.ndarray]) -> dict[str, Any]:
    """``{"format", "spec", "columns": {name: array}, "stream", "episode"}``, oldest first."""
    lay = ring.layout
    live = ring.live_chunks()
    parts: dict[str, list] = {c.name: [] for c in lay.columns}
    streams = []
    for chunk, seq, count, stream, base in zip(live.chunk, live.seq, live.count, live.stream,
                                               live.base):
        rows = slice(int(base), int(base + count))
        copies = {name: views[name][rows].copy() for name in parts}
        if not ring.unchanged(chunk[None], seq[None])[0]:
            continue  # recycled while copied
        for name, arr in copies.items():
            parts[name].append(arr)
        streams.append(np.full(int(count), int(stream), np.int64))

    def joined(name):
        col = lay.column(name)
        empty = np.empty((0,) + col.shape, col.dtype)
        return np.concatenate(parts[name]) if parts[name] else empty

    return {
        "format": FORMAT,
        "spec": {c.name: (list(c.shape), c.dtype.str) for c in lay.user_columns},
        "columns": {c.name: joined(c.name) for c in lay.user_columns},
        "stream": np.concatenate(streams) if streams else np.empty(0, np.int64),
        "episode": joined(EP_COLUMN),
    }


def check_compatible(buf, state: dict[str, Any]) -> None:
    """Raise ValueError naming what differs between ``state`` and ``buf``."""
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        got = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"state: expected a shmbuf checkpoint of format {FORMAT!r}, got {got!r}")
    mine = {k: (list(shape), dtype.str) for k, (shape, dtype) in buf.spec.items()}
    theirs = {k: (list(v[0]), str(v[1])) for k, v in state["spec"].items()}
    if mine != theirs:
        raise ValueError(f"state: checkpoint schema {theirs} does not match the buffer's {mine}")
    n = len(state["stream"])
    for name, arr in state["columns"].items():
        shape, dtype = buf.spec[name]
        arr = np.asarray(arr)
        if arr.shape != (n,) + shape or arr.dtype != dtype:
            raise ValueError(f"state['columns'][{name!r}]: expected shape {(n,) + shape} and "
                             f"dtype {dtype}, got {arr.shape} and {arr.dtype}")
    if len(state["episode"]) != n:
        raise ValueError(f"state['episode'] has {len(state['episode'])} rows, expected {n}")


def restore(buf, ring: Ring, state: dict[str, Any]) -> None:
    """Replace the buffer's contents with the checkpoint ``state``, through writers."""
    check_compatible(buf, state)
    ring.clear()
    streams = np.asarray(state["stream"]).tolist()
    episodes = np.asarray(state["episode"])
    columns = {k: np.asarray(v) for k, v in state["columns"].items()}
    done = columns[buf.done_key] if buf.done_key else None
    last = {sid: i for i, sid in enumerate(streams)}
    writers, prev = {}, {}
    try:
        for i, sid in enumerate(streams):
            w = writers.get(sid)
            if w is None:
                w = writers[sid] = buf.writer()
            j = prev.get(sid)
            if j is not None and episodes[i] != episodes[j] and not (done is not None and done[j]):
                w.end_episode()  # the original stream was cut here without a terminal
            w.add(**{k: v[i] for k, v in columns.items()})
            prev[sid] = i
            if last[sid] == i:
                writers.pop(sid).close()
    finally:
        for w in writers.values():
            w.close()
