"""PlaNet ``Memory`` checkpoints: the held episodes only, restored under fresh serials.

A state is the core store's snapshot (``format``, ``spec``, ``columns``,
``stream``, ``episode``) cut down to the rows of held episodes, plus
``facade``.  A Memory with no shared segment yet saves an empty ``spec``.
"""
from __future__ import annotations

import numpy as np

from .._checkpoint import FORMAT
from ._base import Facade, to_torch
from ._episodic import census


def state_dict(memory) -> dict:
    """See ``Memory.state_dict``."""
    if memory.buffer is None:
        state = {"format": FORMAT, "spec": {}, "columns": {},
                 "stream": np.empty(0, np.int64), "episode": np.empty(0, np.int64)}
    else:
        state = memory.buffer.snapshot()
        cols = state["columns"]
        held = census(cols["serial"], cols["length"], memory.max_episodes).serials
        keep = np.isin(cols["serial"], held)
        state["columns"] = {k: v[keep] for k, v in cols.items()}
        state["stream"], state["episode"] = state["stream"][keep], state["episode"][keep]
    state["facade"] = memory.FACADE
    return to_torch(state)


def load_state_dict(memory, state: dict) -> None:
    """See ``Memory.load_state_dict``; ``state`` is already numpy."""
    if state.get("facade") != memory.FACADE:
        raise ValueError(f"state: checkpoint was made by {state.get('facade')!r}, "
                         f"not {memory.FACADE!r}")
    if not state.get("spec"):
        if memory.buffer is not None:
            _restore(memory, _empty_state(memory))
        return
    spec = _checkpoint_spec(memory, state["spec"])
    if memory.buffer is None:
        memory._materialize(spec)
    # Restored episodes get fresh serials, so that later appends are newer.
    columns = dict(state["columns"])
    old = np.unique(columns["serial"])
    new = np.array([memory.buffer.next_serial() for _ in old], np.int64)
    columns["serial"] = new[np.searchsorted(old, columns["serial"])]
    _restore(memory, dict(state, columns=columns))


def _restore(memory, state: dict) -> None:
    with memory._lock:
        Facade.load_state_dict(memory, state)  # which closes this handle's writer first


def _checkpoint_spec(memory, spec: dict) -> dict:
    """This Memory's schema (or, with none yet, the checkpoint's shapes in it).

    Raises ValueError, before anything changes, if the checkpoint's differs.
    """
    try:
        mine = memory.buffer.spec if memory.buffer is not None else memory._spec(
            tuple(spec["x"][0]), int(spec["u"][0][0]))
        got = {k: (list(v[0]), np.dtype(v[1]).str) for k, v in spec.items()}
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise ValueError(f"state: not a PlaNet Memory schema: {spec!r}") from exc
    want = {k: (list(v[0]), np.dtype(v[1]).str) for k, v in mine.items()}
    if want != got:
        raise ValueError(f"state: checkpoint schema {got} does not match this Memory's "
                         f"{want}; create the Memory with matching obs_dtype / action_dtype")
    return mine


def _empty_state(memory) -> dict:
    spec = memory.buffer.spec
    return {"format": FORMAT, "facade": memory.FACADE,
            "spec": {k: (list(s), np.dtype(d).str) for k, (s, d) in spec.items()},
            "columns": {k: np.empty((0,) + s, d) for k, (s, d) in spec.items()},
            "stream": np.empty(0, np.int64), "episode": np.empty(0, np.int64)}
