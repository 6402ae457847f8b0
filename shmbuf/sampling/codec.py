"""The codecs a ``Compress`` may name, and the one block format of a compressed column.

A codec is a well-kept library (``zstandard``, ``lz4``), imported only when a
buffer that compresses is created or attached, so the core stays lean: both
live behind the ``compress`` extra.  Each codec knows its level range, so
``Compress`` can refuse a bad level at ``create`` before anything exists.

Decoders hold no shared state: a ``zstandard.ZstdDecompressor`` is not
thread-safe, so each thread keeps its own (``threading.local``).  Both
libraries release the GIL while they encode and decode, so prefetch threads
and DataLoader workers decode in parallel.
"""
from __future__ import annotations

import dataclasses
import importlib
import threading
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class CodecInfo:
    """What ``Compress`` checks a codec against: its module and its level range."""

    name: str
    module: str          # the import that provides it
    extra: str           # pip install 'shmbuf[...]'
    levels: tuple[int, int]


CODECS = {
    "zstd": CodecInfo("zstd", "zstandard", "compress", (-7, 22)),
    "lz4": CodecInfo("lz4", "lz4.block", "compress", (1, 12)),
}


def available() -> list[str]:
    """The codec names whose library imports here."""
    out = []
    for name, info in CODECS.items():
        try:
            importlib.import_module(info.module)
        except ImportError:
            continue
        out.append(name)
    return out


class Codec:
    """Encode and decode blocks with one codec at one level; safe to share between threads.

    Args:
        name: a key of ``CODECS``.
        level: the codec's level (checked by ``Compress``).
    Raises:
        ImportError: the codec's library is not installed (names the extra).
    """

    def __init__(self, name: str, level: int):
        info = CODECS[name]
        try:
            mod = importlib.import_module(info.module)
        except ImportError as exc:
            raise ImportError(
                f"codec {name!r} needs the {info.module!r} package: "
                f"pip install 'shmbuf[{info.extra}]'") from exc
        self.name, self.level = name, level
        self._local = threading.local()
        self._encode: Callable[[bytes], bytes]
        self._decode: Callable[[bytes, int], bytes]
        self._size: Callable[[bytes], int]
        self._into: Callable[[bytes, memoryview], int] | None = None
        if name == "zstd":
            self._mod = mod

            def encode(raw: bytes) -> bytes:
                return self._tl("c", lambda: mod.ZstdCompressor(
                    level=level, write_checksum=True)).compress(raw)

            def decode(blob: bytes, n: int) -> bytes:
                return self._tl("d", mod.ZstdDecompressor).decompress(blob, max_output_size=n)

            def into(blob: bytes, dest: memoryview) -> int:
                # A reader over the whole frame decodes it in one pass straight into dest.
                return self._tl("d", mod.ZstdDecompressor).stream_reader(blob).readinto(dest)

            self._size, self._into = mod.frame_content_size, into
        else:
            def encode(raw: bytes) -> bytes:
                return mod.compress(raw, mode="high_compression" if level > 1 else "default",
                                    compression=level)

            def decode(blob: bytes, n: int) -> bytes:
                return mod.decompress(blob)

            def size(blob: bytes) -> int:   # lz4.block's default header: the size, u32 LE
                return int.from_bytes(blob[:4], "little") if len(blob) >= 4 else -1

            self._size = size
        self._encode, self._decode = encode, decode

    def _tl(self, key: str, make):
        obj = getattr(self._local, key, None)
        if obj is None:
            obj = make()
            setattr(self._local, key, obj)
        return obj

    def encode(self, raw) -> bytes:
        """The compressed bytes of ``raw`` (a bytes-like object)."""
        return self._encode(raw)

    def decode(self, blob: bytes, n: int) -> bytes:
        """The raw bytes of ``blob``, a block of at most ``n`` bytes.

        Raises:
            ValueError: ``blob`` is not a whole block of 1 to ``n`` bytes (torn
                or overwritten); the codec's own error is chained.
        """
        try:
            out = self._decode(blob, n)
        except Exception as exc:   # zstd.ZstdError, lz4's LZ4BlockError: both mean "not a block"
            raise ValueError(f"not a {self.name} block of at most {n} bytes") from exc
        if not 0 < len(out) <= n:
            raise ValueError(f"a {self.name} block decoded to {len(out)} bytes, not 1 to {n}")
        return out

    def block_bytes(self, blob: bytes) -> int:
        """The size ``blob`` says it decodes to, from its header; -1 if it has none."""
        try:
            return int(self._size(blob))
        except Exception:   # not a frame header: decoding will say so
            return -1

    def decode_into(self, blob: bytes, dest, n: int) -> int:
        """Decode ``blob``, a block of at most ``n`` bytes, into the start of ``dest`` (a
        writable contiguous buffer of at least ``n`` bytes); returns the bytes decoded.

        Raises:
            ValueError: as ``decode``; ``dest`` may then hold part of a block.
        """
        mv = memoryview(dest).cast("B")
        if self._into is None:
            raw = self.decode(blob, n)
            mv[:len(raw)] = raw
            return len(raw)
        try:
            size = self._size(blob)
        except Exception as exc:   # not even a frame header
            raise ValueError(f"not a {self.name} block of at most {n} bytes") from exc
        if not 0 < size <= min(n, len(mv)):
            raise ValueError(f"a {self.name} block of {size} bytes, not 1 to {n}")
        try:
            got = self._into(blob, mv[:size])
        except Exception as exc:
            raise ValueError(f"not a {self.name} block of {size} bytes") from exc
        if got != size:
            raise ValueError(f"a {self.name} block decoded to {got} bytes, not {size}")
        return size
