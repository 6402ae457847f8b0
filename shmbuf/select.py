"""Sampling regimes: which windows ``Buffer.sample_sequences(select=...)`` draws, how often.

Each selector is a small frozen object; give one to ``sample_sequences``,
``dataset`` or ``prefetch``.  Whatever the selector, a window never crosses
a writer's stream, an episode end (outside ``tail``), a hole or an
eviction: every candidate goes through the same window check and seqlock
re-check as a uniform draw, and a selector only changes how likely each
valid window is.

- ``Uniform()``: every valid start equally likely (``uniform="steps"``).
- ``Recency(exponent)``: a start of age ``a`` (steps published after it, in
  the buffer's global publish order) has weight ``(1 + a) ** -exponent``.
- ``AgeBuckets(weights)``: the eligible finished episodes, oldest first, in
  ``len(weights)`` contiguous groups of as equal a size as possible; a group
  by weight, an episode uniformly in it, a start uniformly in the episode.
- ``Prioritized(exponent, maxfrac, default)``: a window's score is
  ``(maxfrac * max + (1 - maxfrac) * mean) ** exponent`` of its steps'
  priorities (a buffer made with ``priorities=True``; a step never updated
  counts as ``default``, or as the largest priority set so far).
- ``Mixture([(fraction, selector), ...])``: each window picks its selector
  independently with those probabilities.

Example:
    >>> from shmbuf.select import Mixture, Prioritized, Recency, Uniform
    >>> mix = Mixture([(0.5, Uniform()), (0.3, Prioritized()), (0.2, Recency())])
    >>> batch = buf.sample_sequences(16, 64, select=mix)

How a selector plugs into sampling (for the internals): ``resolve`` turns
``select``/``uniform``/``newest`` into one selector; ``sel.check(buffer)``
runs at the door; each draw is ``sel.draw(finder, rng, n, length, tail)``,
``n`` located ``sampling.Windows`` (see /docs/design.md, "Sampling regimes").
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

_UNIFORM = ("steps", "episodes")
_SUM_TOLERANCE = 1e-6


def _real(owner: str, arg: str, value, lo: float, hi: float = math.inf) -> float:
    """``value`` as a finite float in ``[lo, hi]``, else an error naming ``owner(arg=...)``."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{owner}: {arg} must be a real number, got {value!r} "
                        f"({type(value).__name__})")
    value = float(value)
    if not (math.isfinite(value) and lo <= value <= hi):
        bound = f">= {lo}" if hi == math.inf else f"between {lo} and {hi}"
        raise ValueError(f"{owner}: {arg} must be a finite number {bound}, got {value!r}")
    return value


class Selector:
    """The base of every selector, and the whole selector protocol: ``check`` at the door,
    ``draw`` for each round of windows.

    ``sample_sequences``, ``dataset``, ``prefetch``, the facades' own selectors
    and Ray's shards call these two methods and nothing else, so a custom
    regime subclasses ``Selector`` and implements ``draw`` (with
    ``sampling.windows.WindowFinder``'s ``locate`` or ``draw`` underneath,
    which only ever return valid windows).
    """

    def check(self, buffer) -> None:
        """Raise (ValueError) if ``buffer`` cannot be sampled this way; at the door."""

    def draw(self, finder, rng: np.random.Generator, n: int, length: int, tail: int):
        """``n`` located windows (``sampling.Windows``) drawn this way from the windows
        ``finder`` (a ``WindowFinder``) finds valid, with ``rng``'s draws."""
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class Uniform(Selector):
    """Every valid start row equally likely: ``uniform="steps"``, the default.

    Example:
        >>> buf.sample_sequences(16, 64, select=Uniform())
    """

    def draw(self, finder, rng, n, length, tail):
        return finder.draw(rng, n, length, tail)


@dataclasses.dataclass(frozen=True)
class Recency(Selector):
    """Newer starts more likely: weight ``(1 + a) ** -exponent`` for a start of age ``a``.

    ``a`` counts the steps published (by any writer) after the window's
    first step, in the buffer's global publish order; the newest step has
    age 0.  ``exponent=0`` is uniform.

    Args:
        exponent: a finite number >= 0.  Default 1.0.

    Raises:
        TypeError / ValueError: a bad ``exponent``.

    Example:
        >>> buf.sample_sequences(16, 64, select=Recency(exponent=1.0))
    """

    exponent: float = 1.0

    def __post_init__(self):
        object.__setattr__(self, "exponent", _real("Recency", "exponent", self.exponent, 0.0))

    def draw(self, finder, rng, n, length, tail):
        from .sampling import recency as _recency

        return _recency.draw(finder, rng, n, length, tail, self.exponent)


