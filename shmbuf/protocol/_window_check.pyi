"""Type stubs of the C extension _window_check.c: the sampler's per-candidate window check."""
from typing import Any, Callable

import numpy as np

_Buffer = Any  # the segment's mmap
_Geometry = bytes  # Ring.geometry, packed by protocol.geometry: see shmbuf_words.h
_Preempt = Callable[[], object] | None

GEOMETRY_FIELDS: tuple[tuple[str, int, str, int], ...]  # (name, offset, format, count)
GEOMETRY_SIZE: int
GEOMETRY_MAGIC: int

def read_geometry(geometry: _Geometry, buffer: _Buffer, /) -> dict[str, Any]: ...
def find(buffer: _Buffer, geometry: _Geometry, starts: np.ndarray, span: int, length: int,
         tail: int, need: int, max_hops: int, picked: np.ndarray, rows: np.ndarray | None,
         hop_chunks: np.ndarray | None, hop_seqs: np.ndarray | None,
         preempt: _Preempt = None, /) -> tuple[int, int]: ...
def unchanged(buffer: _Buffer, geometry: _Geometry, hop_chunks: np.ndarray,
              hop_seqs: np.ndarray, max_hops: int, ok: np.ndarray,
              preempt: _Preempt = None, /) -> int: ...
def seek(buffer: _Buffer, geometry: _Geometry, chunks: np.ndarray, seqs: np.ndarray,
         offsets: np.ndarray, advances: np.ndarray, rows: np.ndarray,
         preempt: _Preempt = None, /) -> None: ...
