"""DreamerV3's selectors (``embodied/core/selectors.py``), with upstream's constructors.

Each selector says how a facade draw picks items (``pick``); the facade
draws through the shared store, so priorities written by any process
steer every sampler.  Public names are re-exported by ``compat.embodied``.
"""
from __future__ import annotations

import math

import numpy as np

from .. import select as core
from .._errors import NotEnoughDataError
from ..sampling.windows import joined
from . import _embodied_draw as draw

_UNIFORM = core.Uniform()   # stateless: one for every draw


def _seed(owner: str, seed) -> int:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise TypeError(f"{owner}: seed must be an int >= 0, got {seed!r}")
    return int(seed)


class Selector:
    """Base of the embodied selectors: ``pick(items, rng, n)`` returns located windows."""

    seed = 0

    def pick(self, items, rng, n: int):
        raise NotImplementedError

    def _prioritized(self) -> list:
        """The ``Prioritized`` selectors inside (priorities are stored for them)."""
        return []


class Uniform(Selector):
    """Every live item equally likely (upstream's default).

    Args:
        seed: seed of the draws (an int >= 0).

    Example:
        >>> replay = Replay(64, 10_000, selector=Uniform(seed=1))
    """

    def __init__(self, seed=0):
        self.seed = _seed("Uniform", seed)

    def pick(self, items, rng, n):
        return items.uniform(rng, n)

    def __repr__(self):
        return f"Uniform(seed={self.seed})"


class Fifo(Selector):
    """Always the oldest live item, as upstream's ``Fifo``.

    Example:
        >>> replay = Replay(64, 10_000, selector=Fifo())
    """

    def pick(self, items, rng, n):
        return draw.oldest(items, rng, n)

    def __repr__(self):
        return "Fifo()"


class Recency(Selector):
    """Items by age: ``uprobs[a]`` (normalised) is the chance of the item of age ``a``.

    Age 0 is the newest live item.  While fewer than ``len(uprobs)`` items
    are live, the vector is stretched over them: a drawn age ``a`` becomes
    ``floor(a * live / len(uprobs))``, as upstream does.

    Args:
        uprobs: a non-empty 1-D sequence of finite numbers >= 0, not all 0,
            with ``uprobs[0] >= uprobs[-1]``.
        seed: seed of the draws.

    Raises:
        ValueError / TypeError: a bad ``uprobs`` or ``seed``.

    Example:
        >>> recency = Recency(1.0 / np.arange(1, 100_001))
    """

    def __init__(self, uprobs, seed=0):
        self.seed = _seed("Recency", seed)
        try:
            probs = np.asarray(uprobs, np.float64)
        except (TypeError, ValueError):
            raise TypeError(f"Recency: uprobs must be a sequence of numbers, got "
                            f"{type(uprobs).__name__}") from None
        if probs.ndim != 1 or not len(probs):
            raise ValueError(f"Recency: uprobs must be a non-empty 1-D sequence, got shape "
                             f"{probs.shape}")
        bad = ~np.isfinite(probs) | (probs < 0)
        if bad.any():
            at = int(np.argmax(bad))
            raise ValueError(f"Recency: uprobs[{at}] is {float(probs[at])!r}; expected finite "
                             "numbers >= 0")
        if not probs.sum() > 0:
            raise ValueError("Recency: uprobs must not all be 0")
        if probs[0] < probs[-1]:
            raise ValueError(f"Recency: uprobs[0] ({probs[0]!r}) must be >= uprobs[-1] "
                             f"({probs[-1]!r}): newer items at least as likely as the oldest")
        self.uprobs = probs
        self._cdf = np.cumsum(probs)

    def pick(self, items, rng, n):
        return draw.by_age(items, rng, n, self._cdf)

    def __repr__(self):
        return f"Recency(<{len(self.uprobs)} ages>, seed={self.seed})"


FRESH = 1e30   # a never-updated step's score under ``initial=inf``: above any real priority


