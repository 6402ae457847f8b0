"""torchwm's IRIS buffers: ``IRISReplayBuffer`` on the shared step store, and the
local ``IRISOnPolicyBuffer``.

Which windows ``sample_sequence`` returns
-----------------------------------------
A step is what one ``add(obs, action, reward, done)`` stored: the frame seen,
the action taken on it, and the reward and terminal flag that action earned.
A sequence of ``L`` actions needs ``L + 1`` frames, the last being the frame
the final action led to.  So a sampled window is ``L`` consecutive steps of
one writer's stream and one episode (it may end on the terminal step), plus
the frame of the step that follows it in the stream (the core's ``tail=1``).
``obs`` holds the ``L + 1`` frames and ``act``/``rew``/``term`` the ``L``
steps' values.  When the last step is terminal, the frame that follows it was
never stored (the next stored frame is the next episode's reset frame), so
``obs[:, L]`` repeats the terminal step's frame and ``term[:, L - 1]`` is 1:
mask the last frame with ``term``.  The newest step's action and reward are
sampled as soon as its successor frame is added; ``sample_single()`` draws
it at once.

Deliberate differences from upstream (torchwm 0.4.2
``world_models/memory/iris_memory.py``), all bug fixes: the terminal check
covered ``L - 1`` steps, retried once and never re-checked the new start;
windows spliced the newest data onto the oldest once full; the newest action
and reward were never sampled; too little data returned zero-filled windows
(shmbuf raises ``NotEnoughDataError``); ``IRISOnPolicyBuffer`` never enforced
``max_steps`` and kept references to the caller's arrays.  An addition:
``age_weights=`` gives IRIS's own episode weighting by age
(``shmbuf.select.AgeBuckets``), which torchwm's buffer lacks.
"""
from __future__ import annotations

import numpy as np

from .._args import check_int
from .._errors import NotEnoughDataError, OnPolicyBufferFullError
from ..writing.cast import host_array
from . import _torch_batches
from ._base import register
from ._transitions import (
    TransitionFacade,
    age_buckets,
    check_window,
    transition_params,
    transition_spec,
)


