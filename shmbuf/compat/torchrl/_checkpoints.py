"""Checkpoints of a storage written by ``ShmWriter``: shmbuf's own, not rows.

A storage written by TorchRL's writers checkpoints as TorchRL's does (its
rows, its length).  One written by ``ShmWriter`` holds streams: its rows are
chunks that writers claimed, so its checkpoint is the buffer's own
(``Buffer.state_dict`` in memory, ``Buffer.save`` on disk), which keeps
every stream, trajectory end and their order; restored steps land in new
rows (the indices from before do not carry over).
"""
from __future__ import annotations

import json
from pathlib import Path

from ..._open import load as _load
from ._control import GEN, STREAMS

MARK = "shmbuf_torchrl.json"
FORMAT = 1


def state_dict(storage) -> dict:
    buf = storage.buffer
    return {"shmbuf_streams": FORMAT, "schema": storage._schema_cache,
            "buffer": None if buf is None else buf.state_dict()}


def load_state_dict(storage, state: dict) -> None:
    storage._claim_mode(STREAMS)
    if not storage.initialized:
        if state["buffer"] is None:
            return
        storage._make_data(state["schema"], STREAMS)
    elif state["schema"] != storage._schema_cache:
        raise ValueError("state_dict: the checkpoint's keys, shapes or dtypes differ from "
                         "this storage's; nothing was loaded")
    if state["buffer"] is not None:
        storage.buffer.load_state_dict(state["buffer"])
    storage._bump_mutation_revision()


def dumps(storage, path) -> None:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    storage.buffer.save(path / "shmbuf", overwrite=True)
    (path / MARK).write_text(json.dumps({"mode": "streams", "format": FORMAT}))


def holds_streams(path) -> bool:
    return (Path(path) / MARK).is_file()


def loads(storage, path) -> None:
    """Replace the storage's data with the save at ``path`` (a new data generation)."""
    storage._claim_mode(STREAMS)
    ctl = storage._ctl
    current = storage._data_buffer()
    gen = ctl[GEN] + 1
    buf = _load(Path(path) / "shmbuf", ctl.data_name(gen),
                None if current is None else current.capacity,
                handle_signals=None if storage.owner else False)
    if not storage.owner:
        buf.keep()
    storage._publish(buf, gen)   # every process follows it; the old generation goes
    storage._bump_mutation_revision()
