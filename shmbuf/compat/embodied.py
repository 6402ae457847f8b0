"""DreamerV3's replay (``embodied.replay.Replay``), drop-in and shared across processes.

``Replay`` keeps upstream's constructor, methods, shapes and directory
format, and its selectors (``Uniform``, ``Recency``, ``Prioritized``,
``Mixture``, ``Fifo``) keep upstream's constructors; nothing of DreamerV3 or
its ``elements`` package is imported.  Steps live in one shmbuf step store
without episode cuts (``is_first`` / ``is_last`` are ordinary columns), so
actors in other processes ``add`` straight into shared memory and any
process samples, sets priorities and writes replay context back.  The
deliberate differences from upstream are listed in docs/embodied.md.
"""
from __future__ import annotations

import collections
import os
import threading
import time
from collections.abc import Mapping

import numpy as np

from .._errors import (
    BufferClosedError,
    ForeignStepIdsError,
    NoFreeWriterSlotError,
    SegmentExistsError,
    SegmentNotFoundError,
)
from ..posix import procs as _procs
from ..posix import signals as _signals
from ..sampling.out import prepare_out
from ..segment import segment as _segment
from ..store import buffer as store
from ..store.reads import checked_priorities
from ..writing.cast import coerce, host_array
from ..writing.compress import Compress
from . import _embodied_disk as disk
from . import _embodied_draw as draw
from ._base import Facade, register
from ._embodied_select import Fifo, Mixture, Prioritized, Recency, Selector, Uniform

__all__ = ["Fifo", "Mixture", "Prioritized", "Recency", "Replay", "Uniform"]

_HIDDEN = ("item", "stream", "pos")   # the facade's own int64 columns (see _embodied_draw)
_DEFAULT_CAPACITY = 1_000_000
# An empty sample() says what it waits for after WAIT_NOTICE_FIRST seconds, then every
# WAIT_NOTICE_EVERY seconds (upstream prints its notice every 60 s, the first after 60 s).
WAIT_NOTICE_FIRST = 5.0
WAIT_NOTICE_EVERY = 60.0
_STORE_CHUNK = 128


class _Name:
    """The finalizer's resource while the constructing process answers for the name."""

    def __init__(self, name: str):
        self.name = name

    def unlink(self) -> None:
        try:
            _segment.unlink(self.name)
        except SegmentNotFoundError:
            raise FileNotFoundError(self.name) from None

    def close(self) -> None:
        pass


class _Stream:
    """One worker's stream in this process: its writer, id, next position, and the
    buffer's stop word (checked before an item's serial is taken)."""

    __slots__ = ("id", "pos", "stop", "writer")

    def __init__(self, writer, stop):
        self.writer = writer
        self.stop = stop
        self.id = draw.stream_id()
        self.pos = 0


