"""What ``compat.embodied`` needs from the store below the public ``Buffer`` API.

Every use of the store's internals by the embodied facade is here, so that
they can move into the core as one piece:

- ``draw``: a batch drawn by a facade selector through the store's own
  gather and seqlock re-check (``Buffer._draw``), so that a window recycled
  while it was copied is redrawn exactly as for ``sample_sequences``;
- ``locate``: validated windows from candidate start rows;
- ``ids_of_rows``: the step ids of located rows (``zero_on_sample``);
- ``live_chunks``, ``unchanged``: the chunk table, for
  finding items by serial and for copying chunks out to files.
"""
from __future__ import annotations

import numpy as np

from ..sampling.out import prepare_out
from ..sampling.windows import Windows


def draw(buffer, selector, batch: int, length: int, spec: dict) -> dict:
    """``batch`` windows that ``selector._draw(finder, rng, n, length, 0)`` picks,
    gathered batch-major (the columns of ``spec``, and ``"ids"``); stale windows
    are redrawn."""
    buffer._check_live()
    targets = prepare_out(None, spec, (batch, length), ids=True)
    return buffer._draw(buffer._parts.random.get(), batch, length, 0, selector, targets, False)


def locate(buffer, starts: np.ndarray, length: int) -> Windows:
    """The valid windows among candidate ``starts`` (int64 rows), in order."""
    starts = np.ascontiguousarray(starts, np.int64)
    return buffer._parts.finder.locate(starts, length, 0, len(starts))


def finder(buffer):
    return buffer._parts.finder


def ids_of_rows(buffer, found_rows: np.ndarray) -> np.ndarray:
    """The step ids of the steps at ``found_rows`` (a window's rows, just located)."""
    return buffer._parts.ring.prio().ids(found_rows)


def never_set(buffer, found_rows: np.ndarray) -> np.ndarray:
    """Per window of ``found_rows`` (n, L): True if one of its steps was never given a
    priority (in the claim its chunk has now)."""
    if not found_rows.size:
        return np.zeros(len(found_rows), bool)
    _, explicit = buffer._parts.ring.prio().values(found_rows.reshape(-1))
    return ~explicit.reshape(found_rows.shape).all(axis=1)


def live_chunks(buffer):
    """The chunks holding committed rows now, with their seqs (``Ring.live_chunks``)."""
    return buffer._parts.ring.live_chunks()


def unchanged(buffer, chunks: np.ndarray, seqs: np.ndarray) -> np.ndarray:
    """After rows were read: True where each chunk still has its seq."""
    return buffer._parts.ring.unchanged(chunks, seqs)
