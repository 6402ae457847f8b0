"""stable-worldmodel's data API over shared memory: ``ReplayBuffer`` and the ``shm://`` format.

``ReplayBuffer`` has the signature and behaviour of
``stable_worldmodel.data.ReplayBuffer`` (a swm ``Dataset`` and episode
writer), but its episodes live in a shmbuf segment: it pickles to its name,
so DataLoader workers read the same memory and several collector processes
write episodes into it at once.

Importing this module registers ``ShmFormat`` with swm's format registry as
``"shmbuf"``: ``load_dataset("shm://NAME")``, ``convert(..., "shm://NAME",
dest_format="shmbuf")``, ``World.collect("shm://NAME", format="shmbuf")`` and
``ReplayBuffer.dump("shm://NAME", format="shmbuf")`` then work.

This module and its helper ``_swm_format`` (the format's reader and writer)
are the only ones of shmbuf that import stable-worldmodel; the core never
does.  docs/swm.md describes the classes, the storage and every deliberate
difference from swm.
"""
from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
from stable_worldmodel.data import format as _swm_format
from stable_worldmodel.data.dataset import Dataset

from ..segment.segment import generate_name
from ..select import Selector
from ..writing.compress import Compress
from . import _swm_codec as codec
from . import _swm_table as table
from ._swm_format import SCHEME, ShmDataset, ShmFormat, ShmWriter, parse

EPISODE_DATA_KEY = codec.EPISODE_DATA_KEY
Sampler = Callable[[int, Any, int, int], Any]
_log = logging.getLogger(__name__)

__all__ = ["EPISODE_DATA_KEY", "SCHEME", "ReplayBuffer", "ShmDataset", "ShmFormat",
           "ShmWriter", "as_sampler", "parse"]


def _uniform_sampler(step: int, buffer: ReplayBuffer, batch_size: int,
                     history_len: int) -> np.ndarray:
    n = buffer.num_valid_ends(history_len)
    if n == 0:
        raise RuntimeError(
            f"ReplayBuffer.sample: no clips of history_len={history_len} available "
            f"(num_episodes={buffer.num_episodes}, num_steps_stored={buffer.num_steps_stored})")
    return buffer._rng().integers(0, n, size=batch_size)


