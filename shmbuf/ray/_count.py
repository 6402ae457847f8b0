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

The counts themselves are the core's ``Buffer.count_valid_starts`` and
``Buffer.count_episodes``; this module holds the sharding's choice of
``PROBES`` and why it is enough.
"""
from __future__ import annotations

import numpy as np

PROBES = 4096
MODES = ("steps", "episodes")   # the values of uniform= a sharded buffer takes


def weight(buf, length: int, tail: int, uniform: str, rng: np.random.Generator) -> int:
    """``buf``'s weight in a global batch drawn with ``uniform``: its valid starts of
    windows ``(length, tail)`` (``"steps"``) or its eligible finished episodes
    (``"episodes"``), now (see the module doc)."""
    if uniform == "episodes":
        return buf.count_episodes(length, tail, rng=rng, probes=PROBES)
    return buf.count_valid_starts(length, tail, rng=rng, probes=PROBES)
