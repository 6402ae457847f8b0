"""The store's one door upward: every call a layer above the store makes into a buffer.

``Buffer.port`` hands out this buffer's ``StorePort``.  The layers above the
store (the facades, saving and checkpoints, the DataLoader dataset, the
Prioritized total, Ray) ask it, by name, for what they need of the store's
insides, and never read a ``Buffer``'s private attributes: a test
(tests/test_store_door.py) fails on such a reach.  It lives below the store
(which builds it) and below disk/ and feed/ (which call it), so none of them
needs to import the store.

The calls, by what they serve:

- windows: ``draw`` (a selector's located windows), ``sample`` (drawn,
  copied and re-checked, as ``sample_sequences``), ``locate``, ``still_valid``,
  ``take_rows`` (columns at located rows, packed rows decoded), ``read_rows``
  (rows named one by one, each read whole: located, copied, re-checked);
- steps: ``step_ids`` of rows, ``priority_values`` (the priority of each row and
  whether one was set in its claim);
- chunks: ``live_chunks``, ``final_chunks``, ``chunk_seqs`` (each chunk's seq
  now), ``unchanged`` (the seqlock re-check), ``chunk_base``;
- episodes: ``episodes_logged``, ``episode_slots``, ``read_episodes``;
- the buffer's state: ``live`` and ``check_live`` (not closed anywhere),
  ``stop_mark``, ``count_sample``; ``packing`` and ``unpacker``, a compressing
  buffer's chunk words and packed-row reader (None otherwise);
- the buffer's own checks and parts: ``sample_args``, ``check_priorities``,
  ``writer``, ``savers``, ``limiter``, ``random``, ``owner_pid``, ``views``;
- saving's own access: ``ring``, the protocol object that disk/ copies
  chunks and episodes through.
"""
from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Callable

import numpy as np

from ..sampling import gather as _gather
from ..sampling.rows import read_rows as _read_rows
from ..sampling.rows import take_rows as _take_rows

if TYPE_CHECKING:  # annotations only
    from ..protocol.packing import PackWords
    from ..protocol.ring import Chunks, Episodes, Ring
    from ..protocol.stepids import StepIds
    from ..sampling.rng import ProcessRandom
    from ..sampling.unpack import Unpacker
    from ..sampling.windows import WindowFinder, Windows
    from .ratelimit import Limiter
    from .writer import Writer


