"""shmbuf: replay and history buffers for world-model RL in POSIX shared memory.

Env workers in other processes write straight into a lock-free ring; the
trainer samples zero-copy views; any process can attach by name.
"""
from ._errors import (BufferClosedError, CorruptSegmentError, LayoutVersionError,
                      NoFreeChunkError, NoFreeWriterSlotError, NotEnoughDataError,
                      OnPolicyBufferFullError, SampleRetryError, SampleTooLargeError,
                      SchemaPendingError,
                      SegmentExistsError, SegmentNotFoundError, SegmentPermissionError,
                      SharedMemoryFullError, ShmbufError, WaitTimeoutError)
from .compat.diamond import ReplayBuffer as DiamondReplayBuffer
from .compat._diamond_dataset import SequenceDataset
from .compat.dreamer import ReplayBuffer
from .compat.history import HistoryBuffer
from .compat.iris import IRISOnPolicyBuffer, IRISReplayBuffer
from .compat.planet import Episode, Memory
from . import keyed as _keyed
from ._layout import KIND_KEYED as _KIND_KEYED
from ._segment import Segment as _Segment
from .compat._base import facade_for as _facade_for
from .store import Buffer, Stats, create
from .writer import Writer

__version__ = "0.1.0"


def attach(name: str, *, seed=None):
    """Attach to any shmbuf buffer by name; the result never unlinks it.

    Returns the class that made the buffer: a ``Buffer`` for ``create``, or
    the seed facade (``ReplayBuffer``, ``Memory``, ``HistoryBuffer``, ...)
    that created it.  The segment is mapped once and its header read once.

    Raises:
        SegmentNotFoundError: no segment has that name.
        CorruptSegmentError / LayoutVersionError: it is not a readable shmbuf buffer.

    Example:
        >>> buf = shmbuf.attach("shmbuf-1a2b3c4d5e6f")
    """
    segment = _Segment.attach(name)
    try:
        layout, owner = segment.header()
    except BaseException:
        segment.close()
        raise
    if owner["kind"] == _KIND_KEYED:
        return HistoryBuffer._from_rings(_keyed.open_segment(segment, layout, owner))
    try:
        buffer = Buffer(segment, layout, (owner["owner_pid"], owner["owner_start"]),
                        owner["meta"], seed)
    except BaseException:
        segment.close()
        raise
    cls = _facade_for(buffer)
    return buffer if cls is None else cls._from_buffer(buffer)


__all__ = [
    "Buffer", "Stats", "Writer", "attach", "create",
    "HistoryBuffer", "ReplayBuffer", "Memory", "Episode", "IRISReplayBuffer", "IRISOnPolicyBuffer",
    "DiamondReplayBuffer", "SequenceDataset",
    "ShmbufError", "SegmentNotFoundError", "SegmentExistsError", "SegmentPermissionError",
    "CorruptSegmentError", "LayoutVersionError", "SharedMemoryFullError",
    "BufferClosedError", "NotEnoughDataError", "NoFreeChunkError", "NoFreeWriterSlotError",
    "SampleRetryError", "SampleTooLargeError", "OnPolicyBufferFullError", "SchemaPendingError",
    "WaitTimeoutError",
]
