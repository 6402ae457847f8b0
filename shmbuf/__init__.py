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
from .store import Buffer, Stats, create
from .store import attach as _attach_store
from .writer import Writer

__version__ = "0.1.0"


def attach(name: str, *, seed=None):
    """Attach to any shmbuf buffer by name; the result never unlinks it.

    Returns the class that made the buffer: a ``Buffer`` for ``create``, or
    the seed facade (``ReplayBuffer``, ``Memory``, ``HistoryBuffer``, ...)
    that created it.

    Raises:
        SegmentNotFoundError: no segment has that name.
        CorruptSegmentError / LayoutVersionError: it is not a readable shmbuf buffer.

    Example:
        >>> buf = shmbuf.attach("shmbuf-1a2b3c4d5e6f")
    """
    from ._layout import KIND_KEYED
    from .compat._base import facade_for

    if _segment_kind(name) == KIND_KEYED:
        return HistoryBuffer.attach(name)
    buffer = _attach_store(name, seed=seed)
    cls = facade_for(buffer)
    if cls is None:
        return buffer
    try:
        return cls._from_buffer(buffer)
    except BaseException:
        buffer.close()
        raise


def _segment_kind(name: str) -> int:
    from ._segment import Segment

    segment = Segment.attach(name)
    try:
        return segment.header()[1]["kind"]
    finally:
        segment.close()


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
