"""``RateLimit``: hold the train ratio (replayed steps per inserted step) across processes.

The limit lives in the buffer's header, so every process attached to the
buffer obeys it: env workers that insert, and every sampler (the trainer,
``prefetch`` threads, DataLoader workers, several trainer processes) draws
from one atomic budget.  Units are DreamerV3's: ``sample_sequences(B, L)``
replays ``B * L`` steps, ``sample_steps(B)`` replays ``B``, and each added
step is one inserted step.  After ``min_steps`` inserts,

    -tolerance <= replayed - train_ratio * (inserted - min_steps) <= tolerance

A sample that would pass the upper edge waits for inserts; with
``block_writers`` an insert that would pass the lower edge waits for
samples.  An ``add_batch`` or ``extend`` inserts its steps together and is
admitted once its first step fits, so it may pass the lower edge by its
other steps' worth.  A batch takes its budget when it is drawn: a batch
that a prefetcher or a DataLoader worker drew and nobody consumed still
counts.

The admissions are one compare-and-swap each (``protocol.rate.RateWords``, C in
``_atomic.RateGate``); waiting is ``posix.wait.poll``'s bounded backoff.
"""
from __future__ import annotations

import dataclasses
import math
import os
import time

from .._args import check_int
from .._errors import WaitTimeoutError
from ..posix.wait import check_timeout, poll
from ..protocol.layout import RATE_AUTO_TOLERANCE, RATE_BLOCK_WRITERS, RATE_ON
from ..protocol.rate import RateWords, rate_words

# The limiter's waits poll faster than wait_ready: a trainer at train ratio 32
# waits for a few dozen inserts, a millisecond or so of a writer's time.
_MAX_PAUSE = 1e-3
DEFAULT_WRITER_TIMEOUT = 300.0


def _check_number(arg: str, value, *, positive: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) and not (
            hasattr(value, "dtype") and getattr(value, "ndim", 1) == 0
            and getattr(value.dtype, "kind", "") in "iuf"):
        raise TypeError(f"{arg} must be a real number, got {value!r} ({type(value).__name__})")
    x = float(value)
    if not math.isfinite(x) or (x <= 0 if positive else x < 0):
        want = "> 0" if positive else ">= 0"
        raise ValueError(f"{arg} must be a finite number {want}, got {value!r}")
    return x


@dataclasses.dataclass(frozen=True)
class RateLimit:
    """A train ratio for ``shmbuf.create(..., rate_limit=RateLimit(...))``.

    Args:
        train_ratio: replayed steps per inserted step (DreamerV3's
            ``train_ratio``: 32 on Atari, 512 or 1024 on control), > 0.
        min_steps: inserted steps before any sample is served (samples wait
            for them; writers never wait before them); inserts are counted
            from there on.  Default 0.
        tolerance: half-width of the band, in replayed steps.  None
            (default): one batch's worth: ``train_ratio`` at first, then
            widened to the largest ``B * L`` a sample has asked for, so the
            band always holds a batch and an inserted step and the achieved
            ratio is never more than about one batch off.  A number: fixed,
            at least ``train_ratio``.
        block_writers: True (default): writers wait when they are a band
            ahead of the samplers.  False: writers never wait; only the
            samplers are limited.
        writer_timeout: seconds a writer waits for samples before
            ``WaitTimeoutError`` (None: forever).  Default 300.

    Raises:
        TypeError / ValueError: a bad argument, naming it.

    Example:
        >>> buf = shmbuf.create(spec, 100_000, rate_limit=shmbuf.RateLimit(512, min_steps=5_000))
        >>> buf.sample_sequences(16, 64)   # waits until the writers have inserted enough
        >>> buf.stats().rate.ratio         # replayed / (inserted - min_steps)
    """

    train_ratio: float
    _: dataclasses.KW_ONLY
    min_steps: int = 0
    tolerance: float | None = None
    block_writers: bool = True
    writer_timeout: float | None = DEFAULT_WRITER_TIMEOUT

    def __post_init__(self):
        ratio = _check_number("train_ratio", self.train_ratio, positive=True)
        object.__setattr__(self, "train_ratio", ratio)
        object.__setattr__(self, "min_steps", check_int("min_steps", self.min_steps, 0, 1 << 62))
        if self.tolerance is not None:
            tol = _check_number("tolerance", self.tolerance, positive=False)
            if tol < ratio:
                raise ValueError(
                    f"tolerance must be at least train_ratio ({ratio:g} replayed steps, one "
                    f"inserted step's worth), or no insert could ever fit the band; got "
                    f"{self.tolerance!r}")
            object.__setattr__(self, "tolerance", tol)
        if not isinstance(self.block_writers, bool):
            raise TypeError(f"block_writers must be True or False, got {self.block_writers!r}")
        object.__setattr__(self, "writer_timeout", check_timeout(self.writer_timeout))

    def _words(self) -> dict[str, int]:
        """The header words that hold this limit (``protocol.layout.RATE_FIELDS``)."""
        flags = RATE_ON | (RATE_BLOCK_WRITERS if self.block_writers else 0) | (
            RATE_AUTO_TOLERANCE if self.tolerance is None else 0)
        tol = self.train_ratio if self.tolerance is None else self.tolerance
        return rate_words((flags, self.train_ratio, self.min_steps, self.writer_timeout, tol))

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def check_rate_limit(rate_limit) -> RateLimit | None:
    if rate_limit is not None and not isinstance(rate_limit, RateLimit):
        raise TypeError(f"rate_limit must be a shmbuf.RateLimit or None, got {rate_limit!r}")
    return rate_limit


