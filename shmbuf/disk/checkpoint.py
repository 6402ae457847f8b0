"""Copy a buffer's live steps out, oldest first, and write them back.

The copy goes chunk by chunk, oldest claim first, straight into arrays
sized for every live row: one extra copy of the live data at most, never
two.  Each chunk is validated after its copy like a sample (``Ring.unchanged``):
a chunk recycled meanwhile is dropped, and the next chunk is copied over its
rows.  ``StreamIds`` splits streams at holes: a chunk that its stream's
previous copied chunk does not link to (by chunk and seq) starts a stream
id of its own, so that no window ever joins the steps on both sides of a
hole.  ``Buffer.save`` splits streams by the same rule.  The result is a set
of whole chunks, never a torn step.

Restoring replays the steps through writers, one per stream, in the
original order, so episode cuts, stream boundaries and FIFO order survive;
a checkpoint larger than the target keeps its newest steps.

``state_dict`` holds the same as torch tensors and plain values, for
``torch.save`` / ``torch.load(weights_only=True)``; a column whose dtype
torch lacks (fixed-width strings, non-native byte order) travels as raw
bytes, ``uint8 (n, row bytes)``, and the schema says how to read it back.
"""
from __future__ import annotations

import ctypes
from typing import Any, Callable

import numpy as np

from ..protocol.layout import EP_COLUMN, PRIORITY_COLUMN
from ..protocol.ring import Ring
from ..writing.cast import host_array
from ..writing.compress import META_KEY
from .blocks import Placer, SavedBlocks

FORMAT = "shmbuf-steps-v1"


def copy_live(port, names: list[str], empty: Callable[[str, int], np.ndarray]) -> tuple:
    """Copy the live rows of ``names`` into ``empty(name, rows)`` arrays, oldest chunk first.

    Returns ``(arrays, stream, original, starts, n)``: the first ``n`` rows
    of each array, and of the int64 ``stream`` (split at holes) and
    ``original`` (the writer's stream id) arrays, are whole chunks, which
    begin at the rows ``starts``; rows past ``n`` are unused (chunks
    recycled while they were copied).  ``port``: the buffer's ``StorePort``.
    """
    ring = port.ring
    live = ring.live_chunks()
    total = int(live.count.sum())
    out = {name: empty(name, total) for name in names}
    stream = np.empty(total, np.int64)
    original = np.empty(total, np.int64)
    starts = []
    at = 0

    def copy(base: int, count: int, read: Callable[[str], np.ndarray]) -> None:
        for name in names:
            if name == PRIORITY_COLUMN:   # the value set in this claim, NaN if none
                out[name][at:at + count] = ring.prio().saved(base, count)
            else:
                out[name][at:at + count] = read(name)

    ids = StreamIds(int(live.stream.max()) + 1 if total else 0)
    for i, sid in copy_chunks(port, live, copy, ids):
        count = int(live.count[i])
        stream[at:at + count] = sid
        original[at:at + count] = live.stream[i]
        starts.append(at)
        at += count
    return out, stream, original, np.array(starts, np.int64), at


def copy_chunks(port, chunks, copy: Callable[[int, int, Callable], None], ids: "StreamIds"):
    """Copy ``chunks`` (``StorePort.live_chunks()``, oldest claim first), validating each.

    For each chunk, ``copy(first row, rows, read)`` copies its rows out, where
    ``read(name)`` gives the chunk's rows of column ``name`` (decoded where
    the chunk is packed: every copy goes through it); then, if the chunk was
    not recycled meanwhile, this yields ``(i, stream id)`` (``ids`` splits
    streams at holes).  A chunk recycled during its copy is skipped: the
    caller copies the next one over the same place.
    """
    ring, views, unpack = port.ring, port.views, port.unpacker
    nxt, nxt_seq = ring.links(chunks.chunk)
    for i in range(len(chunks.chunk)):
        base, count = int(chunks.base[i]), int(chunks.count[i])
        if unpack is None:
            # called before the loop moves on: the closure's base and count are this chunk's
            copy(base, count, lambda name: views[name][base:base + count])  # noqa: B023
        else:
            with unpack.reading():
                copy(base, count, unpack.chunk_reader(views, int(chunks.chunk[i]),
                                                      int(chunks.seq[i]), base, count))
        if ring.unchanged(chunks.chunk[i:i + 1], chunks.seq[i:i + 1])[0]:
            yield i, ids.of(int(chunks.stream[i]), int(chunks.chunk[i]), int(chunks.seq[i]),
                            int(nxt[i]), int(nxt_seq[i]))


