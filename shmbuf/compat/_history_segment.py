"""HistoryBuffer's segment: creating its keyed rings, and binding handles to existing ones.

The constructing process creates the rings once the schema is known
(``spec=`` or the first append), recording the facade's parameters and key
schema in their metadata.  Every other handle (``attach``, an unpickled copy,
a worker attaching lazily) binds to existing rings after checking that
metadata, and closes them again if the check fails.
"""
from __future__ import annotations

import numpy as np

from .. import keyed
from .._errors import CorruptSegmentError, SegmentNotFoundError
from . import _infos


def create(buf, schema) -> None:
    """Create the rings for ``schema`` under ``buf``'s name and bind ``buf`` to them."""
    meta = {"facade": "HistoryBuffer", "params": buf._params(),
            "keys": _infos.schema_meta(schema)}
    try:
        rings = keyed.create({s.column: (s.shape, s.dtype) for s in schema}, buf.n_envs,
                             buf.max_len, spare=buf.SPARE, name=buf._name, meta=meta)
    except ValueError as exc:
        if "meta" in str(exc):
            raise ValueError(f"HistoryBuffer: the key names are too long to record "
                             f"({exc}); use fewer or shorter keys") from None
        raise
    buf._bind(rings, schema)


def new_handle(cls, name: str):
    """A bare ``cls`` handle on segment ``name``, not yet bound to its rings."""
    buf = cls.__new__(cls)
    buf._name, buf.rng = name, np.random.default_rng()
    return buf


def bind_attached(buf, rings, adopt: bool = False) -> None:
    """Bind attached ``rings``; ``adopt`` takes the parameters from their metadata.

    ``rings`` are closed if they do not fit.
    """
    try:
        meta = rings.meta
        if meta.get("facade") != "HistoryBuffer":
            raise CorruptSegmentError(f"segment {rings.name!r} holds keyed rings that were not "
                                      "made by a HistoryBuffer")
        if adopt:
            p = meta["params"]
            buf._set_params(p["n_envs"], p["max_len"], p["action_block"], p["block_keys"])
        elif meta["params"] != buf._params():
            raise CorruptSegmentError(f"segment {rings.name!r} was made with {meta['params']}, "
                                      f"but this handle expects {buf._params()}")
        buf._bind(rings, _infos.schema_from_meta(meta["keys"], rings.spec))
    except BaseException:
        rings.close()
        raise


def attach_lazily(buf) -> None:
    """Bind ``buf`` to its segment if that has been created by now; else leave it unbound."""
    try:
        rings = keyed._attach_once(buf._name)
    except SegmentNotFoundError:
        return
    if rings is not None:
        bind_attached(buf, rings)
