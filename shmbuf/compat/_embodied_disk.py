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
import os
import pathlib

import numpy as np

from . import _embodied_chunks as chunks
from . import _embodied_draw as draw
from . import _embodied_rows as rows

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
    k = rows.chunk_size(buffer)
    ids = np.arange(rows.claimed_chunks(buffer))
    state, count = rows.chunk_seqs(buffer, ids)
    ids, state, count = ids[count > 0], state[count > 0], count[count > 0]
    firsts = ids * k
    streams, first_pos = items.stream[firsts].copy(), items.pos[firsts].copy()
    starts = _live_starts(items, firsts, count)
    newest: dict = {}
    for s, p, c in zip(streams.tolist(), first_pos.tolist(), count.tolist()):
        newest[s] = max(newest.get(s, -1), p + c - 1)
    now = datetime.datetime.now()
    for i in np.argsort(first_pos, kind="stable").tolist():
        s, p, c = int(streams[i]), int(first_pos[i]), int(count[i])
        if s not in starts or p + c - 1 < starts[s]:
            continue   # holds no step of a live item
        done = replay._disk.saved.get((s, p), p)
        if done >= p + c:
            continue
        got = _copy(replay, firsts[i] + done - p, firsts[i] + c, s)
        if got is None or not rows.unchanged(buffer, ids[i:i + 1], state[i:i + 1])[0]:
            continue   # recycled while it was read: evicted
        uuid = chunks.uuid_for(replay.shm_name, s, done)
        got["stepid"] = chunks.stepids(uuid, c - (done - p))
        # Ages along a stream must sort like the stream: older steps, earlier names.
        when = now - datetime.timedelta(microseconds=newest[s] - done)
        name = chunks.file_name(chunks.stamp(when), uuid,
                                chunks.uuid_for(replay.shm_name, s, p + c), c - (done - p))
        chunks.write(directory, name, got)
        replay._disk.saved[(s, p)] = p + c
        replay._disk.files.add(name)


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


def _copy(replay, lo: int, hi: int, stream: int) -> dict | None:
    arrays = replay.buffer.arrays
    if not (arrays["stream"][lo:hi] == stream).all():
        return None
    return {k: arrays[replay._columns[k]][lo:hi].copy() for k, _, _ in replay._keys}


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
    first = rows.take_serials(replay.buffer, made) if made else 0
    item = np.full(n, -1, np.int64)
    item[length - 1:] = np.arange(first, first + made)
    stream = draw.stream_id()
    with replay.buffer.writer() as w:
        w.extend(**values, item=item, stream=np.full(n, stream, np.int64),
                 pos=np.arange(n, dtype=np.int64))
    k = rows.chunk_size(replay.buffer)
    for p in range(0, n, k):   # loaded steps are on disk already: never saved again
        replay._disk.saved[(stream, p)] = min(p + k, n)
