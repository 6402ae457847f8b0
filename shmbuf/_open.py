"""``shmbuf.attach`` and ``shmbuf.load``: one way to open any buffer, through the registry.

A segment's header says its kind (a step store or keyed rings) and which
class made it; a save's manifest says the same.  Both calls read that name,
ask ``_registry`` for the class, and let the class open the segment or
rebuild the save.  There is no ladder of kinds here: a new class registers
itself and opens like the others.
"""
from __future__ import annotations

import numpy as np

from ._registry import class_for
from .disk.keyed_save import holds_keyed
from .disk.saved import open_save, rate_limit_of
from .posix import signals
from .protocol import stepids
from .protocol.layout import KIND_KEYED, NO_SLOT
from .segment.segment import Segment
from .store import buffer as store
from .store.checkpoints import restore_loaded
from .writing.compress import META_KEY, Compress

# Keyed rings that name no class are HistoryBuffer's to judge: it refuses
# rings it did not make (a plain ``keyed.create``) with a clear error.
_KEYED_DEFAULT = "HistoryBuffer"


def made_by(owner: dict) -> str:
    """The registry name of the class that made a segment, from its decoded header."""
    meta = owner["meta"] if isinstance(owner["meta"], dict) else {}
    if owner["kind"] == KIND_KEYED:
        user = meta.get("user")
        name = user.get("facade") if isinstance(user, dict) else None
        return name if isinstance(name, str) and class_for(name) else _KEYED_DEFAULT
    name = meta.get("facade")
    return name if isinstance(name, str) and class_for(name) else store.KIND