class StreamIds:
    """Stream ids for copied chunks, split at holes (see the module docstring).

    ``of`` is called for each chunk kept, oldest claim first, with the
    chunk's successor link as read before the copy; ids from ``first_gap_id``
    on are given to the parts of streams after a hole.
    """

    def __init__(self, first_gap_id: int):
        self._next_gap_id = first_gap_id
        self._successor: dict[int, tuple[int, int]] = {}   # stream -> (chunk, seq) it links to
        self._id: dict[int, int] = {}

    def of(self, stream: int, chunk: int, seq: int, next_chunk: int, next_seq: int) -> int:
        """The id of chunk ``(chunk, seq)`` of ``stream``, which links to ``next_chunk``."""
        prev = self._successor.get(stream)
        if prev is None:
            self._id.setdefault(stream, stream)
        elif prev != (chunk, seq):
            self._id[stream] = self._next_gap_id
            self._next_gap_id += 1
        self._successor[stream] = (next_chunk, next_seq)
        return self._id[stream]


def episode_ends(ring: Ring, original: np.ndarray, episode: np.ndarray) -> np.ndarray:
    """Per row: the episode-index number of the episode it ends, or -1.

    Restore replays streams so that episodes end in this order again (the
    order ``episodes()`` and ``uniform="episodes", newest=K`` go by), and
    ends the last episode of a stream that ``end_episode`` closed.
    """
    ends = np.full(len(original), -1, np.int64)
    hi = ring.episodes_logged()
    eps = ring.read_episodes(np.arange(max(0, hi - ring.layout.episode_slots), hi))
    if not len(original) or not len(eps):
        return ends
    key = (original << 32) + episode
    order = np.argsort(key, kind="stable")
    keys = key[order]
    last = order[np.searchsorted(keys, keys, side="right") - 1]   # last row of each key
    want = (eps.stream << 32) + eps.ep
    at = np.searchsorted(keys, want, side="right") - 1
    found = (at >= 0) & (keys[np.maximum(at, 0)] == want)
    ends[last[at[found]]] = eps.index[found]
    return ends


def _names(ring: Ring) -> list[str]:
    """What a checkpoint copies per row: the user columns, _ep, and the priorities if kept."""
    names = [c.name for c in ring.layout.user_columns] + [EP_COLUMN]
    return names + [PRIORITY_COLUMN] if ring.priorities is not None else names


def _with_priorities(ring: Ring, state: dict, saved) -> dict:
    """``state`` plus "priorities" ((n,) float32, NaN: never set) and "max_priority"."""
    if ring.priorities is not None:
        state["priorities"] = saved
        state["max_priority"] = ring.priorities.largest_set()
    return state


def snapshot(port) -> dict[str, Any]:
    """``{"format", "spec", "columns": {name: array}, "stream", "episode"}``, oldest first."""
    ring = port.ring
    lay = ring.layout
    names = _names(ring)

    def empty(name, n):
        if name == PRIORITY_COLUMN:
            return np.empty(n, np.float32)
        col = lay.column(name)
        return np.empty((n,) + col.shape, col.dtype)

    out, stream, original, starts, n = copy_live(port, names, empty)
    return _with_priorities(ring, {
        "format": FORMAT,
        "spec": {c.name: (list(c.shape), c.dtype.str) for c in lay.user_columns},
        "columns": {c.name: out[c.name][:n] for c in lay.user_columns},
        "stream": stream[:n],
        "episode": out[EP_COLUMN][:n],
        "ends": episode_ends(ring, original[:n], out[EP_COLUMN][:n]),
        "chunks": starts,
    }, out.get(PRIORITY_COLUMN, np.empty(0, np.float32))[:n])


# -- torch ------------------------------------------------------------------------------
def _torch_dtype(dtype: np.dtype):
    """torch's dtype for ``dtype``, or None when torch has none (then: raw bytes)."""
    import torch

    try:
        return torch.from_numpy(np.empty(0, dtype)).dtype
    except (TypeError, ValueError):   # no such dtype, or not in native byte order
        return None


