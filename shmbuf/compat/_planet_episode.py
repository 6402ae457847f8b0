"""PlaNet's ``Episode``: recorded step by step in one process, stacked, laid out as rows.

Besides the class, the read-only views ``Memory.episodes`` and
``Memory.eps_lengths`` (upstream's deques, read from the core's episode
index), and pure functions for ``Memory``: the checks of what
``Episode.append`` records (numbers, scalars) and of the episodes that
``Memory.append`` takes (``episode_list``); the rows ``Memory`` stores for an
episode (``episode_rows``); and its checkpoint format, the core's snapshot
cut down to the held episodes (``held_rows``, ``runs_of``, ``check_schema``).
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, NoReturn, overload

import numpy as np

from ..disk.checkpoint import FORMAT
from ..writing.cast import coerce, host_array


class Episode:
    """One episode, recorded in the process that runs the env (never shared).

    ``append`` one step at a time, then ``terminate(final_obs)``: the lists
    ``x``, ``u``, ``r``, ``t`` become arrays ``x (T+1, ...)`` (the final
    observation last), ``u (T, ...)``, ``r (T,)`` and ``t (T,)`` (bool).

    Args:
        postprocess_fn: applied to each observation (a numpy array) as it is
            recorded, final observation included; default identity.

    Example:
        >>> ep = Episode(postprocess_fn=lambda x: x / 255.0)
        >>> ep.append(obs, action, 0.0, False)
        >>> ep.terminate(final_obs); ep.x.shape   # (2, 3, 64, 64)
    """

    def __init__(self, postprocess_fn=None):
        if postprocess_fn is not None and not callable(postprocess_fn):
            raise TypeError("Episode(postprocess_fn=...) must be callable, got "
                            f"{postprocess_fn!r}")
        self.postprocess_fn = postprocess_fn if postprocess_fn is not None else _identity
        # Lists while recording; terminate() stacks each into one array.
        self.x: Any = []
        self.u: Any = []
        self.r: Any = []
        self.t: Any = []
        self._size = 0
        self._terminated = False

    @property
    def size(self) -> int:
        """Steps appended so far (``T``)."""
        return self._size

    @property
    def terminated(self) -> bool:
        """True once ``terminate`` has stacked the episode."""
        return self._terminated

    def append(self, obs, act, reward, terminal) -> None:
        """Record one step: the observation, the action taken, its reward and terminal flag.

        Args:
            obs: numpy array or torch tensor; passed through ``postprocess_fn``.
            act: numpy array, torch tensor or number (copied).
            reward: a number (or a one-element array/tensor).
            terminal: a bool, or a number that is exactly 0 or 1.

        Raises:
            RuntimeError: the episode is already terminated.
            ValueError / TypeError: a value is not numeric, or its shape differs
                from the first step's; nothing is recorded.

        Example:
            >>> ep.append(torch.zeros(3, 64, 64), torch.zeros(6), 0.0, False)
        """
        self._check_recording("append")
        x = self._observation("Episode.append(obs=...)", obs)
        u = _numbers("Episode.append(act=...)", act)
        if self.u and u.shape != self.u[0].shape:
            raise ValueError(f"Episode.append(act=...): shape {u.shape} differs from the "
                             f"first step's {self.u[0].shape}")
        r = _scalar("Episode.append(reward=...)", reward)
        t = _scalar("Episode.append(terminal=...)", terminal)
        if t not in (0, 1):
            raise ValueError(f"Episode.append(terminal=...): expected a bool or 0/1, got {t}")
        self.x.append(x)
        self.u.append(u)
        self.r.append(r)
        self.t.append(t.astype(np.bool_))
        self._size += 1

    def terminate(self, final_obs) -> None:
        """Record the final observation and stack every list into an array.

        Raises:
            RuntimeError: already terminated.
            ValueError: no step was appended, or ``final_obs`` has another shape.

        Example:
            >>> ep.terminate(obs); ep.u.shape   # (T, action_dim)
        """
        self._check_recording("terminate")
        if not self._size:
            raise ValueError("Episode.terminate: append() at least one step first")
        x = self._observation("Episode.terminate(final_obs=...)", final_obs)
        self.x = np.stack(self.x + [x])
        self.u, self.r, self.t = np.stack(self.u), np.stack(self.r), np.stack(self.t)
        self._terminated = True

    def _check_recording(self, verb: str) -> None:
        if self._terminated:
            raise RuntimeError(f"Episode.{verb}: the episode is already terminated; "
                               "record the next one in a new Episode()")

    def _observation(self, label: str, obs) -> np.ndarray:
        x = _numbers(label, self.postprocess_fn(_numbers(label, obs)))
        if self.x and x.shape != self.x[0].shape:
            raise ValueError(f"{label}: shape {x.shape} differs from the first "
                             f"observation's {self.x[0].shape}")
        return x

    def __repr__(self):
        state = "terminated" if self._terminated else "recording"
        return f"<shmbuf Episode size={self._size} {state}>"


def stored_episode(rows: dict) -> Episode:
    """A terminated ``Episode`` from the ``T + 1`` rows ``Memory`` stored for it."""
    episode = Episode()
    episode.x = rows["x"]
    episode.u, episode.r, episode.t = rows["u"][:-1], rows["r"][:-1], rows["t"][:-1]
    episode._size, episode._terminated = len(rows["x"]) - 1, True
    return episode


class _HeldView(Sequence):
    """What both views share: ``maxlen``, ``len`` and a deque-like repr, read-only."""

    def __init__(self, memory):
        self._memory = memory

    @property
    def maxlen(self) -> int | None:
        """The Memory's ``size`` (None: no bound), as ``deque.maxlen``."""
        return self._memory.max_episodes

    def __len__(self) -> int:
        return len(self._memory)

    def _position(self, i, n: int) -> int:
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
            raise TypeError(f"sequence index must be integer, not {type(i).__name__!r}")
        if not -n <= i < n:
            raise IndexError(f"{type(self).__name__} index {i} out of range for {n} episodes")
        return int(i) % n

    def __repr__(self) -> str:
        return f"{type(self).__name__}({list(self)!r}, maxlen={self.maxlen})"


