"""The exception hierarchy.

Every error subclasses ``ShmbufError`` and the builtin a caller would already
catch, so ``except FileNotFoundError`` keeps working on a missing segment.
"""


class ShmbufError(Exception):
    """Base class of every error that shmbuf raises on purpose."""


class SegmentNotFoundError(ShmbufError, FileNotFoundError):
    """No shared-memory segment has the given name."""


class SegmentExistsError(ShmbufError, FileExistsError):
    """``create`` was given a name that is already taken."""


class SegmentPermissionError(ShmbufError, PermissionError):
    """The segment exists but this process may not open it (mode 0600)."""


class CorruptSegmentError(ShmbufError, ValueError):
    """The segment is not a shmbuf buffer, or its header does not add up."""


class LayoutVersionError(CorruptSegmentError):
    """The segment was written by a shmbuf with another layout version."""


class SharedMemoryFullError(ShmbufError, OSError):
    """``/dev/shm`` has too little free space for the requested buffer."""


class BufferClosedError(ShmbufError, ValueError):
    """An operation was attempted on a closed buffer or writer."""


class OwnerAliveError(ShmbufError, RuntimeError):
    """``attach(name, own=True)`` found the buffer's owner alive (or a rival adopted it first)."""


class SaveExistsError(ShmbufError, FileExistsError):
    """``save`` or ``load``'s target path already exists (see ``overwrite=``)."""


class CorruptSaveError(ShmbufError, ValueError):
    """A save on disk is incomplete, truncated, tampered with, or of another schema."""


class ForeignStepIdsError(ShmbufError, ValueError):
    """Step ids given to a buffer that did not issue them (another buffer's sample did)."""


class NotEnoughDataError(ShmbufError, ValueError):
    """The buffer holds too little data for the requested sample."""


class NoFreeChunkError(ShmbufError, RuntimeError):
    """Every chunk is held by a live writer stream; nothing can be recycled."""


class NoFreeWriterSlotError(ShmbufError, RuntimeError):
    """Every writer slot in the header is held by a live process."""


class SampleRetryError(ShmbufError, RuntimeError):
    """Writers recycled the sampled chunks faster than a batch could be read."""


class WaitTimeoutError(ShmbufError, TimeoutError):
    """A ``wait_*`` call ran out of time."""


class WritersStoppedError(ShmbufError, RuntimeError):
    """``Buffer.stop_writers`` was called: every write raises this until ``resume_writers``."""


class SampleTooLargeError(ShmbufError, MemoryError):
    """A sample would build a batch larger than the configured byte limit."""


class OnPolicyBufferFullError(ShmbufError, OverflowError):
    """``IRISOnPolicyBuffer.add`` was called with ``max_steps`` steps already held."""


class MemoryFullError(ShmbufError, OverflowError):
    """``Memory(size=None)``, which never evicts, has no room left for the episodes appended."""


class SchemaPendingError(ShmbufError, RuntimeError):
    """A HistoryBuffer handle was used before its constructing process fixed the schema."""
