"""A batch of windows copied into its targets, with the seqlock re-check and redraws.

Every sampler of a store ends here: ``Buffer.sample_sequences`` and the
facades' own selectors (``StorePort.sample``) alike.  A selector draws
located windows, their rows are copied (packed rows decoded), and the
windows whose chunks were recycled meanwhile are drawn again, so no torn or
overwritten step is ever returned.
"""
from __future__ import annotations

import numpy as np

from .._errors import SampleRetryError
from ..protocol import _rows
from .out import array_of, put, result_of

MAX_REDRAWS = 64
# Time-major, each row of a window goes to its own place in the batch: rows smaller
# than this are gathered by numpy's fancy index, which copies small items faster than
# a copy per row (measured: 16-byte rows 26 against 31 us, 256-byte rows about even).
_ROW_COPY = 256


def sample(port, selector, rng, batch_size: int, length: int, tail: int, targets: dict,
           time_major: bool) -> dict:
    """``batch_size`` windows that ``selector.draw`` picks, copied into ``targets``
    (``sampling.out.prepare_out``'s); stale ones are redrawn until none is.

    Returns the batch: ``targets`` itself where they are fresh arrays, else the
    caller's own arrays or tensors, by column.

    Raises:
        SampleRetryError: the writers recycled sampled chunks ``MAX_REDRAWS``
            times in a row.
    """
    finder = port.finder
    windows = selector.draw(finder, rng, batch_size, length, tail)
    pending = np.arange(batch_size)
    for _ in range(MAX_REDRAWS):
        gather(port, windows, pending, targets, time_major, batch_size)
        fresh, every = finder.recheck(windows)
        if every:
            port.count_sample(batch_size * length)
            if type(next(iter(targets.values()))) is np.ndarray:
                return targets   # fresh arrays (prepare_out makes all fresh, or none)
            return {k: result_of(t) for k, t in targets.items()}
        pending = pending[~fresh]
        windows = selector.draw(finder, rng, len(pending), length, tail)
    raise SampleRetryError(
        f"writers recycled sampled chunks {MAX_REDRAWS} times in a row; the buffer "
        f"(capacity {port.capacity}) is too small for its ingest rate")


def gather(port, windows, pending, targets, time_major, batch_size) -> None:
    """Copy the rows of ``windows`` into the ``pending`` places of every target."""
    unpack = port.unpacker
    if unpack is None:
        return _gather_rows(port, windows.rows, pending, targets, time_major, batch_size)
    with unpack.reading():   # no raw page this reads is punched meanwhile
        flags = unpack.flags(windows.rows, windows.chunks, windows.seqs)
        if flags is not None and time_major:
            flags = flags.transpose()
        _gather_rows(port, windows.rows, pending, targets, time_major, batch_size, flags)
    return None


def _gather_rows(port, rows, pending, targets, time_major, batch_size, flags=None) -> None:
    """Copy rows ``rows`` of every target's column; ``flags`` (``Unpacker.flags``, for
    the rows as laid out in the batch) where some chunks are packed.  Raw rows going to
    a host array are copied by one ``_rows.copy_rows`` call for every such column: a
    window that lies in one chunk is one slice copy per column (batch-major), not a
    fancy-index gather; time-major, rows under ``_ROW_COPY`` bytes are fancy-indexed."""
    idx = np.ascontiguousarray(rows.T) if time_major else rows
    everything = len(pending) == batch_size
    unpack, views = port.unpacker, port.views
    raw = []   # (src, dst, row bytes, window stride, row stride) for one copy_rows call
    for name, target in targets.items():
        array = target if type(target) is np.ndarray else array_of(target)
        if name == "ids":   # read with the rows, checked by the same seqs after
            if array is None:
                put(target, port.step_ids(idx), pending, time_major)
            elif everything:
                port.step_ids(idx, out=array)   # int64, or a record with the id first
            else:
                part = np.zeros(idx.shape + array.shape[2:], array.dtype)
                put(target, port.step_ids(idx, out=part), pending, time_major)
            continue
        src = views[name]
        if flags is not None:
            assert unpack is not None
            if everything and array is not None:
                unpack.take(name, src, idx, flags, out=array)
            else:
                put(target, unpack.take(name, src, idx, flags), pending, time_major)
        elif array is not None and (not time_major or src.strides[0] >= _ROW_COPY):
            strides = array.strides   # (L, B, ...) time-major, else (B, L, ...)
            window, row = (strides[1], strides[0]) if time_major else strides[:2]
            raw.append((src, array, src.strides[0], window, row))
        elif everything and array is not None:
            np.take(src, idx, axis=0, out=array, mode="clip")
        else:
            put(target, np.take(src, idx, axis=0, mode="clip"), pending, time_major)
    if raw:
        _rows.copy_rows(raw, np.ascontiguousarray(rows, np.int64),
                        np.ascontiguousarray(pending, np.int64))
