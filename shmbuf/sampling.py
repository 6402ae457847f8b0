"""Which rows make a valid window, found and checked without a loop over the batch.

A window of ``length`` rows starts at a committed row and follows its
stream: the rest of the start chunk, then the successor chunk published by
``Ring.link``, and so on.  It is valid when every row it needs is committed,
every hop's successor still has the seq recorded at link time, and its first
and last rows carry the same episode number (so it never continues past a
terminal step, though it may end on one).

Candidates are drawn uniformly over the rows of the chunks claimed so far and
rejected when invalid, so the cost of a batch depends on the batch, not on
the capacity or the fill.  When almost nothing is valid, the sampler
enumerates every committed row instead; either way the draw is uniform over
all valid start rows.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from . import _atomic as atomic
from ._errors import NotEnoughDataError, SampleRetryError
from ._layout import CHUNK_ENTRY, CHUNK_FIELDS

_ROUNDS = 4
_MAX_ELEMENTS = 1 << 22  # candidates x length per locate() call
_REST = np.array([CHUNK_FIELDS[f] for f in ("count", "next", "next_seq")], np.int64)


@dataclasses.dataclass
class Windows:
    """Row indices of accepted windows, and the chunk seqs they depend on."""

    rows: np.ndarray        # (B, L) int64 physical rows
    chunks: np.ndarray      # (B, H) chunk per hop, -1 where unused
    seqs: np.ndarray        # (B, H) seq each hop had when located

    def take(self, keep: np.ndarray) -> "Windows":
        return Windows(self.rows[keep], self.chunks[keep], self.seqs[keep])


class WindowFinder:
    """Locates and validates windows over one ring; see the module doc."""

    def __init__(self, ring, ep_column: np.ndarray):
        self.ring = ring
        self.mm = ring.mm
        self.k = ring.layout.chunk_size
        self.ep = ep_column

    def _snapshot(self, chunks: np.ndarray):
        """(seq, count, next, next_seq) of ``chunks``, seq read before the rest."""
        entry = self.ring.state_off[0] + chunks * CHUNK_ENTRY
        state = np.empty(len(chunks), np.uint64)
        atomic.load_many(self.mm, entry, state)  # ends with an acquire fence
        rest = np.empty((len(chunks), 3), np.uint64)
        atomic.load_many(self.mm, entry[:, None] + _REST, rest)
        return (state >> np.uint64(32)).view(np.int64), rest.view(np.int64).T

    def locate(self, starts: np.ndarray, length: int, tail: int = 0):
        """Validity mask and Windows for candidate start rows (any order).

        The first ``length - tail`` rows must share an episode; the last
        ``tail`` rows only have to follow them in the stream.
        """
        t = np.arange(length, dtype=np.int64)
        chunk = starts // self.k
        seq, (count, nxt, nxt_seq) = self._snapshot(chunk)
        offset = starts - chunk * self.k
        ok = ((seq & 1) == 0) & (offset < count)
        rows = starts[:, None] + t
        covered = count - offset
        hops, hop_seqs = [chunk], [seq]
        cur = chunk
        for _ in range(length):
            need = ok & (covered < length)
            if not need.any():
                break
            # A writer links a successor only once the chunk is full; a count
            # read before it filled up would make the window skip rows.
            full = count == self.ring.chunk_rows[cur]
            ok &= ~need | ((nxt > 0) & full)
            need &= ok
            succ = np.where(need, nxt - 1, 0)
            s2, (c2, n2, ns2) = self._snapshot(succ)
            ok &= ~need | (s2 == nxt_seq)
            need &= ok
            spill = need[:, None] & (t >= covered[:, None])
            rows = np.where(spill, (succ * self.k - covered)[:, None] + t, rows)
            hops.append(np.where(need, succ, -1))
            hop_seqs.append(s2)
            covered = np.where(need, covered + c2, covered)
            nxt, nxt_seq = np.where(need, n2, 0), ns2
            cur, count = succ, c2
        ok &= covered >= length
        good = np.flatnonzero(ok)
        ok[good] = self.ep[rows[good, 0]] == self.ep[rows[good, length - 1 - tail]]
        hop_chunks = np.stack(hops, axis=1)
        hop_chunks[~ok] = -1
        return ok, Windows(rows, hop_chunks, np.stack(hop_seqs, axis=1))

    def still_valid(self, w: Windows) -> np.ndarray:
        """After the copy: True where no chunk of the window was recycled meanwhile."""
        atomic.fence_acquire()
        used = w.chunks >= 0
        state = np.empty(int(used.sum()), np.uint64)
        atomic.load_many(self.mm, self.ring.state_off[w.chunks[used]], state)
        same = np.ones(w.chunks.shape, bool)
        same[used] = (state >> np.uint64(32)).astype(np.int64) == w.seqs[used]
        return same.all(axis=1)

    def draw(self, rng: np.random.Generator, batch: int, length: int, tail: int = 0) -> Windows:
        """``batch`` windows, uniform over every valid start row, with replacement."""
        ring = self.ring
        claimed = min(ring.counter("ticket"), ring.layout.n_chunks)
        span = int(ring.chunk_base[claimed - 1] + ring.chunk_rows[claimed - 1]) if claimed else 0
        cap = max(batch, _MAX_ELEMENTS // length)
        found, need = [], batch
        for round_ in range(_ROUNDS):
            if not span or not need:
                break
            # Most candidates are valid once the buffer has filled: start with
            # a small margin, and grow fourfold per round when they are not.
            m = min((need + need // 8 + 16) << (2 * round_), cap)
            ok, w = self.locate(rng.integers(0, span, m), length, tail)
            keep = np.flatnonzero(ok)[:need]
            found.append(w.take(keep))
            need -= len(keep)
        for _ in range(_ROUNDS):
            if not need:
                break
            ok, w = self.locate(self._valid_starts(rng, need, length, tail, claimed, cap),
                                length, tail)
            keep = np.flatnonzero(ok)
            found.append(w.take(keep))
            need -= len(keep)
        if need:
            raise SampleRetryError(
                f"could not draw {batch} windows of length {length}: writers recycled the "
                "chosen chunks each time; the buffer is too small for its ingest rate")
        return _concat(found)

    def _valid_starts(self, rng, need: int, length: int, tail: int, claimed: int,
                      block: int) -> np.ndarray:
        """``need`` start rows drawn from an enumeration of every committed row."""
        ring = self.ring
        counts = ring.count[:claimed].astype(np.int64)
        starts = np.repeat(ring.chunk_base[:claimed], counts)
        starts += np.arange(len(starts)) - np.repeat(np.cumsum(counts) - counts, counts)
        valid = [starts[lo:lo + block][self.locate(starts[lo:lo + block], length, tail)[0]]
                 for lo in range(0, len(starts), block)]
        valid = np.concatenate(valid) if valid else starts
        if not len(valid):
            raise NotEnoughDataError(
                f"no window of length {length} fits in the buffer yet: it holds "
                f"{int(counts.sum())} committed steps, and a window must lie in one writer "
                "stream without continuing past a terminal step; wait with "
                "wait_ready(min_steps=..., timeout=...) or ask for shorter windows")
        return rng.choice(valid, need)


def _concat(parts: list[Windows]) -> Windows:
    parts = [p for p in parts if len(p.rows)]
    if len(parts) == 1:
        return parts[0]
    hops = max(p.chunks.shape[1] for p in parts)

    def pad(a, fill):
        return np.pad(a, ((0, 0), (0, hops - a.shape[1])), constant_values=fill)

    return Windows(np.concatenate([p.rows for p in parts]),
                   np.concatenate([pad(p.chunks, -1) for p in parts]),
                   np.concatenate([pad(p.seqs, 0) for p in parts]))
