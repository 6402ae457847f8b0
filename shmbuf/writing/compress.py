"""``Compress``: which columns of cold chunks are kept compressed in shared memory.

Checked twice: the settings alone when a ``Compress`` is made (codec, level,
types), and against the buffer at ``create`` (columns in the spec,
``hot_steps`` within the capacity), before any system call, so a bad value
creates nothing.  The settings travel in the buffer's JSON metadata (key
``"compress"``), so every attacher sees them.
"""
from __future__ import annotations

import dataclasses

from ..sampling.codec import CODECS, available

BLOCK_ROWS = 16   # rows per compressed block: a 64-step window decodes at most 94 rows
META_KEY = "compress"


@dataclasses.dataclass(frozen=True, init=False)
class Compress:
    """Keep the named columns of cold chunks compressed in shared memory.

    Pass it as ``shmbuf.create(..., compress=Compress(["obs"]))``.  The
    owner compresses, in a background thread, the named columns of every
    sealed chunk whose newest step is at least ``hot_steps`` steps old, and
    gives the raw pages back to /dev/shm; every attached process reads the
    compressed blocks, and every read returns the same bytes as a raw
    buffer.  A column of a chunk that does not shrink 1.5 times stays raw.

    Args:
        columns: the column names (a str or a sequence of str, at most 8),
            each a column of the buffer's spec.
        codec: ``"zstd"`` (default) or ``"lz4"``; the library comes with
            ``pip install 'shmbuf[compress]'``.
        level: the codec's level: zstd -7..22 (default 1), lz4 1..12.
        hot_steps: the newest steps (by the step clock) kept raw and
            zero-copy; default ``max(8 * chunk_size, capacity // 20)``
            (within the capacity): 5% of the capacity, where fresh data is
            sampled most, at a memory cost of 5% of the raw bytes.

    Raises:
        ValueError: an empty or repeated column, an unknown codec (the
            message lists those installed), a level outside the codec's
            range, a negative ``hot_steps``.
        TypeError: a value of the wrong type.

    Example:
        >>> buf = shmbuf.create(spec, 1_000_000, compress=shmbuf.Compress("obs"))
        >>> buf.compact()          # compress every cold chunk now
        >>> buf.stats().compression.ratio
    """

    columns: tuple[str, ...]
    codec: str
    level: int
    hot_steps: int | None

    def __init__(self, columns, *, codec: str = "zstd", level: int = 1,
                 hot_steps: int | None = None):
        if isinstance(columns, str):
            columns = (columns,)
        try:
            columns = tuple(columns)
        except TypeError:
            raise TypeError(f"columns must be a column name or a sequence of names, "
                            f"got {columns!r}") from None
        if not columns or not all(isinstance(c, str) for c in columns):
            raise ValueError(f"columns must name at least one column (str), got {columns!r}")
        if len(set(columns)) != len(columns) or len(columns) > 8:
            raise ValueError(f"columns must be at most 8 distinct names, got {list(columns)}")
        if not isinstance(codec, str) or codec not in CODECS:
            raise ValueError(f"codec must be one of {sorted(CODECS)} (installed here: "
                             f"{available() or 'none: pip install shmbuf[compress]'}), "
                             f"got {codec!r}")
        lo, hi = CODECS[codec].levels
        if isinstance(level, bool) or not isinstance(level, int) or not lo <= level <= hi:
            raise ValueError(f"level must be an int from {lo} to {hi} for codec {codec!r}, "
                             f"got {level!r}")
        if hot_steps is not None and (isinstance(hot_steps, bool) or not isinstance(
                hot_steps, int) or hot_steps < 0):
            raise ValueError(f"hot_steps must be None or an int >= 0, got {hot_steps!r}")
        for field, value in (("columns", columns), ("codec", codec), ("level", level),
                             ("hot_steps", hot_steps)):
            object.__setattr__(self, field, value)

    def resolved(self, spec_columns, capacity: int, chunk_size: int,
                 done_key: str | None = None) -> dict:
        """The settings for a buffer with these columns, capacity and chunk size, as the
        JSON metadata records them (``hot_steps`` filled in).

        Raises:
            ValueError: a column not in the spec (or the done column), or
                ``hot_steps`` above the capacity.
        """
        names = list(spec_columns)
        for c in self.columns:
            if c not in names:
                raise ValueError(f"compress: columns names {c!r}, which is not a column of "
                                 f"the spec; its columns are {sorted(names)}")
        if done_key in self.columns:
            raise ValueError(f"compress: columns names {done_key!r}, the done_key, which "
                             "readers look up in place one step at a time; leave it raw (it "
                             "is one byte a step)")
        if self.hot_steps is not None and self.hot_steps > capacity:
            raise ValueError(f"compress: hot_steps must be at most the capacity ({capacity}), "
                             f"got {self.hot_steps}")
        hot = (min(capacity, max(8 * chunk_size, capacity // 20)) if self.hot_steps is None
               else self.hot_steps)
        return {"columns": list(self.columns), "codec": self.codec, "level": self.level,
                "hot_steps": hot, "block_rows": min(BLOCK_ROWS, chunk_size)}

    @classmethod
    def from_meta(cls, entry: dict) -> Compress:
        """The ``Compress`` a buffer's metadata records."""
        return cls(entry["columns"], codec=entry["codec"], level=entry["level"],
                   hot_steps=entry["hot_steps"])


@dataclasses.dataclass(frozen=True)
class CompressionStats:
    """What compression holds now (``Buffer.stats().compression``).

    ``raw_bytes`` is what the packed columns of the packed chunks would take
    raw, and ``stored_bytes`` the pages of /dev/shm their blocks hold (every
    blob slot page in use, its directory included); ``ratio`` is their
    quotient.  ``compressed_chunks`` chunks hold packed columns now;
    ``raw_chunks`` hold steps and none (hot, open, still to do, or
    incompressible), of which ``cold_raw_chunks`` are cold and sealed, the
    compressor's backlog.  ``last_error`` is the compressor's last
    ``SharedMemoryFullError`` message in this process, if any.
    """

    columns: tuple[str, ...]
    codec: str
    level: int
    hot_steps: int
    compressed_chunks: int
    raw_chunks: int
    cold_raw_chunks: int
    raw_bytes: int
    stored_bytes: int
    last_error: str | None = None

    @property
    def ratio(self) -> float:
        """``raw_bytes / stored_bytes`` (1.0 while nothing is packed)."""
        return self.raw_bytes / self.stored_bytes if self.stored_bytes else 1.0