@dataclasses.dataclass(frozen=True)
class AgeBuckets(Selector):
    """IRIS's and DIAMOND's sampler: finished episodes weighted by age group.

    The finished episodes that are still held and have at least
    ``length - tail`` steps, oldest first (in the order they ended), are
    split into ``len(weights)`` contiguous groups whose sizes differ by at
    most one (the newer groups get the extra episodes).  A draw picks a
    group with probability proportional to its weight (among the groups
    that hold an episode), an episode uniformly within it, and a start
    uniformly within the episode.  One weight is ``uniform="episodes"``.

    Args:
        weights: a non-empty sequence of finite numbers >= 0, not all 0
            (normalised; oldest group first).

    Raises:
        TypeError / ValueError: empty, negative, non-finite or all-zero ``weights``.

    Example:
        >>> iris = AgeBuckets([1 / 8, 1 / 8, 1 / 4, 1 / 2])
        >>> buf.sample_sequences(16, 21, tail=1, select=iris)
    """

    weights: tuple

    def __post_init__(self):
        w = self.weights
        if isinstance(w, (str, bytes)) or not hasattr(w, "__len__"):
            raise TypeError(f"AgeBuckets: weights must be a sequence of numbers, got {w!r}")
        if len(w) == 0:
            raise ValueError("AgeBuckets: weights must hold at least one group's weight, "
                             "got an empty sequence")
        checked = tuple(_real("AgeBuckets", f"weights[{i}]", v, 0.0) for i, v in enumerate(w))
        if not sum(checked) > 0:
            raise ValueError(f"AgeBuckets: weights must not all be 0, got {list(checked)}")
        object.__setattr__(self, "weights", checked)

    def draw(self, finder, rng, n, length, tail):
        from .sampling import age_buckets as _age_buckets

        return _age_buckets.draw(finder, rng, n, length, tail, self.weights)


@dataclasses.dataclass(frozen=True)
class Prioritized(Selector):
    """Windows drawn in proportion to a score made from per-step priorities.

    A window's score is ``(maxfrac * max + (1 - maxfrac) * mean) ** exponent``
    over its steps' priorities (``Buffer.update_priorities``; a step never
    updated has the priority ``default``).  Needs a buffer made with
    ``create(..., priorities=True)``.

    Args:
        exponent: a finite number >= 0.  Default 0.8.
        maxfrac: the weight of the max in the score, ``0 <= maxfrac <= 1``.
            Default 0.5.
        default: the priority of a step never updated (in this draw only:
            nothing is stored), a finite number >= 0; or None (the default):
            the largest priority set so far, 1.0 before any.

    Raises:
        TypeError / ValueError: a bad argument.

    Example:
        >>> batch = buf.sample_sequences(16, 64, select=Prioritized(), ids=True)
    """

    exponent: float = 0.8
    maxfrac: float = 0.5
    default: float | None = None

    def __post_init__(self):
        object.__setattr__(self, "exponent",
                           _real("Prioritized", "exponent", self.exponent, 0.0))
        object.__setattr__(self, "maxfrac",
                           _real("Prioritized", "maxfrac", self.maxfrac, 0.0, 1.0))
        if self.default is not None:
            object.__setattr__(self, "default",
                               _real("Prioritized", "default", self.default, 0.0))

    def check(self, buffer) -> None:
        from .sampling import prioritized as _prioritized

        _prioritized.check(buffer)

    def draw(self, finder, rng, n, length, tail):
        from .sampling import prioritized as _prioritized

        return _prioritized.draw(finder, rng, n, length, tail, self.exponent, self.maxfrac,
                                 self.default)


_LEAVES = (Uniform, Recency, AgeBuckets, Prioritized)