@register
class IRISReplayBuffer(TransitionFacade):
    """IRIS's replay buffer in shared memory: a ring of transitions, sampled batch-major.

    Args:
        size: transitions held before the oldest are evicted (FIFO).
        obs_shape: ``(C, H, W)`` of the uint8 frames.
        action_size: length of the float32 action vector.
        seq_len: default actions per sampled sequence, >= 1 (a window spans
            ``seq_len + 1`` steps).  As upstream, one longer than ``size - 1``
            is accepted here; sampling then raises ``NotEnoughDataError``.
        batch_size: sequences per ``sample_sequence()``.
        age_weights: None (default: windows uniform over every valid start,
            as upstream's buffer), or IRIS's episode weighting by age, e.g.
            ``(1/8, 1/8, 1/4, 1/2)``: ``sample_sequence``, ``prefetch`` and
            ``dataset`` then draw with ``shmbuf.select.AgeBuckets(age_weights)``
            (the finished episodes of at least ``seq_len`` steps, oldest
            first, in equal groups; a group by weight, then an episode and a
            start uniformly).  Every handle attached by name draws the same way.
        seed: seed of this handle's own ``np.random.Generator``.
        name: shared-memory name (generated if None); ``IRISReplayBuffer.attach(name)``
            opens the same buffer in another process.
        compress: keep the frames of cold chunks compressed in shared memory: True
            (``shmbuf.Compress("obs")``'s defaults) or a ``shmbuf.Compress``; None: raw.

    Raises:
        TypeError / ValueError: a bad argument, naming it; nothing is created.
        SegmentExistsError: ``name`` is taken.

    Example:
        >>> rb = IRISReplayBuffer(size=50_000, obs_shape=(3, 64, 64), action_size=6)
        >>> rb.add(frame, action, 1.0, False)
        >>> obs, act, rew, term = rb.sample_sequence()   # (64, 21, 3, 64, 64) uint8, ...
    """

    FACADE = "torchwm.iris.IRISReplayBuffer"

    def __init__(self, size: int, obs_shape: tuple, action_size: int, seq_len: int = 20,
                 batch_size: int = 64, *, age_weights=None, seed=None, name: str | None = None,
                 compress=None):
        params = transition_params(size, obs_shape, action_size, seq_len, batch_size, frames=1)
        params["age_weights"] = age_buckets(age_weights)[0]
        self._create(transition_spec(params["obs_shape"], params["action_size"]),
                     params["size"], params, name=name, seed=seed, compress=compress)

    def _setup(self, params: dict) -> None:
        super()._setup(params)
        self._select = age_buckets(params.get("age_weights"))[1]
        self.age_weights = None if self._select is None else self._select.weights

    def add(self, obs, action, reward, done) -> None:
        """Append one transition from this process.

        Several processes may add to the same buffer at once; each process's
        steps form their own stream, and no sampled sequence mixes streams.

        Args:
            obs: the ``(C, H, W)`` uint8 frame the action was taken on.
            action: ``(action_size,)`` floats.
            reward: a scalar.
            done: True / 1 if the episode ended with this step.

        Raises:
            TypeError: a value would lose information in its column (float
                frames into uint8, a ``done`` other than 0 or 1); the message
                names the argument.
            ValueError: a value has the wrong shape.
            BufferClosedError: the buffer was closed in this process (nothing
                is written when any of these is raised).

        Example:
            >>> rb.add(np.zeros((3, 64, 64), np.uint8), np.zeros(6, np.float32), 0.0, False)
        """
        self._add(obs, action, reward, done)

    def sample_sequence(self, seq_len: int | None = None):
        """Draw ``batch_size`` windows of ``seq_len`` actions and ``seq_len + 1`` frames.

        Starts are uniform over every valid window (or drawn by ``age_weights``,
        see the constructor): ``seq_len`` consecutive
        steps of one writer's stream and one episode, which may end on the
        terminal step, and the frame that follows (see the module doc);
        ``obs[:, t + 1]`` is the frame that ``act[:, t]`` led to, except after
        a terminal step, where it repeats the terminal frame.

        Args:
            seq_len: actions per window, ``1 <= seq_len <= size - 1``;
                default the constructor's ``seq_len``.

        Returns:
            ``(obs, act, rew, term)``: fresh numpy arrays of shapes
            ``(batch_size, seq_len + 1, C, H, W)`` uint8,
            ``(batch_size, seq_len, action_size)`` float32,
            ``(batch_size, seq_len)`` float32 and ``(batch_size, seq_len)``
            float32 (1.0 only at the last step, when it ended the episode).

        Raises:
            NotEnoughDataError: no episode holds ``seq_len + 1`` steps yet (or
                ever can: ``seq_len >= size``).
            ValueError / TypeError: a bad ``seq_len``.
            BufferClosedError: the buffer was closed in this process.

        Example:
            >>> obs, act, rew, term = rb.sample_sequence(seq_len=10)
            >>> obs.shape, act.shape   # (64, 11, 3, 64, 64), (64, 10, 6)
        """
        self._check_open()
        length = check_window("seq_len", self.seq_len if seq_len is None else seq_len,
                              self.size, 1)
        batch_size = check_int("batch_size", self.batch_size, 1)
        try:
            batch = self.buffer.sample_sequences(batch_size, length + 1, time_major=False,
                                                 tail=1, select=self._select)
        except NotEnoughDataError as exc:
            raise NotEnoughDataError(
                f"sample_sequence(seq_len={length}) needs {length + 1} consecutive steps of "
                f"one episode ({length} actions and the frame after them): {exc}") from None
        first = slice(0, length)
        obs, ended = batch["obs"], batch["done"][:, length - 1]
        obs[ended, length] = obs[ended, length - 1]  # the frame after a terminal was never stored
        return (obs, np.ascontiguousarray(batch["action"][:, first]),
                np.ascontiguousarray(batch["reward"][:, first]),
                batch["done"][:, first].astype(np.float32))

    def prefetch(self, seq_len: int | None = None, depth: int = 2, device=None,
                 pin_memory: bool | None = None):
        """``sample_sequence()`` batches made ahead by a background thread, on ``device``.

        Yields ``(obs, act, rew, term)`` of ``sample_sequence()``'s shapes and
        dtypes as tensors, drawn and copied as ``Buffer.prefetch`` does: a
        batch is valid until the next one is taken.

        Example:
            >>> with rb.prefetch(seq_len=10, device="cuda") as batches:
            ...     obs, act, rew, term = next(batches)   # obs (B, 11, C, H, W)
        """
        length = check_window("seq_len", self.seq_len if seq_len is None else seq_len,
                              self.size, 1)
        return _torch_batches.prefetch(self, check_int("batch_size", self.batch_size, 1),
                                       length + 1, _torch_batches.iris, depth, device,
                                       pin_memory, time_major=False, tail=1,
                                       select=self._select)

    def dataset(self, seq_len: int | None = None, batches: int | None = None, seed=None):
        """A torch ``IterableDataset`` of ``sample_sequence()`` batches (``Buffer.dataset``)."""
        length = check_window("seq_len", self.seq_len if seq_len is None else seq_len,
                              self.size, 1)
        return _torch_batches.dataset(self, check_int("batch_size", self.batch_size, 1),
                                      length + 1, _torch_batches.iris, batches, seed,
                                      time_major=False, tail=1, select=self._select)

    def sample_single(self):
        """Draw one stored transition uniformly, the newest included.

        Returns:
            ``(obs, act, rew, term)``: a ``(C, H, W)`` uint8 copy, an
            ``(action_size,)`` float32 copy, and float32 scalars (``term`` 1.0
            on a terminal step).

        Raises:
            NotEnoughDataError: the buffer is empty.
            BufferClosedError: the buffer was closed in this process.

        Example:
            >>> obs, act, rew, term = rb.sample_single()
        """
        self._check_open()
        step = self.buffer.sample_steps(1)
        return (step["obs"][0], step["action"][0], np.float32(step["reward"][0]),
                np.float32(step["done"][0]))

    def __len__(self) -> int:
        """Transitions stored now: at most ``size``, as upstream.

        Eviction frees whole chunks, so once full the count dips by up to a
        chunk (``buffer.chunk_size`` steps) below ``size`` before it refills.
        """
        self._check_open()
        return self.buffer.stats().live_steps

    @property
    def buffer_capacity(self) -> int:
        """Transitions held before the oldest are evicted (``size``)."""
        return self.size


