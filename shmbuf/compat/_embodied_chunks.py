"""DreamerV3's replay directory format: one compressed ``.npz`` per chunk of one stream.

A file is named ``{time}-{uuid}-{succ}-{length}.npz``:

- ``time``: ``YYYYmmddTHHMMSSFffffff`` (microseconds after ``F``), so that
  names sort by age;
- ``uuid``: the chunk's 128-bit id, base62 in 22 characters (or a decimal
  number, which readers treat the same: ids are only compared);
- ``succ``: the id of the next chunk of the same stream (an id with no file
  means the stream ends here);
- ``length``: the steps in the file.

Each array of the archive holds one key, ``length`` steps along its first
axis; ``stepid`` holds ``(length, 20)`` uint8: the uuid's 16 bytes and the
step's index in the chunk, 4 bytes big-endian.  A stream is the chain of
chunks linked by ``succ``; an item may span chunks.
"""
from __future__ import annotations

import datetime
import hashlib
import os
import pathlib
import string
import tempfile

import numpy as np

_BASE62 = string.digits + string.ascii_letters


class Name:
    """One parsed chunk file name."""

    __slots__ = ("file", "length", "succ", "time", "uuid")

    def __init__(self, time: str, uuid: str, succ: str, length: int, file: str):
        self.time, self.uuid, self.succ, self.length, self.file = time, uuid, succ, length, file


def parse(file: str) -> Name | None:
    """The parts of a chunk file's name, or None if it is not one."""
    if not file.endswith(".npz"):
        return None
    parts = file[:-4].split("-")
    if len(parts) != 4 or not parts[3].isdigit() or not all(parts[:3]):
        return None
    return Name(parts[0], parts[1], parts[2], int(parts[3]), file)


def file_name(time: str, uuid: str, succ: str, length: int) -> str:
    return f"{time}-{uuid}-{succ}-{length}.npz"


def stamp(when: datetime.datetime) -> str:
    return when.strftime("%Y%m%dT%H%M%S") + f"F{when.microsecond:06d}"


def uuid_for(*parts) -> str:
    """A 22-character base62 id that is a function of ``parts`` (a stream and a position)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=16).digest()
    value, chars = int.from_bytes(digest, "big"), []
    while value:
        value, rest = divmod(value, 62)
        chars.append(_BASE62[rest])
    return "".join(reversed(chars)).rjust(22, "0")


def uuid_bytes(uuid: str) -> bytes:
    """The 16 bytes of a base62 (or, as upstream's debug ids, decimal) id."""
    value = 0
    for char in uuid:
        value = value * 62 + _BASE62.index(char)
    return (value % (1 << 128)).to_bytes(16, "big")


def stepids(uuid: str, n: int) -> np.ndarray:
    """``(n, 20)`` uint8: the chunk id, then each step's index, 4 bytes big-endian."""
    out = np.empty((n, 20), np.uint8)
    out[:, :16] = np.frombuffer(uuid_bytes(uuid), np.uint8)
    out[:, 16:] = np.arange(n, dtype=">u4").view(np.uint8).reshape(n, 4)
    return out


def write(directory: pathlib.Path, name: str, arrays: dict) -> None:
    """Write one chunk file atomically (a reader never sees half of it)."""
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".npz")
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez_compressed(f, **arrays)
        os.replace(tmp, directory / name)
    except BaseException:
        pathlib.Path(tmp).unlink(missing_ok=True)
        raise


def read(path: pathlib.Path) -> dict | None:
    """A chunk's arrays, or None if the file cannot be read (as upstream, it is skipped)."""
    try:
        with np.load(path) as data:
            return {k: data[k] for k in data.files}
    except (OSError, ValueError, EOFError, KeyError):
        return None


def newest(names: list[Name], amount: float, length: int) -> list[Name]:
    """The newest chunks whose items add up to ``amount`` (upstream's rule), newest first.

    A chunk counts the items that start in it and fit in its chain of
    successors on disk.
    """
    names = sorted(names, key=lambda n: n.file, reverse=True)
    by_uuid = {n.uuid: n for n in names}
    ahead: dict[str, int] = {}
    for n in names:   # newest first: a successor is counted before its chunk
        ahead[n.uuid] = n.length + ahead.get(n.succ, 0)
    total, chosen = 0, []
    for n in names:
        after = ahead[by_uuid[n.succ].uuid] if n.succ in by_uuid else 0
        total += int(np.clip(n.length + 1 - length + after, 0, n.length))
        chosen.append(n)
        if total >= amount:
            break
    return chosen


def chains(names: list[Name]) -> list[list[Name]]:
    """``names`` as streams: each a list of chunks linked by ``succ``, oldest stream first."""
    by_uuid = {n.uuid: n for n in names}
    successors = {n.succ for n in names}
    heads = sorted((n for n in names if n.uuid not in successors), key=lambda n: n.file)
    out, seen = [], set()
    for head in heads:
        chain: list[Name] = []
        node: Name | None = head
        while node is not None and node.uuid not in seen:
            seen.add(node.uuid)
            chain.append(node)
            node = by_uuid.get(node.succ)
        out.append(chain)
    return out
