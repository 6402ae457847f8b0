"""PlaNet's ``Memory`` and ``Episode`` (torchwm ``world_models.memory.planet_memory``), shared.

An ``Episode`` is recorded in one process.  ``Memory.append`` writes each
terminated episode into the core store as one contiguous run of ``T + 1``
rows of this process's writer stream (the last row carries the final
observation), then ends it with ``end_episode``, so no window spans two
episodes and the core's episode index lists it.  The held episodes are the
newest ``size`` of that index (``Buffer.episodes``), and ``sample`` is the
core's per-episode draw (``uniform="episodes"``).  One hidden column repeats
the episode's ``T`` on each of its rows, for ``sample``'s ``lengths``.
``Episode`` and the read-only ``episodes`` / ``eps_lengths`` views live in
``_planet_episode`` (``Episode`` is re-exported here).
"""
from __future__ import annotations

import threading

import numpy as np

from .._args import check_int
from .._errors import MemoryFullError, NotEnoughDataError, SampleTooLargeError
from ..protocol.layout import default_episode_slots
from ._base import Facade, register, to_numpy, to_torch
from ._planet_episode import (
    Episode,
    EpisodesView,
    LengthsView,
    check_schema,
    empty_snapshot,
    episode_list,
    episode_rows,
    held_rows,
    runs_of,
    storage_dtype,
)
from ._transitions import check_shape

__all__ = ["Episode", "Memory"]

DEFAULT_MAX_SAMPLE_BYTES = 200 * 2**20   # the "200 MiB threshold" of the TorchWM docs
DEFAULT_STEPS_PER_EPISODE = 1000         # DeepMind Control's episode length
UNBOUNDED_BYTES = 2**30                  # Memory(size=None): a 1 GiB store ...
UNBOUNDED_MAX_ROWS = 1_000_000           # ... of at most a million rows


def _row_bytes(spec: dict) -> int:
    """Bytes of one stored row of ``spec``, hidden columns included."""
    return sum(int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
               for shape, dtype in spec.values())