@register
class Replay(Facade):
    """DreamerV3's ``Replay`` in shared memory; pickles to its name.

    Every ``length`` consecutive steps of one worker's stream form an item,
    across chunks and episodes.  ``len(replay)`` counts items and
    ``capacity`` bounds them, oldest evicted first, as upstream counts them.

    Args:
        length: steps per item, an int >= 1.
        capacity: items held (an int, or a float holding one); None: 1,000,000
            (memory is taken as the buffer fills).
        directory: where ``save`` writes and ``load`` reads upstream's chunk
            files; None: ``save`` and ``load`` do nothing, as upstream.
        chunksize: steps per chunk file (and per chunk of the shared store).
        online: serve each new item once, before the selector's draws (in
            ``sample(mode='train')``; items added by any process, upstream's
            rule: those whose last step's stream position is a multiple of
            ``length``).
        selector: one of this module's selectors; None: ``Uniform(seed)``.
        save_wait: accepted for upstream's signature (``save`` always
            finishes before it returns).
        name: upstream's label, used in messages (``replay.label``).
        seed: the seed of the default selector.
        spec: optional ``{key: (shape, dtype)}`` (or objects with ``shape``
            and ``dtype``) fixing the schema now instead of at the first ``add``.
        streams: worker streams that may add at the same time, in all
            processes together (default 16); the store keeps room for each.
        shm_name: the shared segment's name; generated if None.
        handle_signals: as ``shmbuf.create``: None (default) installs shmbuf's
            SIGTERM handler in the main thread if SIGTERM has its default
            action, so that SIGTERM removes the segment; False installs nothing.
        compress: keep image keys of cold chunks compressed in shared memory: True
            (every uint8 key of 2 or more dimensions, ``shmbuf.Compress``'s
            defaults), or a ``shmbuf.Compress`` naming the replay's keys.  None
            (default): raw.  Keys written back with ``update`` must stay raw.

    Raises:
        ValueError / TypeError: a bad argument, naming it (``length >
            capacity`` among them); nothing is created.

    Example:
        >>> replay = Replay(length=64, capacity=100_000)
        >>> replay.add({"image": frame, "is_first": True, "is_last": False,
        ...             "is_terminal": False, "action": a}, worker=0)
        >>> batch = replay.sample(16)   # batch["image"].shape == (16, 64, 64, 64, 3)
    """

    FACADE = "embodied.Replay"

    def __init__(self, length, capacity=None, directory=None, chunksize=1024, online=False,
                 selector=None, save_wait=False, name="unnamed", seed=0, *, spec=None,
                 streams: int = 16, shm_name: str | None = None,
                 handle_signals: bool | None = None, compress=None):
        params = _params(length, capacity, directory, chunksize, online, save_wait, name,
                         seed, streams)
        params["compress"] = _compress_param(compress)
        params["owner"] = [os.getpid(), _procs.my_start_time()]
        self.selector = _selector(selector, params["seed"])
        schema = None if spec is None else _schema_of_spec(spec)
        shm_name = _segment.generate_name() if shm_name is None else \
            _segment.validate_name(shm_name)
        _signals.check(handle_signals)
        self._track(shm_name, owner=True, resource=_Name(shm_name))
        self._setup(params)
        # SIGTERM unwinds and removes the segment, as for every owner (shmbuf.posix.signals).
        _signals.watch_or_close(self, handle_signals)
        if schema is not None:
            try:
                self._make(schema)
            except BaseException:
                self.close()
                raise

    # -- state of this handle -------------------------------------------------------
    def _setup(self, params: dict) -> None:
        """This handle's state from the replay's parameters (made, unpickled or attached)."""
        self._params = params
        self._shm_name: str = self._name  # type: ignore[assignment]  # _track set it first
        self.length = params["length"]
        self.capacity = params["capacity"]
        self.chunksize = params["chunksize"]
        self.online = params["online"]
        self.save_wait = params["save_wait"]
        self.label = params["label"]
        self.directory = None if params["directory"] is None else disk.Path(params["directory"])
        self._lock = threading.Lock()
        self._streams: dict = {}
        self._streams_pid = os.getpid()
        self._queue: collections.deque = collections.deque()
        self._online_seen = 0   # serials below this were offered to the online queue
        self._counts = {"samples": 0, "updates": 0}
        self._made_seen = 0
        self._items: draw.Items | None = None
        self._disk = disk.State()
        if not hasattr(self, "selector"):
            self.selector = Uniform(params["seed"])
        if self.buffer is not None:
            self._bind(self.buffer)

    def _bind(self, buffer) -> None:
        keys = buffer.meta["params"]["keys"]
        self._keys = [(k, tuple(shape), np.dtype(dtype)) for k, shape, dtype in keys]
        self._columns = {k: f"k{i}" for i, (k, _, _) in enumerate(self._keys)}
        self._spec = {self._columns[k]: (shape, dtype) for k, shape, dtype in self._keys}
        self._items = draw.Items(buffer, self.length, self.capacity)
        # The constructing handle counts and queues every item; a later one, from now on.
        self._made_seen = 0 if self.owner else self._items.made()
        self._online_seen = self._made_seen

    @property
    def shm_name(self) -> str:
        """The shared segment's name (``Replay.attach(shm_name)`` in any process)."""
        return self._shm_name

    # -- the store, made at the first add in any process ------------------------------
    def _make(self, schema: list) -> None:
        """Create the store for ``schema``; if another process did, attach and compare."""
        pid, start = self._params["owner"]
        if not self.owner and not _procs.is_alive(pid, start):
            # Its finalizer can no longer remove a segment made now: refuse to make one.
            raise BufferClosedError(f"add: replay {self.label!r} ({self._shm_name}) has no "
                                    f"store yet and the process that made it (pid {pid}) "
                                    "has ended")
        params = dict(self._params, keys=[[k, list(s), d.str] for k, s, d in schema])
        spec = {f"k{i}": (shape, dtype) for i, (_, shape, dtype) in enumerate(schema)}
        spec.update({c: ((), np.int64) for c in _HIDDEN})
        compress = _compress_for(params.get("compress"), schema)
        # Small chunks keep the room held for each stream's open chunk small (files
        # keep upstream's chunksize: _embodied_disk cuts them by stream position).
        k = min(params["chunksize"], _STORE_CHUNK)
        slack = params["streams"] * (params["length"] - 1 + k) + 2 * k
        steps = -(-(params["capacity"] + slack) // k) * k   # whole chunks, all of k rows
        try:
            buffer = store.create(spec, steps, name=self._shm_name,
                                  chunk_size=k, max_writers=params["streams"],
                                  done_key=None, seed=self.selector.seed,
                                  meta={"facade": self.FACADE, "params": params},
                                  overcommit=True, priorities=True, handle_signals=False,
                                  compress=compress)
        except SegmentExistsError:
            buffer = store.attach(self._shm_name, seed=self.selector.seed)
            self._adopt(buffer)
            self._check_schema(schema, "add")
            return
        # The constructing process answers for the name (its finalizer unlinks it); the
        # store's own finalizer must not unlink it when this process ends.
        buffer._disown()
        self._adopt(buffer)

    def _adopt(self, buffer) -> None:
        with self._lock:
            if self.buffer is None:
                self.buffer = buffer
                self._bind(buffer)
            else:
                buffer.close()

    def _ensure(self):
        """The store, attaching to it if another process made it; None while pending."""
        if self.buffer is not None:
            return self.buffer
        self._check_open()
        try:
            buffer = store.attach(self._shm_name, seed=self.selector.seed)
        except SegmentNotFoundError:
            return None
        self._adopt(buffer)
        return self.buffer

    def _check_schema(self, schema: list, verb: str) -> None:
        mine = [(k, s, d.str) for k, s, d in self._keys]
        theirs = [(k, s, d.str) for k, s, d in schema]
        if sorted(mine) != sorted(theirs):
            raise ValueError(f"{verb}: replay {self.label!r} has the schema {mine}, fixed by "
                             f"the first add; got {theirs}")

    # -- adding ---------------------------------------------------------------------
    def add(self, step, worker=0) -> None:
        """Append one step to ``worker``'s stream (keys starting with ``log/`` are dropped).

        The first ``add`` in any process fixes the keys, shapes and dtypes.

        Raises:
            KeyError: a key missing from, or unknown to, the fixed schema.
            ValueError / TypeError: a value of another shape, or one that
                would lose information in its column; nothing is written.
            NoFreeWriterSlotError: more than ``streams`` workers add at once.
            BufferClosedError: the replay was closed.
            WritersStoppedError: ``stop_writers()`` was called on the replay's buffer
                (``replay.buffer.stop_writers()``), in any process; every later add
                raises it too, so actor loops end.

        Example:
            >>> replay.add({"image": frame, "action": a, "is_first": True}, worker=3)
        """
        self._check_open()
        if not isinstance(step, Mapping):
            raise TypeError(f"add(step=...): expected a dict of arrays, got "
                            f"{type(step).__name__}")
        step = {k: v for k, v in step.items() if not k.startswith("log/")}
        if self._ensure() is None:
            self._make(_schema_of_step(step))
        values = self._coerced(step)
        s = self._stream(worker)
        # A stopped buffer refuses the step: check before an item's serial is taken, so
        # that a refused step counts no item (a stop that lands in between costs one).
        s.stop.check()
        item = self.buffer.next_serial() if s.pos >= self.length - 1 else -1
        s.writer.add(**values, item=item, stream=s.id, pos=s.pos)
        s.pos += 1

    def _coerced(self, step: dict) -> dict:
        names = {k for k, _, _ in self._keys}
        if step.keys() != names:
            raise KeyError(f"add: replay {self.label!r} has keys {sorted(names)} (fixed by "
                           f"the first add); missing {sorted(names - step.keys())}, unknown "
                           f"{sorted(step.keys() - names)}; nothing was written")
        return {self._columns[k]: coerce(f"add(step[{k!r}])", step[k], dtype, shape)
                for k, shape, dtype in self._keys}

    def _coerced_run(self, run: dict, n: int) -> dict:
        names = {k for k, _, _ in self._keys}
        if run.keys() != names:
            raise ValueError(f"load: the chunk files hold keys {sorted(run)}, but replay "
                             f"{self.label!r} has keys {sorted(names)}; nothing was loaded")
        return {self._columns[k]: coerce(f"load({k!r})", run[k], dtype, (n,) + shape)
                for k, shape, dtype in self._keys}

    def _stream(self, worker) -> _Stream:
        if self._streams_pid != os.getpid():   # a forked child: its own writers
            self._streams, self._streams_pid = {}, os.getpid()
        s = self._streams.get(worker)
        if s is None:
            with self._lock:
                s = self._streams.get(worker)
                if s is None:
                    try:
                        writer = self.buffer.writer()
                    except NoFreeWriterSlotError:
                        raise NoFreeWriterSlotError(
                            f"add(worker={worker!r}): replay {self.label!r} already has "
                            f"{self._params['streams']} workers adding (streams=); make it "
                            "with Replay(..., streams=N) for more") from None
                    s = self._streams[worker] = _Stream(
                        writer, self.buffer.port.stop_mark)
        return s

    # -- sampling -------------------------------------------------------------------
    def __len__(self) -> int:
        """Live items: ``min(items made by every process, capacity)``."""
        self._check_open()
        if self._ensure() is None:
            return 0
        lo, made = self._items.live()  # type: ignore[union-attr]  # bound with the buffer
        return made - lo

    def sample(self, batch, mode="train") -> dict:
        """``batch`` items: ``{key: (batch, length, ...)}`` plus ``stepid`` ``(batch, length, 20)``.

        Waits while the replay holds no item (as upstream), and prints what it
        waits for after 5 s, then every 60 s (upstream: every 60 s).  ``is_first`` is
        set at position 0 and ``is_last`` before every later ``is_first``.

        Args:
            batch: items, an int >= 1.
            mode: ``'train'`` (counted in ``stats()``, serves the online
                queue), ``'report'`` or ``'eval'``.

        Raises:
            ValueError / TypeError: a bad ``batch`` or ``mode``.
            BufferClosedError: the replay was closed.

        Example:
            >>> data = replay.sample(16)
            >>> replay.update({"stepid": data["stepid"], "priority": loss})
        """
        if mode not in ("train", "report", "eval"):
            raise ValueError(f"sample: mode must be 'train', 'report' or 'eval', got {mode!r}")
        if isinstance(batch, bool) or not isinstance(batch, (int, np.integer)) or batch < 1:
            raise ValueError(f"sample: batch must be an int >= 1, got {batch!r}")
        items = self._items
        made = 0 if items is None else items.made()
        if not made:
            self._wait_items()
            items = self._items
            made = items.made()  # type: ignore[union-attr]  # bound once an item exists
        queued = None
        if self.online and mode == "train":
            # Upstream's online queue, fed by every process: the items made since this
            # handle last looked whose last step's stream position is a multiple of length.
            found, self._online_seen = items.online(self._online_seen)  # type: ignore[union-attr]
            self._queue.extend(found)
            queued = self._queue
        batch = int(batch)
        targets = prepare_out(None, self._spec, (batch, self.length), ids=_STEPID)
        data = {k: targets[self._columns[k]] for k, _, _ in self._keys}
        data["stepid"] = targets["ids"]
        items.sample(draw.Draw(items, self.selector, queued, made), batch, targets)  # type: ignore[union-attr, arg-type]  # bound once the buffer exists
        if mode == "train":
            self._counts["samples"] += batch
        return _annotated(data)

    def _wait_items(self) -> None:
        """Return once the replay holds an item; say so while it waits (see ``WAIT_NOTICE_*``)."""
        if len(self) > 0:
            return
        start = time.monotonic()
        notice = start + WAIT_NOTICE_FIRST
        pause = 1e-4
        while len(self) == 0:
            now = time.monotonic()
            if now >= notice:
                print(self._empty_notice(now - start), flush=True)
                notice = now + WAIT_NOTICE_EVERY
            time.sleep(min(pause, max(notice - now, 0.0)))
            pause = min(2 * pause, 0.02)

    def _empty_notice(self, waited: float) -> str:
        buffer = self._ensure()
        held = ("no step was added yet" if buffer is None else
                f"{buffer.stats().live_steps} steps held, no stream has {self.length} yet")
        return (f"Replay buffer {self.label} is empty, waited {waited:.1f}s: sample() waits "
                f"for its first item, {self.length} consecutive steps added to one worker's "
                f"stream by any process ({held}; segment {self._shm_name})")

    # -- priorities and replay context ----------------------------------------------
    def update(self, data) -> None:
        """Set priorities and write replay context back, by ``stepid``, from any process.

        Args:
            data: ``{"stepid": (B, T, 20) uint8 from sample, "priority":
                optional (B, T) floats >= 0, key: (B, T', ...) for T' <= T}``;
                each other key is written into the steps the ids name.
                Steps evicted meanwhile are skipped; no other step is touched.

        Raises:
            KeyError: no ``stepid``, or a key the replay does not hold.
            ValueError / TypeError: ids of the wrong shape, dtype or replay; a
                priority that is negative, NaN or infinite; a value of the
                wrong shape or a lossy one.  Nothing is written.

        Example:
            >>> replay.update({"stepid": data["stepid"], "priority": np.abs(td)})
        """
        self._check_open()
        if not isinstance(data, Mapping):
            raise TypeError(f"update(data=...): expected a dict, got {type(data).__name__}")
        if "stepid" not in data:
            raise KeyError(f"update: data has no 'stepid' (keys {sorted(data)})")
        data = dict(data)
        stepid = host_array(data.pop("stepid"))
        priority = data.pop("priority", None)
        if self._ensure() is None:
            raise ValueError(f"update: replay {self.label!r} holds no step yet")
        ids = self._ids(stepid)
        stored = None
        if priority is not None:
            priority = host_array(priority)
            if priority.shape != ids.shape:
                raise ValueError(f"update: priority has shape {priority.shape}, expected "
                                 f"{ids.shape} (batch, length) like stepid")
            checked_priorities(ids, priority.astype(np.float64)
                               if priority.dtype.kind == "f" else priority)
            prios = self.selector._prioritized()
            stored = prios[0].stored(priority) if prios else priority
            _, stored = checked_priorities(ids, stored)
        context = self._context(data, ids.shape)
        if stored is not None:
            self.buffer.update_priorities(ids, stored.reshape(ids.shape))
        for column, (width, values) in context.items():
            self.buffer.write_steps(np.ascontiguousarray(ids[:, :width]), **{column: values})
        self._counts["updates"] += int(ids.size)

    def _ids(self, stepid: np.ndarray) -> np.ndarray:
        if stepid.dtype != np.uint8 or stepid.ndim != 3 or stepid.shape[-1] != 20:
            raise ValueError(f"update: stepid must be (batch, length, 20) uint8 as sample() "
                             f"returns it, got shape {stepid.shape} dtype {stepid.dtype}")
        flat = np.ascontiguousarray(stepid).reshape(-1, 20)
        ids = flat[:, :8].copy().view(np.int64).reshape(stepid.shape[:2])
        # The step ids carry their buffer's tag (the core's rule, protocol.stepids).
        at = self.buffer.port.first_foreign(ids)
        if at is not None:
            raise ForeignStepIdsError(
                f"update: stepid[{at // stepid.shape[1]}, {at % stepid.shape[1]}] was not "
                f"sampled from replay {self.label!r} ({self.shm_name}); nothing was written")
        return ids

    def _context(self, data: dict, lead: tuple) -> dict:
        out = {}
        known = {k: (shape, dtype) for k, shape, dtype in self._keys}
        for key, value in data.items():
            if key not in known:
                raise KeyError(f"update: replay {self.label!r} has no key {key!r} (keys "
                               f"{sorted(known)}); nothing was written")
            shape, dtype = known[key]
            value = host_array(value)
            width = value.shape[1] if value.ndim >= 2 else -1
            if value.ndim < 2 or value.shape[0] != lead[0] or not 1 <= width <= lead[1]:
                raise ValueError(f"update: data[{key!r}] has shape {value.shape}; expected "
                                 f"({lead[0]}, T, *{shape}) with 1 <= T <= {lead[1]}; "
                                 "nothing was written")
            out[self._columns[key]] = (width, coerce(f"update(data[{key!r}])", value, dtype,
                                                     (lead[0], width) + shape))
        return out

    # -- counters -------------------------------------------------------------------
    def stats(self) -> dict:
        """Upstream's counters; ``inserts``, ``samples`` and ``updates`` reset on read.

        ``inserts`` counts items made by every process since this handle's
        last ``stats()``; ``samples`` and ``updates`` count this handle's.

        Example:
            >>> replay.stats()["replay_ratio"]
        """
        self._check_open()
        buffer = self._ensure()
        made = 0 if buffer is None else self._items.made()  # type: ignore[union-attr]
        inserts, self._made_seen = made - self._made_seen, made
        samples, updates = self._counts["samples"], self._counts["updates"]
        self._counts = {"samples": 0, "updates": 0}
        s = None if buffer is None else buffer.stats()
        return {
            "items": len(self),
            "chunks": 0 if s is None else s.chunks_in_use,
            "streams": 0 if s is None else s.streams,
            "ram_gb": 0.0 if s is None else s.reserved_bytes / 1024 ** 3,
            "inserts": inserts,
            "samples": samples,
            "updates": updates,
            "replay_ratio": self.length * samples / inserts if inserts else np.nan,
        }

    # -- upstream's chunk directory -------------------------------------------------
    def save(self):  # type: ignore[override]  # upstream's save(), not Facade.save(path)
        """Write the chunks that hold live items into ``directory``, upstream's format.

        Chunks written by an earlier ``save`` of this handle are not written
        again (a chunk that grew since is continued in a new file).
        Returns None, as upstream; does nothing without a ``directory``.

        Example:
            >>> replay.save(); replay2.load()
        """
        self._check_open()
        if self.directory is None or self._ensure() is None:
            return
        disk.save(self, self.directory)
        return

    def load(self, data=None, directory=None, amount=None) -> None:  # type: ignore[override]  # upstream's instance method, not Facade.load
        """Add the newest chunks of an upstream-format directory, up to ``amount`` items.

        Chunk files this handle saved or loaded are skipped; a chunk file
        that cannot be read is skipped (as upstream).

        Args:
            data: ignored (``save()`` returns None), as upstream.
            directory: default the constructor's ``directory``.
            amount: items to load; default ``capacity``.

        Raises:
            ValueError: the files hold other keys or shapes than the replay.

        Example:
            >>> replay = Replay(64, 100_000, directory="logdir/replay")
            >>> replay.load()
        """
        self._check_open()
        directory = directory or self.directory
        if not directory:
            return
        disk.load(self, disk.Path(directory), amount or self.capacity)
        if self._items is not None:   # loaded items are not new: never queued as online
            self._online_seen = self._items.made()

    # -- sharing ----------------------------------------------------------------------
    def __reduce__(self):
        return _unpickle, (self._shm_name, self._params, self.selector)

    def _release(self) -> None:
        for s in list(self._streams.values()):
            if self._streams_pid == os.getpid():
                s.writer.close()
        self._streams = {}
        _signals.forget(self)
        super()._release()

    def __repr__(self):
        state = "closed" if self._closed else f"{len(self)} items"
        return f"<embodied.Replay {self.label!r} {self._shm_name!r} {state}>"


def _unpickle(shm_name: str, params: dict, selector) -> Replay:
    self = Replay.__new__(Replay)
    self.selector = selector
    self._track(shm_name, owner=False)
    self._setup(params)
    self._ensure()
    return self


# -- helpers ------------------------------------------------------------------------
def _params(length, capacity, directory, chunksize, online, save_wait, name, seed,
            streams) -> dict:
    length = _int("length", length, 1)
    capacity = _DEFAULT_CAPACITY if capacity is None else _int("capacity", capacity, 1)
    if length > capacity:
        raise ValueError(f"length ({length}) must be <= capacity ({capacity}): an item of "
                         f"{length} steps needs room for {length} items' worth of steps")
    for arg, value in (("online", online), ("save_wait", save_wait)):
        if not isinstance(value, (bool, np.bool_)):
            raise TypeError(f"{arg} must be True or False, got {value!r}")
    if not isinstance(name, str):
        raise TypeError(f"name must be a str (upstream's label), got {name!r}")
    return {"length": length, "capacity": capacity,
            "directory": None if directory is None else os.fspath(directory),
            "chunksize": _int("chunksize", chunksize, 1), "online": bool(online),
            "save_wait": bool(save_wait), "label": name, "seed": _int("seed", seed, 0),
            "streams": _int("streams", streams, 1)}


def _compress_param(compress) -> dict | None:
    """``compress=`` as the replay's parameters record it (plain JSON, checked now)."""
    if compress is None or compress is False:
        return None
    if compress is True:
        return {"keys": None, "codec": "zstd", "level": 1, "hot_steps": None}
    if not isinstance(compress, Compress):
        raise TypeError(f"compress must be True, False, None or a shmbuf.Compress, "
                        f"got {compress!r}")
    return {"keys": list(compress.columns), "codec": compress.codec, "level": compress.level,
            "hot_steps": compress.hot_steps}


def _compress_for(conf: dict | None, schema: list) -> Compress | None:
    """The store's ``Compress`` for the replay's ``conf`` once its keys are known."""
    if conf is None:
        return None
    names = [k for k, _, _ in schema]
    keys = conf["keys"]
    if keys is None:    # True: the images
        keys = [k for k, shape, dtype in schema if dtype == np.uint8 and len(shape) >= 2]
        if not keys:
            return None
    for k in keys:
        if k not in names:
            raise ValueError(f"compress: columns names {k!r}, which is not a key of the "
                             f"replay; its keys are {sorted(names)}")
    return Compress([f"k{names.index(k)}" for k in keys], codec=conf["codec"],
                    level=conf["level"], hot_steps=conf["hot_steps"])


def _int(arg: str, value, lo: int) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)   # upstream's perf test passes capacity=1e5
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or \
            value < lo:
        raise ValueError(f"{arg} must be an int >= {lo}, got {value!r}")
    return int(value)


