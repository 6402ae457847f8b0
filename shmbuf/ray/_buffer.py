"""``ShardedBuffer``: the table of shards, and what a trainer or a worker does with it."""
from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np
import ray

import shmbuf
from shmbuf._args import generator
from shmbuf.ray import _ids, _sampler
from shmbuf.ray._count import MODES, modes
from shmbuf.ray._errors import ShardLostError, is_loss
from shmbuf.ray._placement import ShardEntry, actor_name, alive_nodes, make_entry, start_shards
from shmbuf.ray._shard import META_KEY, node_id
from shmbuf.ray._writers import LocalWriter, ShippingWriter
from shmbuf.select import resolve

log = logging.getLogger("shmbuf.ray")
_LOCAL_CHECK_S = 1.0

@dataclasses.dataclass(frozen=True)
class ShardStats:
    """One shard's entry in ``ShardedBuffer.stats()``.

    ``health`` is ``"ok"``, or ``"lost"`` with ``error`` saying why (a lost
    shard's counters are zeros).  The rates (steps written by every writer of
    the shard, and remote batches it served, per second) run from the previous
    ``stats()`` call that reached the shard, from any process, or its start.
    """

    node_id: str
    buffer: str
    health: str
    local: bool
    live_steps: int = 0
    steps_written: int = 0
    episodes: int = 0
    capacity: int = 0
    writers: int = 0
    writers_stopped: bool = False   # stop_writers() is in force on this shard
    remote_writers: int = 0
    ingest_steps_per_s: float = 0.0
    samples_per_s: float = 0.0
    steps_received: int = 0
    blocks_received: int = 0
    samples_served: int = 0
    windows_served: int = 0
    error: str = ""


