"""stable-worldmodel's HDF5 files in and out.

Its layout (``stable_worldmodel.data``'s HDF5 format): one ``.h5`` file, one
top-level dataset per column whose first axis runs over every step of every
episode, plus ``ep_len`` (steps of each episode) and ``ep_offset`` (the row
where each episode starts).  Columns keep their names, per-step shapes,
dtypes and rows as they are: the file's own step convention is not
changed.  A ``terminated`` column, if present, is the buffer's ``done_key``
(an episode that ends without it is an ``end_episode`` cut).
"""
from __future__ import annotations

import os
import tempfile

import numpy as np

from ..protocol.layout import default_episode_slots, validate_column_name
from ..store import buffer as store
from ._common import (
    BLOCK_BYTES,
    DatasetFormatError,
    block_rows,
    check_progress,
    filling,
    finished_episodes,
    keep_newest,
    progress_bar,
)

_INDEX = ("ep_len", "ep_offset")


def _open_file(path):
    import h5py

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"from_swm_hdf5: no file at {path!r}")
    try:
        return h5py.File(path, "r")
    except OSError as exc:
        raise DatasetFormatError(f"from_swm_hdf5: {path!r} is not a readable HDF5 file "
                                 f"(truncated, or not HDF5): {exc}") from None


def _index(f, path) -> tuple[np.ndarray, np.ndarray]:
    """``ep_len`` and ``ep_offset``, checked to be 1-D integers of one length."""
    import h5py

    out = []
    for key in _INDEX:
        ds = f.get(key)
        if not isinstance(ds, h5py.Dataset) or ds.ndim != 1 or ds.dtype.kind not in "iu":
            raise DatasetFormatError(
                f"from_swm_hdf5: {path!r} has no 1-D integer dataset {key!r}; "
                "stable-worldmodel's layout has one column per dataset plus ep_len and "
                "ep_offset (found: " + ", ".join(sorted(f.keys())) + ")")
        out.append(_read(ds, path).astype(np.int64))
    lengths, offsets = out
    if len(lengths) != len(offsets):
        raise DatasetFormatError(f"from_swm_hdf5: {path!r} has {len(lengths)} ep_len entries "
                                 f"but {len(offsets)} ep_offset entries")
    return lengths, offsets


def _read(ds, path, sel=slice(None)) -> np.ndarray:
    try:
        return ds[sel]
    except OSError as exc:  # a truncated file fails at the read of a missing chunk
        raise DatasetFormatError(f"from_swm_hdf5: cannot read {ds.name!r} of {path!r} "
                                 f"(truncated or damaged): {exc}") from None


def _columns(f, path, keys) -> dict:
    import h5py

    names = [k for k in f.keys() if k not in _INDEX] if keys is None else list(keys)
    cols = {}
    for name in names:
        ds = f.get(name)
        if not isinstance(ds, h5py.Dataset) or ds.ndim < 1:
            raise KeyError(f"from_swm_hdf5: {name!r} is not a column dataset of {path!r}; "
                           f"its datasets are {sorted(f.keys())}")
        if ds.dtype.kind not in "biuf":
            raise DatasetFormatError(
                f"from_swm_hdf5: column {name!r} of {path!r} has dtype {ds.dtype}, which a "
                "buffer cannot hold (numbers and bools only); leave it out with keys=[...]")
        try:
            validate_column_name(name)
        except ValueError as exc:
            raise ValueError(f"from_swm_hdf5: column {name!r} of {path!r}: {exc}; leave it "
                             "out with keys=[...]") from None
        cols[name] = ds
    if not cols:
        raise DatasetFormatError(f"from_swm_hdf5: {path!r} has no column datasets")
    rows = {name: ds.shape[0] for name, ds in cols.items()}
    if len(set(rows.values())) > 1:
        raise DatasetFormatError(f"from_swm_hdf5: the columns of {path!r} have different "
                                 f"numbers of rows: {rows}")
    return cols


def _check_partition(lengths, offsets, rows: int, path) -> None:
    """The episodes cover the rows exactly once: ep_len matches the columns."""
    order = np.argsort(offsets, kind="stable")
    ends = offsets[order] + lengths[order]
    starts_ok = len(order) == 0 or (offsets[order][0] == 0
                                    and (offsets[order][1:] == ends[:-1]).all())
    if (lengths < 1).any() or not starts_ok or int(lengths.sum()) != rows:
        raise DatasetFormatError(
            f"from_swm_hdf5: ep_len/ep_offset of {path!r} do not match its rows: "
            f"{len(lengths)} episodes of {int(lengths.sum())} steps in all (each at least 1, "
            f"back to back from row 0), but the columns have {rows} rows")