@dataclasses.dataclass(frozen=True)
class Mixture(Selector):
    """Each window of a batch picks one of ``selectors``, independently, with ``fractions``.

    Args:
        components: a non-empty sequence of ``(fraction, selector)`` pairs:
            fractions finite and >= 0, summing to 1 within 1e-6; selectors any
            of ``Uniform``, ``Recency``, ``AgeBuckets``, ``Prioritized``
            (not a Mixture).

    Raises:
        TypeError / ValueError: a bad pair, fraction or selector.

    Example:
        >>> dreamer = Mixture([(0.5, Uniform()), (0.5, Recency())])
        >>> dreamer.fractions, dreamer.selectors
    """

    components: tuple

    def __post_init__(self):
        comps = self.components
        if isinstance(comps, (str, bytes)) or not hasattr(comps, "__len__") or not len(comps):
            raise ValueError(f"Mixture: components must be a non-empty sequence of "
                             f"(fraction, selector) pairs, got {comps!r}")
        checked = []
        for i, pair in enumerate(comps):
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise TypeError(f"Mixture: components[{i}] must be a (fraction, selector) "
                                f"pair, got {pair!r}")
            fraction = _real("Mixture", f"fraction of components[{i}]", pair[0], 0.0)
            if not isinstance(pair[1], _LEAVES):
                raise TypeError(f"Mixture: components[{i}] has selector {pair[1]!r}; expected "
                                "one of Uniform(), Recency(...), AgeBuckets(...), "
                                "Prioritized(...) (a Mixture cannot nest)")
            checked.append((fraction, pair[1]))
        total = sum(f for f, _ in checked)
        if abs(total - 1.0) > _SUM_TOLERANCE:
            raise ValueError(f"Mixture: fractions must sum to 1 (within {_SUM_TOLERANCE}), "
                             f"got {[f for f, _ in checked]} summing to {total!r}")
        object.__setattr__(self, "components", tuple(checked))

    @property
    def fractions(self) -> tuple:
        return tuple(f for f, _ in self.components)

    @property
    def selectors(self) -> tuple:
        return tuple(s for _, s in self.components)

    def check(self, buffer) -> None:
        for f, s in self.components:
            if f > 0:
                s.check(buffer)

    def draw(self, finder, rng, n, length, tail):
        from .sampling.windows import joined

        p = np.array(self.fractions)
        counts = rng.multinomial(n, p / p.sum())
        parts = [s.draw(finder, rng, int(c), length, tail)
                 for c, s in zip(counts, self.selectors) if c]
        w = joined(parts)
        # Shuffled: a batch's windows are exchangeable, as if each picked its selector.
        return w.take(rng.permutation(n)) if len(parts) > 1 else w


@dataclasses.dataclass(frozen=True)
class _PerEpisode(Selector):
    """``uniform="episodes"`` (optionally only the ``newest`` finished episodes)."""

    newest: int | None = None

    def draw(self, finder, rng, n, length, tail):
        return finder.draw_episodes(rng, n, length, tail, self.newest)


def resolve(select, uniform, newest) -> Selector:
    """The one selector that ``select``, ``uniform`` and ``newest`` mean; errors at the door.

    ``uniform`` None means ``"steps"`` unless ``select`` is given; given
    both, they must agree (``Uniform()`` is ``"steps"``, ``AgeBuckets`` with
    one weight is ``"episodes"``).  ``newest`` needs ``uniform="episodes"``.
    """
    if uniform is not None and uniform not in _UNIFORM:
        raise ValueError(f"uniform must be one of {_UNIFORM} (or None), got {uniform!r}")
    if select is not None and not isinstance(select, _LEAVES + (Mixture,)):
        raise TypeError(f"select must be a selector of shmbuf.select (Uniform(), Recency(), "
                        f"AgeBuckets(...), Prioritized(), Mixture(...)), got {select!r}")
    if newest is not None and uniform != "episodes":
        raise ValueError(f"newest= applies to uniform='episodes' only; got uniform={uniform!r}"
                         + (f" and select={select!r}" if select is not None else ""))
    if select is None:
        return _PerEpisode(newest) if uniform == "episodes" else Uniform()
    if uniform is not None:
        agree = (select == Uniform() if uniform == "steps"
                 else isinstance(select, AgeBuckets) and len(select.weights) == 1)
        if not agree:
            raise ValueError(f"select={select!r} and uniform={uniform!r} disagree: give one "
                             "of them (uniform='steps' is Uniform(), uniform='episodes' is "
                             "AgeBuckets([1]))")
        if uniform == "episodes":
            return _PerEpisode(newest)
    return select
