"""``Recency``'s draw: a start of age ``a`` has weight ``(1 + a) ** -exponent``, exactly.

A row's age is ``clock - 1 - _t[row]``: the steps published after it, by any
writer (``Ring.clock``, the ``_t`` column).  The draw is rejection sampling
from an envelope built per chunk, with these facts about a chunk's rows:
they were published in row order (one stream fills a chunk), so a row ``u``
rows older than another is at least ``u`` steps older; a valid start has at
least ``length - 1`` later steps in its window, so its age is at least
``length - 1``; a start needs ``length - 1`` rows after it in its stream, so
the newest rows of a chunk whose stream holds too few rows after them (in the
chunk and its successor) are left out until the stream grows, and the chunk
is anchored again when its successor is linked or fills; and a start whose
first ``length - tail`` rows would contain the chunk's last episode start
never becomes valid, so those rows are left out for good.

Per chunk, the ``_t`` of a few anchor rows is read (distances 0, 1, 3, 7, ...
from the newest row that could start a window, a doubling ladder), and the
rows between anchor ``i`` and the next get the bound ``(1 + A_i + u) ** -e``
(``A_i`` the anchor's age, ``u`` rows older than it): a point mass at the
anchor, then a continuous density whose integral over each unit cell is at
least the cell's bound.  Candidates are drawn from that envelope (a chunk by
its mass, a segment, a row by inverse CDF), accepted with probability
``true weight / envelope``, then checked like any candidate (the C window
pass) and kept only if their chunk still has the seq the envelope was read
at.  The accepted starts are therefore distributed exactly as the weights
among the valid starts.  The doubling ladder keeps every envelope within
``2 ** exponent`` of the truth for streams that interleave, so acceptance
does not collapse when many streams share the clock.

Ages only grow, so an envelope read at an earlier clock still bounds the
weights: the anchors of a chunk are re-read only when its seq or count
changed (per draw: the chunks written since, typically one per stream),
and its masses are recomputed when the clock has moved by more than a
quarter of its age.  Per draw the cost is two vectorised passes over the
chunk table and the candidates' own rows, not a pass over the steps.  When
rejection keeps failing, the draw enumerates every committed row instead
(in log space, so no weight underflows), as the uniform draw does.
"""
from __future__ import annotations

import threading

import numpy as np

from .._errors import NotEnoughDataError
from .windows import Windows, enough, in_rounds

_ROUNDS = 4
_MAX_CANDIDATES = 1 << 20
_REFRESH = 0.25   # recompute a chunk's masses once the clock moved by this share of its age


def draw(finder, rng: np.random.Generator, n: int, length: int, tail: int,
         exponent: float) -> Windows:
    """``n`` windows, each start drawn with weight ``(1 + age) ** -exponent``."""
    index = _index(finder, length, tail, exponent)
    found: list[Windows] = []
    m = 2 * n + 16

    def proposed(round_, need):
        with index.lock:
            starts = index.candidates(rng, min(m << 2 * round_, _MAX_CANDIDATES))
        return None if starts is None else _located(finder, starts, index.seq, length, tail,
                                                    need)

    need = in_rounds(found, n, proposed, _ROUNDS)
    need = in_rounds(found, need, lambda _, need: _enumerated(finder, rng, need, length, tail,
                                                              exponent), _ROUNDS)
    return enough(found, need, n, f"recency windows of length {length}")


def _index(finder, length: int, tail: int, exponent: float) -> "_Envelope":
    """The finder's envelope for ``(length, tail, exponent)``, refreshed to the buffer now."""
    cache = finder.__dict__.setdefault("recency_envelopes", {})
    key = (length, tail, exponent)
    env = cache.get(key)
    if env is None:
        if len(cache) >= 4:
            cache.clear()
        env = cache[key] = _Envelope(finder.ring, length, tail, exponent)
    with env.lock:     # a prefetch thread and its caller may share the finder
        env.refresh()
    return env


def _located(finder, starts, seqs, length: int, tail: int, need: int) -> Windows:
    """The first ``need`` windows among ``starts`` that are valid now and whose first chunk
    still has the seq (``seqs``, one per chunk) that the envelope was read at."""
    w = finder.locate(starts, length, tail, len(starts))
    same = w.seqs[:, 0] == seqs[w.chunks[:, 0]]
    return w.take(np.flatnonzero(same)[:need])


def _enumerated(finder, rng, need: int, length: int, tail: int, exponent: float) -> Windows:
    """``need`` windows drawn from every valid start now, weights in log space."""
    ring = finder.ring
    rows = ring.committed_rows()
    valid = finder.valid(rows, length, tail)
    clock = ring.clock()
    if not len(valid):
        raise NotEnoughDataError(finder._no_window_message(len(rows), length, tail))
    age = np.maximum(clock - 1 - ring.clock_rows[valid], 0)
    logw = -exponent * np.log1p(age.astype(np.float64))
    p = np.exp(logw - logw.max())
    return finder.locate(rng.choice(valid, 2 * need + 16, p=p / p.sum()), length, tail, need)