class EpisodesView(_HeldView):
    """``Memory.episodes``: the held episodes as ``Episode`` copies, oldest first."""

    @overload
    def __getitem__(self, i: int | np.integer) -> Episode: ...
    @overload
    def __getitem__(self, i: slice) -> NoReturn: ...   # TypeError: integer indices only

    def __getitem__(self, i: int | np.integer | slice) -> Episode:
        held = self._memory._held()
        i = self._position(i, 0 if held is None else len(held))
        rows = self._memory.buffer.read_episode(int(held.index[i]))
        if rows is None:
            raise IndexError(f"episode {i} left the Memory while it was read")
        return stored_episode(rows)

    def __iter__(self) -> Iterator[Episode]:
        memory = self._memory
        if memory._held() is None:
            return iter(())
        return map(stored_episode, memory.buffer.iter_episodes(newest=memory.max_episodes))

    def __repr__(self) -> str:
        return f"EpisodesView(<{len(self)} episodes>, maxlen={self.maxlen})"


class LengthsView(_HeldView):
    """``Memory.eps_lengths``: each held episode's ``T``, oldest first."""

    def _lengths(self) -> list[int]:
        return (self._memory._held_rows() - 1).tolist()   # T steps are T + 1 rows

    @overload
    def __getitem__(self, i: int | np.integer) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> NoReturn: ...   # TypeError: integer indices only

    def __getitem__(self, i: int | np.integer | slice) -> int:
        lengths = self._lengths()
        return lengths[self._position(i, len(lengths))]

    def __iter__(self) -> Iterator[int]:
        return iter(self._lengths())


def episode_rows(i: int, episode: Episode, spec: dict) -> dict:
    """``Memory.append``'s ``episodes[i]`` as its ``T + 1`` rows, cast to ``spec``.

    The final row holds only the final observation (``u``, ``r`` and ``t``
    are zero there).  Errors name the field, e.g. ``Memory.append(episodes[1].x)``.
    """
    steps = episode.size
    u = episode.u[:, None] if episode.u.ndim == 1 else episode.u
    run = {}
    for name, value in (("x", episode.x), ("u", u), ("r", episode.r), ("t", episode.t)):
        shape, dtype = spec[name]
        n = steps + 1 if name == "x" else steps
        arr = coerce(f"Memory.append(episodes[{i}].{name})", value, dtype, (n,) + shape)
        full = np.zeros((steps + 1,) + shape, dtype)
        full[:n] = arr
        run[name] = full
    return run


# -- argument checks ----------------------------------------------------------------

