"""``shmbuf.load``: a new buffer from a save, replayed through writers, in its facade.

It sits above the store and the saving format (``_saving`` reads a save,
``store`` creates the buffer, ``Buffer.restore`` replays the steps), and
finds the facade that made the save in the core's registry (``_facades``),
so neither the store nor ``_saving`` needs to know about loading or facades.
"""
from __future__ import annotations

import numpy as np

from . import store
from ._facades import facade_for
from ._layout import NO_SLOT
from ._saving import _rate_limit, open_save


def load(path, name: str | None = None, capacity: int | None = None, *, seed=None,
         handle_signals: bool | None = None):
    """A new buffer holding a save's steps, streams and episodes (see ``shmbuf.load``)."""
    manifest, state = open_save(path)
    facade = manifest["meta"].get("facade")
    if capacity is not None and facade and capacity != manifest["capacity"]:
        raise ValueError(f"capacity: a {facade!r} save keeps its own capacity "
                         f"({manifest['capacity']}); load it with capacity=None")
    same = capacity is None or capacity == manifest["capacity"]
    # Loading replays every saved stream through a writer of its own, all open at once.
    streams = len(np.unique(state["stream"])) if manifest["rows"] else 0
    saved_writers = manifest.get("max_writers")
    writers = max(streams + 1, saved_writers if isinstance(saved_writers, int) else 1, 128)
    buf = store.create({k: v for k, v in manifest["spec"].items()},
                       manifest["capacity"] if capacity is None else capacity, name=name,
                       chunk_size=manifest["chunk_size"] if same else None,
                       max_writers=min(writers, NO_SLOT - 1),
                       done_key=manifest.get("done_key"), seed=seed, meta=manifest["meta"],
                       handle_signals=handle_signals,
                       priorities=manifest.get("priorities") is True, rate_limit=_rate_limit(path, manifest))
    state["rate"] = manifest.get("rate")
    try:
        buf.restore(state)
    except BaseException:
        buf.close()
        raise
    cls = facade_for(buf)
    return buf if cls is None else cls._from_buffer(buf)
