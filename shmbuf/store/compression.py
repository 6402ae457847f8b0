"""A Buffer's compressed cold chunks: its settings at ``create``, its compressor, ``compact``
and the ``stats().compression`` figures.

A mixin of ``Buffer`` plus the helpers ``create`` and ``Buffer.__init__`` call.  The
protocol is ``protocol.packing``'s; the compressor is ``writing.compressor``'s and the
reader ``sampling.unpack``'s (held by the buffer's ``StorePort``, which every read path
goes through).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .._args import check_int
from ..posix.wait import check_timeout
from ..protocol.layout import Layout, default_chunk_size
from ..protocol.packing import PackWords
from ..sampling.codec import Codec
from ..sampling.unpack import Unpacker
from ..writing.compress import META_KEY, Compress, CompressionStats
from ..writing.compressor import Packer

if TYPE_CHECKING:
    from ..segment.segment import Segment


class Compaction:
    """``compact`` and the compression figures of a ``Buffer`` (see its docs)."""

    # Class defaults: close() works even after a constructor that failed first.
    _packer: Packer | None = None

    def compact(self, timeout: float | None = None) -> int:
        """Compress every eligible chunk now, in this process; return how many it compressed.

        Eligible: sealed chunks whose newest step is at least ``hot_steps``
        old and whose packed columns are not compressed yet.  The raw pages
        are back in /dev/shm when it returns.  Chunks another live process is
        compressing are waited for.  A buffer made without ``compress`` has
        nothing to compact: 0.

        Args:
            timeout: seconds to wait (None: as long as it takes).

        Raises:
            TimeoutError: chunks were still to compress after ``timeout``.
            SharedMemoryFullError: /dev/shm could not hold a compressed block
                (that chunk stays raw, and nothing is lost).

        Example:
            >>> n = buf.compact()
            >>> buf.stats().compression.ratio
        """
        self._check_live()          # type: ignore[attr-defined]
        timeout = check_timeout(timeout)
        return 0 if self._packer is None else self._packer.compact(timeout)

    def _compression_stats(self) -> CompressionStats | None:
        if self._packer is None:
            return None
        conf = self._meta[META_KEY]   # type: ignore[attr-defined]
        return CompressionStats(tuple(conf["columns"]), conf["codec"], conf["level"],
                                conf["hot_steps"], *self._packer.stats(), self._packer.last_error)

    def _stop_compressing(self) -> None:
        """At close, before the mapping goes: stop the thread, drop every view."""
        packer, self._packer = self._packer, None
        if packer is not None:
            packer.stop()
            packer.words.close()


def settings(compress, spec, capacity, chunk_size, done_key, meta):
    """``(plan's packing argument, the metadata with the settings)``: checks ``compress``
    against the spec and the capacity before anything exists."""
    if compress is None:
        return None, meta
    if not isinstance(compress, Compress):
        raise TypeError(f"compress must be a shmbuf.Compress or None, got {compress!r}")
    if isinstance(meta, dict) and META_KEY in meta:
        raise ValueError(f"meta key {META_KEY!r} is reserved for the compression settings")
    cap = check_int("capacity", capacity, 1, 1 << 40)
    k = default_chunk_size(cap) if chunk_size is None else check_int(
        "chunk_size", chunk_size, 1, cap)
    conf = compress.resolved(dict(spec) if isinstance(spec, dict) else spec, cap, k, done_key)
    Codec(conf["codec"], conf["level"])    # its library must import: fail before creating
    meta = dict(meta or {})
    meta[META_KEY] = conf
    return (tuple(conf["columns"]), conf["block_rows"]), meta


def fit_bytes(layout: Layout, meta: dict) -> tuple[int, int, int]:
    """``check_fits``'s (total, fixed, per-row) bytes.  The blob slots are address space
    only and the cold rows of packed columns are given back, so a compressing buffer
    counts its raw columns, the hot rows of its packed ones, and its words."""
    row = sum(c.row_bytes for c in layout.columns)
    fixed = layout.columns[0].offset
    if layout.pack is None:
        return layout.total_bytes, fixed, row
    packed = sum(c.row_bytes for c in layout.pack.columns)
    fixed += layout.pack.slots_offset - layout.pack.offset
    hot = packed * meta[META_KEY]["hot_steps"]
    return fixed + hot + (row - packed) * layout.capacity, fixed + hot, row - packed


def reserve_words(segment: Segment, layout: Layout) -> None:
    """At create: the reader slots and the chunk words are written by everyone."""
    if layout.pack is not None and segment.space is not None:
        segment.space.reserve(layout.pack.offset, layout.pack.slots_offset - layout.pack.offset,
                              "the compression words")


def attach_packing(ring, views: dict, segment: Segment, layout: Layout,
                   meta: dict) -> tuple[Packer, PackWords, Unpacker]:
    """The compressor, the packing words and the packed-row reader of a compressing
    buffer; hooks the words' ``on_recycle`` into the ring's chunk claims."""
    conf = meta[META_KEY]
    assert segment.space is not None and layout.pack is not None
    words = PackWords(segment.mmap, segment.space.fd, layout.pack, segment.name)
    codec = Codec(conf["codec"], conf["level"])   # thread-safe: one per handle
    ring.on_recycle, ring.before_claim = words.on_recycle, words.reserve_raw
    return (Packer(ring, words, codec, views, conf["hot_steps"]), words,
            Unpacker(ring, words, codec))