class Prioritized(Selector):
    """Items in proportion to ``maxfrac * max + (1 - maxfrac) * mean`` of their steps'
    ``priority ** exponent``, as upstream.

    Priorities come from ``Replay.update(data)`` in any process.  A step that
    was never given one counts as ``initial``.  ``initial=inf`` (DreamerV3's
    config) means new data first: while any item holds a step never given a
    priority, every draw picks uniformly among those items.

    Args:
        exponent: a finite number >= 0 (default 1.0).
        initial: a step's priority before any update, > 0, or ``inf`` (default 1.0).
        zero_on_sample: set the priorities of a drawn item's steps to 0.
        maxfrac: the weight of the max, ``0 <= maxfrac <= 1`` (default 0.0).
        branching: accepted for upstream's signature (an int >= 2); the shared
            sum tree has its own shape.
        seed: seed of the draws.

    Raises:
        ValueError / TypeError: a bad argument, naming it.

    Example:
        >>> replay = Replay(64, 10_000, selector=Prioritized(exponent=0.8, maxfrac=0.1))
    """

    def __init__(self, exponent=1.0, initial=1.0, zero_on_sample=False, maxfrac=0.0,
                 branching=16, seed=0):
        self.seed = _seed("Prioritized", seed)
        self.exponent = _real("exponent", exponent, 0.0)
        self.initial = _real("initial", initial, 0.0, math.inf, infinite=True)
        if not self.initial > 0:
            raise ValueError(f"Prioritized: initial must be > 0 or inf, got {initial!r}")
        self.maxfrac = _real("maxfrac", maxfrac, 0.0, 1.0)
        if not isinstance(zero_on_sample, (bool, np.bool_)):
            raise TypeError(f"Prioritized: zero_on_sample must be True or False, got "
                            f"{zero_on_sample!r}")
        self.zero_on_sample = bool(zero_on_sample)
        if isinstance(branching, bool) or not isinstance(branching, (int, np.integer)) or \
                branching < 2:
            raise ValueError(f"Prioritized: branching must be an int >= 2, got {branching!r}")
        self.branching = int(branching)
        # Stored priorities are priority ** exponent, scaled so that ``initial`` is 1.0,
        # the draw's value for a step never updated (``default=1.0``): the store's mean
        # and max then make upstream's score.  With ``initial=inf`` they are stored
        # unscaled, and never-updated steps are drawn first (``_fresh_first``).
        self._unit = 1.0 if math.isinf(self.initial) else self.initial ** self.exponent

    def pick(self, items, rng, n):
        w = self._fresh_first(items, rng, n) if math.isinf(self.initial) else None
        if w is None:
            try:
                w = items.core(core.Prioritized(exponent=1.0, maxfrac=self.maxfrac,
                                                default=1.0), rng, n)
            except NotEnoughDataError:   # every score is 0: uniform, as upstream's tree
                w = items.core(_UNIFORM, rng, n)
        if self.zero_on_sample:   # as upstream, when the item is selected (in a Mixture too)
            items.zero(w)
        return w

    def _fresh_first(self, items, rng, n):
        """``initial=inf``: ``n`` windows drawn uniformly among those holding a step never
        given a priority, or None if there is none (then the finite scores decide).

        Scored by their largest step with never-set steps at ``FRESH``, such a window
        scores exactly ``FRESH`` whichever its other steps are, and any other window at
        most the largest priority set: a draw is uniform over fresh windows, and picks
        another only with odds below ``largest set / FRESH``.  A draw that found no fresh
        window says there is none (up to those odds)."""
        try:
            w = items.core(core.Prioritized(exponent=1.0, maxfrac=1.0, default=FRESH), rng, n)
        except NotEnoughDataError:
            return None
        fresh = items.fresh(w)
        if not fresh.any():
            return None
        if not fresh.all():   # a window updated meanwhile, or the odds above: draw again
            keep = np.flatnonzero(fresh)
            w = w.take(keep[rng.integers(0, len(keep), n)])
        return w

    def stored(self, priority: np.ndarray) -> np.ndarray:
        """What the store keeps for ``priority``: ``priority ** exponent / initial ** exponent``."""
        with np.errstate(over="ignore"):
            return np.power(priority.astype(np.float64), self.exponent) / self._unit

    def _prioritized(self):
        return [self]

    def __repr__(self):
        return (f"Prioritized(exponent={self.exponent}, initial={self.initial}, "
                f"zero_on_sample={self.zero_on_sample}, maxfrac={self.maxfrac}, "
                f"seed={self.seed})")


class Mixture(Selector):
    """Each draw picks one of ``selectors`` with the matching ``fractions``.

    Args:
        selectors: ``{name: selector}`` of this module's selectors.
        fractions: ``{name: fraction}`` with the same names, each >= 0,
            summing to 1 (within 1e-6).  A 0 fraction drops its selector.
        seed: seed of the draws.

    Raises:
        ValueError / TypeError: other names, a negative or non-finite fraction,
            fractions that do not sum to 1, or two ``Prioritized`` selectors.

    Example:
        >>> mix = Mixture({"uni": Uniform(), "rec": Recency(probs)},
        ...               {"uni": 0.5, "rec": 0.5})
    """

    def __init__(self, selectors, fractions, seed=0):
        self.seed = _seed("Mixture", seed)
        if not isinstance(selectors, dict) or not isinstance(fractions, dict):
            raise TypeError("Mixture: selectors and fractions must be dicts keyed by name, "
                            f"got {type(selectors).__name__} and {type(fractions).__name__}")
        if set(selectors) != set(fractions):
            raise ValueError(f"Mixture: selectors {sorted(selectors)} and fractions "
                             f"{sorted(fractions)} must have the same names")
        checked = {k: _real(f"fractions[{k!r}]", v, 0.0) for k, v in fractions.items()}
        total = sum(checked.values())
        if abs(total - 1.0) > 1e-6:
            raise ValueError(f"Mixture: fractions must sum to 1, got {dict(fractions)} "
                             f"summing to {total!r}")
        for k, s in selectors.items():
            if not isinstance(s, Selector):
                raise TypeError(f"Mixture: selectors[{k!r}] is {s!r}; expected Uniform, "
                                "Recency, Prioritized, Fifo or Mixture of compat.embodied")
        keys = sorted(k for k in selectors if checked[k] > 0)
        self.selectors = [selectors[k] for k in keys]
        self.fractions = np.array([checked[k] for k in keys]) / sum(checked[k] for k in keys)
        if len(self._prioritized()) > 1:
            raise ValueError("Mixture: at most one Prioritized selector (they share the "
                             "buffer's stored priorities)")

    def pick(self, items, rng, n):
        counts = rng.multinomial(n, self.fractions)
        parts = [s.pick(items, rng, int(c)) for c, s in zip(counts, self.selectors) if c]
        w = joined(parts)
        return w.take(rng.permutation(len(w.rows))) if len(parts) > 1 else w

    def _prioritized(self):
        return [p for s in self.selectors for p in s._prioritized()]

    def __repr__(self):
        return f"Mixture({list(zip(self.fractions.tolist(), self.selectors))})"


def _real(arg: str, value, lo: float, hi: float = math.inf, infinite: bool = False) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(
            value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{arg} must be a real number, got {value!r}")
    value = float(value)
    if infinite and value == math.inf:
        return value
    if not (math.isfinite(value) and lo <= value <= hi):
        raise ValueError(f"{arg} must be a finite number in [{lo}, {hi}]"
                         f"{' or inf' if infinite else ''}, got {value!r}")
    return value
