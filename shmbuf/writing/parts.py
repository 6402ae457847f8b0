"""The parts of a step store that its sibling layers work with, behind one name.

``Buffer._parts`` hands out a ``StoreParts``; saving,
checkpoints, the DataLoader dataset and the Prioritized total reach the ring,
the column views, the window finder and the limiter through it, and never
through ``Buffer``'s other attributes.  It lives below the store (which
builds it) and below disk/ and feed/ (which read it), so none of them needs
to import the store.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable

from ..sampling.rows import take_rows as _take_rows

if TYPE_CHECKING:  # annotations only
    import numpy as np

    from ..protocol.ring import Ring
    from ..sampling.rng import ProcessRandom
    from ..sampling.windows import WindowFinder
    from .ratelimit import Limiter
    from .writer import Writer


@dataclasses.dataclass(frozen=True)
class StoreParts:
    """One step store's working parts, as its owner ``Buffer`` made them in this process."""

    ring: Ring                           # every shared word of the store
    views: dict[str, np.ndarray]         # column -> (capacity, *shape) view, internal ones too
    finder: WindowFinder                 # which rows make valid windows
    limiter: Limiter | None              # the train ratio's limiter, if the buffer has one
    random: ProcessRandom                # the buffer's random stream, one per process
    owner_pid: int                       # the owner's pid, for per-process streams
    writer: Callable[[bool], Writer]     # writer(limited): a writer; False bypasses the limit

    def take_rows(self, columns, rows: np.ndarray, chunks: np.ndarray,
                  seqs: np.ndarray) -> dict[str, np.ndarray]:
        """``sampling.rows.take_rows`` on this store: ``{column: (B, L, ...)}`` at ``rows``
        of windows located at ``chunks``/``seqs``, packed rows decoded.  Re-check the
        windows (``finder.still_valid``) after it."""
        return _take_rows(self.ring, self.views, columns, rows, chunks, seqs)