def attach(name: str, *, seed=None, own: bool = False, handle_signals: bool | None = None):
    """Attach to any shmbuf buffer by name; the result never unlinks it, unless ``own``.

    ``own=True`` takes over a buffer whose owner died (a step store, a
    HistoryBuffer or a parameter block): this process then unlinks it at
    close and answers for SIGTERM; the data and the writers carry on.

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
    signals.check(handle_signals)
    segment = Segment.attach(name)
    try:
        layout, owner = segment.header()
        cls = class_for(made_by(owner))
    except BaseException:
        segment.close()
        raise
    return cls._open_segment(segment, layout, owner, seed=seed,  # type: ignore[union-attr]
                             own=own, handle_signals=handle_signals)


def load(path, name: str | None = None, capacity: int | None = None, *, seed=None,
         handle_signals: bool | None = None):
    """Create a new buffer from a save made by ``Buffer.save`` (this process owns it).

    The steps come back in their order, in their streams and episodes
    (terminal steps and ``end_episode`` cuts), through writers, so sampling
    treats them exactly like fresh ones.  A save made by a seed facade comes
    back as that facade; one made by ``HistoryBuffer.save`` as a
    HistoryBuffer (``HistoryBuffer.load``).  A compressing buffer's save
    comes back with its ``Compress`` settings (``hot_steps`` at its default
    if ``capacity`` changes) and its compressed blocks put back as they are,
    undecoded, so /dev/shm holds the compressed bytes (``shmbuf.disk.blocks``
    says which blocks are decoded instead).

    Step ids (a buffer with priorities): loaded with its saved capacity, a
    one-shot save (``Buffer.save()``) puts each chunk back under the claim
    number its ids name it by, so ids sampled before the save name the same
    steps in the new buffer (``update_priorities``, ``write_steps``,
    ``priorities_of``).  With another capacity, or from a following save
    (``save(follow=True)``), they are stale there (skipped, NaN), never wrong.  Either way the new
    buffer takes them (it accepts the saved buffer's tag; any other buffer's
    ids raise ``ForeignStepIdsError``) and tags its own ids anew.

    Args:
        path: the save's directory.
        name: the new segment's name; generated if None.
        capacity: steps the new buffer holds; default the saved buffer's.  A
            smaller one keeps the newest ``capacity`` steps, even when it is
            smaller than one saved chunk (that chunk loses its oldest steps).
            A facade's or HistoryBuffer's save keeps its own (pass None).
        seed: as in ``create``.
        handle_signals: as in ``create``.

    Raises:
        FileNotFoundError: no directory at ``path``.
        CorruptSaveError: the save is incomplete, truncated, tampered with
            (a compressed block that fails its CRC-32 among them), or its files
            do not match its schema; nothing is created.
        SegmentExistsError: ``name`` is taken.

    Example:
        >>> buf.save("ckpt/replay")
        >>> buf2 = shmbuf.load("ckpt/replay", capacity=2 * buf.capacity)
    """
    if holds_keyed(path):
        if capacity is not None:
            raise ValueError(f"capacity: a HistoryBuffer save keeps its own n_envs and max_len; "
                             f"load it with capacity=None, not {capacity!r}")
        cls = class_for(_KEYED_DEFAULT)
        return cls.load(path, name, seed=seed, handle_signals=handle_signals)  # type: ignore[union-attr]
    return load_steps(path, name, capacity, seed=seed, handle_signals=handle_signals)


def load_steps(path, name: str | None = None, capacity: int | None = None, *, seed=None,
               handle_signals: bool | None = None):
    """A new step store holding a save's steps, streams and episodes, in the class that saved it.

    It sits above the store and the save format (``disk.save`` reads a save,
    ``store`` creates the buffer, ``Buffer.restore`` replays the steps), so
    neither of them needs to know about loading or facades.
    """
    manifest, state = open_save(path)
    facade = manifest["meta"].get("facade")
    if capacity is not None and facade and capacity != manifest["capacity"]:
        raise ValueError(f"capacity: a {facade!r} save keeps its own capacity "
                         f"({manifest['capacity']}); load it with capacity=None")
    same = capacity is None or capacity == manifest["capacity"]
    # Loading replays every saved stream through a writer of its own, all open at once.
    streams = len(np.unique(state["stream"])) if manifest["rows"] else 0
    saved_writers = manifest.get("max_writers")
    writers = max(streams + 1, saved_writers if isinstance(saved_writers, int) else 1, 128)
    meta = dict(manifest["meta"])
    packed = meta.pop(META_KEY, None)   # the saved buffer's compression: the new one keeps it
    ids = stepids.StepIds.of_meta(meta, int(manifest["chunk_size"]))
    meta.pop(stepids.META_KEY, None)    # the saved buffer's ids: the new one's descend from it
    cap = manifest["capacity"] if capacity is None else capacity
    state["rate"] = manifest.get("rate")

    def make(place: bool):
        """The new buffer, its steps restored; and whether the saved ids name them."""
        entry, base = None, None
        if manifest.get("priorities") is True:
            n_chunks = -(-int(manifest["capacity"]) // int(manifest["chunk_size"]))
            entry, place = ids.for_load(state.get("tickets"), n_chunks,
                                        place and same and manifest["rows"] <= cap)
            base = entry["base"] if place else None
        buf = store.create(dict(manifest["spec"]), cap, name=name,
                           chunk_size=manifest["chunk_size"] if same else None,
                           max_writers=min(writers, NO_SLOT - 1),
                           done_key=manifest.get("done_key"), seed=seed, meta=meta,
                           compress=None if packed is None else Compress.from_meta(
                               packed if same else dict(packed, hot_steps=None)),
                           handle_signals=handle_signals,
                           priorities=manifest.get("priorities") is True,
                           rate_limit=rate_limit_of(path, manifest), _step_ids=entry)
        try:
            return buf, restore_loaded(buf, state, base)
        except BaseException:
            buf.close()
            raise

    buf, placed = make(place=True)
    if placed is False:   # the saved ids would not name their steps: load them as stale
        buf.close()
        buf, _ = make(place=False)
    cls = class_for(facade) if isinstance(facade, str) else None
    return buf if cls is None else cls._from_buffer(buf)  # type: ignore[attr-defined]