def state_dict(port) -> dict[str, Any]:
    """The checkpoint as torch tensors and plain values: one copy of the live rows."""
    import torch

    ring = port.ring
    lay = ring.layout
    names = _names(ring)
    tensors: dict[str, Any] = {}
    raw: list[str] = []

    def empty(name, n):
        if name == PRIORITY_COLUMN:
            tensors[name] = torch.empty(n, dtype=torch.float32)
            return _raw_view(tensors[name], np.dtype(np.float32), (n,))
        col = lay.column(name)
        tdtype = _torch_dtype(col.dtype)
        if tdtype is None:
            raw.append(name)
            tensors[name] = torch.empty((n, col.row_bytes), dtype=torch.uint8)
        else:
            tensors[name] = torch.empty((n,) + col.shape, dtype=tdtype)
        return _raw_view(tensors[name], col.dtype, (n,) + col.shape)

    out, stream, original, starts, n = copy_live(port, names, empty)
    ends = episode_ends(ring, original[:n], out[EP_COLUMN][:n])
    del out   # views without a reference count on the storage: drop them before _shrink
    for name, t in tensors.items():
        tensors[name] = _shrink(t, n)
    return _with_priorities(ring, {
        "format": FORMAT,
        "spec": {c.name: [list(c.shape), c.dtype.str] for c in lay.user_columns},
        "raw_bytes": raw,
        "columns": {c.name: tensors[c.name] for c in lay.user_columns},
        "stream": torch.from_numpy(stream[:n].copy()),
        "episode": tensors[EP_COLUMN],
        "ends": torch.from_numpy(ends),
        "chunks": torch.from_numpy(starts),
    }, tensors.get(PRIORITY_COLUMN))


def _raw_view(t, dtype: np.dtype, shape: tuple) -> np.ndarray:
    """A numpy view of ``t``'s memory that leaves its storage resizable (``t.numpy()``
    would pin it).  The caller drops the view before the storage changes."""
    nbytes = t.numel() * t.element_size()
    if not nbytes:
        return np.empty(shape, dtype)
    raw = (ctypes.c_uint8 * nbytes).from_address(t.data_ptr())
    return np.frombuffer(raw, np.uint8).view(dtype).reshape(shape)


def _shrink(t, n: int):
    """``t[:n]`` that owns only its rows (``torch.save`` writes a view's whole storage)."""
    if n == len(t):
        return t
    row = t[0].numel() * t.element_size() if len(t) else 0
    storage = t.untyped_storage()
    storage.resize_(n * row)   # realloc in place: no second copy of the rows
    return t.new_empty(0).set_(storage, 0, (n,) + tuple(t.shape[1:]))


def from_state_dict(state: dict[str, Any]) -> dict[str, Any]:
    """A ``state_dict`` as the numpy ``snapshot`` that ``restore`` takes (views, no copies)."""
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        got = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"state: expected a shmbuf state_dict of format {FORMAT!r}, got {got!r}")
    for key in ("spec", "columns", "stream", "episode"):
        if key not in state:
            raise ValueError(f"state: a shmbuf state_dict has the key {key!r}; this one has "
                             f"{sorted(state)}")
    raw = set(state.get("raw_bytes", ()))
    spec = {k: (list(v[0]), str(v[1])) for k, v in state["spec"].items()}
    columns = {}
    for name, t in state["columns"].items():
        arr = _numpy(t, f"state['columns'][{name!r}]")
        if name in raw and name in spec:
            shape, dtype = spec[name]
            arr = np.ascontiguousarray(arr).view(np.dtype(dtype))
            arr = arr.reshape((len(arr),) + tuple(shape))
        columns[name] = arr
    out = {"format": FORMAT, "spec": spec, "columns": columns,
           "stream": _numpy(state["stream"], "state['stream']"),
           "episode": _numpy(state["episode"], "state['episode']")}
    for key in ("ends", "chunks", "priorities"):
        if key in state:
            out[key] = _numpy(state[key], f"state[{key!r}]")
    if "rate" in state:   # the rate limiter's counters: plain values
        out["rate"] = state["rate"]
    if "max_priority" in state:
        out["max_priority"] = state["max_priority"]
    return out


def _numpy(value, what: str) -> np.ndarray:
    if type(value).__module__.startswith("torch") or isinstance(value, np.ndarray):
        return host_array(value)
    raise ValueError(f"{what}: expected a tensor, got {type(value).__name__}")


