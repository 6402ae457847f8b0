"""The train ratio's words: the ``replayed`` line and the ``rate`` line of a step store.
"""
from __future__ import annotations

import struct

from . import _atomic as atomic
from .layout import NO_TIMEOUT, RATE_FIELDS
from .words import _CLOCK, _RATE, _REPLAYED, _U64


class RateWords:
    """The rate limiter's words of one step store: the ``replayed`` line and the ``rate`` line.

    The admissions themselves (a CAS on ``clock`` for writers, on
    ``replayed`` for samplers, each checking the band first) are one C call
    each (``_atomic.RateGate``), which the writer's C fast path shares; this
    class holds every other load and store of the limiter's words.  Waiting,
    timeouts and messages are ``shmbuf.writing.ratelimit``'s.
    """

    def __init__(self, mm, geometry: bytes):
        self.mm = mm
        self.off = {f: _RATE + o for f, o in RATE_FIELDS.items()}
        # The gate's words are the geometry's clock, replayed and rate_* (protocol.geometry).
        self.gate = atomic.RateGate(mm, geometry)
        self.take_insert = self.gate.insert   # n -> the clock before, or -1: the band refuses
        self.take_replay = self.gate.replay   # n -> 1 taken, 0 min_steps not met, 2 past the edge

    def _load(self, field: str) -> int:
        return atomic.load_acquire(self.mm, self.off[field])

    def config(self) -> tuple[int, float, int, float | None]:
        """(flags, train ratio, min_steps, writer timeout or None): constants since create."""
        timeout = self._load("writer_timeout")
        return (self._load("flags"), _double(self._load("ratio")), self._load("min_steps"),
                None if timeout == NO_TIMEOUT else _double(timeout))

    def tolerance(self) -> float:
        return _double(self._load("tolerance"))

    def widen(self, tolerance: float) -> float:
        """Raise the tolerance to at least ``tolerance`` (a CAS loop; it never shrinks); return it.

        Widening only moves the band's edges outwards, so a state inside the
        old band is inside the new one.
        """
        off = self.off["tolerance"]
        while True:
            bits = atomic.load_acquire(self.mm, off)
            if _double(bits) >= tolerance or atomic.compare_exchange(
                    self.mm, off, bits, _bits(tolerance)):
                return max(_double(bits), tolerance)

    def refund(self, n: int) -> None:
        """Give back ``n`` replayed steps a sample took but did not deliver."""
        atomic.fetch_add(self.mm, _REPLAYED, (1 << 64) - n)

    def add_wait(self, side: str, ns: int) -> None:
        """Count ``ns`` nanoseconds waited by ``side`` ("sample" or "insert")."""
        atomic.fetch_add(self.mm, self.off[side + "_wait_ns"], ns)

    def counts(self) -> tuple[int, int, int, int]:
        """(inserted, replayed, sample wait ns, insert wait ns); inserted is clock + base.

        The clock is read before and after ``replayed``, until it did not move
        (a bounded number of tries): then the pair is one instant's, which the
        band holds at (both words only grow).
        """
        for _ in range(64):
            clock = atomic.load_acquire(self.mm, _CLOCK)
            replayed = atomic.load_acquire(self.mm, _REPLAYED)
            if atomic.load_acquire(self.mm, _CLOCK) == clock:
                break
        inserted = (clock + self._load("base")) & _U64
        return (inserted, replayed, self._load("sample_wait_ns"), self._load("insert_wait_ns"))

    def set_counts(self, inserted: int, replayed: int) -> None:
        """Continue from a checkpoint's counts: inserted (through ``base``) and replayed.

        Plain stores: a restore is not concurrent with sampling, and steps
        published meanwhile would only be counted from now on.
        """
        base = (inserted - atomic.load_acquire(self.mm, _CLOCK)) & _U64
        atomic.store_release(self.mm, self.off["base"], base)
        atomic.store_release(self.mm, _REPLAYED, replayed)


def _double(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<Q", bits))[0]


def _bits(value: float) -> int:
    return struct.unpack("<Q", struct.pack("<d", value))[0]


def rate_words(limit: tuple[int, float, int, float | None, float]) -> dict[str, int]:
    """The rate line's words for ``encode_header``: (flags, ratio, min_steps, writer timeout
    or None, tolerance)."""
    flags, ratio, min_steps, timeout, tolerance = limit
    return {"flags": flags, "ratio": _bits(ratio), "min_steps": min_steps,
            "writer_timeout": NO_TIMEOUT if timeout is None else _bits(timeout),
            "tolerance": _bits(tolerance)}