class ShardedBuffer:
    """A replay buffer with one shard per node; make one with ``create`` or ``connect``.

    Pickles into Ray tasks and actors as a handle (names and actor handles,
    never data); the copy never closes the shards.
    """

    def __init__(self, name: str, namespace: str, spec: dict, capacity: int, options: dict,
                 node_resource: str | bool | None, entries: list, *, owner: bool, seed=None,
                 timeout_s: float = 60.0):
        self.name, self.namespace = name, namespace
        self._spec = {k: (tuple(s), np.dtype(d)) for k, (s, d) in spec.items()}
        self._capacity, self._options = capacity, dict(options)
        self._node_resource = node_resource
        self._entries = {e.node_id: e for e in entries}
        self._lost_entries: dict[str, tuple[ShardEntry, str]] = {}
        self._owner = owner
        self._seed = seed
        self._rng = np.random.default_rng(seed)
        self._timeout = float(timeout_s)
        self._attachments: dict[str, shmbuf.Buffer] = {}
        self._local_checked = 0.0
        self._counts = _sampler.Counts()
        self.timing = _sampler.new_timing()
        self._closed = False

    # -- identity -----------------------------------------------------------------------
    @property
    def spec(self) -> dict:
        return dict(self._spec)

    @property
    def capacity_per_shard(self) -> int:
        return self._capacity

    @property
    def owner(self) -> bool:
        return self._owner

    @property
    def shards(self) -> list[ShardEntry]:
        """The live shards, as they reported themselves."""
        return list(self._entries.values())

    @property
    def closed(self) -> bool:
        return self._closed

    def __repr__(self):
        return (f"<shmbuf.ray.ShardedBuffer {self.name!r} namespace={self.namespace!r} "
                f"shards={len(self._entries)}{' owner' if self._owner else ''}>")

    # -- writing ----------------------------------------------------------------------
    def writer(self, *, block_steps: int | None = None, max_inflight_bytes: int = 64 << 20,
               shard: str | None = None):
        """A writer for this process: shared memory if this node has a shard, else shipping.

        Args:
            block_steps: rows per stream in one shipped block (default: the
                shard's chunk size, so whole chunks travel).
            max_inflight_bytes: shipped bytes not yet written by the shard;
                past it, ``add`` waits for the oldest block (backpressure).
            shard: node id of the shard to ship to (default: this node's
                shard if any, else one chosen at random).

        Raises:
            ShardLostError: no live shard (on node ``shard``, if given).

        Example:
            >>> w = rb.writer(); w.add(obs=o, action=a, reward=r, done=d); w.close()
        """
        self._check_open()
        here = node_id()
        if shard is not None and shard not in self._entries:
            raise ShardLostError(f"{self!r} has no live shard on node {shard!r}; its shards "
                                 f"are on {sorted(self._entries)}")
        entry = self._entries.get(shard or here) or (None if shard else self._find(here))
        if entry is not None and entry.node_id == here:
            return LocalWriter(self._attached(entry), here, self._describe(entry))
        if entry is None:
            live = self.shards
            if not live:
                raise ShardLostError(f"{self!r} has no live shard to write to")
            entry = live[int(self._rng.integers(len(live)))]
        return ShippingWriter(entry.actor, entry.node_id, self._spec,
                              block_steps=block_steps or entry.chunk_size,
                              max_inflight_bytes=max_inflight_bytes, timeout_s=self._timeout,
                              describe=self._describe(entry))

    def _find(self, node: str) -> ShardEntry | None:
        """A shard on ``node`` made after this handle was (refresh from another process)."""
        try:
            actor = ray.get_actor(actor_name(self.name, node), namespace=self.namespace)
            entry = make_entry(actor, ray.get(actor.info.remote(), timeout=self._timeout))
        except Exception as exc:
            if isinstance(exc, ValueError) or is_loss(exc):
                return None
            raise
        self._entries[entry.node_id] = entry
        return entry

    def _attached(self, entry: ShardEntry) -> shmbuf.Buffer:
        """The shard's buffer, attached by name: only ever the shard of this node."""
        buf = self._attachments.get(entry.node_id)
        if buf is None:
            here = node_id()
            if entry.node_id != here:
                raise RuntimeError(f"refusing to attach to the shard of node {entry.node_id} "
                                   f"from node {here}: only a node's own shard is read "
                                   "through shared memory")
            buf = shmbuf.attach(entry.buffer)
            meta = buf.meta
            if meta.get(META_KEY) != self.name or meta.get("node_id") != here:
                buf.close()
                raise RuntimeError(f"segment {entry.buffer!r} is not the shard of {self.name!r} "
                                   f"on node {here} (its meta: {meta})")
            self._attachments[entry.node_id] = buf
        return buf

    def _local_shard(self) -> ShardEntry | None:
        return self._entries.get(node_id())

    def _local_alive(self, entry: ShardEntry) -> bool:
        """Is this node's shard process alive?  Checked at most once a second; a dead
        one is dropped like a remote shard whose call failed."""
        now = time.monotonic()
        if now - self._local_checked < _LOCAL_CHECK_S:
            return True
        self._local_checked = now
        if self._attached(entry).stats().owner_alive:
            return True
        self._lost(entry, ShardLostError(f"{self._describe(entry)}: its process died"))
        return False

    # -- sampling ---------------------------------------------------------------------
    def sample_sequences(self, batch_size: int, length: int, *, time_major: bool = True,
                         out: dict | None = None, rng=None, tail: int = 0,
                         uniform: str | None = None, newest: int | None = None,
                         select=None, ids: bool = False) -> dict:
        """``batch_size`` windows uniform over all valid windows (or episodes) of all shards.

        Each shard's share is drawn multinomially in proportion to its valid
        starts (its eligible finished episodes with ``uniform="episodes"``,
        its total score with ``select=Prioritized(...)``);
        this node's shard is read from shared memory, the others sample on
        their nodes and send one batch each.  Windows are grouped by shard
        along the batch axis (shuffle before slicing the batch).

        Args:
            batch_size: as ``shmbuf.Buffer.sample_sequences``.
            length: as ``shmbuf.Buffer.sample_sequences``.
            time_major: as ``shmbuf.Buffer.sample_sequences``.
            tail: as ``shmbuf.Buffer.sample_sequences``.
            out: optional dict of C-contiguous numpy arrays or CPU torch
                tensors of the batch's shapes.
            rng: a ``np.random.Generator`` or seed for the split and the
                shards' draws; default this handle's generator (``seed=``).
            uniform: ``"steps"`` (the default unless ``select`` is given):
                every valid start of every shard is equally likely.  ``"episodes"``: every finished
                episode of every shard that is still held and has at least
                ``length - tail`` steps is equally likely, the start uniform
                within it (as ``shmbuf.Buffer.sample_sequences``).
            newest: None only: each shard numbers its episodes in its own
                index, so "the newest K episodes" has no meaning across shards.
            select: ``Uniform()``, ``Prioritized(...)``, ``AgeBuckets`` with
                one weight (``uniform="episodes"``) or a ``Mixture`` of them
                (``shmbuf.select``), drawn globally: a Mixture's windows are
                split by its fractions, then each component's over the shards
                by that component's weights.  ``Recency`` and ``AgeBuckets``
                with several groups are refused: the shards have no common
                publish order or episode order.

        Returns:
            ``{column: array}`` of shape ``(length, batch_size, ...)`` (time-major),
            or the ``out`` objects.

            ids: also return ``"ids"`` (int64, the batch's layout) for
                ``update_priorities``: each names its shard in its top bits
                (``shmbuf.ray._ids``), so any handle routes it back.  Shards
                made with ``priorities=True`` only.

        Raises:
            NotEnoughDataError: no shard holds a valid window (or an eligible
                finished episode) yet.
            ShardLostError: every shard is gone.
            ValueError: a bad argument, ``newest`` or a regime with no global
                meaning included.

        Example:
            >>> batch = rb.sample_sequences(50, 50)
            >>> per_episode = rb.sample_sequences(50, 50, uniform="episodes")
        """
        self._check_open()
        batch_size, length, tail, mix = self._sample_args(batch_size, length, tail, uniform,
                                                          newest, select)
        gen = self._rng if rng is None else generator("rng", rng)
        lead = (length, batch_size) if time_major else (batch_size, length)
        if not isinstance(ids, bool):
            raise TypeError(f"ids must be True or False, got {ids!r}")
        if ids and not self._options.get("priorities"):
            raise ValueError("sample_sequences(..., ids=True) needs shards made with "
                             "shmbuf.ray.create(..., priorities=True)")
        arrays = _out_arrays(out, dict(self._spec, ids=((), np.dtype(np.int64)))
                             if ids else self._spec, lead)
        p = _sampler.plan(self, batch_size, length, tail, time_major, gen, mix=mix, ids=ids)
        _sampler.finish(self, p, arrays, gen, self.timing)
        return arrays if out is None else out

    def update_priorities(self, ids, priorities) -> int:
        """Set the priorities of steps sampled with ``ids=True``, each on the shard holding it.

        This node's shard is written in shared memory; the others get one
        call each (in parallel).  Ids of a shard that is gone are skipped.

        Args:
            ids: as ``shmbuf.Buffer.update_priorities``; the ids from this (or
                any) handle's ``sample_sequences(..., ids=True)``.
            priorities: as ``shmbuf.Buffer.update_priorities``.

        Returns:
            How many entries named a held step.

        Raises:
            ValueError / TypeError: as ``shmbuf.Buffer.update_priorities``,
                before anything is written on any shard.

        Example:
            >>> batch = rb.sample_sequences(50, 50, select=Prioritized(), ids=True)
            >>> rb.update_priorities(batch["ids"], td_error)
        """
        self._check_open()
        if not self._options.get("priorities"):
            raise ValueError("update_priorities needs shards made with "
                             "shmbuf.ray.create(..., priorities=True)")
        flat, values = shmbuf.store.reads.checked_priorities(ids, priorities)
        tags, local = _ids.split(flat)
        shards = {_ids.tag_of(s.buffer): s for s in self._live()}
        here, updated, calls = self._local_shard(), 0, []
        for tag in np.unique(tags).tolist():
            s = shards.get(tag)
            if s is None:
                continue   # its shard is gone: the ids are stale
            mine = tags == tag
            if s is here and self._local_alive(s):
                buf = self._attached(s)
                updated += buf.update_priorities(_ids.for_shard(local[mine], buf), values[mine])
            else:
                calls.append((s, s.actor.update_priorities.remote(local[mine], values[mine])))
        for s, ref in calls:
            try:
                updated += ray.get(ref, timeout=self._timeout)
            except Exception as exc:
                if not is_loss(exc):
                    raise
                self._lost(s, exc)
        return updated

    @property
    def port(self) -> "_FeedDoor":
        """What shmbuf's feeds (``prefetch``) ask of a source at their door: its checks."""
        return _FeedDoor(self._sample_args)

    def _sample_args(self, batch_size, length, tail=0, uniform=None, newest=None, select=None):
        """Checked ``(batch_size, length, tail, mix)``, ``mix`` the ``(fraction, mode)``
        pairs of ``_count.modes`` (``shmbuf.feed.prefetch`` calls it too)."""
        for arg, v, lo in (("batch_size", batch_size, 1), ("length", length, 1),
                           ("tail", tail, 0)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
                raise ValueError(f"{arg} must be an int >= {lo}, got {v!r}")
        if length > self._capacity or tail >= length:
            raise ValueError(f"need tail < length <= capacity_per_shard ({self._capacity}), "
                             f"got length {length}, tail {tail}")
        if uniform is not None and (not isinstance(uniform, str) or uniform not in MODES):
            raise ValueError(f"uniform must be one of {MODES}, got {uniform!r}")
        if newest is not None:
            raise ValueError(f"a sharded buffer takes newest=None only, got newest={newest!r}: "
                             "each shard numbers its episodes in its own index, so there is "
                             "no global order of the newest episodes across shards")
        mix = modes(resolve(select, uniform, None))
        return int(batch_size), int(length), int(tail), mix

    def prefetch(self, batch_size: int, length: int, *, depth: int = 2, device=None,
                 pin_memory: bool | None = None, rng=None, **sample_kwargs):
        """Global batches made ahead by a background thread: ``shmbuf``'s own prefetcher.

        The same iterator as ``shmbuf.Buffer.prefetch`` (``shmbuf.feed.prefetch``):
        ``depth`` preallocated batches of torch tensors (pinned and copied on
        a side stream for CUDA), each valid until the next ``next()``; errors
        in the thread are raised by ``next()``.  Each batch's remote shares
        are requested before its local share is sampled, so the network and
        the other nodes work while this node gathers, and the whole batch is
        made while the trainer trains on the previous one.

        Args:
            device: ``"cpu"`` or ``"cuda[:N]"``; default CUDA when available.
            rng: seed or generator of the thread's draws (default: one drawn
                from this handle's generator).
            **sample_kwargs: ``time_major``, ``tail``, ``uniform``, ``select``
                (as ``sample_sequences``).

        Example:
            >>> with rb.prefetch(50, 50, depth=2, device="cuda") as batches:
            ...     for batch in batches: ...
        """
        from shmbuf.feed.prefetch import Prefetcher

        self._check_open()
        if device is None:
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        gen = (np.random.default_rng(self._rng.integers(1 << 63)) if rng is None
               else generator("rng", rng))
        return Prefetcher(self, batch_size, length, depth=depth, device=device,
                          pin_memory=pin_memory, rng=gen, **sample_kwargs)

    def wait_ready(self, min_steps: int = 1, timeout: float | None = None) -> int:
        """Poll ``stats()`` until the live shards hold ``min_steps`` steps; return the sum."""
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = 0.01
        while True:
            total = sum(s.live_steps for s in self.stats() if s.health == "ok")
            if total >= min_steps:
                return total
            if deadline is not None and time.monotonic() > deadline:
                raise shmbuf.WaitTimeoutError(f"{self!r} holds {total} live steps after "
                                              f"{timeout} s; wanted {min_steps}")
            time.sleep(pause)
            pause = min(pause * 2, 0.2)

    # -- shards coming and going --------------------------------------------------------
    def _live(self) -> list[ShardEntry]:
        return list(self._entries.values())

    def _is_live(self, entry: ShardEntry) -> bool:
        return entry.node_id in self._entries

    def _lost(self, entry: ShardEntry, exc: BaseException) -> None:
        """Drop a shard that failed: log it; sampling goes on with the others."""
        if self._entries.pop(entry.node_id, None) is None:
            return
        buf = self._attachments.pop(entry.node_id, None)
        if buf is not None:
            buf.close()
        self._lost_entries[entry.node_id] = (entry, f"{type(exc).__name__}: {exc}"[:500])
        log.warning("shmbuf.ray: dropped the shard of %r on node %s (%s); sampling goes on "
                    "with %d shard(s)", self.name, entry.node_id, type(exc).__name__,
                    len(self._entries))

    def refresh(self, nodes: list[str] | None = None) -> dict:
        """Give a shard to every alive node that matches and has none; drop dead nodes' shards.

        Call it after nodes join (an autoscaler, ``ray start`` on a new
        machine) or a shard's actor died.  The nodes that match are those of ``create``'s
        ``node_resource`` (every node if None); a buffer made with an
        explicit ``nodes=`` list grows only by the ``nodes`` given here.
        Idempotent and safe from any process: shard names are a function of
        the node id, so two callers get the same actor.

        Returns:
            ``{"added": [node ids], "dropped": [node ids]}``.
        """
        self._check_open()
        alive = alive_nodes(None)
        dropped = [n for n in list(self._entries) if n not in alive]
        for n in dropped:
            self._lost(self._entries[n], ShardLostError(f"node {n} is no longer alive"))
        dropped += self._ping()
        alive = [n for n in (alive_nodes(self._node_resource) if nodes is None else nodes)
                 if n in alive]
        wanted = [n for n in alive if n not in self._entries]
        added = start_shards(self.name, self.namespace, self._spec, self._capacity,
                              self._options, wanted, self._timeout, self._node_resource)
        for e in added:
            self._entries[e.node_id] = e
            self._lost_entries.pop(e.node_id, None)
        return {"added": [e.node_id for e in added], "dropped": dropped}

    def _ping(self) -> list[str]:
        """Drop the shards that do not answer (an actor that died on a live node)."""
        entries = self._live()
        answered = {e.node_id for e, _ in self._on_every_shard("info")}
        return [e.node_id for e in entries if e.node_id not in answered]

    def _on_every_shard(self, method: str) -> list[tuple[ShardEntry, object]]:
        """Call ``method`` on every live shard at once; ``(shard, reply)`` of those that
        answered.  A shard whose call failed because it is gone is dropped (``_lost``)."""
        entries = self._live()
        refs = [getattr(e.actor, method).remote() for e in entries]
        out = []
        for e, ref in zip(entries, refs):
            try:
                out.append((e, ray.get(ref, timeout=self._timeout)))
            except Exception as exc:
                if not is_loss(exc):
                    raise
                self._lost(e, exc)
        return out

    # -- counters and lifecycle ---------------------------------------------------------
    def stop_writers(self) -> None:
        """``shmbuf.Buffer.stop_writers`` on every live shard, from any process.

        Writers on a shard's node raise ``WritersStoppedError`` at their next
        ``add``; a shipping writer raises it when it ships or flushes a block
        the stopped shard refuses (the steps it staged before are refused with
        that block).  Either writer may go on after ``resume_writers``.

        Example:
            >>> rb.stop_writers()     # every actor's add() raises WritersStoppedError
        """
        self._check_open()
        self._on_every_shard("stop_writers")

    def resume_writers(self) -> None:
        """Undo ``stop_writers`` on every live shard.

        Example:
            >>> rb.resume_writers()
        """
        self._check_open()
        self._on_every_shard("resume_writers")

    def stats(self) -> list[ShardStats]:
        """One entry per shard, live or lost: node, live steps, rates, health."""
        self._check_open()
        here = node_id()
        out = [ShardStats(health="ok", local=e.node_id == here, **s)   # type: ignore[arg-type]
               for e, s in self._on_every_shard("stats")]
        for e, why in self._lost_entries.values():
            out.append(ShardStats(e.node_id, e.buffer, "lost", e.node_id == here, error=why))
        return out

    def close(self) -> None:
        """Owner: close every shard (each unlinks its segment) and end its actor.

        Any other handle only unmaps what it attached.  Idempotent.
        """
        if self._closed:
            return
        self._closed = True
        for buf in self._attachments.values():
            buf.close()
        self._attachments.clear()
        if not self._owner:
            return
        entries = self._live()
        refs = [e.actor.close.remote() for e in entries]
        for e, ref in zip(entries, refs):
            try:
                ray.get(ref, timeout=self._timeout)
            except Exception as exc:
                if not is_loss(exc):
                    log.warning("closing the shard on node %s: %r", e.node_id, exc)
            ray.kill(e.actor, no_restart=True)

    def _check_open(self) -> None:
        if self._closed:
            raise shmbuf.BufferClosedError(f"{self!r} is closed")

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __reduce__(self):
        args = (self.name, self.namespace, self._spec, self._capacity, self._options,
                self._node_resource, self._live())
        return _rebuild, (args, self._timeout)

    def _describe(self, entry: ShardEntry) -> str:
        return f"the shard of {self.name!r} on node {entry.node_id} ({entry.buffer})"


def _out_arrays(out, spec: dict, lead: tuple) -> dict:
    """Numpy arrays to fill: fresh ones, or views of the caller's arrays or CPU tensors."""
    if out is None:
        return {k: np.empty(lead + s, d) for k, (s, d) in spec.items()}
    if not isinstance(out, dict) or out.keys() != spec.keys():
        raise ValueError(f"out must be a dict with exactly the keys {sorted(spec)}")
    arrays = {}
    for k, v in out.items():
        a = v.numpy() if type(v).__module__.startswith("torch") else v
        if not isinstance(a, np.ndarray) or a.shape != lead + spec[k][0] or (
                a.dtype != spec[k][1]) or not a.flags.c_contiguous:
            raise ValueError(f"out[{k!r}] must be a C-contiguous array or CPU tensor of shape "
                             f"{lead + spec[k][0]} and dtype {spec[k][1]}")
        arrays[k] = a
    return arrays


def _rebuild(args, timeout_s):
    return ShardedBuffer(*args, owner=False, timeout_s=timeout_s)


class _FeedDoor:
    """A ``ShardedBuffer``'s answer to the feeds' checks (as ``StorePort``'s, for a Buffer)."""

    def __init__(self, sample_args):
        self.sample_args = sample_args

    def check_priorities(self, what: str) -> None:
        raise ValueError(f"{what}: ShardedBuffer batches made ahead carry no ids; sample with "
                         "ids=True directly")