# -- checks and restore -------------------------------------------------------------------
def check_compatible(buf, state: dict[str, Any]) -> None:
    """Raise ValueError naming what differs between ``state`` and ``buf``."""
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        got = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"state: expected a shmbuf checkpoint of format {FORMAT!r}, got {got!r}")
    mine = {k: (list(shape), dtype.str) for k, (shape, dtype) in buf.spec.items()}
    theirs = {k: (list(v[0]), str(v[1])) for k, v in state["spec"].items()}
    if mine != theirs:
        raise ValueError(f"state: checkpoint schema {theirs} does not match the buffer's {mine}")
    n = len(state["stream"])
    if set(state["columns"]) != set(buf.spec):
        raise ValueError(f"state['columns'] has {sorted(state['columns'])}, the buffer "
                         f"{sorted(buf.spec)}")
    for name, arr in state["columns"].items():
        shape, dtype = buf.spec[name]
        arr = np.asarray(arr)
        if arr.shape != (n,) + shape or arr.dtype != dtype:
            raise ValueError(f"state['columns'][{name!r}]: expected shape {(n,) + shape} and "
                             f"dtype {dtype}, got {arr.shape} and {arr.dtype}")
    if len(state["episode"]) != n:
        raise ValueError(f"state['episode'] has {len(state['episode'])} rows, expected {n}")
    if "priorities" in state:
        pri = np.asarray(state["priorities"])
        if pri.shape != (n,) or pri.dtype != np.float32:
            raise ValueError(f"state['priorities']: expected shape {(n,)} and dtype float32, "
                             f"got {pri.shape} and {pri.dtype}")
        bad = ~np.isnan(pri) & ~(np.isfinite(pri) & (pri >= 0))
        top = state.get("max_priority")
        if bad.any() or not (top is None or isinstance(top, float) and np.isfinite(top)
                             and top >= 0):
            raise ValueError("state['priorities'] and state['max_priority'] must be finite and "
                             ">= 0 (NaN: never set)")


def restore(buf, port, state: dict[str, Any], place: int | None = None) -> bool | None:
    """Replace the buffer's contents with the checkpoint ``state``, through writers.

    One writer per stream.  The first row of each chunk is written in the
    checkpoint's chunk order, so chunks are claimed (and will be evicted) in
    the same FIFO order; between those, streams advance so that episodes end
    in the order they ended before (``ends``), as far as the chunk order
    allows.  A change of episode number without a terminal step is an
    ``end_episode`` cut.

    ``place`` (a load into a new buffer of the saved geometry, whose step
    ids have that ``base``: ``protocol.stepids``): before saved chunk ``j``
    is claimed, the tickets up to ``state["tickets"][j] - place`` are taken
    unclaimed, as the saved buffer's claims skipped them, so that the chunk
    gets its saved ticket (and its saved place) back and its saved ids name
    its steps.  Returns whether every saved chunk is held under its ticket
    then, None without ``place``.
    """
    check_compatible(buf, state)
    ring = port.ring
    stream = np.asarray(state["stream"])
    n = len(stream)
    ends = np.asarray(state.get("ends", np.full(n, -1, np.int64)))
    starts = np.asarray(state.get("chunks", np.flatnonzero(np.diff(stream, prepend=-1) != 0)))
    if ends.shape != (n,) or starts.ndim != 1 or len(starts) and (
            starts.min() < 0 or starts.max() >= n):
        raise ValueError("state: 'ends' or 'chunks' do not fit the rows")
    saved: SavedBlocks | None = state.get("packed")   # a save's compressed blocks (load)
    if n > buf.capacity:
        if saved is not None:
            saved = saved.cut(n - buf.capacity, state["columns"])
        state, stream, ends, starts = newest_rows(state, stream, ends, starts, buf.capacity)
        n = len(stream)
    placer = None if saved is None else _placer(buf, port, saved, stream, state["columns"])
    tickets = None if place is None else np.asarray(state["tickets"], np.int64) - place
    ring.clear()
    replay = _Replay(buf, port, state, ends, placer)
    try:
        for j, (a, b) in enumerate(zip(starts.tolist(), starts[1:].tolist() + [n])):
            if tickets is not None:
                ring.skip_tickets(int(tickets[j]))
            replay.schedule(int(stream[a]), a, b)
        replay.drain(force=True)
        if ring.priorities is not None and "priorities" in state:
            _restore_priorities(ring, replay, stream, state)
    finally:
        replay.close()
    if tickets is None:
        return None
    held = ring.live_chunks()
    assert held.ticket is not None   # live_chunks gives them
    have = dict(zip(held.ticket.tolist(), held.count.tolist()))
    counts = np.diff(np.append(starts, n))
    return all(have.get(t) == c for t, c in zip(tickets.tolist(), counts.tolist()))


