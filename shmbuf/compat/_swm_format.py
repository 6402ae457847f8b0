"""stable-worldmodel's format ``"shmbuf"``: ``shm://NAME`` tables, their reader and writer.

``ShmFormat`` ties them into swm's registry (``shmbuf.compat.swm`` registers
it); ``ShmDataset`` reads a table like swm's HDF5 reader, ``ShmWriter``
writes one with swm's write modes.  The table itself is ``_swm_table``'s.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
from stable_worldmodel.data import format as _swm_format
from stable_worldmodel.data.dataset import Dataset

from ..segment.segment import validate_name
from . import _swm_codec as codec
from . import _swm_table as table

SCHEME = "shm://"


def parse(path, who: str) -> str:
    """The segment name of ``shm://NAME``.

    Raises:
        ValueError: ``path`` is not ``shm://`` plus a valid segment name.
    """
    s = os.fspath(path) if not isinstance(path, str) else path
    if not isinstance(s, str) or not s.startswith(SCHEME):
        raise ValueError(f"{who}: path must be 'shm://NAME', got {path!r}")
    try:
        return validate_name(s[len(SCHEME):])
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{who}: {path!r}: {exc}") from None


class ShmDataset(Dataset):
    """A swm ``Dataset`` over a shared swm table, attached by name; pickles to the name.

    Follows the HDF5 reader's output: torch tensors, ``(T, C, H, W)`` for a
    4-D column whose last axis is 1 or 3, ``action`` dense and the other
    columns strided by ``frameskip``, a text column as one ``str``.  The
    episodes are those held when it was opened (pickled copies keep the same
    ones); a read of an episode recycled since raises ``RuntimeError``.

    Args:
        name: the segment (``shm://NAME`` without the scheme).
        frameskip: as swm's ``Dataset``.
        num_steps: as swm's ``Dataset``.
        transform: as swm's ``Dataset``.
        keys_to_load: the columns to read (default all).
        keys_to_cache: accepted for the HDF5 reader's signature; the table is
            in memory already, so it changes nothing.
        keys_to_merge: ``{target: source columns or regex}``, as the HDF5
            reader: ``merge_col`` for each.

    Raises:
        SegmentNotFoundError: no segment has that name.
        ValueError: the segment is not a stable-worldmodel buffer.
        KeyError: an unknown column in ``keys_to_load``.
    """

    def __init__(self, name: str, frameskip: int = 1, num_steps: int = 1,
                 transform: Callable[[dict], dict] | None = None,
                 keys_to_load: list[str] | None = None, keys_to_cache: list[str] | None = None,
                 keys_to_merge: dict | None = None, _episodes=None) -> None:
        self._name = name
        self._tab = table.Table(name, 1, {}, keep_created=True)
        buf = table.attach_table(name, "load_dataset")
        self._tab.buf = buf
        view = self._tab.view("load_dataset")
        if _episodes is not None:
            keep = np.isin(view.index, np.asarray(_episodes, np.int64))
            if keep.sum() != len(_episodes):
                raise RuntimeError(f"shm://{name}: episodes of this dataset were recycled "
                                   "since it was opened; open it again")
            view = view.keep_only(keep, view.logged)
        self._fixed = view
        cols = self._tab.columns()
        self._keys = list(cols) if keys_to_load is None else list(keys_to_load)
        for k in self._keys:
            if k not in cols:
                raise KeyError(f"keys_to_load: {k!r} is not a column of shm://{name}; its "
                               f"columns are {cols}")
        self._store_col = {c: f"c{i}" for i, c in enumerate(cols)}
        self._cache: dict[str, np.ndarray] = {}
        self._kwargs = {"frameskip": frameskip, "num_steps": num_steps, "transform": transform,
                        "keys_to_load": None if keys_to_load is None else list(keys_to_load),
                        "keys_to_merge": keys_to_merge}
        self.lengths = view.lengths.copy()
        self.offsets = view.offsets.copy()
        self.frameskip = frameskip
        self.num_steps = num_steps
        self.span = num_steps * frameskip
        self.transform = transform
        for target, source in (keys_to_merge or {}).items():
            self.merge_col(source, target)

    def __reduce__(self):
        return _reopen_dataset, (self._name, self._kwargs, self._fixed.index.copy())

    @property
    def clip_indices(self) -> list[tuple[int, int]]:
        """swm's ``(episode, start)`` list of every clip (built on request)."""
        return [(ep, s) for ep, n in enumerate(self.lengths.tolist())
                for s in range(max(0, n - self.span + 1))]

    @property
    def column_names(self) -> list[str]:
        return self._keys

    @property
    def episode_column_names(self) -> list[str]:
        seen: dict[str, None] = {}
        for ep in range(len(self.lengths)):
            seen.update(dict.fromkeys(self._data(ep)))
        return list(seen)

    def get_episode_data(self, episodes_idx=None) -> dict[str, list]:
        cols = self.episode_column_names
        if not cols:
            return {}
        idx = (range(len(self.lengths)) if episodes_idx is None else
               [int(i) for i in np.asarray(episodes_idx, np.int64).reshape(-1)])
        metas = [self._data(i) for i in idx]
        return {k: [m.get(k) for m in metas] for k in cols}

    def _data(self, ep: int) -> dict:
        try:
            return self._fixed.episode_data(ep)
        except table.TableChangedError:
            raise self._recycled() from None

    def _recycled(self) -> RuntimeError:
        return RuntimeError(f"shm://{self._name}: episodes of this dataset were recycled by a "
                            "writer since it was opened; open it again")

    def __len__(self) -> int:
        return int(self._fixed.clip_starts(self.span)[-1])

    def __getitem__(self, idx: int) -> dict:
        ep, start = self._fixed.to_clips(np.array([int(idx)], np.int64), self.span,
                                         "ShmDataset")
        steps = self._load_slice(int(ep[0]), int(start[0]), int(start[0]) + self.span)
        if "action" in steps:
            steps["action"] = steps["action"].reshape(self.num_steps, -1)
        return steps

    def _read(self, col: str, pos: np.ndarray, eps: np.ndarray) -> np.ndarray:
        if col in self._cache:
            return self._cache[col][pos]
        got = self._fixed.gather(self._store_col[col], pos)
        try:
            self._fixed.confirm(eps, "ShmDataset")
        except table.TableChangedError:
            raise self._recycled() from None
        return got

    def _load_slice(self, ep_idx: int, start: int, end: int) -> dict:
        import torch

        pos = np.arange(start, end) + self.offsets[ep_idx]
        eps = np.array([ep_idx])
        steps: dict[str, Any] = {}
        for col in self._keys:
            data = self._read(col, pos if col == "action" else pos[::self.frameskip], eps)
            if codec.is_text(data.dtype):
                val = data[0] if len(data) else ""
                steps[col] = val.decode() if isinstance(val, bytes) else str(val)
                continue
            t = torch.from_numpy(data)
            steps[col] = t.permute(0, 3, 1, 2) if data.ndim == 4 and data.shape[-1] in (1, 3) else t
        return self.transform(steps) if self.transform else steps

    def get_col_data(self, col: str) -> np.ndarray:
        if col in self._cache:
            return self._cache[col]
        return self._read(col, np.arange(len(self._fixed.rows)),
                          np.arange(len(self.lengths)))

    def get_row_data(self, row_idx) -> dict:
        pos = np.asarray(row_idx, np.int64)
        eps = np.searchsorted(self.offsets, pos.reshape(-1), side="right") - 1
        return {col: self._read(col, pos, eps) for col in self._keys}

    def merge_col(self, source, target: str, dim: int = -1) -> None:
        import re

        if isinstance(source, str):
            source = [k for k in self._store_col if re.match(source, k)]
        self._cache[target] = np.concatenate([self.get_col_data(s) for s in source], axis=dim)
        if target not in self._keys:
            self._keys.append(target)

    def get_dim(self, col: str) -> int:
        shape = self.get_col_data(col).shape
        return int(np.prod(shape[1:])) if len(shape) > 1 else 1

    def close(self) -> None:
        """Detach from the segment (it stays, see docs/swm.md)."""
        self._tab.close(remove_segment=False)


def _reopen_dataset(name: str, kwargs: dict, episodes) -> ShmDataset:
    return ShmDataset(name, _episodes=episodes, **kwargs)


class ShmWriter:
    """swm's ``Writer`` into a shared table ``shm://NAME`` that outlives the writer.

    ``mode`` is applied at the first ``with``: ``"append"`` extends an
    existing table (or makes one), ``"overwrite"`` removes an existing one
    first, ``"error"`` raises ``FileExistsError`` if it exists.  Later
    ``with`` blocks on the same writer append (it is re-entrant, so repeated
    ``World.collect(writer=w)`` calls add up).  A table this writer creates
    is kept when the writer closes: see docs/swm.md for how it is removed.

    Args:
        path: ``"shm://NAME"``.
        mode: ``"append"`` (default), ``"overwrite"`` or ``"error"``.
        max_steps: capacity of a table it creates (default 1,000,000 steps);
            the oldest episodes are evicted first.
        compress: as ``ReplayBuffer``'s: the columns a table it creates keeps
            compressed in its cold chunks (an existing table keeps its own
            settings).  A compressing table is compacted when the writer's
            last ``with`` block ends without an error, so every chunk older
            than ``hot_steps`` is compressed before the writer lets go
            (``Compress(..., hot_steps=0)``: every sealed chunk).

    Raises:
        ValueError: a bad path or mode, or a name that is not a swm table;
            ``compress`` with ``hot_steps`` above ``max_steps``.
        TypeError: ``compress`` of another type.
        ImportError: ``compress``'s codec library is not installed.
    """

    def __init__(self, path, *, mode: str = "append", max_steps: int = 1_000_000,
                 compress=None) -> None:
        _swm_format.validate_write_mode(mode)
        self.name = parse(path, "ShmWriter")
        self.mode = mode
        self.max_steps = codec.positive("max_steps", max_steps)
        self.compress = table.check_compress(compress, self.max_steps, "ShmWriter")
        self._depth = 0
        self._started = False
        self._tab: table.Table | None = None

    def __enter__(self):
        if not self._started:
            self._apply_mode()
            self._started = True
        if self._tab is None:
            self._tab = table.Table(self.name, self.max_steps, {"max_steps": self.max_steps},
                                    keep_created=True, compress=self.compress)
        self._depth += 1
        return self

    def _apply_mode(self) -> None:
        if not table.exists(self.name):
            return
        if self.mode == "error":
            raise FileExistsError(f"ShmWriter: 'shm://{self.name}' already exists. Pass "
                                  "mode='overwrite' to replace it or mode='append' to extend it.")
        table.attach_table(self.name, "ShmWriter").close()   # a swm table, or refuse
        if self.mode == "overwrite":
            table.remove(self.name)

    def __exit__(self, exc_type, *exc) -> None:
        self._depth -= 1
        if self._depth == 0 and self._tab is not None:
            tab, self._tab = self._tab, None
            try:
                # The table outlives this writer, and no process may own it after: the
                # owner's compressor (this writer's, if it made the table) may never run
                # again, so the cold chunks are compressed now (0 when it keeps none).
                if exc_type is None and tab.buf is not None:
                    tab.close_writer()     # seals its last chunk, which compact then takes
                    tab.buf.compact()
            finally:
                tab.close(remove_segment=False)

    def write_episode(self, ep_data: dict) -> None:
        """Append one episode (``World.collect``'s per-step lists, or arrays).

        Raises:
            RuntimeError: outside a ``with`` block.
            ValueError / TypeError: as ``ReplayBuffer.write_episode``
                (schema drift included); nothing is written.
        """
        who = "ShmWriter.write_episode"
        if self._tab is None:
            raise RuntimeError("ShmWriter used outside of a `with` block")
        cols, data = codec.split_episode(ep_data)
        arrays, steps = codec.coerce(cols, who)
        if steps == 0:
            return
        buf = self._tab.attached(who)
        cap = self._tab.capacity if buf is None else buf.capacity   # an existing table's own
        if steps > cap:
            raise ValueError(f"{who}: episode length {steps} exceeds max_steps={cap}")
        self._tab.write(arrays, steps, data, who)

    def write_episodes(self, episodes: Iterable[dict]) -> None:
        for ep in episodes:
            self.write_episode(ep)


class ShmFormat(_swm_format.Format):
    """swm format ``"shmbuf"``: tables in shared memory, named ``shm://NAME``.

    ``detect`` claims only ``shm://`` paths; ``open_reader`` returns a
    ``ShmDataset``, ``open_writer`` a ``ShmWriter``.

    Example:
        >>> import shmbuf.compat.swm  # registers the format
        >>> from stable_worldmodel.data import convert, load_dataset
        >>> convert("pusht.h5", "shm://pusht", dest_format="shmbuf")
        >>> ds = load_dataset("shm://pusht", num_steps=4, frameskip=5)
    """

    name = "shmbuf"
    supports_episode_data = True

    @classmethod
    def detect(cls, path) -> bool:
        return isinstance(path, str) and path.startswith(SCHEME)

    @classmethod
    def open_reader(cls, path, **kwargs) -> ShmDataset:
        return ShmDataset(parse(path, "ShmFormat.open_reader"), **kwargs)

    @classmethod
    def open_writer(cls, path, **kwargs) -> ShmWriter:
        return ShmWriter(path, **kwargs)