@dataclasses.dataclass(frozen=True)
class RateStats:
    """The rate limiter's counters, in ``Buffer.stats().rate``.

    ``ratio`` is the achieved ratio, ``replayed / (inserted - min_steps)``
    (0.0 before ``min_steps``); ``lag`` is ``replayed - train_ratio *
    (inserted - min_steps)``, which the limiter keeps within
    ``[-tolerance, tolerance]``.  Waits are summed over every process.
    """

    train_ratio: float
    tolerance: float
    min_steps: int
    block_writers: bool
    inserted: int
    replayed: int
    ratio: float
    lag: float
    sample_wait_s: float
    insert_wait_s: float


class Limiter:
    """One process's handle on a buffer's rate limit (made by ``Buffer`` when it has one)."""

    def __init__(self, words: RateWords, name: str, check_open, check_writing=None):
        self.words, self.name, self._check_open = words, name, check_open
        self._check_writing = check_writing   # Buffer.stop_writers ends an insert's wait
        flags, self.ratio, self.min_steps, self.writer_timeout = words.config()
        self.block_writers = bool(flags & RATE_BLOCK_WRITERS)
        self.auto = bool(flags & RATE_AUTO_TOLERANCE)
        self._tolerance = words.tolerance()   # a lower bound: the word only widens

    @classmethod
    def of(cls, words: RateWords, name: str, check_open,
           check_writing=None) -> "Limiter | None":
        return cls(words, name, check_open, check_writing) if words.config()[0] & RATE_ON \
            else None

    def limit(self) -> RateLimit:
        """The ``RateLimit`` this buffer was created with."""
        return RateLimit(self.ratio, min_steps=self.min_steps,
                         tolerance=None if self.auto else self._tolerance,
                         block_writers=self.block_writers, writer_timeout=self.writer_timeout)

    # -- the samplers' side ---------------------------------------------------------
    def replay(self, n: int, timeout: float | None, what: str) -> None:
        """Take ``n`` replayed steps from the budget, waiting for inserts if need be.

        Raises ValueError if ``n`` can never be served (the band is too narrow
        for a batch and an inserted step), WaitTimeoutError after ``timeout``.
        """
        if n > self._tolerance:
            self._tolerance = self.words.widen(n) if self.auto else self.words.tolerance()
        if self.block_writers and n + self.ratio > 2 * self._tolerance:
            raise ValueError(
                f"{what}: a batch of {n} replayed steps can never be served under the rate "
                f"limit of buffer {self.name!r} (train_ratio {self.ratio:g}, tolerance "
                f"{self._tolerance:g}): the band's width, 2 x tolerance, must hold the batch "
                f"and one inserted step ({n + self.ratio:g}), or the sampler and the writers "
                "would wait for each other forever; sample smaller batches or create the "
                f"buffer with RateLimit(..., tolerance >= {(n + self.ratio) / 2:g})")
        if self.words.take_replay(n) == 1:
            return
        self._wait("sample", lambda: self.words.take_replay(n) == 1 or None, timeout,
                   lambda: f"{what} of {n} replayed steps")

    def refund(self, n: int) -> None:
        self.words.refund(n)

    # -- the writers' side ------------------------------------------------------------
    def insert(self, n: int) -> int:
        """Reserve ``n`` clock numbers (``Ring.stamp``'s ``take``), waiting for samples."""
        t = self.words.take_insert(n)
        if t >= 0:
            return t
        got: list[int] = []

        def ready():
            t = self.words.take_insert(n)
            if t < 0:
                return None
            got.append(t)
            return True

        self._wait("insert", ready, self.writer_timeout,
                   lambda: f"an insert of {n} step{'s' * (n != 1)}", self._check_writing)
        return got[0]

    # -- waiting and counters -------------------------------------------------------------
    def _wait(self, side: str, ready, timeout: float | None, what, check=None) -> None:
        start = time.monotonic_ns()

        def attempt():
            self._check_open()   # a worker waiting on a closed buffer stops
            if check is not None:
                check()          # and a writer whose writers were stopped
            return ready()

        try:
            poll(attempt, timeout, lambda: WaitTimeoutError(self._timed_out(side, what(), timeout)),
                 max_pause=_MAX_PAUSE)
        finally:
            self.words.add_wait(side, time.monotonic_ns() - start)

    def _timed_out(self, side: str, what: str, timeout) -> str:
        s = self.stats()
        state = (f"inserted {s.inserted} steps (min_steps {s.min_steps}), replayed {s.replayed}, "
                 f"replayed - train_ratio x counted inserts = {s.lag:g} (the band is "
                 f"+-{s.tolerance:g} at train_ratio {s.train_ratio:g})")
        if side == "sample":
            hint = ("Are the writers running?" if s.inserted >= s.min_steps else
                    f"The writers have not inserted min_steps = {s.min_steps} steps yet.")
            return (f"buffer {self.name!r}: {what} waited {timeout} s for inserts and timed "
                    f"out; {state}. {hint}")
        return (f"buffer {self.name!r}: {what} waited {timeout} s for samples and timed out "
                f"(writer_timeout); {state}. Is the trainer sampling? A restarted trainer "
                "that adopts the buffer lets waiting writers go on; RateLimit(..., "
                "block_writers=False) never makes writers wait")

    def stats(self) -> RateStats:
        inserted, replayed, sample_ns, insert_ns = self.words.counts()
        tol = self.words.tolerance()
        counted = inserted - self.min_steps
        ratio = replayed / counted if counted > 0 else 0.0
        return RateStats(self.ratio, tol, self.min_steps, self.block_writers, inserted, replayed,
                         ratio, replayed - self.ratio * max(counted, 0), sample_ns / 1e9,
                         insert_ns / 1e9)

    def state(self) -> dict:
        """The counters a checkpoint carries (plain values), and the tolerance reached."""
        inserted, replayed, _, _ = self.words.counts()
        return {"inserted": int(inserted), "replayed": int(replayed),
                "tolerance": self.words.tolerance()}

    def restore(self, state) -> None:
        """Continue from a checkpoint's ``state()`` (after its steps were written back)."""
        if not isinstance(state, dict):
            raise ValueError(f"state['rate'] must be a dict of counts, got {state!r}")
        inserted = check_int("state['rate']['inserted']", state.get("inserted"), 0, (1 << 63) - 1)
        replayed = check_int("state['rate']['replayed']", state.get("replayed"), 0, (1 << 63) - 1)
        tol = state.get("tolerance")
        if self.auto and isinstance(tol, (int, float)) and math.isfinite(tol):
            self._tolerance = self.words.widen(float(tol))   # the batches it had seen
        self.words.set_counts(inserted, replayed)


def pid_check(ring, check_open):
    """The check a limiter's waits make: this handle closed, or the buffer closed anywhere."""
    def check():
        check_open()
        ring.check_open(os.getpid())
    return check
