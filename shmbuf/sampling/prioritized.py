"""``Prioritized``'s draw and total score over a buffer's shared priorities.

A window's score is ``(maxfrac * max + (1 - maxfrac) * mean) ** exponent``
of its steps' priorities; ``draw`` returns windows with probability
proportional to it among the windows that could start now, by rejection:

- a proposal picks a block of a sum tree in proportion to its bound (the
  largest priority set in it, or ``B`` where a step was never set, to the
  tree's exponent ``e0``: the largest of ``TREE_EXPONENTS`` that is at most
  ``exponent``), then one of the ``block + length - 1`` stream
  positions whose window touches the block, uniformly (``_prio.propose``);
  a start is so proposed with weight ``mu`` = the sum of the bounds of the
  blocks its window touches;
- the window is located and checked by the C window pass like any other;
- it is accepted with probability ``score / (mu * B ** (exponent - e0))``
  (``_prio.accept``, which stops scoring once the batch has enough), which is
  at most 1 because the block holding the window's largest priority is among
  those summed.

A never-set step counts as ``default`` (None: the largest priority ever set,
1.0 before any); ``B`` is the larger of that and the largest ever set, so it
bounds every step's priority whatever ``default`` is.

Accepted windows are independent and exactly distributed by score (up to
float32 rounding of the tree).  Exponents below every tree's cannot be
bounded by a tree: they propose starts uniformly and accept with
``score / B ** exponent``.  When a few rounds cannot fill the batch
(a fresh buffer: few of the proposed positions hold a window yet), every
committed row is scored and the rest is drawn from those scores.
"""
from __future__ import annotations

import numpy as np

from .._errors import NotEnoughDataError
from .windows import Windows, in_rounds, joined

_ROUNDS = 5
_MAX_PROPOSALS = 1 << 18
# Accepted / proposed in this process's last first round, per (length, tail, exponent, maxfrac).
_acceptance: dict = {}


def check(buffer) -> None:
    """Raise ValueError unless ``buffer`` keeps per-step priorities."""
    if not buffer.priorities:
        raise ValueError(f"select=Prioritized(...) needs a buffer made with "
                         f"create(..., priorities=True); {buffer.name!r} keeps no priorities")


def _priorities(finder):
    pri = finder.ring.priorities
    if pri is None:
        raise ValueError("select=Prioritized(...) needs a buffer made with priorities=True")
    return pri


def _propose(finder, pri, rng, size: int, length: int, top: float, tree: int) -> np.ndarray:
    if tree >= 0:
        return pri.propose(rng.bit_generator.random_raw(2 * size), length, tree, top)
    span = finder.ring.claimed_rows()
    return rng.integers(0, span, size, dtype=np.int64) if span else np.empty(0, np.int64)


def _unset(pri, default: float | None) -> tuple[float, float]:
    """(what a never-set step counts as, ``B``: a bound of every step's priority)."""
    largest = pri.largest()   # one value for the whole draw
    if default is None:
        return largest, largest
    return default, max(largest, default)


def draw(finder, rng, n: int, length: int, tail: int, exponent: float, maxfrac: float,
         default: float | None = None) -> Windows:
    """``n`` windows drawn in proportion to their score (``sampling.Windows``); a
    never-set step counts as ``default`` (None: the largest priority ever set).

    Raises:
        NotEnoughDataError: no window that could start now has a positive score.
    """
    pri = _priorities(finder)
    unset, top = _unset(pri, default)
    tree = pri.tree_for(exponent)
    found: list[Windows] = []
    key = (length, tail, exponent, maxfrac)
    rate = min(max(_acceptance.get(key, 0.25), 0.01), 1.0)

    def proposed(round_, need):
        # Sized by the acceptance seen in this process (a guess only: the proposals
        # are independent whatever their number), with three standard deviations of
        # the accepted count to spare so that one round nearly always does, and
        # growing 4x per round after it.  Proposals past the last one accepted cost
        # their locating, not their scoring.
        spare = 3 * (need * (1 - rate)) ** 0.5
        size = min(int((need + spare) / rate + 16) << 2 * round_, _MAX_PROPOSALS)
        raw = _propose(finder, pri, rng, size, length, top, tree)
        starts = raw[raw >= 0]
        w = finder.locate(starts, length, tail, len(starts))
        # Scored in order until ``need`` are accepted: the windows after those are
        # left unscored (the same picks as scoring them all and keeping the first).
        accepted, scored = pri.accept(w.rows, rng.random(len(w.rows)), need, exponent,
                                      maxfrac, top, tree, unset)
        if round_ == 0:   # accepted per proposal, among those scored; averaged over draws
            hits, tries = len(accepted), scored
            if hits == need > 1:   # stopped on a hit: (hits - 1) / (tries - 1) is unbiased
                hits, tries = hits - 1, tries - 1
            seen = max(hits, 1) / max(tries, 1) * len(w.rows) / size
            _acceptance[key] = seen if key not in _acceptance else 0.75 * rate + 0.25 * seen
        return w.take(accepted)

    need = in_rounds(found, n, proposed, _ROUNDS)
    if need:
        found.append(_enumerated(finder, pri, rng, need, length, tail, exponent, maxfrac, top,
                                 unset))
    return joined(found)


def _enumerated(finder, pri, rng, need, length, tail, exponent, maxfrac, top,
                unset) -> Windows:
    """``need`` windows drawn by score from every valid start (a fresh or sparse buffer)."""
    starts = finder.ring.committed_rows()
    w = finder.locate(starts, length, tail, len(starts))
    score, _ = pri.score_ratio(w.rows, exponent, maxfrac, top, -1, unset)
    total = score.sum()
    if not len(score) or not total > 0:
        raise NotEnoughDataError(
            f"no window of length {length} (tail {tail}) with a positive priority score can "
            f"start now: {len(starts)} committed steps, {len(score)} valid starts; wait for "
            "more steps or set some priorities above 0")
    pick = rng.choice(len(score), need, p=score / total)
    return Windows(w.rows[pick], w.chunks[pick], w.seqs[pick])


def total(buffer, length: int, tail: int, exponent: float, maxfrac: float, rng,
          probes: int = 4096, default: float | None = None) -> float:
    """The sum of the scores of the windows ``(length, tail)`` that could start now
    (a never-set step counts as ``default``, as in ``draw``).

    Exact while at most ``probes`` rows have been claimed; otherwise an
    unbiased estimate from ``probes`` proposals of the draw (the mean of
    ``score / proposal weight`` times the proposals' total weight), at a cost
    that does not grow with the capacity.
    """
    finder = buffer.port.finder
    pri = _priorities(finder)
    unset, top = _unset(pri, default)
    ring = finder.ring
    if ring.claimed_rows() <= probes:
        w = finder.locate(ring.committed_rows(), length, tail, ring.claimed_rows())
        return float(pri.score_ratio(w.rows, exponent, maxfrac, top, -1, unset)[0].sum())
    tree = pri.tree_for(exponent)
    starts = _propose(finder, pri, rng, probes, length, top, tree)
    kept = starts >= 0
    w = finder.locate(starts[kept], length, tail, int(kept.sum()))
    _, ratio = pri.score_ratio(w.rows, exponent, maxfrac, top, tree, unset)
    if tree >= 0:
        weight = (pri.mass(tree, top) * (pri.block + length - 1)
                  * top ** (exponent - pri.exponents[tree]))
    else:
        weight = ring.claimed_rows() * top ** exponent
    return float(weight * ratio.sum() / probes)
