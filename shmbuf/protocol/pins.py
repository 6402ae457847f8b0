"""Chunk pins: a process writing values back into held steps keeps their chunk from being
recycled under it.

``Buffer.write_steps`` checks that each id still names its step and then writes the
step's row.  Without a pin, a writer could recycle the chunk between the two and its new
step would keep the written value.  The pin is the last word of a chunk's table entry
(``layout.CHUNK_FIELDS["pin"]``, zero in every segment ever made: unpinned), holding the
pinner's ``posix.procs.stamp_of`` (pid and start time), or 0.

- A pinner CASes the word from 0 (or from a dead pinner's stamp) to its own stamp,
  then a seq_cst fence, and only then loads the chunk's state for the held check.
- A recycler (``Ring.recycle``) CASes the chunk's state to claimed, then a seq_cst
  fence, then loads the pin: a live pinner's stamp makes it undo its claim (nothing
  was written yet) and take the next ticket, as for a chunk a live writer holds.

The Dekker pair: either the pinner's load sees the claim (the step is not held, so
nothing is written) or the recycler's load sees the pin.  A pin is held for the few
microseconds of one write; a pinner that dies holding it is taken over or ignored once
its stamp names no live process.  Threads of one process take turns (a lock), since a
stamp tells processes apart, not threads.
"""
from __future__ import annotations

import os
import threading

import numpy as np

from ..posix.procs import my_stamp, stamp_alive
from ..posix.wait import poll
from . import _atomic as atomic
from .layout import CHUNK_ENTRY, CHUNK_FIELDS

PIN_WAIT = 10.0              # seconds a pinner waits for another live pinner of a chunk
_LOCK = threading.Lock()     # one pinner per process at a time (see the module's doc)


def _fresh_lock() -> None:   # a child forked while another thread pinned: it holds nothing
    global _LOCK
    _LOCK = threading.Lock()


os.register_at_fork(after_in_child=_fresh_lock)

class Pins:
    """The pin words of one mapped buffer's chunks (``mm`` at ``chunks_offset``)."""

    def __init__(self, mm, chunks_offset: int):
        self.mm, self.base = mm, chunks_offset + CHUNK_FIELDS["pin"]

    def _off(self, chunk: int) -> int:
        return self.base + chunk * CHUNK_ENTRY

    def held(self, chunk: int) -> bool:
        """For a recycler, after its claim and a seq_cst fence: is ``chunk`` pinned by a
        live process?"""
        word = atomic.load_acquire(self.mm, self._off(chunk))
        return word != 0 and stamp_alive(word)

    def pinned(self, chunks: np.ndarray):
        """Context manager: ``chunks`` pinned (ascending, so two pinners never wait on each
        other in a cycle), then a seq_cst fence; unpinned on exit.

        Raises:
            TimeoutError: another live process kept one of them pinned ``PIN_WAIT`` s.
        """
        return _Pinned(self, sorted({int(c) for c in np.asarray(chunks).reshape(-1)}))


class _Pinned:
    def __init__(self, pins: Pins, chunks: list[int]):
        self.pins, self.chunks = pins, chunks
        self.taken: list[int] = []
        self.me = my_stamp()

    def __enter__(self):
        self.lock = _LOCK
        self.lock.acquire()
        try:
            for chunk in self.chunks:
                if not self._take(chunk):
                    self._wait_for(chunk)
                self.taken.append(chunk)
            atomic.fence_seq_cst()    # the pins before the held check's loads
        except BaseException:
            self.__exit__()
            raise
        return self

    def _wait_for(self, chunk: int) -> None:
        def took() -> bool | None:
            return True if self._take(chunk) else None

        def late() -> BaseException:
            return TimeoutError(f"chunk {chunk} stayed pinned by another process for "
                                f"{PIN_WAIT} s (a write_steps that does not end)")
        poll(took, PIN_WAIT, late)

    def _take(self, chunk: int) -> bool:
        off = self.pins._off(chunk)
        word = atomic.load_acquire(self.pins.mm, off)
        if word and stamp_alive(word):
            return False
        return atomic.compare_exchange(self.pins.mm, off, word, self.me)

    def __exit__(self, *exc) -> None:
        try:
            for chunk in self.taken:
                atomic.compare_exchange(self.pins.mm, self.pins._off(chunk), self.me, 0)
            self.taken.clear()
        finally:
            self.lock.release()
