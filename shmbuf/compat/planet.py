"""PlaNet's ``Memory`` and ``Episode`` (torchwm ``world_models.memory.planet_memory``), shared.

An ``Episode`` is recorded in one process.  ``Memory.append`` writes each
terminated episode into the core store as one contiguous run of ``T + 1``
rows of this process's writer stream (the last row carries the final
observation), then cuts the stream with ``end_episode``, so no window spans
two episodes.  Two hidden columns repeat the episode's serial and length on
every row; ``_episodic`` works out from them which episodes are held and how
to draw them uniformly per episode from the core's per-start draws.
``Episode`` itself lives in ``_planet_episode`` (re-exported here), and the
checkpoint logic in ``_planet_state``.
"""
from __future__ import annotations

import threading

import numpy as np

from .._args import check_int
from .._errors import (NotEnoughDataError, SampleRetryError,
                       SampleTooLargeError)
from . import _planet_state
from ._base import Facade, register, to_numpy
from ._episodic import Batch, Draw, census, committed_rows, row_bytes
from ._episodic import capacity as store_capacity
from ._planet_episode import Episode, episode_list, episode_rows
from ._transitions import check_shape

__all__ = ["Episode", "Memory"]

DEFAULT_MAX_SAMPLE_BYTES = 200 * 2**20   # the "200 MiB threshold" of the TorchWM docs
DEFAULT_STEPS_PER_EPISODE = 1000         # DeepMind Control's episode length