def from_swm_hdf5(path, *, name: str | None = None, capacity: int | None = None,
                  episodes=None, keys=None, done_key: str | None = "terminated", seed=None,
                  progress: bool | None = None, block_bytes: int = BLOCK_BYTES):
    """A new buffer holding a stable-worldmodel HDF5 file's episodes, in file order.

    One column per dataset of the file (``keys`` selects some), same name,
    per-step shape, dtype and rows; every episode of ``ep_len`` /
    ``ep_offset`` ends as the file says: terminal when its ``done_key``
    column is true on its last row, else an ``end_episode`` cut.  Rows are
    read with h5py into reused blocks of at most ``block_bytes`` and
    appended with ``Writer.extend``.

    Args:
        path: the ``.h5`` file.
        name: as in ``from_minari``.
        capacity: as in ``from_minari`` (a smaller capacity keeps the newest
            whole episodes and warns).
        seed: as in ``from_minari``.
        progress: as in ``from_minari``.
        block_bytes: as in ``from_minari``.
        episodes: indices into ``ep_len`` to import (default all), in order.
        keys: the column datasets to import (default every one).
        done_key: the scalar column of terminations; None: none (every
            episode end is a cut).  Ignored if the file has no such column.

    Returns:
        The owning ``Buffer``.

    Raises:
        FileNotFoundError: no file at ``path``.
        DatasetFormatError: not HDF5, truncated, no ``ep_len``/``ep_offset``,
            episodes that do not cover the rows exactly, a termination inside
            an episode, a column a buffer cannot hold; no segment is left.
        KeyError / ValueError: a bad ``keys``, ``episodes`` or ``capacity``.

    Example:
        >>> buf = shmbuf.datasets.from_swm_hdf5("pusht.h5", name="pusht")
        >>> buf.episodes().length[:3]
    """
    check_progress(progress)
    with _open_file(path) as f:
        lengths, offsets = _index(f, path)
        cols = _columns(f, path, keys)
        _check_partition(lengths, offsets, next(iter(cols.values())).shape[0], path)
        picked = np.arange(len(lengths)) if episodes is None else np.asarray(list(episodes))
        if len(picked) and (picked.dtype.kind not in "iu" or picked.min() < 0
                            or picked.max() >= len(lengths)):
            raise ValueError(f"from_swm_hdf5: episodes must be indices into ep_len "
                             f"(0..{len(lengths) - 1}), got {picked[:10].tolist()}")
        first, capacity = keep_newest(lengths[picked], capacity, "from_swm_hdf5")
        picked = picked[first:]
        spec = {k: (ds.shape[1:], ds.dtype) for k, ds in cols.items()}
        done = done_key if done_key in spec and spec[done_key][0] == () else None
        slots = min(capacity, max(default_episode_slots(capacity), len(picked)))
        # No prefault: the copy touches every page anyway, and faulting them there is
        # cheaper than populating first (bench_datasets.py).
        buf = store.create(spec, capacity, name=name, seed=seed, done_key=done,
                           prefault=False, episode_slots=slots,
                           meta={"source": "swm-hdf5", "file": os.path.basename(path)[:200]})
        with filling(buf) as writer, progress_bar(int(lengths[picked].sum()),
                                                  "from_swm_hdf5", progress) as bar:
            _copy(writer, cols, path, lengths[picked], offsets[picked], done,
                  block_rows(spec, block_bytes), bar)
    return buf


def _runs(lengths, offsets):
    """Back-to-back episodes merged: ``(start, end, episode ends)`` per run of rows."""
    start = 0  # the open run's first row
    ends: list[int] = []  # its episode ends; empty: no run open yet
    for length, off in zip(lengths.tolist(), offsets.tolist()):
        if ends and off == ends[-1]:
            ends.append(off + length)
            continue
        if ends:
            yield start, ends[-1], ends
        start, ends = off, [off + length]
    if ends:
        yield start, ends[-1], ends


