"""Whole episodes read back in order, from the episode index (``Buffer.iter_episodes``).

A finished episode's index entry says where its first step lies (chunk,
seq, offset) and how long it is.  Reading it is a window of that length
from that row: the same C pass as a sample checks that the rows follow the
stream's links and that the first and last carry the episode's number,
the rows are gathered, and the chunks' seqs are checked again after the
copy.  An episode recycled before or while it is read is skipped, never
returned torn.

Open episodes (``include_open``) are the steps each stream holds after its
last finished episode: found by walking the stream's chunks back from its
newest row while the episode number stays the same, then read and
validated the same way.  Their oldest steps may already be recycled; what
is returned is the part still held, whole.
"""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from .._args import check_int
from ..protocol.layout import EP_COLUMN
from ..protocol.ring import Ring

_ENTRIES_PER_READ = 256


def iterate(buf, port, newest, include_open):
    """``Buffer.iter_episodes``: check the arguments now, then a generator of episodes
    (read through the buffer's ``StorePort``)."""
    if newest is not None:
        newest = check_int("newest", newest, 1)
    if not isinstance(include_open, (bool, np.bool_)):
        raise TypeError(f"include_open must be True or False, got {include_open!r}")
    names = list(buf.spec)

    def episodes():
        yield from finished(port, names, newest, buf._check_open)
        if include_open:
            buf._check_open()
            yield from open_episodes(port, names, buf.done_key)
    return episodes()


def finished(port, names: list[str], newest: int | None, check_open) -> Iterator[dict]:
    """The finished episodes still held, oldest first (in the order they ended)."""
    ring = port.ring
    hi = ring.episodes_logged()
    held = min(hi, ring.layout.episode_slots)
    if newest is not None:
        held = min(held, newest)
    for lo in range(hi - held, hi, _ENTRIES_PER_READ):
        check_open()
        eps = ring.read_episodes(np.arange(lo, min(lo + _ENTRIES_PER_READ, hi)))
        for i in range(len(eps)):
            check_open()
            got = read_entry(port, names, eps, i)
            if got is not None:
                yield got


def one(port, names: list[str], index) -> dict | None:
    """Finished episode number ``index`` (``Buffer.read_episode``), or None if not held."""
    index = check_int("index", index, 0)
    ring = port.ring
    if index < ring.episodes_logged() - ring.layout.episode_slots:
        return None   # its index entry was reused by a newer episode
    eps = ring.read_episodes(np.array([index], np.int64))
    return read_entry(port, names, eps, 0) if len(eps) else None


def read_entry(port, names: list[str], eps, i: int) -> dict | None:
    """The columns of episode ``eps[i]`` (an ``Episodes`` entry), or None if recycled."""
    chunk, seq = int(eps.chunk[i]), int(eps.seq[i])
    start = int(port.chunk_base[chunk]) + int(eps.offset[i])
    return read_window(port, names, start, int(eps.length[i]), (chunk, seq), int(eps.ep[i]))


def read_window(port, names: list[str], start: int, length: int,
                first_chunk: tuple[int, int] | None, ep: int | None) -> dict | None:
    """The columns of the ``length`` rows from ``start`` along its stream, or None.

    None when the rows are not one stretch of one episode of the stream now,
    when the first chunk is not ``first_chunk`` (chunk, seq) any more, or
    when a chunk was recycled during the copy.
    """
    w = port.locate(np.array([start], np.int64), length)
    if not len(w.rows) or (first_chunk is not None and
                           (w.chunks[0, 0], w.seqs[0, 0]) != first_chunk):
        return None
    out = {name: v[0] for name, v in port.take_rows(names, w.rows, w.chunks, w.seqs).items()}
    first_ep = int(port.views[EP_COLUMN][w.rows[0, 0]])
    if not port.still_valid(w)[0] or (ep is not None and first_ep != ep):
        return None
    return out


def open_episodes(port, names: list[str], done_key: str | None) -> Iterator[dict]:
    """Each stream's unfinished episode (the part still held), by its newest chunk's age."""
    ring, views = port.ring, port.views
    live = ring.live_chunks()
    hi = ring.episodes_logged()
    recent = ring.read_episodes(np.arange(max(0, hi - ring.layout.episode_slots), hi))
    ended = set(zip(recent.stream.tolist(), recent.ep.tolist()))
    by_stream: dict[int, list[int]] = {}
    for i, (sid, count) in enumerate(zip(live.stream.tolist(), live.count.tolist())):
        if count:   # a chunk its stream has just claimed holds no row yet
            by_stream.setdefault(sid, []).append(i)
    order = sorted(by_stream, key=lambda s: by_stream[s][-1])
    ep_col = views[EP_COLUMN]
    for sid in order:
        idx = by_stream[sid]
        last = idx[-1]
        end = int(live.base[last] + live.count[last]) - 1
        ep = int(ep_col[end])
        if (sid, ep) in ended or (done_key is not None and bool(views[done_key][end])):
            continue
        start, length = _open_stretch(ring, live, idx, ep_col, ep)
        if length < 1:
            continue   # its newest chunk was recycled while we looked: nothing whole to read
        got = read_window(port, names, start, length, None, ep)
        if got is not None:
            yield got


def _open_stretch(ring: Ring, live, idx: list[int], ep_col: np.ndarray, ep: int):
    """(first row, rows) of the run of episode ``ep`` that ends the stream's chunks ``idx``.

    Walks back along the stream's links: a stream's chunks lie anywhere in
    the rows (writers claim chunks in turn), so the chunk before is the
    predecessor only if it links to this one, and an episode that begins at
    a chunk's first row begins at that chunk's base, not after the chunk
    before it.
    """
    chunks = np.asarray(live.chunk)[idx]
    nxt, nxt_seq = ring.links(chunks)
    start, length = 0, 0
    for pos in range(len(idx) - 1, -1, -1):
        i = idx[pos]
        base, count = int(live.base[i]), int(live.count[i])
        differ = np.flatnonzero(ep_col[base:base + count] != ep)
        if len(differ):
            first = int(differ[-1]) + 1
            if first == count:           # it begins with the chunk after this one
                return start, length
            return base + first, length + count - first   # it begins inside this chunk
        start, length = base, length + count
        if pos == 0:
            break
        if (int(nxt[pos - 1]), int(nxt_seq[pos - 1])) != (int(chunks[pos]), int(live.seq[i])):
            break                        # the chunk before is not this one's predecessor
    return start, length
