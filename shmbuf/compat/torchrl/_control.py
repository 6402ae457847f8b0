"""The storage's control block: a one-row shmbuf buffer that every process shares.

A ``LazyShmStorage`` cannot make its data segment when it is constructed:
the columns come from the first element written, in whichever process
writes first.  So the constructor makes this small buffer at once, under
the storage's name; it owns it, and every process that holds the storage
(by pickle or ``attach``) reads it:

- its metadata: the constructor's parameters (``max_size``, ``ndim``,
  ``device``, compression), which ``shmbuf.attach`` needs to rebuild the
  storage (the registry finds the class by the metadata's ``facade``);
- its one row of int64 words (``Buffer.arrays``), below;
- its serial counter (``Buffer.next_serial``): the storage's mutation
  revision, an atomic counter that TorchRL's samplers read to drop caches.

Words, each written by plain stores (TorchRL's own counters are no more
atomic than that: its ``_len`` is a read-modify-write of a shared value),
but GEN and READY, which only ever move forward, by compare-and-swap
(``advance``): a process that publishes late never takes back a newer
generation.

| word | name | meaning |
|------|------|---------|
| 0 | LEN | elements held, for TorchRL's writers (indexed mode) |
| 1 | MODE | 0 nothing written, 1 indexed (``Storage.set``), 2 streams (``ShmWriter``) |
| 2 | GEN | generation of the data segment (a grow, or ``empty()`` in streams mode, makes one) |
| 3 | READY | GEN + 1 once that generation's data segment is published (processes follow it) |
| 4 | CURSOR | the last cursor written, +1 (0: none) |
| 5 | WRITTEN | steps ``ShmWriter`` wrote in earlier generations that its write count keeps |
"""
from __future__ import annotations

import contextlib

import numpy as np

from ...protocol import cells
from ...segment import segment as _segment
from ...store import buffer as store

FACADE = "torchrl.LazyShmStorage"
LEN, MODE, GEN, READY, CURSOR, WRITTEN = range(6)
WORDS = 8
NONE, INDEXED, STREAMS = 0, 1, 2
MODE_NAMES = {NONE: "empty", INDEXED: "indexed (TorchRL's writers)", STREAMS: "streams (ShmWriter)"}


def remove_segment(name: str) -> None:
    """Mark segment ``name`` closed and remove it, whoever created it (quiet if it is gone):
    a data segment a worker created and kept, removed by the storage's constructing
    process (as ``shmbuf rm --force`` would)."""
    with contextlib.suppress(FileNotFoundError):
        _segment.unlink(name)


class Control:
    """The control buffer of one storage, and typed access to its words."""

    def __init__(self, buffer: store.Buffer):
        self.buffer = buffer
        self.words = buffer.arrays["words"][0]

    @classmethod
    def create(cls, name: str | None, params: dict, handle_signals=None) -> "Control":
        buf = store.create({"words": ((WORDS,), np.int64)}, 1, name=name, chunk_size=1,
                           max_writers=1, done_key=None, handle_signals=handle_signals,
                           meta={"facade": FACADE, "params": params})
        return cls(buf)

    @property
    def params(self) -> dict:
        return self.buffer.meta["params"]

    def __getitem__(self, word: int) -> int:
        return int(self.words[word])

    def __setitem__(self, word: int, value: int) -> None:
        self.words[word] = value

    def advance(self, word: int, value: int) -> bool:
        """Raise ``word`` to ``value`` unless it is there or past already; True if this
        call moved it."""
        return cells.raise_to(self.words, word * self.words.itemsize, value)

    def data_name(self, generation: int) -> str:
        return f"{self.buffer.name}.d{generation}"

    def revision(self) -> int:
        return self.buffer.serial_count()

    def bump_revision(self) -> None:
        self.buffer.next_serial()