@register
class Memory(Facade):
    """PlaNet's episodic memory in shared memory: at most ``size`` episodes, FIFO.

    Any process may ``append`` terminated episodes (workers get the Memory by
    pickling, or by ``Memory.attach(name)``) while the trainer samples.

    Sizes, as upstream: ``len(memory)`` is the number of episodes held and the
    ``size`` *property* is the number of transitions they hold; the
    constructor's ``size`` is ``max_episodes``.  An episode is held once its
    append has finished; episodes leave in the order their appends finished,
    across all processes.  ``episodes`` and ``eps_lengths`` are read-only
    views that read like upstream's deques (``maxlen``, ``len``, iteration,
    indexing), from the core's episode index.

    The shared store is allocated up front with ``capacity = ceil(1.25 *
    size * (steps_per_episode + 1))`` rows (an episode of T steps takes T+1
    rows; the quarter on top absorbs chunk granularity and concurrent
    writers), or ``capacity=`` rows.  Longer episodes are accepted up to
    ``capacity - chunk_size`` rows, but then the store may recycle the oldest
    episodes' rows before ``size`` episodes are held; a partly recycled
    episode is no longer held.

    ``Memory()`` (``size=None``, upstream's default: no bound on episodes)
    never evicts.  A shared segment cannot grow, so its store is 1 GiB (at
    most a million rows; ``capacity=`` to choose), sized at the first append
    from the row size, e.g. about 21,800 steps of ``(3, 64, 64)`` float32 frames,
    and an append that does not fit raises ``MemoryFullError`` and writes
    nothing.  The room is checked before writing; appends from several
    processes at the same instant share it without a lock, so size it with
    some headroom when many processes append.

    Observation and action shapes are fixed: ``obs_shape`` / ``action_size``,
    or else those of the first appended episode, when the shared segment is
    created; pass both to share a Memory before anything is appended.
    Rewards are stored as float32 and terminals as bool.

    Args:
        size: the most episodes held (FIFO); None: every episode, until full.
        capacity: rows of the shared store; default from ``size`` and
            ``steps_per_episode``, or 1 GiB worth when ``size`` is None.
        steps_per_episode: the longest episode expected, in appended steps
            (1000, DeepMind Control's episode, by default; divide by your
            action repeat).  Sizes the store.
        obs_shape: per-step observation shape, e.g. ``(3, 64, 64)``.
        action_size: action vector length (a scalar action counts as 1).
        obs_dtype: storage dtype of observations (float32); values that do
            not fit losslessly (0.5 into uint8, say) are rejected.
        action_dtype: storage dtype of actions (float32), checked the same way.
        max_sample_bytes: ``sample`` raises ``SampleTooLargeError`` rather
            than build a batch larger than this (the docs' 200 MiB).
        name: shared-memory name; generated if None.
        seed: seed of this handle's random generator.

    Raises:
        TypeError / ValueError: a bad argument, naming it.
        SharedMemoryFullError: ``/dev/shm`` cannot hold the store.

    Example:
        >>> memory = Memory(size=100, steps_per_episode=250, obs_shape=(3, 64, 64),
        ...                 action_size=6)
        >>> memory.append([episode])
        >>> [x, u, r, t], lengths = memory.sample(batch_size=32, tracelen=50)
        >>> memory.episodes.maxlen, len(memory.episodes), list(memory.eps_lengths)
    """

    FACADE = "planet.Memory"
    _lock: threading.Lock = None  # type: ignore[assignment]  # made by _setup
    _schema: dict = None  # type: ignore[assignment]  # constructor's shapes and dtypes, until the segment exists
    _pending: dict = None  # type: ignore[assignment]  # constructor's name and seed, until the segment exists

    def __init__(self, size: int | None = None, *, capacity: int | None = None,
                 steps_per_episode: int = DEFAULT_STEPS_PER_EPISODE, obs_shape=None,
                 action_size: int | None = None, obs_dtype=np.float32, action_dtype=np.float32,
                 max_sample_bytes: int = DEFAULT_MAX_SAMPLE_BYTES, name: str | None = None,
                 seed=None):
        params = {"size": None if size is None else check_int("Memory(size=...)", size),
                  "capacity": None if capacity is None else check_int("Memory(capacity=...)",
                                                                      capacity, 2),
                  "steps_per_episode": check_int("Memory(steps_per_episode=...)",
                                                 steps_per_episode),
                  "max_sample_bytes": check_int("Memory(max_sample_bytes=...)", max_sample_bytes)}
        if obs_shape is not None:
            obs_shape = tuple(check_shape("Memory(obs_shape=...)", obs_shape))
        if action_size is not None:
            action_size = check_int("Memory(action_size=...)", action_size)
        self._schema = {"obs_shape": obs_shape, "action_size": action_size,
                        "obs_dtype": storage_dtype("obs_dtype", obs_dtype),
                        "action_dtype": storage_dtype("action_dtype", action_dtype)}
        self._pending = {"name": name, "seed": seed}
        self._setup(params)
        self._track(None, owner=True)   # open; the segment comes with the schema
        if obs_shape is not None and action_size is not None:
            self._materialize(self._spec(obs_shape, action_size))

    def _setup(self, params: dict) -> None:
        self._params = dict(params)
        if self._lock is None:
            self._lock = threading.Lock()   # one writer stream per handle: appends take turns

    def _spec(self, obs_shape: tuple, action_size: int) -> dict:
        s = self._schema
        return {"x": (tuple(obs_shape), s["obs_dtype"]), "u": ((action_size,), s["action_dtype"]),
                "r": ((), np.dtype(np.float32)), "t": ((), np.dtype(np.bool_)),
                "length": ((), np.dtype(np.int64))}

    def _capacity(self, spec: dict) -> tuple[int, int]:
        """(rows, chunk_size): ``capacity=``, else ``size`` episodes of
        ``steps_per_episode`` steps plus 25%, else (``size=None``) 1 GiB of ``spec``'s rows.

        Chunks are at most 1/64 of the store, so the headroom is at least 16
        chunks: room for the partly filled chunks of a dozen concurrent writers.
        """
        p = self._params
        rows = p.get("capacity")
        if rows is None and p["size"] is not None:
            rows = -(-p["size"] * (p["steps_per_episode"] + 1) * 5 // 4)
        elif rows is None:
            rows = max(64, min(UNBOUNDED_MAX_ROWS, UNBOUNDED_BYTES // _row_bytes(spec)))
        return rows, max(1, min(512, rows // 64))

    def _materialize(self, spec: dict) -> None:
        capacity, chunk = self._capacity(spec)
        self._params["capacity"] = capacity   # attachers read it from the header
        size = self._params["size"]   # index every held episode (each takes >= 2 rows)
        slots = capacity // 2 + 1 if size is None else max(size, default_episode_slots(capacity))
        self._create(spec, capacity, self._params, name=self._pending["name"],
                     seed=self._pending["seed"], chunk_size=chunk, done_key=None,
                     episode_slots=slots, overcommit=True)  # upstream's deque grows as it fills

    @classmethod
    def attach(cls, name: str, *, seed=None, own: bool = False, handle_signals=None) -> "Memory":
        """Attach to a Memory made by another process, by name; never unlinks it, unless ``own``.

        Raises:
            SegmentNotFoundError: no such segment.
            CorruptSegmentError: the segment is not a PlaNet Memory.

        Example:
            >>> memory = Memory.attach("shmbuf-1a2b3c4d5e6f")
        """
        return super().attach(name, seed=seed, own=own, handle_signals=handle_signals)

    # -- sizes ------------------------------------------------------------------
    @property
    def max_episodes(self) -> int | None:
        """The constructor's ``size``: the most episodes held (None: no bound, never evicts)."""
        return self._params["size"]

    @property
    def episodes(self) -> EpisodesView:
        """The held episodes, oldest first, as terminated ``Episode`` copies (read-only).

        Reads like upstream's ``deque(maxlen=size)``: ``memory.episodes.maxlen``,
        ``len(memory.episodes)``, ``memory.episodes[-1]``, iteration.  Each
        item is read from shared memory when asked for.
        """
        return EpisodesView(self)

    @property
    def eps_lengths(self) -> LengthsView:
        """Each held episode's length ``T`` (appended steps), oldest first (a read-only deque)."""
        return LengthsView(self)

    @property
    def steps_per_episode(self) -> int:
        """The episode length the store was sized for."""
        return self._params["steps_per_episode"]

    @property
    def capacity(self) -> int | None:
        """Rows of the shared store (an episode of T steps takes T+1).

        None for ``Memory()`` before its first append: the row size decides it.
        """
        if self.buffer is not None:
            return self.buffer.capacity
        p = self._params
        return p.get("capacity") if p["size"] is None else self._capacity({})[0]

    @property
    def max_sample_bytes(self) -> int:
        """The largest batch ``sample`` builds, in bytes; settable, for this handle."""
        return self._params["max_sample_bytes"]

    @max_sample_bytes.setter
    def max_sample_bytes(self, value) -> None:
        self._params["max_sample_bytes"] = check_int("max_sample_bytes", value)

    @property
    def size(self) -> int:
        """Total transitions (steps) in the held episodes, as upstream's ``size``."""
        rows = self._held_rows()
        return int(rows.sum()) - len(rows)   # an episode of T steps is T + 1 rows

    def __len__(self) -> int:
        """Number of episodes held."""
        return len(self._held_rows())

    def _held_rows(self) -> np.ndarray:
        """Rows of each held episode (the newest ``size`` the core indexed), oldest first."""
        held = self._held()
        return np.empty(0, np.int64) if held is None else held.length

    def _held(self):
        """The core's index entries of the held episodes, oldest first; None before any."""
        self._check_open()
        return None if self.buffer is None else self.buffer.episodes(newest=self.max_episodes)

    # -- writing ------------------------------------------------------------------
    def append(self, episodes: "Episode | list[Episode]") -> None:
        """Write terminated episodes into the shared memory, each as one contiguous run.

        Works from any process holding the Memory.  Every episode is checked
        against the schema before anything is written, so a bad one writes
        nothing.  Each becomes the newest episode; beyond ``size``, the
        oldest leave.

        Args:
            episodes: an ``Episode`` or a list of them, each terminated.

        Raises:
            ValueError: not an Episode, not terminated, too long for the store,
                or a shape mismatch; TypeError: a lossy cast.  Messages name the
                episode and field, e.g. ``Memory.append(episodes[1].x)``.
            BufferClosedError: the Memory is closed.

        Example:
            >>> episode.terminate(final_obs)
            >>> memory.append([episode])
        """
        self._check_open()
        episodes = episode_list(episodes)
        if not episodes:
            return
        spec = self.buffer.spec if self.buffer is not None else self._infer_spec(episodes[0])
        runs = [self._run(i, ep, spec) for i, ep in enumerate(episodes)]
        with self._lock:
            if self.buffer is None:
                self._materialize(spec)
            elif self.buffer.spec != spec:  # another thread created it meanwhile
                runs = [self._run(i, ep, self.buffer.spec) for i, ep in enumerate(episodes)]
            if self.max_episodes is None:
                stats = self.buffer.stats()   # free chunks; the writer's open one not counted
                self._check_room(runs, (stats.n_chunks - stats.chunks_in_use) * stats.chunk_size)
            self._write(runs)

    def _check_room(self, runs, free: int) -> None:
        """``Memory(size=None)`` never evicts: refuse runs that need more than ``free`` rows."""
        need = sum(len(run["x"]) for run in runs)
        if need > free:
            raise MemoryFullError(
                f"Memory {self.name!r} keeps every episode (size=None) and its store of "
                f"{self.capacity} rows has room for {free} more, but the episodes need {need} "
                "(T + 1 rows for T steps); nothing was written. Create it with a larger "
                "capacity=, or with size= to keep only the newest episodes")

    def _write(self, runs) -> None:
        """Each run's rows, then ``end_episode``: the core indexes the episode there."""
        writer = self._get_writer()
        try:
            for run in runs:
                steps = len(run["x"]) - 1
                writer.extend(x=run["x"], u=run["u"], r=run["r"], t=run["t"],
                              length=np.full(steps + 1, steps, np.int64))
                writer.end_episode()
        except BaseException:
            self._drop_writer()   # its stream ends unfinished: a cut-short run is never held
            raise

    def _infer_spec(self, episode: Episode) -> dict:
        obs_shape, action_size = self._schema["obs_shape"], self._schema["action_size"]
        if obs_shape is None:
            obs_shape = episode.x.shape[1:]
        if action_size is None:
            if episode.u.ndim > 2:
                raise ValueError(f"Memory.append(episodes[0].u): actions must be scalars or "
                                 f"vectors, got per-step shape {episode.u.shape[1:]}")
            action_size = episode.u.shape[1] if episode.u.ndim == 2 else 1
        return self._spec(obs_shape, action_size)

    def _run(self, i: int, episode: Episode, spec: dict) -> dict:
        """The episode's T+1 rows, checked and cast to the schema (final row: x only)."""
        steps = episode.size
        capacity, chunk = self._capacity(spec)
        if steps + 1 > capacity - chunk:
            raise ValueError(
                f"Memory.append(episodes[{i}]): an episode of {steps} steps needs {steps + 1} "
                f"rows but this Memory fits episodes of at most {capacity - chunk - 1} steps; "
                f"create it with steps_per_episode >= {steps}")
        return episode_rows(i, episode, spec)

    # -- sampling -----------------------------------------------------------------
    def sample(self, batch_size, tracelen=1, time_first=False):
        """Draw sub-sequences of held episodes: episodes uniformly, with replacement.

        Only episodes of length >= ``tracelen`` are eligible, each equally
        likely whatever its length; the start within it is uniform.  The
        cost does not grow with the number of episodes held.

        Args:
            batch_size: sequences per batch.
            tracelen: actions per sequence (observations: ``tracelen + 1``).
            time_first: put time before batch in every array.

        Returns:
            ``([x, u, r, t], lengths)``: ``x (B, tracelen+1, *obs_shape)``,
            ``u (B, tracelen, A)``, ``r (B, tracelen)`` float32, ``t (B,
            tracelen)`` bool (the first two axes swapped when ``time_first``;
            never squeezed), and ``lengths (B,)`` int64, the length T of each
            sequence's episode.  ``x[:, i]``, ``u[:, i]``, ``r[:, i]`` and
            ``t[:, i]`` come from one ``Episode.append``; ``x[:, tracelen]``
            from the next one, or is the final observation.

        Raises:
            NotEnoughDataError (a ValueError): the memory is empty, or no held
                episode has ``tracelen`` steps.
            SampleTooLargeError (a MemoryError): the batch, ``batch_size *
                (tracelen + 1)`` stored rows (all columns, 8 hidden bytes a
                row included), would exceed ``max_sample_bytes``; nothing is read.
            TypeError / ValueError: a bad argument.

        Example:
            >>> [x, u, r, t], lengths = memory.sample(16, tracelen=50, time_first=True)
            >>> x.shape   # (51, 16, 3, 64, 64)
        """
        self._check_open()
        batch_size = check_int("Memory.sample(batch_size=...)", batch_size)
        tracelen = check_int("Memory.sample(tracelen=...)", tracelen)
        if self.buffer is None:
            raise NotEnoughDataError("Memory is empty; cannot sample.")
        need = batch_size * (tracelen + 1) * _row_bytes(self.buffer.spec)
        if need > self.max_sample_bytes:
            raise SampleTooLargeError(
                f"Memory.sample(batch_size={batch_size}, tracelen={tracelen}) needs "
                f"{need / 2**20:.1f} MiB, more than max_sample_bytes "
                f"({self.max_sample_bytes / 2**20:.1f} MiB); sample fewer or shorter "
                "sequences, or raise memory.max_sample_bytes")
        try:
            c = self.buffer.sample_sequences(batch_size, tracelen + 1, time_major=bool(time_first),
                                             uniform="episodes",
                                             newest=self.max_episodes)
        except NotEnoughDataError:
            rows = self._held_rows()
            if not len(rows):
                raise NotEnoughDataError("Memory is empty; cannot sample.") from None
            raise NotEnoughDataError(
                f"No episodes with length >= {tracelen} available to sample: the "
                f"{len(rows)} held episodes have at most {rows.max() - 1} steps") from None
        if time_first:
            return [c["x"]] + [c[k][:tracelen] for k in "urt"], c["length"][0].copy()
        return ([c["x"]] + [np.ascontiguousarray(c[k][:, :tracelen]) for k in "urt"],
                c["length"][:, 0].copy())

    # -- checkpoints ----------------------------------------------------------------
    def state_dict(self) -> dict:
        """Copies of the held episodes, oldest first, as torch tensors and plain values.

        ``torch.save(memory.state_dict(), path)`` and later
        ``memory.load_state_dict(torch.load(path, weights_only=True))`` work.
        The format is the core's ``snapshot()`` cut down to the held
        episodes' rows, episode by episode, plus ``facade``.

        Example:
            >>> torch.save(memory.state_dict(), "memory.pt")
        """
        self._check_open()
        if self.buffer is None:
            state = empty_snapshot({})
        else:
            state = self.buffer.snapshot()
            rows = held_rows(self.buffer.episodes(newest=self.max_episodes), state["stream"],
                             state["episode"])
            state["columns"] = {k: v[rows] for k, v in state["columns"].items()}
            state["stream"], state["episode"] = state["stream"][rows], state["episode"][rows]
        state["facade"] = self.FACADE
        return to_torch(state)

    def load_state_dict(self, state: dict) -> None:
        """Replace the contents with a ``state_dict``, keeping this Memory's sizes.

        Episodes keep their order and come before anything appended later;
        if the checkpoint holds more than ``size`` episodes, the newest are kept.
        A Memory with no schema yet takes the checkpoint's.

        Raises:
            ValueError: another facade's checkpoint, or another schema
                (shapes, dtypes); nothing is changed.

        Example:
            >>> fresh = Memory(size=100)
            >>> fresh.load_state_dict(torch.load("memory.pt", weights_only=True))
        """
        self._check_open()
        state = to_numpy(dict(state))
        if state.get("facade") != self.FACADE:
            raise ValueError(f"state: checkpoint was made by {state.get('facade')!r}, "
                             f"not {self.FACADE!r}")
        spec = self._state_spec(state["spec"]) if state.get("spec") else None
        if spec is None and self.buffer is None:
            return
        runs = runs_of(state, spec) if spec is not None else []
        with self._lock:
            if self.buffer is None:
                self._materialize(spec)
            self._drop_writer()   # its open chunk would otherwise survive the clear
            if self.max_episodes is None:   # all must fit once cleared (open chunks stay)
                stats = self.buffer.stats()
                self._check_room(runs, (stats.n_chunks - stats.writers) * stats.chunk_size)
            self.buffer.restore(empty_snapshot(self.buffer.spec))
            self._write(runs)

    def _state_spec(self, spec: dict) -> dict:
        """This Memory's schema (or, with none yet, one with the checkpoint's shapes), checked."""
        try:
            mine = self.buffer.spec if self.buffer is not None else self._spec(
                tuple(spec["x"][0]), int(spec["u"][0][0]))
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise ValueError(f"state: not a PlaNet Memory schema: {spec!r}") from exc
        return check_schema(mine, spec)

    # -- lifecycle --------------------------------------------------------------------
    def __reduce__(self):
        if self.buffer is None:
            raise TypeError(
                "this Memory has no shared segment yet, so it cannot be sent to another "
                "process: create it with obs_shape= and action_size=, or append an episode "
                "first")
        return super().__reduce__()

    def __repr__(self):
        if self._closed:
            return f"<shmbuf PlaNet Memory {self.name!r} closed>"
        bound = "unbounded" if self.max_episodes is None else self.max_episodes
        return (f"<shmbuf PlaNet Memory {self.name!r} episodes={len(self)}/{bound} "
                f"capacity={self.capacity}>")
