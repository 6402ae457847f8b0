"""What the importers and exporters share: the episodes that fit, blocks, progress, cleanup."""
from __future__ import annotations

import contextlib
import math
import sys
import warnings

import numpy as np

from .._errors import ShmbufError

#: Bytes of rows an importer holds in RAM at a time (a block of every column).
BLOCK_BYTES = 64 << 20


class DatasetFormatError(ShmbufError, ValueError):
    """A dataset is damaged, or is not laid out as the format it was read as says."""


class CapacityWarning(UserWarning):
    """An importer kept only the newest episodes: the dataset is larger than ``capacity``."""


def keep_newest(rows: np.ndarray, capacity, who: str) -> tuple[int, int]:
    """The first episode to import and the buffer's capacity, for episodes of ``rows`` rows.

    ``capacity=None`` holds them all.  A smaller one keeps the newest whole
    episodes that fit and warns (``CapacityWarning``) how many were left out.

    Raises:
        ValueError: no episodes, a bad ``capacity``, or not even the newest
            episode fits (nothing is created then).
    """
    total = int(rows.sum())
    if len(rows) == 0:
        raise ValueError(f"{who}: the dataset has no episodes to import (after the episodes= "
                         "selection); nothing was created")
    if capacity is None:
        return 0, total
    if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) or capacity < 1:
        raise ValueError(f"{who}: capacity must be None or an int >= 1, got {capacity!r}")
    capacity = int(capacity)
    if capacity >= total:
        return 0, capacity
    newest_first = np.cumsum(rows[::-1])
    kept = int(np.searchsorted(newest_first, capacity, side="right"))
    if kept == 0:
        raise ValueError(f"{who}: capacity={capacity} cannot hold even the newest episode "
                         f"({int(rows[-1])} rows); pass a capacity of at least {int(rows[-1])} "
                         "(or None for the whole dataset); nothing was created")
    first = len(rows) - kept
    warnings.warn(f"{who}: capacity={capacity} holds the newest {kept} of {len(rows)} episodes "
                  f"({int(newest_first[kept - 1])} of {total} rows); the {first} oldest were "
                  "not imported. Pass capacity=None to import them all", CapacityWarning,
                  stacklevel=3)
    return first, capacity


def block_rows(spec: dict, block_bytes: int) -> int:
    """Rows of every column of ``spec`` that fit in ``block_bytes`` (at least 1)."""
    if isinstance(block_bytes, bool) or not isinstance(block_bytes, int) or block_bytes < 1:
        raise ValueError(f"block_bytes must be an int >= 1, got {block_bytes!r}")
    row = sum(math.prod(shape) * np.dtype(dtype).itemsize for shape, dtype in spec.values())
    return max(1, block_bytes // max(row, 1))


def check_progress(progress) -> None:
    if progress is not None and not isinstance(progress, bool):
        raise TypeError(f"progress must be None, True or False, got {progress!r}")


@contextlib.contextmanager
def progress_bar(total: int, desc: str, progress):
    """A tqdm bar of ``total`` steps, or an object whose ``update`` does nothing.

    ``progress=None`` shows it when stderr is a terminal and tqdm is
    installed; True whenever tqdm is installed; False never.
    """
    show = sys.stderr.isatty() if progress is None else progress
    bar = None
    if show:
        try:
            from tqdm import tqdm
        except ImportError:  # optional: no bar without it
            tqdm = None
        if tqdm is not None:
            bar = tqdm(total=total, desc=desc, unit="step", unit_scale=True, leave=False)
    try:
        yield bar if bar is not None else _NoBar()
    finally:
        if bar is not None:
            bar.close()


class _NoBar:
    def update(self, n: int) -> None:
        pass


@contextlib.contextmanager
def filling(buffer):
    """Yield ``buffer``'s writer; on any error close the buffer, which unlinks it (owner)."""
    try:
        with buffer.writer() as writer:
            yield writer
    except BaseException:
        buffer.close()
        raise


def finished_episodes(buffer, episodes, who: str) -> list[int]:
    """The episode-index numbers to export: every finished one held, or ``episodes``'."""
    held = [int(i) for i in buffer.episodes().index]
    if episodes is None:
        if not held:
            raise ValueError(f"{who}: buffer {buffer.name!r} holds no finished episode (an "
                             "episode is finished by a terminal step or Writer.end_episode); "
                             "nothing was written")
        return held
    wanted = [int(i) for i in episodes]
    missing = sorted(set(wanted) - set(held))
    if missing:
        raise ValueError(f"{who}: episodes {missing[:10]} are not finished episodes held by "
                         f"buffer {buffer.name!r} (see buffer.episodes().index); nothing was "
                         "written")
    return wanted
