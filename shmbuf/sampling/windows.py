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
all valid start rows.  The per-candidate check runs in C (``_window_check.c``),
which examines candidates in order and stops once enough are valid.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from .._errors import NotEnoughDataError, SampleRetryError
from ..protocol import _window_check
from ..protocol.ring import Ring

_ROUNDS = 4
_MAX_ELEMENTS = 1 << 22  # candidates x length: caps the random words drawn per round


def max_hops(length: int, chunk_size: int) -> int:
    """Chunks a window of ``length`` rows can touch.

    The start chunk gives at least one row, every later chunk but the last
    is full, and at most one of them (the last physical chunk, when the
    capacity is not a multiple of the chunk size) is shorter.
    """
    return min(length, (length - 1) // chunk_size + 3)


@dataclasses.dataclass
class Windows:
    """Row indices of accepted windows, and the chunk seqs they depend on."""

    rows: np.ndarray        # (B, L) int64 physical rows
    chunks: np.ndarray      # (B, H) chunk per hop, -1 where unused
    seqs: np.ndarray        # (B, H) seq each hop had when located

    def take(self, keep) -> "Windows":
        """The windows ``keep`` (an index array or a mask) selects, in that order."""
        return Windows(self.rows[keep], self.chunks[keep], self.seqs[keep])


class WindowFinder:
    """Locates and validates windows over one ring; see the module doc."""

    def __init__(self, ring: Ring):
        self.ring = ring
        self.mm = ring.mm
        self.k = ring.layout.chunk_size
        self.geometry = ring.geometry
        self.preempt = None  # tests: called before every shared load (see _window_check.c)
        self._held: tuple = (None, 0)   # held_episodes' entries read so far, and the end of them

    def locate(self, starts: np.ndarray, length: int, tail: int, need: int,
               span: int = 0) -> Windows:
        """The first ``need`` valid windows among candidate ``starts``, in order.

        ``starts`` are int64 rows, or with ``span > 0`` raw uint64 random
        words that the C pass maps uniformly onto rows ``[0, span)``.  The
        first ``length - tail`` rows must share an episode; the last ``tail``
        rows only have to follow them in the stream.
        """
        hops = max_hops(length, self.k)
        picked = np.empty(need, np.int64)
        rows = np.empty((need, length), np.int64)
        chunks, seqs = np.empty((need, hops), np.int64), np.empty((need, hops), np.int64)
        found, _ = _window_check.find(self.mm, self.geometry, starts, span, length, tail,
                                      need, hops, picked, rows, chunks, seqs, self.preempt)
        if found == need:
            return Windows(rows, chunks, seqs)
        return Windows(rows[:found], chunks[:found], seqs[:found])

    def valid(self, starts: np.ndarray, length: int, tail: int) -> np.ndarray:
        """The candidate ``starts`` (int64) that begin a valid window now."""
        picked = np.empty(len(starts), np.int64)
        found, _ = _window_check.find(self.mm, self.geometry, starts, 0, length, tail,
                                      len(starts), max_hops(length, self.k), picked, None,
                                      None, None, self.preempt)
        return starts[picked[:found]]

    def count_valid(self, length: int, tail: int, rng: np.random.Generator,
                    probes: int = 4096) -> int:
        """Valid start rows of windows ``(length, tail)`` now: exact or estimated.

        Exact (every committed row checked) while at most ``probes`` rows
        have been claimed; otherwise ``claimed * accepted / probes`` from
        ``probes`` uniform candidates over the claimed rows, the space the
        sampler draws from.  The estimate is unbiased, with relative standard
        error ``sqrt((1 - p) / (p * probes))`` for an acceptance rate ``p``,
        and costs one C pass whatever the capacity.
        """
        span = self.ring.claimed_rows()
        if span <= probes:
            return len(self.valid(self.ring.committed_rows(), length, tail))
        starts = rng.integers(0, span, probes, dtype=np.int64)
        return round(span * len(self.valid(starts, length, tail)) / probes)

    def still_valid(self, w: Windows) -> np.ndarray:
        """After the copy: True where no chunk of the window was recycled meanwhile."""
        return self.recheck(w)[0]

    def recheck(self, w: Windows) -> tuple[np.ndarray, bool]:
        """``(still_valid(w), whether every window is)``, in one pass."""
        ok = np.empty(len(w.rows), np.bool_)
        same = _window_check.unchanged(self.mm, self.geometry, w.chunks, w.seqs,
                                       w.chunks.shape[1], ok, self.preempt)
        return ok, same == len(ok)

    def draw(self, rng: np.random.Generator, batch: int, length: int, tail: int = 0) -> Windows:
        """``batch`` windows, uniform over every valid start row, with replacement."""
        span = self.ring.claimed_rows()
        cap = max(batch, _MAX_ELEMENTS // length)
        found: list[Windows] = []
        # Candidates are cheap (one random word each; the C pass stops once
        # enough are valid), so the first round has room for half of them to
        # be invalid, and later rounds grow fourfold.  The sizes depend only
        # on the batch, so a seed gives the same batch on the same contents.
        m = 2 * batch + 16
        first = None
        if span:
            first = self.locate(rng.bit_generator.random_raw(min(m, cap)), length, tail,
                                batch, span)
            if len(first.rows) == batch:
                return first   # the usual case: round 0 found them all (as in_rounds would)

        def proposed(round_, need):
            if round_ == 0 or not span:
                return first
            raw = rng.bit_generator.random_raw(min(m << 2 * round_, cap))
            return self.locate(raw, length, tail, need, span)

        need = in_rounds(found, batch, proposed, _ROUNDS)
        need = in_rounds(found, need, lambda _, need: self.locate(
            self._valid_starts(rng, need, length, tail), length, tail, need), _ROUNDS)
        return enough(found, need, batch, f"windows of length {length}")

    def _valid_starts(self, rng, need: int, length: int, tail: int) -> np.ndarray:
        """``need`` start rows drawn from an enumeration of every committed row."""
        starts = self.ring.committed_rows()
        valid = self.valid(starts, length, tail)
        if not len(valid):
            raise NotEnoughDataError(self._no_window_message(len(starts), length, tail))
        return rng.choice(valid, need)

    def _no_window_message(self, steps: int, length: int, tail: int) -> str:
        """Say whether waiting can help: how long the held episodes are."""
        ring = self.ring
        hi = ring.episodes_logged()
        done = ring.read_episodes(np.arange(hi - min(hi, ring.layout.episode_slots), hi))
        rule = ("a window must lie in one writer stream without continuing past a terminal "
                "step or an end_episode cut")
        if len(done) and steps >= length and int(done.length.max()) < length - tail:
            return (f"no window of length {length} fits in the buffer: it holds {steps} "
                    f"committed steps, but the longest of its {len(done)} finished episodes "
                    f"has {int(done.length.max())} steps, and {rule}. Waiting helps only if "
                    f"episodes get longer; ask for windows of at most "
                    f"{int(done.length.max()) + tail} steps, or use tail= for rows that may "
                    "follow an episode's end")
        longest = (f" (the longest finished episode has {int(done.length.max())})"
                   if len(done) else "")
        return (f"no window of length {length} fits in the buffer yet: it holds {steps} "
                f"committed steps{longest}, and {rule}; wait with "
                "wait_ready(min_steps=..., timeout=...) or ask for shorter windows")

    # -- per episode -------------------------------------------------------------
    def draw_episodes(self, rng: np.random.Generator, batch: int, length: int, tail: int,
                      newest: int | None) -> Windows:
        """``batch`` windows, each finished episode equally likely, start uniform within.

        Only the newest ``newest`` finished episodes of the index take part
        (all it holds if None), and of those the ones with at least
        ``length - tail`` steps whose steps are still held.  Episode numbers
        are drawn uniformly from that range of the index and rejected when
        ineligible; when that keeps failing, the range is enumerated instead.
        """
        ring = self.ring
        lo, hi = self._episode_range(newest)
        held = hi - lo
        found: list[Windows] = []
        m = 2 * batch + 16

        def proposed(round_, need):
            if not held:
                return None
            picks = ring.read_episodes(lo + rng.integers(0, held, min(m << 2 * round_, 1 << 20)))
            return self.episode_windows(rng, picks, length, tail, need)

        def enumerated(_, need):
            eligible = ring.read_episodes(np.arange(lo, hi))
            eligible = eligible.take(eligible.length >= length - tail)
            if not len(eligible):
                raise NotEnoughDataError(self._no_episode_message(length, tail, held, lo, hi))
            picks = eligible.take(rng.integers(0, len(eligible), 2 * need + 16))
            return self.episode_windows(rng, picks, length, tail, need)

        need = in_rounds(found, batch, proposed, _ROUNDS)
        need = in_rounds(found, need, enumerated, _ROUNDS)
        return enough(found, need, batch, f"episode windows of length {length}")

    def count_episodes(self, length: int, tail: int, newest: int | None,
                       rng: np.random.Generator, probes: int = 4096) -> int:
        """Episodes ``draw_episodes(..., length, tail, newest)`` could pick now: exact or estimated.

        An episode counts when it has at least ``length - tail`` steps and
        the window at its first step locates (its steps are still held).
        Exact (every entry checked) while the range of the index holds at
        most ``probes`` episodes; otherwise ``held * accepted / probes`` from
        ``probes`` uniform picks over that range, the space ``draw_episodes``
        picks from.  Unbiased, with the relative standard error of
        ``count_valid``, and one C pass whatever the capacity.
        """
        lo, hi = self._episode_range(newest)
        held = hi - lo
        if held <= probes:
            return self._eligible(self.ring.read_episodes(np.arange(lo, hi)), length, tail)
        picks = self.ring.read_episodes(lo + rng.integers(0, held, probes))
        return round(held * self._eligible(picks, length, tail) / probes)

    def held_episodes(self, length: int, tail: int):
        """The finished episodes of the index that are still held and have at least
        ``length - tail`` steps, oldest first (``Episodes``).

        The entries read before are kept (an entry's body never changes once
        read intact; whether its episode is still held is its first chunk's
        seq, checked again here), so a call reads only the entries logged
        since and one seq per episode held.  An entry logged but not yet
        published when it was read is read again next time (with every entry
        after it), never skipped for good.
        """
        lo, hi = self._episode_range(None)
        known, known_hi = self._held     # one tuple: threads sharing the finder see pairs
        if known is not None and len(known) and int(known.index[0]) < lo:
            known = known.take(known.index >= lo)
        start = lo if known is None else max(lo, known_hi)
        ring = self.ring
        upto = ring.first_unpublished(start, hi)   # taken before the read
        fresh = ring.read_episodes(np.arange(start, hi))
        if known is not None and len(known):
            known = known.take(ring.unchanged(known.chunk, known.seq))
            fresh = _concat(known, fresh)
        # Kept: the entries below the first one still pending; from it on, read again.
        self._held = (fresh if upto == hi else fresh.take(fresh.index < upto), upto)
        return fresh.take(fresh.length >= length - tail)

    def no_episode_message(self, length: int, tail: int) -> str:
        """Why no finished episode can give a window ``(length, tail)``."""
        lo, hi = self._episode_range(None)
        return self._no_episode_message(length, tail, hi - lo, lo, hi)

    def _episode_range(self, newest: int | None) -> tuple[int, int]:
        """``[lo, hi)``: the index entries a per-episode draw picks from."""
        hi = self.ring.episodes_logged()
        return hi - min(hi, self.ring.layout.episode_slots, hi if newest is None else newest), hi

    def _eligible(self, picks, length: int, tail: int) -> int:
        """How many of ``picks`` are long enough and still locate a window at step 0."""
        picks = picks.take(picks.length >= length - tail)
        starts = self._seek(picks, np.zeros(len(picks), np.int64))
        return len(self.valid(starts, length, tail))

    def episode_windows(self, rng, picks, length: int, tail: int, need: int) -> Windows:
        """Windows at a uniform start in each eligible episode of ``picks``, in order."""
        picks = picks.take(picks.length >= length - tail)
        span = picks.length - (length - tail) + 1
        advance = (rng.random(len(picks)) * span).astype(np.int64)
        return self.locate(self._seek(picks, advance), length, tail, need)

    def _seek(self, picks, advance: np.ndarray) -> np.ndarray:
        """The row ``advance`` steps into each episode of ``picks``; -1 where not held."""
        starts = np.empty(len(picks), np.int64)
        _window_check.seek(self.mm, self.geometry, picks.chunk, picks.seq, picks.offset, advance,
                      starts, self.preempt)
        return starts

    def _no_episode_message(self, length, tail, held, lo, hi) -> str:
        if not hi:
            return ("no episode has finished yet: per-episode sampling draws from finished "
                    "episodes only (a true done, or Writer.end_episode()); wait for one")
        every = self.ring.read_episodes(np.arange(lo, hi))
        longest = int(every.length.max()) if len(every) else 0
        return (f"no finished episode among the newest {held} holds {length - tail} steps "
                f"(windows of length {length}, tail {tail}); the longest held has {longest}; "
                "ask for shorter windows")


def _concat(a, b):
    """Two ``Episodes``, one after the other."""
    return type(a)(*(np.concatenate([getattr(a, f.name), getattr(b, f.name)])
                     for f in dataclasses.fields(a)))


def in_rounds(found: list[Windows], need: int, draw_round, rounds: int) -> int:
    """Draw in rounds until enough: ``draw_round(round_, need)`` for ``round_`` = 0, 1, ...
    while windows are still needed, at most ``rounds`` times; return how many are still
    needed.

    ``draw_round`` returns located ``Windows`` (the first ``need`` of them are kept
    and appended to ``found``) or None to stop early.  Every sampler's rejection loop
    is this one: a round sized by what is still needed, then ``enough``.
    """
    for round_ in range(rounds):
        if not need:
            break
        w = draw_round(round_, need)
        if w is None:
            break
        if len(w.rows) > need:
            w = w.take(np.arange(need))
        found.append(w)
        need -= len(w.rows)
    return need


def enough(found: list[Windows], need: int, n: int, what: str) -> Windows:
    """The windows ``found``, one after the other, once ``in_rounds`` left none needed.

    Raises:
        SampleRetryError: ``need`` windows are still missing: the writers recycled
            the chosen chunks in every round (``what`` names the windows).
    """
    if need:
        raise SampleRetryError(
            f"could not draw {n} {what}: writers recycled the chosen chunks each time; "
            "the buffer is too small for its ingest rate")
    return joined(found)


def joined(found: list[Windows]) -> Windows:
    """The windows of ``found``, one after the other."""
    found = [w for w in found if len(w.rows)]
    if len(found) == 1:
        return found[0]
    return Windows(*(np.concatenate([getattr(w, f) for w in found])
                     for f in ("rows", "chunks", "seqs")))