@register
class Memory(Facade):
    """PlaNet's episodic memory in shared memory: at most ``size`` episodes, FIFO.

    Any process may ``append`` terminated episodes (workers get the Memory by
    pickling, or by ``Memory.attach(name)``) while the trainer samples.

    Sizes, as upstream: ``len(memory)`` is the number of episodes held and the
    ``size`` *property* is the number of transitions they hold; the
    constructor's ``size`` is ``max_episodes``.  An episode is held once its
    append has finished; episodes leave in the order their appends began,
    across all processes.

    The shared store is allocated up front with ``capacity = ceil(1.25 *
    size * (steps_per_episode + 1))`` rows (an episode of T steps takes T+1
    rows; the quarter on top absorbs chunk granularity and concurrent
    writers).  Longer episodes are accepted up to ``capacity - chunk_size``
    rows, but then the store may recycle the oldest episodes' rows before
    ``size`` episodes are held; a partly recycled episode is no longer held.

    Observation and action shapes are fixed: ``obs_shape`` / ``action_size``,
    or else those of the first appended episode, when the shared segment is
    created; pass both to share a Memory before anything is appended.
    Rewards are stored as float32 and terminals as bool.

    Args:
        size: the most episodes held.
        steps_per_episode: the longest episode expected, in appended steps
            (1000, DeepMind Control's episode, by default; divide by your
            action repeat).  Sizes the store.
        obs_shape: per-step observation shape, e.g. ``(3, 64, 64)``.
        action_size: action vector length (a scalar action counts as 1).
        obs_dtype, action_dtype: storage dtypes (float32); values that do
            not fit losslessly (0.5 into uint8, say) are rejected.
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
    """

    FACADE = "planet.Memory"
    _rng = None
    _lock = None
    _schema = None     # constructor's shapes and dtypes, until the segment exists
    _pending = None    # constructor's name and seed, until the segment exists

    def __init__(self, size, *, steps_per_episode=DEFAULT_STEPS_PER_EPISODE, obs_shape=None,
                 action_size=None, obs_dtype=np.float32, action_dtype=np.float32,
                 max_sample_bytes=DEFAULT_MAX_SAMPLE_BYTES, name=None, seed=None):
        params = {"size": check_int("Memory(size=...)", size),
                  "steps_per_episode": check_int("Memory(steps_per_episode=...)", steps_per_episode),
                  "max_sample_bytes": check_int("Memory(max_sample_bytes=...)", max_sample_bytes)}
        if obs_shape is not None:
            obs_shape = tuple(check_shape("Memory(obs_shape=...)", obs_shape))
        if action_size is not None:
            action_size = check_int("Memory(action_size=...)", action_size)
        self._schema = {"obs_shape": obs_shape, "action_size": action_size,
                        "obs_dtype": _dtype("obs_dtype", obs_dtype),
                        "action_dtype": _dtype("action_dtype", action_dtype)}
        self._pending = {"name": name, "seed": seed}
        self._rng = np.random.default_rng(seed)
        self._setup(params)
        if obs_shape is not None and action_size is not None:
            self._materialize(self._spec(obs_shape, action_size))

    def _setup(self, params: dict) -> None:
        self._params = dict(params)
        if self._lock is None:
            self._lock = threading.Lock()   # one writer stream per handle: appends take turns
        if self._rng is None:
            self._rng = np.random.default_rng()

    def _spec(self, obs_shape: tuple, action_size: int) -> dict:
        s = self._schema
        return {"x": (tuple(obs_shape), s["obs_dtype"]), "u": ((action_size,), s["action_dtype"]),
                "r": ((), np.dtype(np.float32)), "t": ((), np.dtype(np.bool_)),
                "serial": ((), np.dtype(np.int64)), "length": ((), np.dtype(np.int64))}

    def _capacity(self) -> tuple[int, int]:
        return store_capacity(self._params["size"], self._params["steps_per_episode"])

    def _materialize(self, spec: dict) -> None:
        capacity, chunk = self._capacity()
        self._create(spec, capacity, self._params, name=self._pending["name"],
                     seed=self._pending["seed"], chunk_size=chunk, done_key=None)

    @classmethod
    def attach(cls, name: str, *, seed=None) -> "Memory":
        """Attach to a Memory made by another process, by name; never unlinks it.

        Raises:
            SegmentNotFoundError: no such segment.
            CorruptSegmentError: the segment is not a PlaNet Memory.

        Example:
            >>> memory = Memory.attach("shmbuf-1a2b3c4d5e6f")
        """
        memory = super().attach(name, seed=seed)
        memory._rng = np.random.default_rng(seed)
        return memory

    # -- sizes ------------------------------------------------------------------
    @property
    def max_episodes(self) -> int:
        """The constructor's ``size``: the most episodes held."""
        return self._params["size"]

    @property
    def steps_per_episode(self) -> int:
        """The episode length the store was sized for."""
        return self._params["steps_per_episode"]

    @property
    def capacity(self) -> int:
        """Rows of the shared store (an episode of T steps takes T+1)."""
        return self._capacity()[0]

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
        return int(self._census().lengths.sum())

    def __len__(self) -> int:
        """Number of episodes held."""
        return len(self._census().serials)

    @property
    def name(self) -> str | None:
        """The shared-memory name, or None until the shared segment exists."""
        return None if self.buffer is None else self.buffer.name

    # -- writing ------------------------------------------------------------------
    def append(self, episodes) -> None:
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
            writer = self._get_writer()
            for run in runs:
                serial, steps = self.buffer.next_serial(), len(run["x"]) - 1
                try:
                    for i in range(steps + 1):
                        writer.add(x=run["x"][i, ...], u=run["u"][i, ...], r=run["r"][i, ...],
                                   t=run["t"][i, ...], serial=serial, length=steps)
                finally:
                    writer.end_episode()  # even a cut-short episode ends here

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
        capacity, chunk = self._capacity()
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
        likely whatever its length; the start within it is uniform.

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
                (tracelen + 1)`` stored rows (all columns, 16 hidden bytes a
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
        spec = self.buffer.spec
        window = (tracelen + 1) * row_bytes(spec)
        if batch_size * window > self.max_sample_bytes:
            raise SampleTooLargeError(
                f"Memory.sample(batch_size={batch_size}, tracelen={tracelen}) needs "
                f"{batch_size * window / 2**20:.1f} MiB, more than max_sample_bytes "
                f"({self.max_sample_bytes / 2**20:.1f} MiB); sample fewer or shorter "
                "sequences, or raise memory.max_sample_bytes")
        draw = Draw.plan(self._census(), tracelen)
        out = Batch(spec, batch_size, tracelen, bool(time_first))
        room = self.max_sample_bytes - batch_size * window
        self._fill(out, draw, max(1, room // window))
        return out.result()

    def _fill(self, out: Batch, draw: Draw, per_round: int) -> None:
        """Draw straight into ``out``, then refill rejected slots in rounds.

        Later rounds hold at most ``per_round`` candidate windows, what the
        batch leaves of ``max_sample_bytes`` (at least one).
        """
        target, budget = out.columns, 64 * len(out.holes) / draw.rate + 4096
        while len(out.holes):
            if budget <= 0:
                raise SampleRetryError("Memory.sample: the held episodes changed faster than "
                                       "sequences could be drawn from them; try again")
            m = len(out.holes) if target is not None else int(
                min(per_round, np.ceil(len(out.holes) / draw.rate * 1.5) + 4))
            budget -= m
            cand = self.buffer.sample_sequences(m, draw.tracelen + 1, out=target,
                                                time_major=out.time_first, rng=self._rng)
            keep = draw.keep(self._rng, out.first_step(cand["serial"]),
                             out.first_step(cand["length"]))
            if target is not None:
                out.holes, target = np.flatnonzero(~keep), None
            else:
                out.fill(cand, np.flatnonzero(keep))
            if not keep.any():  # the held episodes may have changed: plan again
                draw = Draw.plan(self._census(), draw.tracelen)

    def _census(self):
        self._check_open()
        if self.buffer is None:
            return census(np.empty(0, np.int64), np.empty(0, np.int64), 1)
        rows = committed_rows(self.buffer)
        arrays = self.buffer.arrays
        return census(arrays["serial"][rows], arrays["length"][rows], self.max_episodes)

    # -- checkpoints ----------------------------------------------------------------
    def state_dict(self) -> dict:
        """Copies of the held episodes, oldest first, as torch tensors and plain values.

        ``torch.save(memory.state_dict(), path)`` and later
        ``memory.load_state_dict(torch.load(path, weights_only=True))`` work.

        Example:
            >>> torch.save(memory.state_dict(), "memory.pt")
        """
        self._check_open()
        return _planet_state.state_dict(self)

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
        _planet_state.load_state_dict(self, to_numpy(dict(state)))

    # -- lifecycle --------------------------------------------------------------------
    def unlink(self) -> None:
        """Remove the shared segment's name now (creator only); no-op before it exists."""
        if self.buffer is not None:
            super().unlink()

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
        return (f"<shmbuf PlaNet Memory {self.name!r} episodes={len(self)}/"
                f"{self.max_episodes} capacity={self.capacity}>")


# -- argument checks ----------------------------------------------------------------

def _dtype(arg: str, dtype) -> np.dtype:
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"Memory({arg}=...): {dtype!r} is not a numpy dtype") from None
    if dt.kind not in "biuf":
        raise TypeError(f"Memory({arg}=...): expected a numeric or bool dtype, got {dt}")
    return dt