class IRISOnPolicyBuffer:
    """A per-process list buffer for the episode being collected (not shared).

    It is a staging area: fill it with ``add``, copy its steps into an
    ``IRISReplayBuffer``, then ``clear`` it.  Unlike upstream it enforces
    ``max_steps``, copies every array it is given, and keeps the shape and
    dtype of the first step for all later ones, so ``get_arrays`` always
    stacks.

    Args:
        max_steps: the most steps held between two ``clear`` calls.

    Attributes:
        observations, actions, rewards, terminals: lists, one entry per step
            (arrays, arrays, floats, floats 0.0/1.0).

    Example:
        >>> on_policy = IRISOnPolicyBuffer(max_steps=1000)
        >>> on_policy.add(frame, action, 0.0, False)
        >>> obs, act, rew, term = on_policy.get_arrays()
    """

    def __init__(self, max_steps: int = 1000):
        self.max_steps = check_int("max_steps", max_steps, 1)
        self.clear()

    def add(self, obs, action, reward, done) -> None:
        """Append one step (copies of ``obs`` and ``action``).

        Args:
            obs: the frame, an array (numpy or torch).
            action: the action, an array (numpy or torch) or a number.
            reward: a real scalar.
            done: a bool or 0/1.

        Raises:
            OnPolicyBufferFullError: ``max_steps`` steps are held; ``clear()`` first.
            TypeError / ValueError: a value is not of the documented kind, or its
                shape or dtype differs from the first step's; nothing is appended.

        Example:
            >>> on_policy.add(np.zeros((3, 64, 64), np.uint8), np.zeros(6), 1.0, True)
        """
        if len(self.observations) >= self.max_steps:
            raise OnPolicyBufferFullError(
                f"IRISOnPolicyBuffer holds max_steps={self.max_steps} steps already; move them "
                "to the replay buffer and call clear(), or create it with a larger max_steps")
        obs = self._like_first("obs", obs, self.observations)
        action = self._like_first("action", action, self.actions)
        reward = _real("reward", reward)
        done = _flag("done", done)
        self.observations.append(obs)
        self.actions.append(action)
        self.rewards.append(reward)
        self.terminals.append(done)

    @staticmethod
    def _like_first(arg: str, value, held: list) -> np.ndarray:
        arr = np.array(host_array(value))
        if arr.dtype.kind not in "biuf":
            raise TypeError(f"add({arg}=...): expected numbers, got dtype {arr.dtype}")
        if held and (arr.shape != held[0].shape or arr.dtype != held[0].dtype):
            raise ValueError(f"add({arg}=...): expected shape {held[0].shape} and dtype "
                             f"{held[0].dtype} like the first step, got {arr.shape} and "
                             f"{arr.dtype}")
        return arr

    def clear(self) -> None:
        """Drop every step (new lists: lists taken from the attributes earlier stay intact).

        Example:
            >>> on_policy.clear(); len(on_policy)   # 0
        """
        self.observations: list[np.ndarray] = []
        self.actions: list[np.ndarray] = []
        self.rewards: list[float] = []
        self.terminals: list[float] = []

    def get_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The steps stacked: ``(obs (T, ...), act (T, ...), rew (T,), term (T,))``.

        Returns:
            numpy arrays; frames and actions keep the dtype they were added
            with, rewards and terminals are float64 (as upstream).  With no
            steps, each is an empty ``(0,)`` array.

        Example:
            >>> obs, act, rew, term = on_policy.get_arrays()
        """
        return (np.array(self.observations), np.array(self.actions),
                np.array(self.rewards, np.float64), np.array(self.terminals, np.float64))

    def __len__(self) -> int:
        return len(self.observations)

    def __repr__(self) -> str:
        return f"<IRISOnPolicyBuffer {len(self)}/{self.max_steps} steps>"


def _real(arg: str, value) -> float:
    if type(value).__module__.startswith("torch"):
        value = value.item()
    arr = np.asarray(value)
    if arr.shape != () or arr.dtype.kind not in "biuf":
        raise TypeError(f"add({arg}=...): expected a real scalar, got {value!r}")
    return float(arr)


def _flag(arg: str, value) -> float:
    flag = _real(arg, value)
    if flag not in (0.0, 1.0):
        raise ValueError(f"add({arg}=...): expected a bool or 0/1, got {value!r}")
    return flag
