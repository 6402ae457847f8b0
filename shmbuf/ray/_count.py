"""How many valid window starts a shard holds: its weight in a global batch.

A global batch is uniform over the valid starts of all shards when each
shard's share is drawn multinomially in proportion to its count.  The count
uses the sampler's own window check (``WindowFinder.valid``, the C pass):

- exactly, by enumerating every committed row, while the shard has claimed
  at most ``PROBES`` rows;
- otherwise by ``PROBES`` uniform probes over the claimed rows (the same
  candidate space the sampler draws from): ``claimed * accepted / PROBES``.
  The estimate is unbiased; its relative standard error is
  ``sqrt((1 - p) / (p * PROBES))`` for an acceptance rate ``p``, 0.5% at
  ``p = 0.9`` and 1.6% at ``p = 0.5``.  The multinomial split itself moves a
  share of 25 windows by sqrt(25 * 0.5 * 0.5) = 2.5 (10%) from batch to
  batch, so the estimate adds nothing one can see.  Its cost does not grow
  with the capacity (one C pass over 4096 candidates, tens of microseconds).

For ``uniform="episodes"`` the weight is the shard's eligible finished
episodes instead (held, at least ``length - tail`` steps), counted the same
way over its episode index (``Buffer.count_episodes``: exact up to
``PROBES`` entries, else ``PROBES`` uniform picks, with the same error).

For ``select=Prioritized(...)`` the weight is the shard's total score, the
sum of the scores of its windows that could start now
(``shmbuf.sampling.prioritized.total``), so that each window of every shard is
drawn in proportion to its score.

The counts themselves are the core's ``Buffer.count_valid_starts`` and
``Buffer.count_episodes``; this module holds the sharding's choice of
``PROBES`` and why it is enough.
"""
from __future__ import annotations

import numpy as np

from shmbuf.select import Prioritized

PROBES = 4096
MODES = ("steps", "episodes")   # the values of uniform= a sharded buffer takes


def weight(buf, length: int, tail: int, mode, rng: np.random.Generator) -> float:
    """``buf``'s weight in a global batch drawn with ``mode``: its valid starts of
    windows ``(length, tail)`` (``"steps"``), its eligible finished episodes
    (``"episodes"``) or its total score (a ``Prioritized``), now (see the module doc)."""
    if isinstance(mode, Prioritized):
        from shmbuf.sampling import prioritized as _prioritized

        return float(_prioritized.total(buf, length, tail, mode.exponent, mode.maxfrac, rng,
                                        default=mode.default))
    if mode == "episodes":
        return buf.count_episodes(length, tail, rng=rng, probes=PROBES)
    return buf.count_valid_starts(length, tail, rng=rng, probes=PROBES)


def modes(sel) -> tuple:
    """The ``(fraction, mode)`` pairs of a resolved selector (``shmbuf.select.resolve``):
    what a sharded buffer samples, each mode weighed by ``weight``.

    Raises:
        ValueError: a regime that has no global meaning across shards.
    """
    from shmbuf.select import AgeBuckets, Mixture, Recency, Uniform, _PerEpisode

    if isinstance(sel, Mixture):
        return tuple((f, modes(s)[0][1]) for f, s in sel.components if f > 0)
    if isinstance(sel, Uniform) or (isinstance(sel, Recency) and sel.exponent == 0):
        return ((1.0, "steps"),)
    if isinstance(sel, _PerEpisode) or (isinstance(sel, AgeBuckets) and len(sel.weights) == 1):
        return ((1.0, "episodes"),)
    if isinstance(sel, Prioritized):
        return ((1.0, sel),)
    if isinstance(sel, Recency):
        raise ValueError(f"a sharded buffer cannot sample select={sel!r}: a window's age "
                         "counts the steps published after it in its own shard's publish "
                         "order; the shards' clocks are independent, so there is no global "
                         "order to weigh ages by. Sample Uniform(), Prioritized() or their "
                         "mixtures, or one node's shard buffer with Recency")
    raise ValueError(f"a sharded buffer cannot sample select={sel!r}: each shard orders only "
                     "its own finished episodes, so there is no global oldest-first order to "
                     "cut into age groups. Sample Uniform(), Prioritized(), "
                     "uniform='episodes' (AgeBuckets with one weight) or their mixtures")


def sample_kwargs(mode) -> dict:
    """``Buffer.sample_sequences``' arguments that draw ``mode`` in one shard."""
    if isinstance(mode, Prioritized):
        return {"select": mode}
    return {"uniform": mode}