def episode_list(episodes) -> list:
    """``Memory.append``'s ``episodes``: an Episode or a list of them, each terminated."""
    if isinstance(episodes, Episode):
        episodes = [episodes]
    if not isinstance(episodes, (list, tuple)):
        raise ValueError("Memory.append(episodes=...): can only append an Episode or a list of "
                         f"Episodes, got {type(episodes).__name__}")
    for i, ep in enumerate(episodes):
        if not isinstance(ep, Episode):
            raise ValueError(f"Memory.append(episodes[{i}]): expected an Episode, got "
                             f"{type(ep).__name__}")
        if not ep.terminated:
            raise ValueError(f"Memory.append(episodes[{i}]): the episode is not terminated; "
                             "call episode.terminate(final_obs) first")
    return list(episodes)


def _numbers(label: str, value) -> np.ndarray:
    """A private numpy copy of a numpy array, torch tensor or array-like of numbers."""
    try:
        arr = np.array(host_array(value), copy=True)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise TypeError(f"{label}: cannot read {type(value).__name__} as an array "
                        f"({exc})") from None
    if arr.dtype.kind not in "biuf":
        raise TypeError(f"{label}: expected numbers, got dtype {arr.dtype}")
    return arr


def _scalar(label: str, value) -> np.ndarray:
    arr = _numbers(label, value)
    if arr.size != 1:
        raise ValueError(f"{label}: expected a scalar, got shape {arr.shape}")
    return arr.reshape(())


def _identity(x):
    return x


def storage_dtype(arg: str, dtype) -> np.dtype:
    """``Memory(obs_dtype=...)`` / ``action_dtype``: a numeric or bool numpy dtype."""
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"Memory({arg}=...): {dtype!r} is not a numpy dtype") from None
    if dt.kind not in "biuf":
        raise TypeError(f"Memory({arg}=...): expected a numeric or bool dtype, got {dt}")
    return dt


# -- checkpoints --------------------------------------------------------------------

def held_rows(held, stream: np.ndarray, episode: np.ndarray) -> np.ndarray:
    """Rows of a snapshot in whole ``held`` episodes (``Buffer.episodes``), episode by episode."""
    ids = held.stream.astype(np.int64) << 32 | held.ep
    rows = np.asarray(stream, np.int64) << 32 | np.asarray(episode, np.int64)
    if not len(ids):
        return np.empty(0, np.int64)
    sorter = np.argsort(ids)
    which = sorter[np.minimum(np.searchsorted(ids, rows, sorter=sorter), len(ids) - 1)]
    which[ids[which] != rows] = -1
    whole = np.bincount(which[which >= 0], minlength=len(ids)) == held.length
    keep = np.flatnonzero((which >= 0) & whole[np.maximum(which, 0)])
    return keep[np.argsort(which[keep], kind="stable")]


def runs_of(state: dict, spec: dict) -> list[dict]:
    """A checkpoint's episodes as runs of rows (consecutive rows of one stream and episode)."""
    n = len(state["stream"])
    columns = {k: coerce(f"state['columns'][{k!r}]", state["columns"].get(k), dtype,
                         (n,) + shape) for k, (shape, dtype) in spec.items()}
    ids = np.asarray(state["stream"], np.int64) << 32 | np.asarray(state["episode"], np.int64)
    return [{k: v[rows] for k, v in columns.items()}
            for rows in np.split(np.arange(n), np.flatnonzero(np.diff(ids)) + 1) if len(rows)]


def check_schema(mine: dict, spec: dict) -> dict:
    """``mine`` if a checkpoint's ``spec`` matches it; ValueError naming both otherwise."""
    try:
        got = {k: (list(v[0]), np.dtype(v[1]).str) for k, v in spec.items()}
    except (IndexError, TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"state: not a PlaNet Memory schema: {spec!r}") from exc
    want = {k: (list(v[0]), np.dtype(v[1]).str) for k, v in mine.items()}
    if want != got:
        raise ValueError(f"state: checkpoint schema {got} does not match this Memory's "
                         f"{want}; create the Memory with matching obs_dtype / action_dtype")
    return mine


def empty_snapshot(spec: dict) -> dict:
    """A core snapshot of no steps (what ``Buffer.restore`` takes to empty a store)."""
    return {"format": FORMAT, "spec": {k: (list(s), np.dtype(d).str) for k, (s, d) in spec.items()},
            "columns": {k: np.empty((0,) + s, d) for k, (s, d) in spec.items()},
            "stream": np.empty(0, np.int64), "episode": np.empty(0, np.int64)}