def _integral(a, m, e: float):
    """``F(a, m)``: the integral of ``(1 + a + v) ** -e`` over ``v`` in ``[0, m]``."""
    y = 1.0 + a
    lg = np.log1p(m / y)
    s = 1.0 - e
    if s == 0.0:
        return lg
    return y ** s * np.expm1(s * lg) / s


class _Envelope:
    """Per-chunk anchors and masses of one buffer for one ``(length, tail, exponent)``."""

    def __init__(self, ring, length: int, tail: int, exponent: float):
        self.ring, self.length, self.tail, self.e = ring, length, tail, exponent
        self.lock = threading.Lock()
        n, k = ring.layout.n_chunks, ring.layout.chunk_size
        ladder = int(np.log2(k)) + 2
        self.ladder = (1 << np.arange(ladder, dtype=np.int64)) - 1
        self.width = 2 * ladder                             # two row ranges per chunk
        self.seq = np.full(n, -1, np.int64)
        self.count = np.zeros(n, np.int64)
        self.succ = np.full(n, -1, np.int64)                # successor whose rows were counted
        self.succ_count = np.zeros(n, np.int64)
        self.waits = np.zeros(n, np.bool_)                  # rows left out until the stream grows
        self.dist = np.zeros((n, self.width), np.int64)     # anchor distances from the newest row
        self.span = np.full((n, self.width), -1, np.int64)  # rows after each anchor in its segment
        self.anchor_t = np.zeros((n, self.width), np.int64)
        self.ref = np.zeros(n, np.int64)                    # the clock the masses were made at
        self.young = np.zeros(n, np.int64)                  # the smallest anchor age at ref
        self.seg = np.zeros((n, self.width), np.float64)    # segment masses
        self.mass = np.zeros(n, np.float64)
        self.clock = 0

    def refresh(self) -> None:
        seq, count, clock = self.ring.chunk_snapshot()
        self.clock = clock
        changed = (seq != self.seq) | (count != self.count)
        grown = self._successors_moved(seq, count)
        changed[grown] = True
        changed = np.flatnonzero(changed)
        self.seq[changed], self.count[changed] = seq[changed], count[changed]
        self.mass[changed] = 0.0
        self.seg[changed] = 0.0
        self.span[changed] = -1
        self.waits[changed] = False
        self.seq[changed[(seq[changed] & 1) == 1]] = -1     # re-read once it settles
        usable = changed[(seq[changed] & 1 == 0) & (count[changed] > 0)]
        if len(usable):
            self._anchor(usable, seq, count, clock)
        stale = np.flatnonzero((self.mass > 0)
                               & (clock - self.ref > _REFRESH * (1 + self.young)))
        if len(stale):
            self._masses(stale, clock)

    def _successors_moved(self, seq, count) -> np.ndarray:
        """Chunks whose left-out newest rows may start windows now: their stream's next
        chunk was linked, refilled or recycled since they were anchored."""
        waiting = np.flatnonzero(self.waits & (seq == self.seq))
        if not len(waiting):
            return waiting
        succ, succ_seq = self._linked(waiting, seq)
        moved = (succ != self.succ[waiting]) | (np.where(succ >= 0, count[succ], 0)
                                                != self.succ_count[waiting])
        return waiting[moved]

    def _linked(self, chunks, seq):
        """The successor of each of ``chunks`` whose seq is still the linked one, else -1."""
        succ, succ_seq = self.ring.links(chunks)
        ok = (succ >= 0) & (succ < len(seq))
        ok[ok] &= seq[succ[ok]] == succ_seq[ok]
        return np.where(ok, succ, -1), succ_seq

    def _anchor(self, chunks: np.ndarray, seq, count, clock: int) -> None:
        """Read the anchors of ``chunks`` (each stable at ``seq``, ``count`` rows)."""
        ring, n, length = self.ring, count[chunks], self.length
        full = n == ring.chunk_rows[chunks]
        # A start ``j`` rows before the newest needs ``length - 1 - j`` rows after the
        # chunk; rows the stream does not hold yet leave the newest starts out until it
        # grows (then the chunk is anchored again).  One hop is looked at: a full
        # successor is taken to hold enough.
        succ, _ = self._linked(chunks, seq)
        succ = np.where(full, succ, -1)
        after = np.where(succ >= 0, count[np.maximum(succ, 0)], 0)
        succ_full = (succ >= 0) & (after == ring.chunk_rows[np.maximum(succ, 0)])
        first = np.where(succ_full, 0, np.maximum(length - 1 - after, 0))
        self.succ[chunks], self.succ_count[chunks] = succ, after
        self.waits[chunks] = full & (first > 0)
        # Starts whose window would contain the chunk's last episode start (row s)
        # within its first length - tail rows never become valid: leave them out.
        s = ring.last_starts(chunks, n)
        band = length - 1 - self.tail
        has = (s > 0) & (band > 0)
        lo = np.maximum(s - band, 0)
        newer_end = np.where(has, n - s - 1, n - 1)        # distances of rows >= s
        older_from = np.where(has, np.maximum(first, n - lo), n)   # rows < s - band
        older_from = np.where(has & (lo > 0), older_from, n)
        d1, sp1 = self._ladder(first, newer_end)
        d2, sp2 = self._ladder(older_from, n - 1)
        dist, span = np.concatenate([d1, d2], axis=1), np.concatenate([sp1, sp2], axis=1)
        rows = ring.chunk_base[chunks][:, None] + n[:, None] - 1 - dist
        self.dist[chunks], self.span[chunks] = dist, span
        self.anchor_t[chunks] = ring.clock_rows[np.clip(rows, 0, ring.layout.capacity - 1)]
        self._masses(chunks, clock)

    def _ladder(self, start: np.ndarray, end: np.ndarray):
        """Anchors ``start + 0, 1, 3, 7, ...`` up to ``end`` (distances, inclusive) and the
        rows after each in its segment; span -1 marks an unused anchor."""
        dist = start[:, None] + self.ladder[None, :]
        inside = dist <= end[:, None]
        nxt = np.concatenate([dist[:, 1:], np.full((len(start), 1), 1 << 62)], axis=1)
        nxt = np.minimum(nxt, end[:, None] + 1)
        return np.where(inside, dist, 0), np.where(inside, nxt - dist - 1, -1)

    def _masses(self, chunks: np.ndarray, clock: int) -> None:
        span = self.span[chunks]
        inside = span >= 0
        age = np.clip(clock - 1 - self.anchor_t[chunks], 0, None).astype(np.float64)
        point = (1.0 + np.maximum(age, self.length - 1)) ** -self.e
        seg = np.where(inside, point + _integral(age, np.maximum(span, 0), self.e), 0.0)
        self.seg[chunks] = seg
        self.mass[chunks] = seg.sum(axis=1)
        self.ref[chunks] = clock
        self.young[chunks] = np.where(inside, age, np.inf).min(axis=1, initial=np.inf) \
            .clip(0, 1 << 62).astype(np.int64)

    def candidates(self, rng, m: int):
        """The start rows that ``m`` draws from the envelope accepted, in draw order (their
        chunks' seqs at the read are ``self.seq``); None if the envelope holds no mass."""
        cum = np.cumsum(self.mass)
        total = cum[-1] if len(cum) else 0.0
        if not total > 0:
            return None
        chunk = np.minimum(np.searchsorted(cum, rng.random(m) * total, side="right"),
                           len(cum) - 1)
        segcum = np.cumsum(self.seg[chunk], axis=1)
        pick = (segcum < (rng.random(m) * segcum[:, -1])[:, None]).sum(axis=1)
        pick = np.minimum(pick, self.width - 1)
        ref = self.ref[chunk]
        a = np.clip(ref - 1 - self.anchor_t[chunk, pick], 0, None).astype(np.float64)
        span = np.maximum(self.span[chunk, pick], 0)
        point = (1.0 + np.maximum(a, self.length - 1)) ** -self.e
        cont = _integral(a, span, self.e)
        u = self._inverse(a, span, rng.random(m))
        in_cont = rng.random(m) * (point + cont) >= point
        step = np.where(in_cont, np.minimum(np.floor(u).astype(np.int64) + 1, span), 0)
        # the envelope's mass at the row drawn: the point, or the unit cell's integral
        bound = np.where(in_cont, _integral(a + np.maximum(step, 1) - 1, 1.0, self.e), point)
        dist = self.dist[chunk, pick] + step
        rows = self.ring.chunk_base[chunk] + self.count[chunk] - 1 - dist
        age = np.clip(self.clock - 1 - self.ring.clock_rows[rows], 0, None).astype(np.float64)
        accept = rng.random(m) * bound < (1.0 + age) ** -self.e
        return rows[accept]

    def _inverse(self, a, span, v):
        """``u`` in ``[0, span]`` with ``F(a, u) = v * F(a, span)``."""
        y = 1.0 + a
        lg = np.log1p(span / y)
        s = 1.0 - self.e
        ratio = v * lg if s == 0.0 else np.log1p(v * np.expm1(s * lg)) / s
        return y * np.expm1(ratio)
