"""shmbuf: replay and history buffers for world-model RL in POSIX shared memory.

Env workers in other processes write straight into a lock-free ring; the
trainer samples zero-copy views; any process can attach by name.
"""
from ._errors import (BufferClosedError, CorruptSegmentError, LayoutVersionError,
                      NoFreeChunkError, NoFreeWriterSlotError, NotEnoughDataError,
                      SampleRetryError, SegmentExistsError, SegmentNotFoundError,
                      SegmentPermissionError, SharedMemoryFullError, ShmbufError,
                      WaitTimeoutError)
from .store import Buffer, Stats, attach, create
from .writer import Writer

__version__ = "0.1.0"

__all__ = [
    "Buffer", "Stats", "Writer", "attach", "create",
    "ShmbufError", "SegmentNotFoundError", "SegmentExistsError", "SegmentPermissionError",
    "CorruptSegmentError", "LayoutVersionError", "SharedMemoryFullError",
    "BufferClosedError", "NotEnoughDataError", "NoFreeChunkError", "NoFreeWriterSlotError",
    "SampleRetryError", "WaitTimeoutError",
]