def _placer(buf, port, saved: SavedBlocks, stream: np.ndarray, columns: dict) -> Placer:
    """Where the save's compressed blocks go (``blocks.Placer``); the blocks that can go
    nowhere compressed are decoded into ``columns`` now."""
    words, unpack = port.packing, port.unpacker
    conf = buf.meta.get(META_KEY)
    if words is None or unpack is None or not isinstance(conf, dict):
        return Placer(saved, None, "", 0, stream, columns)
    return Placer(saved, words.plan, unpack.codec.name, int(conf["hot_steps"]), stream,
                  columns)


def newest_rows(state: dict[str, Any], stream: np.ndarray, ends: np.ndarray,
                starts: np.ndarray, keep: int) -> tuple:
    """The checkpoint cut to its newest ``keep`` rows: ``(state, stream, ends, starts)``.

    Rows are whole chunks in claim order, oldest first, so the newest steps
    are a suffix; the chunk it cuts in two loses its oldest steps, as if the
    buffer had recycled them (an episode that began there comes back shorter).
    Replaying only what fits means no run is ever longer than the capacity.
    """
    cut = len(stream) - keep
    kept = starts[starts >= cut] - cut
    if not len(kept) or kept[0] != 0:
        kept = np.concatenate([[0], kept]).astype(np.int64)
    state = dict(state, stream=stream[cut:], episode=np.asarray(state["episode"])[cut:],
                 columns={k: np.asarray(v)[cut:] for k, v in state["columns"].items()})
    if "priorities" in state:
        state["priorities"] = np.asarray(state["priorities"])[cut:]
    return state, stream[cut:], ends[cut:], kept


def _restore_priorities(ring: Ring, replay: "_Replay", stream: np.ndarray, state: dict) -> None:
    """Give the replayed steps the checkpoint's priorities (set ones; NaN stays default).

    Each checkpoint stream went through a writer of its own, so that writer's
    stream holds, oldest chunk first, the newest of that stream's rows (all
    of them unless the capacity is smaller).
    """
    pri = ring.prio()
    if state.get("max_priority") is not None:
        pri.raise_largest(float(state["max_priority"]))
    saved = np.asarray(state["priorities"])
    live = ring.live_chunks()
    for sid, w in replay.writers.items():
        mine = live.stream == w.stream_id()
        rows = np.concatenate([np.arange(b, b + c, dtype=np.int64) for b, c in
                               zip(live.base[mine], live.count[mine])] or [np.empty(0, np.int64)])
        theirs = np.flatnonzero(stream == sid)
        if len(rows):
            pri.restore(ring.step_ids(rows), np.ascontiguousarray(saved[theirs[-len(rows):]]))