class StorePort:
    """One step store's door, over the parts its owner ``Buffer`` made in this process.

    The buffer keeps its port; the port holds the buffer's methods only weakly,
    so a dropped buffer still unlinks at once.
    """

    __slots__ = ("ring", "views", "finder", "limiter", "random", "owner_pid", "packing",
                 "unpacker", "capacity", "savers", "_ids", "_writer", "_sample_args",
                 "_priorities")

    def __init__(self, ring: Ring, views: dict[str, np.ndarray], finder: WindowFinder,
                 limiter: Limiter | None, random: ProcessRandom, owner_pid: int,
                 checks: tuple[Callable, Callable, Callable], savers: set, step_ids: StepIds,
                 packing: PackWords | None = None, unpacker: Unpacker | None = None):
        """``checks``: the buffer's ``(writer(limited), sample_args(...),
        check_priorities(what))``, held weakly; ``savers``: its set of running Savers;
        ``step_ids``: its rules for the ids it issues (``protocol.stepids``)."""
        self.ring = ring                  # every shared word of the store (saving's access)
        self.views = views                # column -> (capacity, *shape) view, internal ones too
        self.finder = finder              # which rows make valid windows
        self.limiter = limiter            # the train ratio's limiter, if the buffer has one
        self.random = random              # the buffer's random stream, one per process
        self.owner_pid = owner_pid        # the owner's pid, for per-process streams
        self.packing = packing            # a compressing buffer's chunk words, else None
        self.unpacker = unpacker          # ... and the reader of its packed rows, else None
        self.capacity = ring.layout.capacity
        self.savers = savers              # the Savers following this buffer (disk.save)
        self._ids = step_ids
        self._writer, self._sample_args, self._priorities = (
            weakref.WeakMethod(f) for f in checks)

    def _call(self, method: weakref.WeakMethod):
        found = method()
        if found is None:
            raise ReferenceError("the buffer of this port was dropped")
        return found

    # -- the buffer's own checks and writers -----------------------------------------------
    def writer(self, limited: bool = True) -> Writer:
        """A writer of this store; ``limited=False`` bypasses the rate limit (restores)."""
        return self._call(self._writer)(limited)

    def sample_args(self, batch_size, length, tail=0, uniform=None, newest=None, select=None):
        """The checked ``(batch_size, length, tail, selector)`` of a sample, as
        ``sample_sequences`` checks them (the feeds check at their door the same way)."""
        return self._call(self._sample_args)(batch_size, length, tail, uniform, newest, select)

    def check_priorities(self, what: str) -> None:
        """Raise ValueError, naming ``what``, unless the buffer keeps priorities."""
        self._call(self._priorities)(what)

    # -- windows ------------------------------------------------------------------------
    def draw(self, selector, rng: np.random.Generator, n: int, length: int,
             tail: int = 0) -> Windows:
        """``n`` located windows that ``selector`` draws (``shmbuf.select.Selector.draw``)."""
        return selector.draw(self.finder, rng, n, length, tail)

    def sample(self, selector, rng: np.random.Generator, batch_size: int, length: int,
               targets: dict, *, tail: int = 0, time_major: bool = False) -> dict:
        """``batch_size`` windows ``selector`` draws, copied into ``targets``
        (``sampling.out.prepare_out``'s) and re-checked; stale ones are redrawn."""
        return _gather.sample(self, selector, rng, batch_size, length, tail, targets,
                              time_major)

    def locate(self, starts: np.ndarray, length: int, tail: int = 0) -> Windows:
        """The valid windows among candidate ``starts`` (int64 rows), in order."""
        starts = np.ascontiguousarray(starts, np.int64)
        return self.finder.locate(starts, length, tail, len(starts))

    def still_valid(self, windows: Windows) -> np.ndarray:
        """After reading ``windows``' rows: True for each window whose chunks are unchanged."""
        return self.finder.still_valid(windows)

    def take_rows(self, columns, rows: np.ndarray, chunks: np.ndarray,
                  seqs: np.ndarray) -> dict[str, np.ndarray]:
        """``sampling.rows.take_rows`` on this store: ``{column: (B, L, ...)}`` at ``rows``
        of windows located at ``chunks``/``seqs``, packed rows decoded.  Re-check the
        windows (``still_valid``) after it."""
        return _take_rows(self.unpacker, self.views, columns, rows, chunks, seqs)

    def read_rows(self, columns, rows: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """``sampling.rows.read_rows`` on this store: ``({column: (n, ...)}, held)`` at
        sorted distinct ``rows``, each row the step it holds, whole and decoded (a row a
        writer recycled during the copy is read again); zeros where no step is held."""
        return _read_rows(self, columns, np.ascontiguousarray(rows, np.int64))

    def count_sample(self, rows: int) -> None:
        """Count one sample call that returned ``rows`` steps (``stats().samples``)."""
        self.ring.count_sample(rows)

    # -- steps --------------------------------------------------------------------------
    def step_ids(self, rows: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """The step ids of the steps at ``rows`` (re-check their windows after): every id
        the buffer hands out is made here, tagged as its own (``protocol.stepids``).

        ``out``: a C-contiguous array with one record per row to write them into, each
        id in its record's first 8 bytes (``StepIds.of_rows``); returned."""
        return self._ids.of_rows(self.ring, rows, out)

    @property
    def id_tag(self) -> int:
        """The tag the buffer's step ids carry (``protocol.stepids``)."""
        return self._ids.tag

    @property
    def id_base(self) -> int:
        """The ticket its step ids count from (``protocol.stepids``): 0, or in a buffer
        ``shmbuf.load`` made, where the saved buffer's tickets left off."""
        return self._ids.base

    def rows_of_ids(self, ids: np.ndarray) -> np.ndarray:
        """The rows that this buffer's step ``ids`` (int64, any shape) name: where each
        step is held while its chunk keeps the claim the id names (check with
        ``priorities_of`` or a window re-check); -1 where an id is stale for sure.

        Raises:
            ForeignStepIdsError: an id another buffer issued.
        """
        local = self._ids.decode(np.asarray(ids, np.int64))
        k, n = self.ring.layout.chunk_size, self.ring.layout.n_chunks
        return np.where(local >= 0, local // k % n * k + local % k, -1)

    def first_foreign(self, ids: np.ndarray) -> int | None:
        """The flat index of the first of ``ids`` (int64) that another buffer issued (one
        this buffer refuses, ``ForeignStepIdsError``), or None if it issued them all."""
        return self._ids.first_foreign(ids)

    def priority_values(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(priority float32, set in this claim bool)`` of the steps at committed ``rows``
        (flat int64) of a buffer made with ``priorities=True``."""
        return self.ring.prio().values(np.ascontiguousarray(rows, np.int64))

    # -- chunks -------------------------------------------------------------------------
    @property
    def chunk_base(self) -> np.ndarray:
        """The first physical row of each chunk (int64)."""
        return self.ring.chunk_base

    def live_chunks(self) -> Chunks:
        """Chunks with committed rows and a stable seq, oldest claim first."""
        return self.ring.live_chunks()

    def final_chunks(self) -> Chunks:
        """Live chunks no writer will add to any more, oldest claim first."""
        return self.ring.final_chunks()

    def chunk_seqs(self, chunks: np.ndarray) -> np.ndarray:
        """Each of ``chunks``' seq now (int64; odd while it is being recycled)."""
        return self.ring.seqs_of(chunks)

    def unchanged(self, chunks: np.ndarray, seqs: np.ndarray) -> np.ndarray:
        """After rows were read: True where each chunk still has its seq."""
        return self.ring.unchanged(chunks, seqs)

    # -- episodes -----------------------------------------------------------------------
    def episodes_logged(self) -> int:
        """Episodes ended so far in the buffer's life."""
        return self.ring.episodes_logged()

    @property
    def episode_slots(self) -> int:
        """Entries of the episode index: the newest this many ended episodes are indexed."""
        return self.ring.layout.episode_slots

    def read_episodes(self, indices: np.ndarray) -> Episodes:
        """The published index entries among episode ``indices`` whose first chunk is intact."""
        return self.ring.read_episodes(indices)

    # -- the buffer's state -------------------------------------------------------------
    def live(self) -> bool:
        """False once any process marked the buffer closed (its owner, ``shmbuf rm``)."""
        return not self.ring.closed()

    def check_live(self) -> None:
        """Raise ``BufferClosedError`` once any process marked the buffer closed."""
        self.ring.check_open()   # the pid is asked for only once the word is set

    @property
    def stop_mark(self):
        """The writers-stopped word (``header.StopMark``): ``check()`` raises once set."""
        return self.ring.stop_mark
