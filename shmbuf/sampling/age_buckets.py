"""``AgeBuckets``' draw: finished episodes in age groups, a group by weight.

The eligible episodes (finished, still held, at least ``length - tail``
steps) are read from the episode index, oldest first (the order they
ended), and cut into ``len(weights)`` contiguous groups whose sizes differ
by at most one; the newest groups take the extra episodes.  IRIS and
DIAMOND give the whole remainder to the newest group, which for 4 groups
moves at most 3 episodes; equal sizes keep every group's share exactly
its weight whatever the count.

A draw picks a group by weight among the groups that hold an episode, an
episode uniformly within the group, and a start uniformly within the
episode, then locates the window like any per-episode draw (the C seek and
window check).  An episode recycled between the read of the index and its
window check is dropped and drawn again.  The cost is one read of the
index range per round (``O(episodes held)``, never ``O(steps)``) plus the
windows.
"""
from __future__ import annotations

import numpy as np

from .._errors import NotEnoughDataError
from .windows import Windows, enough, in_rounds

_ROUNDS = 4


def groups(count: int, n_groups: int) -> np.ndarray:
    """The first episode of each group and the end: ``n_groups + 1`` ascending bounds.

    Sizes differ by at most one, the newest (last) groups taking the extra.
    """
    base, extra = divmod(count, n_groups)
    sizes = np.full(n_groups, base, np.int64)
    sizes[n_groups - extra:] += 1
    return np.concatenate([[0], np.cumsum(sizes)])


def draw(finder, rng: np.random.Generator, n: int, length: int, tail: int,
         weights: tuple) -> Windows:
    """``n`` windows under ``AgeBuckets(weights)`` (see the module doc)."""
    found: list[Windows] = []

    def drawn(_, need):
        eligible = finder.held_episodes(length, tail)
        picks = _picks(rng, len(eligible), weights, 2 * need + 16, length, tail, finder)
        return finder.episode_windows(rng, eligible.take(picks), length, tail, need)

    need = in_rounds(found, n, drawn, _ROUNDS)
    return enough(found, need, n, f"age-bucket windows of length {length}")


def _picks(rng, count: int, weights, m: int, length: int, tail: int, finder) -> np.ndarray:
    """``m`` episode positions (0 = oldest eligible) drawn by group weight, then uniformly."""
    bounds = groups(count, len(weights))
    sizes = np.diff(bounds)
    w = np.where(sizes > 0, np.asarray(weights, np.float64), 0.0)
    if not w.sum() > 0:
        if not count:
            raise NotEnoughDataError(finder.no_episode_message(length, tail))
        raise NotEnoughDataError(
            f"AgeBuckets(weights={list(weights)}): the {count} eligible finished episodes "
            f"fill only groups of weight 0 (group sizes {sizes.tolist()}); wait for more "
            "episodes or give the newer groups a weight")
    group = rng.choice(len(w), m, p=w / w.sum())
    return bounds[group] + (rng.random(m) * sizes[group]).astype(np.int64)
