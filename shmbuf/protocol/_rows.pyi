"""Type stubs of the C extension _rows.c: a sampled batch's rows and their step ids."""
from collections.abc import Sequence
from typing import Any

import numpy as np

_Buffer = Any  # the segment's mmap
_Geometry = bytes  # Ring.geometry, packed by protocol.geometry: see shmbuf_words.h

GEOMETRY_FIELDS: tuple[tuple[str, int, str, int], ...]  # (name, offset, format, count)
GEOMETRY_SIZE: int
GEOMETRY_MAGIC: int

def read_geometry(geometry: _Geometry, buffer: _Buffer, /) -> dict[str, Any]: ...
def copy_rows(columns: Sequence[tuple[Any, Any, int, int, int]], rows: np.ndarray,
              at: np.ndarray, /) -> None: ...
def step_ids(buffer: _Buffer, geometry: _Geometry, rows: np.ndarray, out: Any,
             first: int = 0, tag: int = 0, /) -> int: ...
