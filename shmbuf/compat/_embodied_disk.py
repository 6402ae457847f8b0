"""``Replay.save`` and ``Replay.load``: the shared store to and from upstream's chunk files.

A saved file is the part of one store chunk (one stream's consecutive
steps) not written by an earlier save of the same handle.  Its id is a
function of the stream and the position of its first step, so the
``succ`` of a file names the file that will hold the stream's next step,
whether or not it exists yet (upstream links a chunk to its successor the
same way, at the moment the chunk is completed).  A loaded chain of files
becomes one new stream of the store.
"""
from __future__ import annotations

import datetime
import itertools
import os
import pathlib

import numpy as np

from . import _embodied_chunks as chunks
from . import _embodied_draw as draw

Path = pathlib.Path


class State:
    """What one handle saved or loaded: ``saved[(stream, chunk's first pos)]`` is the
    position after the last step saved of that chunk; ``files`` the names it knows."""

    def __init__(self):
        self.saved: dict = {}
        self.files: set = set()


def save(replay, directory: Path) -> None:
    buffer, items = replay.buffer, replay._items
    directory.mkdir(parents=True, exist_ok=True)
    port = buffer.port
    live = port.live_chunks()
    ids, seqs, count, firsts = live.chunk, live.seq, live.count, live.base
    streams, first_pos = items.stream[firsts].copy(), items.pos[firsts].copy()
    starts = _live_starts(items, firsts, count)
    now = datetime.datetime.now()
    for s in starts:
        mine = np.flatnonzero(streams == s)
        mine = mine[np.argsort(first_pos[mine], kind="stable")]
        segments = [(int(first_pos[i]), int(count[i]), int(i), int(firsts[i])) for i in mine]
        newest = segments[-1][0] + segments[-1][1] - 1
        for lo_pos, hi_pos in _files(segments, starts[s], replay.chunksize, replay._disk, s):
            got = _copy(replay, segments, lo_pos, hi_pos, s)
            used = [i for p, c, i, _ in segments if p < hi_pos and p + c > lo_pos]
            if got is None or not port.unchanged(ids[used], seqs[used]).all():
                break   # recycled while it was read: evicted, and so is what follows
            n = hi_pos - lo_pos
            uuid = chunks.uuid_for(replay.shm_name, s, lo_pos)
            got["stepid"] = chunks.stepids(uuid, n)
            # Ages along a stream must sort like the stream: older steps, earlier names.
            when = now - datetime.timedelta(microseconds=newest - lo_pos)
            name = chunks.file_name(chunks.stamp(when), uuid,
                                    chunks.uuid_for(replay.shm_name, s, hi_pos), n)
            chunks.write(directory, name, got)
            replay._disk.saved[(s, lo_pos // replay.chunksize)] = hi_pos
            replay._disk.files.add(name)


def _files(segments: list, live_start: int, size: int, state: State, stream: int):
    """``(first pos, end pos)`` of each file to write for one stream's held ``segments``
    (``(first pos, count, index, first row)``, in order): upstream's chunks of ``size`` steps from
    the stream's start, less what an earlier save wrote and what is no longer held."""
    held_from, held_to = segments[0][0], segments[-1][0] + segments[-1][1]
    for (p, c, _, _), (q, _, _, _) in itertools.pairwise(segments):
        if p + c != q:   # a gap: only what follows it is one run
            held_from = q
    first = max(held_from, live_start - live_start % size)
    for j in range(first // size, -(-held_to // size)):
        lo_pos = max(j * size, held_from, state.saved.get((stream, j), j * size))
        hi_pos = min((j + 1) * size, held_to)
        if lo_pos < hi_pos:
            yield lo_pos, hi_pos


def _live_starts(items, firsts: np.ndarray, count: np.ndarray) -> dict:
    """Per stream, the position of the first step of its oldest live item."""
    lo, _ = items.live()
    every = np.concatenate([np.arange(f, f + c) for f, c in zip(firsts, count)]) \
        if len(firsts) else np.empty(0, np.int64)
    live = every[items.item[every] >= lo]
    out: dict = {}
    for s, p in zip(items.stream[live].tolist(), items.pos[live].tolist()):
        start = p - items.length + 1
        if start < out.get(s, start + 1):
            out[s] = start
    return out


def _copy(replay, segments: list, lo_pos: int, hi_pos: int, stream: int) -> dict | None:
    """The steps at positions ``[lo_pos, hi_pos)`` of ``stream``, copied out of its
    ``segments``; None if a row no longer holds the stream."""
    arrays = replay.buffer.arrays
    parts = []
    for p, c, _, row in segments:
        a, b = max(p, lo_pos), min(p + c, hi_pos)
        if a < b:
            parts.append(np.arange(a - p, b - p) + row)
    picked = np.concatenate(parts)
    if not (arrays["stream"][picked] == stream).all():
        return None
    port = replay.buffer.port
    if port.unpacker is None:
        return {key: arrays[replay._columns[key]][picked] for key, _, _ in replay._keys}
    # Compressed chunks: through the store's packed read, at each chunk's seq now (the
    # caller's re-check after the copy rejects a chunk recycled since it listed them).
    chunk = picked // replay.buffer.chunk_size
    seq = port.chunk_seqs(chunk)
    got = port.take_rows([replay._columns[key] for key, _, _ in replay._keys],
                          picked[:, None], chunk[:, None], seq[:, None])
    return {key: got[replay._columns[key]][:, 0] for key, _, _ in replay._keys}


def load(replay, directory: Path, amount) -> None:
    found = [chunks.parse(f) for f in os.listdir(directory)]
    names = [n for n in found if n is not None and n.file not in replay._disk.files]
    if not names:
        return
    chosen = chunks.newest(names, amount, replay.length)
    for chain in chunks.chains(chosen):
        for run in _runs(directory, chain):
            _add_run(replay, run)
        replay._disk.files.update(n.file for n in chain)


def _runs(directory: Path, chain: list) -> list:
    """The chain's steps as runs of readable files (an unreadable file splits the chain)."""
    runs: list[list[dict]] = []
    current: list[dict] = []
    for n in chain:
        data = chunks.read(directory / n.file)
        if data is None:
            runs.append(current)
            current = []
            continue
        data.pop("stepid", None)
        current.append({k: v for k, v in data.items() if not k.startswith("log/")})
    runs.append(current)
    return [{k: np.concatenate([d[k] for d in run]) for k in run[0]} for run in runs if run]


def _add_run(replay, run: dict) -> None:
    n = len(next(iter(run.values())))
    if replay._ensure() is None:
        replay._make([(k, tuple(v.shape[1:]), v.dtype) for k, v in run.items()])
    values = replay._coerced_run(run, n)
    length = replay.length
    made = max(0, n - length + 1)
    first = replay.buffer.next_serial(made) if made else 0
    item = np.full(n, -1, np.int64)
    item[length - 1:] = np.arange(first, first + made)
    stream = draw.stream_id()
    with replay.buffer.writer() as w:
        w.extend(**values, item=item, stream=np.full(n, stream, np.int64),
                 pos=np.arange(n, dtype=np.int64))
    size = replay.chunksize
    for p in range(0, n, size):   # loaded steps are on disk already: never saved again
        replay._disk.saved[(stream, p // size)] = min(p + size, n)