def _gather_clips(view: table.View, columns: list[str], ep: np.ndarray, local: np.ndarray,
                  history_len: int, frameskip: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Clips ``(len(ep), history_len, ...)`` (observations strided, ``action`` dense), and
    the ``(len(ep), history_len * frameskip)`` step ids they cover.  Re-check the
    episodes ``ep`` afterwards: a clip of an episode recycled meanwhile is garbage."""
    base = view.offsets[ep] + local
    obs = base[:, None] + np.arange(history_len) * frameskip
    act = base[:, None] + np.arange(history_len * frameskip)
    store = {col: f"c{i}" for i, col in enumerate(columns)}
    if frameskip == 1:   # the same rows: one read (one packed-chunk check)
        got = view.take(list(store.values()), obs, ep)
    else:
        got = view.take([store[c] for c in columns if c != "action"], obs, ep)
        if "action" in store:
            got.update(view.take([store["action"]], act, ep))
    out = {}
    for col in columns:
        out[col] = got[store[col]]
        if col == "action":
            out[col] = out[col].reshape(len(ep), history_len, -1)
    ids = view.buf.port.step_ids(view.rows[act])   # read with the rows, checked with them
    return out, ids


class ReplayBuffer(Dataset):
    """stable-worldmodel's ``ReplayBuffer``, in shared memory.

    Same arguments, defaults and behaviour as ``stable_worldmodel.data.ReplayBuffer``:
    an episode writer (``write_episode``, ``with``) and a swm ``Dataset`` of
    fixed-size clips.  The segment is created by the first episode written,
    in whichever process writes it; the buffer pickles to its name, so
    DataLoader workers and collector processes share it.  The process that
    constructed it removes the segment when it closes the buffer (or at
    exit); other processes only detach.

    Args:
        max_steps: capacity in steps; the oldest episodes are evicted first.
        history_len: steps per clip of ``__getitem__``, default of ``sample``.
        frameskip: stride between observations of a clip; ``action`` stays
            dense, reshaped to ``(history_len, frameskip * action_dim)``.
        sampler: ``fn(step, buffer, batch_size, history_len) -> flat clip
            indices`` in ``[0, num_valid_ends(history_len))``; default
            uniform.  ``as_sampler(shmbuf.select.Recency())`` and the other
            selectors work too.
        transform: dict-in, dict-out function applied by ``__getitem__``.
        key_filter: ``fn(episode) -> episode`` applied by ``write_episode``.
        compress: keyword only (shmbuf's, not swm's): keep the named columns
            of cold chunks compressed in shared memory.  A ``shmbuf.Compress``
            naming swm columns (``Compress("pixels")``; its ``hot_steps``
            newest steps stay raw), True (every uint8 column of two or more
            dimensions per step: the frames, with ``Compress``'s defaults),
            or None (default): raw.  Every read returns the same data either
            way.  The columns are checked against the first episode.

    Raises:
        ValueError: a size that is not positive; ``compress`` with
            ``hot_steps`` above ``max_steps``.
        TypeError: ``compress`` of another type.
        ImportError: ``compress``'s codec library is not installed.

    Example:
        >>> rb = ReplayBuffer(max_steps=100_000, history_len=4)
        >>> world.collect(writer=rb, episodes=10)      # or from any process holding rb
        >>> batch = rb.sample(64)                      # {col: (64, 4, ...)}
    """

    def __init__(self, max_steps: int, history_len: int = 1, frameskip: int = 1,
                 sampler: Sampler | None = None, transform: Callable[[dict], dict] | None = None,
                 key_filter: Callable[[dict], dict] | None = None, *,
                 compress: Compress | bool | None = None) -> None:
        size = codec.positive
        max_steps = size("max_steps", max_steps)
        compress = table.check_compress(compress, max_steps, "ReplayBuffer")
        self._setup(max_steps, size("history_len", history_len),
                    size("frameskip", frameskip), sampler, transform, key_filter,
                    generate_name(), os.getpid(), compress)

    def _setup(self, max_steps, history_len, frameskip, sampler, transform, key_filter, name,
               creator_pid, compress=None) -> None:
        self.max_steps = max_steps
        self.history_len = history_len
        self.num_steps = history_len
        self.frameskip = frameskip
        self.span = history_len * frameskip
        self.transform = transform
        self.key_filter = key_filter
        self.sampler: Sampler = sampler if sampler is not None else _uniform_sampler
        self._creator_pid = creator_pid
        self._sample_step = 0
        self.last_ids: np.ndarray | None = None   # step ids of the last sample (update_priorities)
        self._generator: np.random.Generator | None = None
        self._generator_pid = -1
        # The view a sample call's sampler sees (this thread's): its clip indices are
        # resolved in the same view, whatever episodes arrive or go meanwhile.
        self._pinned = threading.local()
        params = {"max_steps": max_steps, "history_len": history_len, "frameskip": frameskip}
        here = creator_pid == os.getpid()
        self._compress = compress
        self._table = table.Table(name, max_steps, params, keep_created=not here, adopt=here,
                                  compress=compress)
        # The constructing process removes the segment, whoever created it.
        self._finalizer = weakref.finalize(self, _close_table, self._table,
                                           creator_pid if here else None)

    # -- identity and lifecycle ---------------------------------------------------------
    @property
    def name(self) -> str:
        """The segment's name (it exists once the first episode is written)."""
        return self._table.name

    def close(self) -> None:
        """Detach; in the constructing process, also remove the segment.  Idempotent."""
        self._finalizer()

    def __reduce__(self):
        return _reopen_buffer, (self.name, self.max_steps, self.history_len, self.frameskip,
                                self.sampler if self.sampler is not _uniform_sampler else None,
                                self.transform, self.key_filter, self._creator_pid,
                                self._compress)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None

    def _rng(self) -> np.random.Generator:
        """This process's generator (a forked DataLoader worker gets a fresh one)."""
        pid = os.getpid()
        if self._generator is None or self._generator_pid != pid:
            self._generator = np.random.default_rng()
            self._generator_pid = pid
        return self._generator

    # -- writing ----------------------------------------------------------------------------
    def write_episode(self, ep_data: dict) -> None:
        """Append one finished episode (per-step lists or ``(T, ...)`` arrays).

        ``_episode_data`` carries per-episode values of any size (what the
        episode's own rows cannot hold takes rows of its own, see docs/swm.md).
        The first episode fixes the columns, per-step shapes and dtypes; the
        episode becomes visible to every process at once when it is whole.

        Raises:
            ValueError: a scalar column, columns of unequal length, an episode
                longer than ``max_steps`` (with its episode data's rows), or
                another schema than the first episode's; nothing is written.
            TypeError: a column of Python objects, or unsupported episode data.
        """
        who = "ReplayBuffer.write_episode"
        if not ep_data:
            return
        cols, data = codec.split_episode(ep_data)
        if self.key_filter is not None:
            cols = self.key_filter(cols)
        if not cols:
            return
        arrays, steps = codec.coerce(cols, who)
        if steps == 0:
            return
        if steps > self.max_steps:
            raise ValueError(f"{who}: episode length {steps} exceeds max_steps={self.max_steps}")
        self._table.write(arrays, steps, data, who)

    def write_episodes(self, episodes: Iterable[dict]) -> None:
        """``write_episode`` for each episode of the iterable, in order.

        Raises what ``write_episode`` raises; the episodes before the bad one
        stay written.
        """
        for ep in episodes:
            self.write_episode(ep)

    def clear(self) -> None:
        """Drop every stored episode, for every process sharing the buffer.

        It writes a one-row mark that hides every episode that ended before it
        (the schema stays), so the buffer's room is reused as it is refilled.

        Example:
            >>> rb.clear(); rb.num_episodes   # 0, here and in every worker
        """
        self._table.clear()

    def compact(self, timeout: float | None = None) -> int:
        """Compress every cold chunk of a ``compress=`` buffer now, in this process
        (shmbuf's, not swm's): ``shmbuf.Buffer.compact`` on the shared segment.

        Args:
            timeout: seconds to wait (None: as long as it takes).

        Returns:
            How many chunks it compressed; 0 without ``compress=`` or before the
            first episode.

        Raises:
            TimeoutError: chunks were still to compress after ``timeout``.
            SharedMemoryFullError: /dev/shm could not hold a compressed block
                (that chunk stays raw, and nothing is lost).

        Example:
            >>> rb = ReplayBuffer(100_000, compress=shmbuf.Compress("pixels"))
            >>> rb.write_episodes(episodes); rb.compact()
        """
        buf = self._table.attached("ReplayBuffer.compact")
        return 0 if buf is None else buf.compact(timeout)

    # -- what is held ---------------------------------------------------------------------
    def _view(self) -> table.View:
        pinned = getattr(self._pinned, "view", None)
        return pinned if pinned is not None else self._table.view("ReplayBuffer")

    @property
    def column_names(self) -> list[str]:
        """The per-step columns (fixed by the first episode)."""
        self._table.attached("ReplayBuffer")
        return self._table.columns()

    @property
    def num_episodes(self) -> int:
        return len(self._view().index)

    @property
    def num_steps_stored(self) -> int:
        return self._view().steps

    @property
    def lengths(self) -> np.ndarray:
        return self._view().lengths.astype(np.int32)

    @property
    def offsets(self) -> np.ndarray:
        return self._view().offsets.copy()

    def num_valid_ends(self, history_len: int | None = None) -> int:
        """Clips of ``history_len`` steps (``frameskip`` apart) held now: the sampler's range."""
        h = self.history_len if history_len is None else history_len
        return int(self._view().clip_starts(h * self.frameskip)[-1])

    @property
    def episode_column_names(self) -> list[str]:
        view = self._view()
        seen: dict[str, None] = {}
        for ep in range(len(view.index)):
            seen.update(dict.fromkeys(view.episode_data(ep)))
        return list(seen)

    def get_episode_data(self, episodes_idx=None) -> dict[str, list]:
        """Episode-scoped values, ``{name: [value per requested episode]}`` (None where absent)."""
        view = self._view()
        cols = self.episode_column_names
        if not cols:
            return {}
        idx = (range(len(view.index)) if episodes_idx is None else
               [int(i) for i in np.asarray(episodes_idx, np.int64).reshape(-1)])
        metas = [view.episode_data(i) for i in idx]
        return {k: [m.get(k) for m in metas] for k in cols}

    # -- sampling ---------------------------------------------------------------------------
    def sample(self, batch_size: int, history_len: int | None = None,
               step: int | None = None) -> dict[str, np.ndarray]:
        """A batch of clips drawn by the sampler: ``{col: (batch_size, history_len, ...)}``.

        Args:
            batch_size: clips, >= 1.
            history_len: steps per clip (``frameskip`` apart); default the
                constructor's.
            step: passed to the sampler; default this process's counter,
                which then advances (an explicit ``step`` leaves it alone).

        Returns:
            numpy arrays, observations ``(B, history_len, ...)`` (frames HWC as
            written) and ``action`` ``(B, history_len, frameskip * action_dim)``;
            ``transform`` is not applied (as swm).  ``last_ids`` then holds the
            clips' step ids.  A clip whose episode a writer recycled while it
            was read is drawn again: the sampler is called once more for just
            those clips (``batch_size`` the number of them), in the episodes
            held then.

        Raises:
            ValueError: a size that is not positive, or a sampler result of
                another shape than ``(batch_size,)``.
            IndexError: a sampler index outside ``[0, num_valid_ends)``.
            RuntimeError: no clip of that length is held (default sampler);
                clips still recycled after 9 draws.

        Example:
            >>> batch = rb.sample(64, history_len=4)
            >>> batch["pixels"].shape      # (64, 4, 64, 64, 3)
        """
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        h = self.history_len if history_len is None else history_len
        if h <= 0:
            raise ValueError(f"history_len must be positive, got {h}")
        if step is None:
            step, self._sample_step = self._sample_step, self._sample_step + 1

        who = "ReplayBuffer.sample"
        need = np.arange(batch_size)   # the batch rows still to fill
        out: dict[str, np.ndarray] = {}
        ids = np.empty(0, np.int64)
        for _ in range(table.RETRIES + 1):
            view = self._table.view("ReplayBuffer")
            flat = self._draw_clips(view, int(step), len(need), h)
            ep, local = view.to_clips(flat, h * self.frameskip, "ReplayBuffer")
            got, got_ids = _gather_clips(view, self._table.columns(), ep, local, h,
                                         self.frameskip)
            ok = view.still_held(ep)       # after the copy: drop clips recycled meanwhile
            if len(need) == batch_size and ok.all():   # the common case: one draw
                self.last_ids = got_ids
                return got
            if not out:
                out = {k: np.empty((batch_size,) + v.shape[1:], v.dtype) for k, v in got.items()}
                ids = np.empty((batch_size,) + got_ids.shape[1:], got_ids.dtype)
            for k, v in got.items():
                out[k][need[ok]] = v[ok]
            ids[need[ok]] = got_ids[ok]
            need = need[~ok]
            if not len(need):
                self.last_ids = ids
                return out
            self._table._view = None     # rebuilt without the recycled episodes
        raise table.TableChangedError(
            f"{who}: episodes were recycled while they were read, {table.RETRIES + 1} times "
            "running; the writers refill the buffer faster than it is read")

    def _draw_clips(self, view: table.View, step: int, n: int, h: int) -> np.ndarray:
        """``n`` flat clip indices from the sampler, which sees ``view`` (its clip count
        stays the one its indices are resolved in, whatever episodes end meanwhile)."""
        self._pinned.view = view
        try:
            flat = np.asarray(self.sampler(step, self, n, h))
        finally:
            self._pinned.view = None
        if flat.shape != (n,):
            raise ValueError(f"ReplayBuffer.sample: sampler returned shape {flat.shape}, "
                             f"expected ({n},)")
        if flat.size and flat.dtype.kind not in "iu":
            raise ValueError(f"ReplayBuffer.sample: sampler returned {flat.dtype} values; "
                             "expected integer clip indices")
        return flat.astype(np.int64, copy=False)

    def update_priorities(self, ids, priorities) -> int:
        """Set the priority of sampled clips, from any process sharing the buffer.

        ``as_sampler(Prioritized(...))`` then draws by them.  Every step of a
        clip gets its clip's priority (where clips overlap, the last one wins).

        Args:
            ids: ``last_ids`` of a ``sample`` call: ``(batch, history_len *
                frameskip)`` int64 step ids, which name their steps while the
                buffer holds them (and never another step).
            priorities: ``(batch,)`` floats, finite and >= 0 (numpy or torch).

        Returns:
            How many steps were still held (and updated).

        Raises:
            ValueError / TypeError: shapes that do not match, or bad values
                (``shmbuf.Buffer.update_priorities``); nothing is written.

        Example:
            >>> batch = rb.sample(64)
            >>> rb.update_priorities(rb.last_ids, loss_per_clip)
        """
        from ._base import to_numpy

        ids = np.asarray(to_numpy(ids))
        values = np.asarray(to_numpy(priorities))
        if ids.ndim != 2 or values.shape != ids.shape[:1]:
            raise ValueError(f"update_priorities: ids must be (batch, steps) as last_ids and "
                             f"priorities (batch,), got {ids.shape} and {values.shape}")
        buf = self._table.attached("ReplayBuffer.update_priorities")
        if buf is None:
            raise ValueError("update_priorities: the buffer holds no episode yet")
        return buf.update_priorities(ids, np.broadcast_to(values[:, None], ids.shape))

    # -- the Dataset path -------------------------------------------------------------------
    def __len__(self) -> int:
        return self.num_valid_ends(self.history_len)

    def __repr__(self) -> str:
        cols = ", ".join(self.column_names) or "-"
        return (f"ReplayBuffer(episodes={self.num_episodes}, steps={self.num_steps_stored}/"
                f"{self.max_steps}, history_len={self.history_len}, frameskip={self.frameskip}, "
                f"columns=[{cols}], name={self.name!r})")

    def __getitem__(self, idx: int) -> dict:
        def clip(view: table.View) -> dict:
            n = int(view.clip_starts(self.span)[-1])
            if n == 0:
                raise IndexError("ReplayBuffer is empty")
            i = int(idx) + n if idx < 0 else int(idx)
            if not 0 <= i < n:
                raise IndexError(idx)
            ep, local = view.to_clips(np.array([i], np.int64), self.span, "ReplayBuffer")
            got, _ = _gather_clips(view, self._table.columns(), ep, local, self.history_len,
                                   self.frameskip)
            view.confirm(ep, "ReplayBuffer")
            return {k: v[0] for k, v in got.items()}

        out = table.retrying(clip, self._table, "ReplayBuffer")
        return self.transform(out) if self.transform is not None else out

    def _load_slice(self, ep_idx: int, start: int, end: int) -> dict:
        def read(view: table.View) -> dict:
            if not 0 <= ep_idx < len(view.index):
                raise IndexError(ep_idx)
            n = int(view.lengths[ep_idx])
            if not 0 <= start <= end <= n:
                raise IndexError(f"slice [{start}:{end}] out of episode of length {n}")
            pos = (np.arange(start, end) + view.offsets[ep_idx])[None]
            cols = self._table.columns()
            got = view.take([f"c{i}" for i in range(len(cols))], pos, np.array([ep_idx]))
            out = {c: got[f"c{i}"][0] for i, c in enumerate(cols)}
            view.confirm(np.array([ep_idx]), "ReplayBuffer")
            return out

        return table.retrying(read, self._table, "ReplayBuffer")

    def episodes(self) -> Iterator[dict]:
        """The held episodes, oldest first, as ``{col: [per-step array, ...]}`` (``World.collect``'s
        shape), with ``_episode_data`` when the episode has some."""
        view = self._view()
        for ep in range(len(view.index)):
            try:
                got = self._load_slice(ep, 0, int(view.lengths[ep]))
                data = view.episode_data(ep)
            except (table.TableChangedError, IndexError):
                continue   # recycled by a writer meanwhile
            out: dict[str, Any] = {c: list(v) for c, v in got.items()}
            if data:
                out[EPISODE_DATA_KEY] = dict(data)
            yield out

    def dump(self, path, format: str, mode: str = "overwrite", **kwargs: Any) -> None:
        """Write the held episodes through the registered swm writer of ``format``.

        Episode data goes along when the format supports it, and is dropped
        with a warning otherwise (as swm).

        Args:
            path: the destination (``"shm://NAME"`` for ``format="shmbuf"``).
            format: a registered swm format name.
            mode: ``"overwrite"`` (default), ``"append"`` or ``"error"``.
            **kwargs: passed to the format's ``open_writer``.

        Raises:
            ValueError: an unknown format or mode.

        Example:
            >>> rb.dump("replay.h5", format="hdf5")
        """
        fmt = _swm_format.get_format(format)
        episodes: Iterable[dict] = self.episodes()
        if self.episode_column_names and not getattr(fmt, "supports_episode_data", False):
            _log.warning("ReplayBuffer.dump: format '%s' does not support episode data; "
                            "dropping it (columns %s).", format, self.episode_column_names)
            episodes = ({k: v for k, v in ep.items() if k != EPISODE_DATA_KEY}
                        for ep in episodes)
        with fmt.open_writer(path, mode=mode, **kwargs) as writer:
            writer.write_episodes(episodes)


def _close_table(tab: table.Table, remove_in_pid: int | None) -> None:
    tab.close(remove_segment=remove_in_pid == os.getpid())


def _reopen_buffer(name, max_steps, history_len, frameskip, sampler, transform, key_filter,
                   creator_pid, compress=None) -> ReplayBuffer:
    # compress travels too: a collector that writes the first episode creates the segment.
    self = ReplayBuffer.__new__(ReplayBuffer)
    self._setup(max_steps, history_len, frameskip, sampler, transform, key_filter, name,
                creator_pid, compress)
    return self


# -- shmbuf's selectors as swm samplers ------------------------------------------------------
class as_sampler:  # used like a function: sampler=as_sampler(Recency())
    """A swm ``sampler=`` that draws clips by one of ``shmbuf.select``'s regimes.

    The selector draws windows of ``history_len * frameskip`` steps from the
    buffer's shared store (``Recency``, ``AgeBuckets``, ``Prioritized``,
    ``Mixture``, ``Uniform``), and each is returned as its flat swm clip
    index.  Windows in episodes that are not finished yet (or that a
    ``clear()`` hid) are drawn again.

    Args:
        select: a ``shmbuf.select`` object.

    Raises:
        TypeError: ``select`` is not one.

    Example:
        >>> from shmbuf.select import Recency
        >>> rb = ReplayBuffer(100_000, history_len=4, sampler=as_sampler(Recency()))
    """

    def __init__(self, select) -> None:
        if not isinstance(select, Selector):
            raise TypeError(f"select must be a shmbuf.select object (Recency(), AgeBuckets(...), "
                            f"Prioritized(), ...), got {select!r}")
        self.select = select

    def __repr__(self) -> str:
        return f"as_sampler({self.select!r})"

    def __call__(self, step: int, buffer: ReplayBuffer, batch_size: int,
                 history_len: int) -> np.ndarray:
        span = history_len * buffer.frameskip
        view = buffer._view()
        total = int(view.clip_starts(span)[-1])
        if total == 0:
            raise RuntimeError(
                f"ReplayBuffer.sample: no clips of history_len={history_len} available "
                f"(num_episodes={buffer.num_episodes}, "
                f"num_steps_stored={buffer.num_steps_stored})")
        store = view.buf
        where, ep_of = view.inverse()
        self.select.check(store)
        port = store.port
        out = np.empty(0, np.int64)
        gen = buffer._rng()
        for _ in range(64):
            w = port.draw(self.select, gen, batch_size, span)
            pos = where[w.rows[:, 0]]
            pos = pos[pos >= 0]
            ep = ep_of[pos]
            local = pos - view.offsets[ep]
            fits = local <= view.lengths[ep] - span
            flat = view.clip_starts(span)[ep[fits]] + local[fits]
            out = np.concatenate([out, flat])[:batch_size]
            if len(out) == batch_size:
                return out
        raise RuntimeError(f"ReplayBuffer.sample: {self.select!r} kept drawing windows outside "
                           "the finished episodes; are writers still filling the buffer?")


if ShmFormat.name not in _swm_format.FORMATS:
    _swm_format.register_format(ShmFormat)
