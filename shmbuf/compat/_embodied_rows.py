"""What ``compat.embodied`` needs from the store below the public ``Buffer`` API.

Every use of the store's internals by the embodied facade is here, in four
small functions, so that they can move into the core as one piece:

- ``items_made``: the buffer-wide serial counter, read without bumping it
  (the facade numbers items with ``Buffer.next_serial``);
- ``draw``: a batch drawn by a facade selector through the store's own
  gather and seqlock re-check (``Buffer._draw``), so that a window recycled
  while it was copied is redrawn exactly as for ``sample_sequences``;
- ``locate``: validated windows from candidate start rows;
- ``write_rows``: values written into the held steps that step ids name,
  skipping ids whose steps were evicted.
"""
from __future__ import annotations

import numpy as np

from ..protocol import _atomic as atomic
from ..protocol.words import _COUNT, _STATE, _TICKET
from ..sampling.out import prepare_out
from ..sampling.windows import Windows


def items_made(buffer) -> int:
    """How many serials ``buffer.next_serial()`` has handed out, in every process."""
    buffer._check_open()
    return buffer._ring.counter("serial")


def take_serials(buffer, n: int) -> int:
    """The first of ``n`` consecutive serials taken at once (``next_serial`` ``n`` times)."""
    buffer._check_open()
    return buffer._ring.bump("serial", n)


def draw(buffer, selector, batch: int, length: int, spec: dict) -> dict:
    """``batch`` windows that ``selector._draw(finder, rng, n, length, 0)`` picks,
    gathered batch-major (the columns of ``spec``, and ``"ids"``); stale windows
    are redrawn."""
    buffer._check_live()
    targets = prepare_out(None, spec, (batch, length), ids=True)
    return buffer._draw(buffer._random.get(), batch, length, 0, selector, targets, False)


def locate(buffer, starts: np.ndarray, length: int) -> Windows:
    """The valid windows among candidate ``starts`` (int64 rows), in order."""
    return buffer._finder.locate(np.ascontiguousarray(starts, np.int64), length, 0, len(starts))


def finder(buffer):
    return buffer._finder


def ids_of_rows(buffer, found_rows: np.ndarray) -> np.ndarray:
    """The step ids of the steps at ``found_rows`` (a window's rows, just located)."""
    return buffer._ring.prio().ids(found_rows)


def chunk_size(buffer) -> int:
    return buffer._layout.chunk_size


def claimed_chunks(buffer) -> int:
    return buffer._ring.claimed_chunks()


def chunk_seqs(buffer, chunks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(state word, committed count) of ``chunks`` now; compare the state after a copy."""
    table = buffer._ring.chunk_table
    state = table[chunks, _STATE].copy()
    atomic.fence_acquire()
    count = np.clip(table[chunks, _COUNT].view(np.int64), 0, buffer._ring.chunk_rows[chunks])
    return state, count


def unchanged(buffer, chunks: np.ndarray, state: np.ndarray) -> np.ndarray:
    atomic.fence_acquire()
    return buffer._ring.chunk_table[chunks, _STATE] == state


def rows_of_ids(buffer, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rows, held mask, chunk states) of int64 step ``ids`` now (see ``write_rows``)."""
    ring, k = buffer._ring, buffer._layout.chunk_size
    flat = np.ascontiguousarray(ids.reshape(-1), np.int64)
    ticket, off = np.divmod(np.maximum(flat, 0), k)
    chunk = ticket % buffer._layout.n_chunks
    claimed = chunk < ring.claimed_chunks()
    chunk = np.where(claimed, chunk, 0)
    table = ring.chunk_table
    state = table[chunk, _STATE].copy()
    atomic.fence_acquire()
    held = (claimed & (flat >= 0) & (off < ring.chunk_rows[chunk])
            & (state >> np.uint64(32) & np.uint64(1) == 0)
            & (table[chunk, _TICKET].view(np.int64) == ticket)
            & (table[chunk, _COUNT].view(np.int64) > off))
    return chunk * k + off, held, state


def write_rows(buffer, column: str, ids: np.ndarray, values: np.ndarray) -> int:
    """Write ``values[i]`` into ``column`` of the step ``ids[i]`` names, where it is held.

    An id whose chunk was recycled is skipped.  The check is repeated after
    the write; the one race left is a chunk recycled between the check and
    the write (the buffer's oldest chunk, while a learner writes back the
    context of a batch it sampled), see docs/embodied.md.
    """
    rows, held, state = rows_of_ids(buffer, ids)
    if not held.any():
        return 0
    view = buffer._views[column]
    view[rows[held]] = values.reshape((len(rows),) + values.shape[ids.ndim:])[held]
    chunks = rows // buffer._layout.chunk_size
    held &= unchanged(buffer, chunks, state)
    return int(held.sum())
