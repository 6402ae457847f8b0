"""shmbuf: replay and history buffers for world-model RL in POSIX shared memory.

Env workers in other processes write straight into a lock-free ring; the
trainer samples zero-copy views; any process can attach by name.
"""
from ._errors import (BufferClosedError, CorruptSegmentError, LayoutVersionError,
                      NoFreeChunkError, NoFreeWriterSlotError, NotEnoughDataError,
                      CorruptSaveError, MemoryFullError, OnPolicyBufferFullError,
                      OwnerAliveError,
                      SampleRetryError, SaveExistsError,
                      SampleTooLargeError,
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
from . import params as _params
from ._layout import KIND_KEYED as _KIND_KEYED
from ._segment import Segment as _Segment
from ._facades import facade_for as _facade_for
from .ratelimit import RateLimit, RateStats
from .store import Buffer, Stats, create
from .store import from_segment as _from_segment
from .writer import Writer
from ._saving import Saver

__version__ = "0.1.0"


def attach(name: str, *, seed=None, own: bool = False, handle_signals: bool | None = None):
    """Attach to any shmbuf buffer by name; the result never unlinks it, unless ``own``.

    ``own=True`` takes over a buffer whose owner died (see ``store.attach``;
    a HistoryBuffer or a parameter block too): this process then unlinks it
    at close and answers for SIGTERM; the data and the writers carry on.

    Returns the class that made the buffer: a ``Buffer`` for ``create``, the
    seed facade (``ReplayBuffer``, ``Memory``, ``HistoryBuffer``, ...) that
    created it, or a ``shmbuf.params.ParamBlock``.  The segment is mapped
    once and its header read once.

    Raises:
        SegmentNotFoundError: no segment has that name.
        CorruptSegmentError / LayoutVersionError: it is not a readable shmbuf buffer.
        BufferClosedError: its owner closed it.
        OwnerAliveError: ``own=True`` but the owner is alive (named in the message).

    Example:
        >>> buf = shmbuf.attach("shmbuf-1a2b3c4d5e6f")
    """
    from . import _signals

    _signals.check(handle_signals)
    segment = _Segment.attach(name)
    try:
        layout, owner = segment.header()
    except BaseException:
        segment.close()
        raise
    if owner["kind"] == _KIND_KEYED:
        user = owner["meta"].get("user") if isinstance(owner["meta"], dict) else None
        if isinstance(user, dict) and user.get("facade") == _params.FACADE:
            return _params.ParamBlock(_keyed.open_segment(
                segment, layout, owner, own=own, handle_signals=handle_signals,
                made_by=_params.FACADE))
        return HistoryBuffer._from_rings(_keyed.open_segment(
            segment, layout, owner, own=own, handle_signals=handle_signals,
            made_by=HistoryBuffer.KIND_NAME))
    try:
        buffer = _from_segment(segment, layout, owner, seed, own, handle_signals)
    except BaseException:
        segment.close()
        raise
    cls = _facade_for(buffer)
    return buffer if cls is None else cls._from_buffer(buffer)


def load(path, name: str | None = None, capacity: int | None = None, *, seed=None,
         handle_signals: bool | None = None):
    """Create a new buffer from a save made by ``Buffer.save`` (this process owns it).

    The steps come back in their order, in their streams and episodes
    (terminal steps and ``end_episode`` cuts), through writers, so sampling
    treats them exactly like fresh ones.  A save made by a seed facade comes
    back as that facade; one made by ``HistoryBuffer.save`` as a
    HistoryBuffer (``HistoryBuffer.load``).

    Args:
        path: the save's directory.
        name: the new segment's name; generated if None.
        capacity: steps the new buffer holds; default the saved buffer's.  A
            smaller one keeps the newest ``capacity`` steps, even when it is
            smaller than one saved chunk (that chunk loses its oldest steps).  A facade's or HistoryBuffer's
            save keeps its own (pass None).
        seed, handle_signals: as in ``create``.

    Raises:
        FileNotFoundError: no directory at ``path``.
        CorruptSaveError: the save is incomplete, truncated, tampered with, or
            its files do not match its schema; nothing is created.
        SegmentExistsError: ``name`` is taken.

    Example:
        >>> buf.save("ckpt/replay")
        >>> buf2 = shmbuf.load("ckpt/replay", capacity=2 * buf.capacity)
    """
    from ._keyed_saving import holds_keyed
    from ._loading import load as _load

    if holds_keyed(path):
        if capacity is not None:
            raise ValueError(f"capacity: a HistoryBuffer save keeps its own n_envs and max_len; "
                             f"load it with capacity=None, not {capacity!r}")
        return HistoryBuffer.load(path, name, seed=seed, handle_signals=handle_signals)
    return _load(path, name, capacity, seed=seed, handle_signals=handle_signals)


__all__ = [
    "Buffer", "Stats", "Writer", "attach", "create", "load", "Saver", "RateLimit", "RateStats",
    "HistoryBuffer", "ReplayBuffer", "Memory", "Episode", "IRISReplayBuffer", "IRISOnPolicyBuffer",
    "DiamondReplayBuffer", "SequenceDataset",
    "ShmbufError", "SegmentNotFoundError", "SegmentExistsError", "SegmentPermissionError",
    "CorruptSegmentError", "LayoutVersionError", "SharedMemoryFullError",
    "BufferClosedError", "OwnerAliveError", "SaveExistsError", "CorruptSaveError", "NotEnoughDataError", "NoFreeChunkError", "NoFreeWriterSlotError",
    "SampleRetryError", "SampleTooLargeError", "OnPolicyBufferFullError", "MemoryFullError",
    "SchemaPendingError",
    "WaitTimeoutError",
]