def _copy(writer, cols, path, lengths, offsets, done, block, bar) -> None:
    blocks = {k: np.empty((block,) + ds.shape[1:], ds.dtype) for k, ds in cols.items()}
    for start, end, ends in _runs(lengths, offsets):
        ends_arr = np.asarray(ends, np.int64)
        for a in range(start, end, block):
            b = min(a + block, end)
            for k, ds in cols.items():
                try:
                    ds.read_direct(blocks[k], np.s_[a:b], np.s_[0:b - a])
                except OSError as exc:
                    raise DatasetFormatError(f"from_swm_hdf5: cannot read rows {a}..{b} of "
                                             f"{k!r} in {path!r} (truncated or damaged): "
                                             f"{exc}") from None
            here = ends_arr[(ends_arr > a) & (ends_arr <= b)] - a  # episode ends in the block
            terminal = np.zeros(len(here), np.bool_)
            if done is not None:
                flags = blocks[done][:b - a] != 0
                inside = np.setdiff1d(np.flatnonzero(flags), here - 1)
                if len(inside):
                    raise DatasetFormatError(
                        f"from_swm_hdf5: {done!r} is true at row {a + int(inside[0])} of "
                        f"{path!r}, inside an episode (ep_len/ep_offset end it later); pass "
                        "done_key=None to keep the column as data only")
                terminal = flags[here - 1]
            _extend_split(writer, blocks, b - a, here, terminal)
            bar.update(b - a)


def _extend_split(writer, blocks, n, ends, terminal) -> None:
    """``extend`` rows ``0..n`` of the blocks, cutting after every non-terminal episode end."""
    at = 0
    for end, term in zip(ends.tolist(), terminal.tolist()):
        if term:
            continue  # extend ends it at its done row
        writer.extend(**{k: v[at:end] for k, v in blocks.items()})
        writer.end_episode()
        at = end
    if at < n:
        writer.extend(**{k: v[at:n] for k, v in blocks.items()})


def to_swm_hdf5(buffer, path, *, episodes=None, overwrite: bool = False,
                progress: bool | None = None) -> int:
    """Write a buffer's finished episodes as a stable-worldmodel HDF5 file.

    Every column of the buffer becomes a dataset of the same name, dtype and
    per-step shape, episodes back to back in the order they ended, with
    ``ep_len`` (int32) and ``ep_offset`` (int64).  One episode is held in RAM
    at a time; the file is written under a temporary name and renamed when
    whole, so a failure leaves no partial file.

    Args:
        buffer: any step-store buffer (attached is fine).
        path: the ``.h5`` file to write.
        episodes: episode-index numbers (``buffer.episodes().index``);
            default every finished episode held, oldest first.
        overwrite: replace an existing file.

    Returns:
        The number of episodes written.

    Raises:
        FileExistsError: ``path`` exists and not ``overwrite``.
        ValueError: no finished episodes, or episodes not held; nothing is written.

    Example:
        >>> shmbuf.datasets.to_swm_hdf5(buf, "replay.h5")
    """
    import h5py

    check_progress(progress)
    path = os.fspath(path)
    if os.path.exists(path) and not overwrite:
        raise FileExistsError(f"to_swm_hdf5: {path!r} exists; pass overwrite=True to replace it")
    wanted = finished_episodes(buffer, episodes, "to_swm_hdf5")
    spec = buffer.spec
    fd, tmp = tempfile.mkstemp(prefix=".shmbuf-", suffix=".h5",
                               dir=os.path.dirname(os.path.abspath(path)))
    os.close(fd)
    try:
        with h5py.File(tmp, "w") as f, progress_bar(len(wanted), "to_swm_hdf5", progress) as bar:
            out = {k: f.create_dataset(k, shape=(0,) + shape, maxshape=(None,) + shape,
                                       dtype=dtype, chunks=_chunks(shape, dtype))
                   for k, (shape, dtype) in spec.items()}
            lengths, offsets, at = [], [], 0
            for index in wanted:
                ep = buffer.read_episode(index)
                if ep is None:
                    raise ValueError(f"to_swm_hdf5: episode {index} of buffer "
                                     f"{buffer.name!r} was recycled while it was being written")
                n = len(next(iter(ep.values())))
                for k, ds in out.items():
                    ds.resize(at + n, axis=0)
                    ds[at:at + n] = ep[k]
                lengths.append(n)
                offsets.append(at)
                at += n
                bar.update(1)
            f.create_dataset("ep_len", data=np.asarray(lengths, np.int32))
            f.create_dataset("ep_offset", data=np.asarray(offsets, np.int64))
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return len(wanted)


def _chunks(shape, dtype) -> tuple:
    """HDF5 chunks of about 1 MiB of rows (swm reads slices of consecutive rows)."""
    row = max(1, int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize)
    return (max(1, (1 << 20) // row),) + tuple(shape)


__all__ = ["from_swm_hdf5", "to_swm_hdf5"]