def _selector(selector, seed) -> Selector:
    if selector is None:
        return Uniform(seed)
    if not isinstance(selector, Selector):
        raise TypeError(f"selector must be one of Uniform, Recency, Prioritized, Mixture, "
                        f"Fifo of shmbuf.compat.embodied (or None for Uniform(seed)), got "
                        f"{selector!r}")
    return selector


def _schema_of_step(step: dict) -> list:
    out = []
    for key, value in step.items():
        arr = host_array(value)
        if arr.dtype.kind not in "biuf":
            raise TypeError(f"add(step[{key!r}]): {arr.dtype} values cannot be stored; "
                            "expected bool, integer or float arrays")
        out.append((key, tuple(arr.shape), arr.dtype))
    if not out:
        raise ValueError("add: the step has no keys (after dropping 'log/' keys)")
    return out


def _schema_of_spec(spec) -> list:
    if not isinstance(spec, Mapping) or not spec:
        raise TypeError(f"spec must be a non-empty dict of key -> (shape, dtype), got {spec!r}")
    out = []
    for key, entry in spec.items():
        if not isinstance(key, str) or key.startswith("log/"):
            raise ValueError(f"spec: key {key!r} must be a str not starting with 'log/'")
        shape, dtype = (entry.shape, entry.dtype) if hasattr(entry, "dtype") else entry
        dtype = np.dtype(dtype)
        if dtype.kind not in "biuf":
            raise TypeError(f"spec[{key!r}]: dtype {dtype} cannot be stored")
        out.append((key, tuple(int(d) for d in shape), dtype))
    return out


# A stepid's 20 bytes: the store's step id (8 bytes in native order, its buffer's tag
# included), then zeros; sample() has the store write the ids straight into them.
_STEPID = ((20,), np.dtype(np.uint8))


def _annotated(data: dict) -> dict:
    """``is_first`` set at position 0 and ``is_last`` before every later ``is_first``,
    in place: the arrays are the batch's own."""
    if "is_first" in data:
        first = data["is_first"]
        first[:, 0] = True
        if "is_last" in data:
            last = data["is_last"]
            if last.dtype == first.dtype:
                last[:, :-1] |= first[:, 1:]
            else:
                following = np.zeros_like(first)
                following[:, :-1] = first[:, 1:]
                data["is_last"] = last | following
    return data