class _Replay:
    """Writers for the checkpoint's streams, and the rows each may still write."""

    def __init__(self, buf, port, state, ends: np.ndarray, placer: Placer | None = None):
        self.port = port
        self.episode = np.asarray(state["episode"])
        self.columns = {k: np.asarray(v) for k, v in state["columns"].items()}
        # A save's compressed blocks (a load), and per stream the columns of the chunk it
        # fills now that are held compressed there (never written).
        self.placer = placer if placer is not None and placer.starts else None
        self.unwritten: dict[int, frozenset] = {}
        self.done = self.columns[buf.done_key] if buf.done_key else None
        self.ends = ends
        self.due = sorted(ends[ends >= 0].tolist())   # episode ends, in the order they ended
        self.next_due = 0
        self.pending: dict[int, list] = {}            # stream -> [next row, end row)
        self.writers: dict[int, Any] = {}   # stream -> its Writer
        self.prev: dict[int, int] = {}      # stream -> the row it wrote last

    def schedule(self, sid: int, a: int, b: int) -> None:
        """Chunk rows ``[a, b)`` of stream ``sid``: its first row is written now."""
        span = self.pending.get(sid)
        if span is not None and span[0] < span[1]:
            self._advance(sid, force=True)   # the stream's earlier rows come first
        self.pending[sid] = [a, b]
        self._write(sid, a)
        self.pending[sid][0] = a + 1
        self.drain(force=False)

    def _prepare(self, sid: int, w, row: int, want: int) -> tuple[frozenset, int]:
        """Before stream ``sid`` writes ``want`` steps from saved row ``row``: the columns
        held compressed in its chunk, and how many of the steps fit that chunk.  At a
        chunk's end (a load with compressed blocks only) the next chunk is claimed here,
        with the blocks that fit it put in (``blocks.Placer``) and the others decoded."""
        placer = self.placer
        if placer is None:
            return frozenset(), want
        room = w._room()
        if room:
            return self.unwritten.get(sid, frozenset()), min(room, want)
        ring = self.port.ring
        rows = int(ring.chunk_rows[ring.next_claim()])
        names, mask, entries = placer.chunk(row, rows)
        chunk, seq, rows_got = w._claim_next(names)
        if names and rows_got != rows:   # another claim took that chunk first
            ring.reserve_rows(chunk, names)
            names = frozenset()
        if names:
            try:
                put = self.port.packing.put_packed(chunk, seq, mask,
                                                   placer.slot_bytes(entries, row))
            except BaseException:
                ring.reserve_rows(chunk, names)   # the claimed chunk stays writable
                raise
            if not put:
                ring.reserve_rows(chunk, names)
                names = frozenset()
        placer.decode(row, rows_got, names)
        self.unwritten[sid] = names
        return names, min(rows_got, want)

    def drain(self, force: bool) -> None:
        """Write what the episode order allows; with ``force``, everything."""
        progress = True
        while progress:
            progress = False
            for sid in list(self.pending):
                progress |= self._advance(sid, force=False)
        if force:
            for sid in list(self.pending):
                self._advance(sid, force=True)

    def _advance(self, sid: int, force: bool) -> bool:
        span, moved = self.pending[sid], False
        while span[0] < span[1]:
            row = span[0]
            rank = int(self.ends[row])
            if rank >= 0 and not force and rank != self._due():
                break   # another episode ended first
            stop = self._run_end(row, span[1]) if rank < 0 else row + 1
            if stop - row > 1:
                self._write_run(sid, row, stop)
            else:
                self._write(sid, row)
            span[0] = stop
            moved = True
        return moved

    def _run_end(self, row: int, end: int) -> int:
        """The first row after ``row`` (below ``end``) that ends an episode or starts another.

        Rows ``[row, stop)`` are one episode with no end to order among the
        streams, so they go in with one ``Writer.extend``.
        """
        rest = slice(row + 1, end)
        brk = np.flatnonzero((self.ends[rest] >= 0) | (self.episode[rest] != self.episode[row]))
        return row + 1 + int(brk[0]) if len(brk) else end

    def _write_run(self, sid: int, a: int, b: int) -> None:
        """Rows ``[a, b)`` of one episode, none of them ending one in the index, at once."""
        w = self._writer_at(sid, a)
        while a < b:
            unwritten, k = self._prepare(sid, w, a, b - a)
            w._extend({name: v[a:a + k] for name, v in self.columns.items()}, unwritten)
            a += k
        self.prev[sid] = b - 1

    def _due(self) -> int:
        return self.due[self.next_due] if self.next_due < len(self.due) else -1

    def _writer_at(self, sid: int, row: int):
        """Stream ``sid``'s writer, ready for ``row``: the episode cut before it is made."""
        w = self.writers.get(sid)
        if w is None:
            # limited=False: restores are not rate limited
            w = self.writers[sid] = self.port.writer(False)
        j = self.prev.get(sid)
        if j is not None and j >= 0 and self.episode[row] != self.episode[j] and not (
                self.done is not None and self.done[j]):
            w.end_episode()   # the original stream was cut here without a terminal
        return w

    def _write(self, sid: int, i: int) -> None:
        w = self._writer_at(sid, i)
        unwritten, _ = self._prepare(sid, w, i, 1)
        if unwritten:
            w._extend({k: v[i:i + 1] for k, v in self.columns.items()}, unwritten)
        else:
            w.add(**{k: v[i] for k, v in self.columns.items()})
        self.prev[sid] = i
        rank = int(self.ends[i])
        if rank >= 0:
            if not (self.done is not None and self.done[i]):
                w.end_episode()   # ended by end_episode (its last one, or the next is gone)
            self.prev[sid] = -1
            if rank == self._due():
                self.next_due += 1
            else:   # forced out of order: skip it in the due list
                self.due.remove(rank)
                self.next_due = min(self.next_due, len(self.due))

    def close(self) -> None:
        for w in self.writers.values():
            w.close()
