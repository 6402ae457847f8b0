"""Columns from gymnasium spaces: names, shapes and the smallest exact dtypes.

A space becomes one column per leaf.  ``Dict`` and ``Tuple`` spaces are
flattened: leaf ``obs["image"]`` is column ``obs_image``, ``obs[0]`` is
``obs_0``, nested ones join every key with ``_``.  A leaf's dtype is the
smallest one that holds every value of the space exactly (``Discrete(6)``:
``uint8``); float and bool ``Box`` keep their dtype, so an image
``Box(0, 255, uint8)`` stays ``uint8``.
"""
from __future__ import annotations

import dataclasses
import re

import numpy as np
from gymnasium import spaces

from .._errors import ShmbufError
from ..protocol.layout import MAX_COLUMNS, validate_column_name

#: The columns the step convention adds to every spec (see ``shmbuf.gym``).
CONVENTION = {"reward": ((), np.dtype(np.float32)), "is_first": ((), np.dtype(np.bool_)),
              "done": ((), np.dtype(np.bool_))}

_INTS = [np.dtype(t) for t in (np.uint8, np.int8, np.uint16, np.int16,
                               np.uint32, np.int32, np.uint64, np.int64)]


SUPPORTED = (spaces.Box, spaces.Discrete, spaces.MultiDiscrete, spaces.MultiBinary)


class UnsupportedSpaceError(ShmbufError, TypeError):
    """A space has no fixed shape and dtype; pass ``spec_for`` an override for its column."""


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One column of a space: its name, the keys that reach it in a value, its space."""

    name: str
    path: tuple
    space: spaces.Space

    def pick(self, value):
        """This leaf's part of a value of the whole space (batched or not)."""
        for key in self.path:
            value = value[key]
        return value


def leaves(space: spaces.Space, prefix: str) -> list[Leaf]:
    """The leaves of ``space``, in its own order, named after ``prefix``."""
    out: list[Leaf] = []

    def walk(sp, name, path):
        if isinstance(sp, spaces.Dict):
            for key, sub in sp.spaces.items():
                walk(sub, f"{name}_{re.sub(r'[^0-9A-Za-z_]', '_', str(key))}", path + (key,))
        elif isinstance(sp, spaces.Tuple):
            for i, sub in enumerate(sp.spaces):
                walk(sub, f"{name}_{i}", path + (i,))
        else:
            out.append(Leaf(name, path, sp))

    walk(space, prefix, ())
    names = [leaf.name for leaf in out]
    clash = sorted({n for n in names if names.count(n) > 1})
    if clash:
        raise ValueError(f"spec_for: the keys of {prefix} space {space} flatten to the same "
                         f"column names {clash}; rename the keys (e.g. with a gymnasium "
                         "wrapper) so that they differ after non-identifier characters "
                         "become '_'")
    return out


def smallest_int(lo, hi) -> np.dtype:
    """The smallest integer dtype holding ``lo..hi`` (unsigned when it fits)."""
    lo, hi = int(lo), int(hi)
    for dt in _INTS:
        info = np.iinfo(dt)
        if info.min <= lo and hi <= info.max:
            return dt
    raise ValueError(f"no integer dtype holds {lo}..{hi}")


def column_of(leaf: Leaf) -> tuple[tuple[int, ...], np.dtype]:
    """``(shape, dtype)`` of one leaf's column.

    Raises:
        UnsupportedSpaceError: the space has no fixed shape and dtype.
    """
    sp = leaf.space
    if isinstance(sp, spaces.Discrete):
        start = int(sp.start)
        return (), smallest_int(start, start + int(sp.n) - 1)
    if isinstance(sp, spaces.MultiDiscrete):
        starts = np.asarray(sp.start, np.int64)
        return tuple(sp.shape), smallest_int(starts.min(), (starts + sp.nvec - 1).max())
    if isinstance(sp, spaces.MultiBinary):
        return tuple(sp.shape), np.dtype(np.bool_)
    if isinstance(sp, spaces.Box):
        dt = np.dtype(sp.dtype)
        if dt.kind in "iu" and sp.is_bounded("both") and sp.low.size:
            dt = smallest_int(sp.low.min(), sp.high.max())
        return tuple(sp.shape), dt
    raise UnsupportedSpaceError(_unsupported(leaf))  # not one of SUPPORTED


def _unsupported(leaf: Leaf) -> str:
    sp = leaf.space
    if isinstance(sp, spaces.Text):
        example = f"((), 'U{sp.max_length}')"
        what = f"strings of at most {sp.max_length} characters"
    else:
        example = "((10, 3), 'float32')"
        what = "values that always have that shape"
    return (f"spec_for: column {leaf.name!r} comes from a {type(sp).__name__} space ({sp}), "
            f"which has no fixed shape and dtype. Pass an override, e.g. "
            f"spec_for(env, {leaf.name}={example}) for {what}, or wrap the env in a "
            "gymnasium.ObservationWrapper / ActionWrapper that maps it to a Box")


def columns(observation_space: spaces.Space, action_space: spaces.Space
            ) -> tuple[list[Leaf], list[Leaf]]:
    """The observation and action leaves; their names plus ``CONVENTION`` are the spec."""
    obs, act = leaves(observation_space, "obs"), leaves(action_space, "action")
    total = len(obs) + len(act) + len(CONVENTION)
    if total >= MAX_COLUMNS:
        raise ValueError(f"spec_for: the spaces flatten to {total} columns; a buffer holds at "
                         f"most {MAX_COLUMNS - 1}. Wrap the env to group its observations")
    for leaf in obs + act:
        validate_column_name(leaf.name)
    return obs, act


def spec(observation_space, action_space, overrides: dict) -> dict:
    """The buffer spec of the step convention, with ``overrides`` applied."""
    obs, act = columns(observation_space, action_space)
    names = [leaf.name for leaf in obs + act] + list(CONVENTION)
    unknown = sorted(set(overrides) - set(names))
    if unknown:
        raise KeyError(f"spec_for: overrides {unknown} name no column; the columns are {names}")
    out = {}
    for leaf in obs + act:
        out[leaf.name] = overrides[leaf.name] if leaf.name in overrides else column_of(leaf)
    for name, column in CONVENTION.items():
        out[name] = overrides.get(name, column)
    return out
