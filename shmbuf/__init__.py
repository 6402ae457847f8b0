"""shmbuf: replay and history buffers for world-model RL in POSIX shared memory.

Env workers in other processes write straight into a lock-free ring; the
trainer samples zero-copy views; any process can attach by name.
"""
from . import params as _params  # noqa: F401  # registers ParamBlock with shmbuf.attach
from ._errors import (
                      BufferClosedError,
                      CorruptSaveError,
                      CorruptSegmentError,
                      ForeignStepIdsError,
                      LayoutVersionError,
                      MemoryFullError,
                      NoFreeChunkError,
                      NoFreeWriterSlotError,
                      NotEnoughDataError,
                      OnPolicyBufferFullError,
                      OwnerAliveError,
                      SampleRetryError,
                      SampleTooLargeError,
                      SaveExistsError,
                      SchemaPendingError,
                      SegmentExistsError,
                      SegmentNotFoundError,
                      SegmentPermissionError,
                      SharedMemoryFullError,
                      ShmbufError,
                      WaitTimeoutError,
                      WritersStoppedError,
)
from ._open import attach, load
from .compat import embodied as _embodied  # noqa: F401  # registers embodied.Replay
from .compat._diamond_dataset import SequenceDataset
from .compat.diamond import ReplayBuffer as DiamondReplayBuffer
from .compat.dreamer import ReplayBuffer
from .compat.history import HistoryBuffer
from .compat.iris import IRISOnPolicyBuffer, IRISReplayBuffer
from .compat.planet import Episode, Memory
from .disk.save import Saver
from .store import Buffer, Stats, create
from .writing.compress import Compress, CompressionStats
from .writing.ratelimit import RateLimit, RateStats
from .writing.writer import Writer

__version__ = "0.1.0"

__all__ = [
    "Buffer", "Stats", "Writer", "attach", "create", "load", "Saver", "RateLimit", "RateStats",
    "Compress", "CompressionStats",
    "HistoryBuffer", "ReplayBuffer", "Memory", "Episode", "IRISReplayBuffer", "IRISOnPolicyBuffer",
    "DiamondReplayBuffer", "SequenceDataset",
    "ShmbufError", "SegmentNotFoundError", "SegmentExistsError", "SegmentPermissionError",
    "CorruptSegmentError", "LayoutVersionError", "SharedMemoryFullError",
    "BufferClosedError", "OwnerAliveError", "SaveExistsError", "CorruptSaveError",
    "NotEnoughDataError", "ForeignStepIdsError", "NoFreeChunkError", "NoFreeWriterSlotError",
    "SampleRetryError", "SampleTooLargeError", "OnPolicyBufferFullError", "MemoryFullError",
    "SchemaPendingError",
    "WaitTimeoutError", "WritersStoppedError",
]
