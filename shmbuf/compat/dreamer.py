"""torchwm's Dreamer ``ReplayBuffer``, on the shared step store.

The documented API, shapes and dtypes are kept; what differs from upstream
(torchwm 0.4.2 ``world_models/memory/dreamer_memory.py``) is on purpose:

- windows never continue past a terminal step (they may end on one), and
  never mix the steps of two writer processes; upstream ignored terminals;
- the newest transition can be sampled (upstream never drew it, nor the
  last slot once full);
- too little data raises ``NotEnoughDataError`` (upstream returned
  uninitialised memory), and ``sample()`` always returns (upstream looped
  forever once full with ``seq_len < size <= 2 * seq_len - 1``);
- every process may ``add``; pickling sends a handle; ``seed=`` seeds the
  buffer's own generator; ``state_dict()`` / ``load_state_dict()`` exist;
- inputs are validated before anything is written (a float frame is not
  silently truncated into uint8);
- like upstream's ``np.empty``, memory is taken as the buffer fills, and a
  ``size`` beyond the size of /dev/shm is accepted (``overcommit=True``): a
  full /dev/shm is a ``SharedMemoryFullError`` at ``add``.
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from .._args import check_int
from .._errors import NotEnoughDataError
from ..writing.ratelimit import RateLimit
from . import _torch_batches
from ._base import register
from ._transitions import TransitionFacade, check_window, transition_params, transition_spec


@register
class ReplayBuffer(TransitionFacade):
    """Dreamer's replay buffer in shared memory: a ring of transitions, sampled as sequences.

    Args:
        size: transitions held before the oldest are evicted (FIFO).
        obs_shape: ``(C, H, W)`` of the uint8 ``obs["image"]``.
        action_size: length of the float32 action vector.
        seq_len: steps per sampled sequence, >= 1.  As upstream, a ``seq_len``
            larger than ``size`` is accepted here; ``sample()`` then raises
            ``NotEnoughDataError``.
        batch_size: sequences per ``sample()``.
        seed: seed of this handle's own ``np.random.Generator``.
        name: shared-memory name (generated if None); ``ReplayBuffer.attach(name)``
            opens the same buffer in another process.
        train_ratio: hold DreamerV3's train ratio (replayed steps per added
            step) across every process that adds or samples: a number for
            ``shmbuf.RateLimit(train_ratio, min_steps=seq_len * batch_size)``
            (one batch of steps before the first sample), or a
            ``RateLimit`` for full control.  None (default): no limit.
            ``sample()`` then waits for adds, and ``add`` for samples.
        compress: keep the frames of cold chunks compressed in shared memory:
            True (``shmbuf.Compress("obs")``'s defaults), or a
            ``shmbuf.Compress`` naming the core column ``"obs"``.  None
            (default): raw.  See ``shmbuf.Compress``.

    Raises:
        TypeError / ValueError: a bad argument, naming it; nothing is created.
        SegmentExistsError: ``name`` is taken.

    Example:
        >>> rb = ReplayBuffer(size=100_000, obs_shape=(3, 64, 64), action_size=6)
        >>> rb.add({"image": frame}, action, 0.5, 0.0)
        >>> obs, act, rew, term = rb.sample()   # (50, 50, 3, 64, 64) uint8, ...
    """

    FACADE = "torchwm.dreamer.ReplayBuffer"

    def __init__(self, size: int, obs_shape: tuple, action_size: int, seq_len: int = 50,
                 batch_size: int = 50, *, seed=None, name: str | None = None,
                 train_ratio=None, compress=None):
        params = transition_params(size, obs_shape, action_size, seq_len, batch_size, frames=0)
        limit = train_ratio
        if train_ratio is not None and not isinstance(train_ratio, RateLimit):
            limit = RateLimit(train_ratio, min_steps=params["seq_len"] * params["batch_size"])
        # Upstream's np.empty takes memory only as it is written, so torchwm
        # sizes it from 80% of the RAM: pages here are reserved as they fill too.
        self._create(transition_spec(params["obs_shape"], params["action_size"]),
                     params["size"], params, name=name, seed=seed, rate_limit=limit,
                     overcommit=True, compress=compress)

    def add(self, obs: Mapping, action, reward, done) -> None:
        """Append one transition from this process.

        Several processes may add to the same buffer at once; each process's
        steps form their own stream, and no sampled sequence mixes streams.
        Nothing is written when any of the errors below is raised.

        Args:
            obs: a dict whose ``"image"`` is a ``(C, H, W)`` uint8 frame (other
                keys are ignored, as upstream).
            action: ``(action_size,)`` floats.
            reward: a scalar.
            done: 1.0 / True if the episode ended with this step, 0.0 / False
                otherwise; no sampled sequence continues past a done step.

        Raises:
            TypeError: ``obs`` has no ``"image"``, or a value would lose
                information in its column (float frames into uint8, a ``done``
                other than 0 or 1); the message names the argument.
            ValueError: a value has the wrong shape.
            BufferClosedError: the buffer was closed in this process.
            WritersStoppedError: ``rb.buffer.stop_writers()`` was called (in any
                process; also while this add waited for the train ratio):
                the adding loop should end.

        Example:
            >>> rb.add({"image": np.zeros((3, 64, 64), np.uint8)}, np.zeros(6), 0.0, 0.0)
        """
        if not isinstance(obs, Mapping) or "image" not in obs:
            raise TypeError(f"add(obs=...): expected a dict with key 'image' holding a "
                            f"{self.obs_shape} uint8 frame, got {type(obs).__name__}")
        self._add(obs["image"], action, reward, done)

    def sample(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Draw ``batch_size`` sequences of ``seq_len`` consecutive transitions, time-major.

        Start steps are uniform over every valid start: a sequence lies in one
        writer's stream, within one episode (it may end on the terminal step),
        and only ever holds live, fully written steps, the newest included.

        Returns:
            ``(obs, act, rew, term)``: fresh numpy arrays of shapes
            ``(seq_len, batch_size, C, H, W)`` uint8,
            ``(seq_len, batch_size, action_size)`` float32,
            ``(seq_len, batch_size)`` float32 and ``(seq_len, batch_size)``
            float32 (1.0 on a terminal step, which can only be the last one).

        Raises:
            NotEnoughDataError: no episode holds ``seq_len`` steps yet (or
                ever can: ``seq_len > size``).
            ValueError / TypeError: ``seq_len`` or ``batch_size`` was set to a
                bad value.
            BufferClosedError: the buffer was closed in this process.

        Example:
            >>> obs, act, rew, term = rb.sample()
            >>> obs.shape   # (50, 50, 3, 64, 64)
        """
        self._check_open()
        length = check_window("seq_len", self.seq_len, self.size, 0)
        batch_size = check_int("batch_size", self.batch_size, 1)
        try:
            batch = self.buffer.sample_sequences(batch_size, length, time_major=True)
        except NotEnoughDataError as exc:
            raise NotEnoughDataError(f"sample() needs seq_len={length} consecutive steps of one "
                                     f"episode: {exc}") from None
        return batch["obs"], batch["action"], batch["reward"], batch["done"].astype(np.float32)

    def prefetch(self, depth: int = 2, device=None, pin_memory: bool | None = None):
        """``sample()`` batches made ahead by a background thread, as tensors on ``device``.

        Yields ``(obs, act, rew, term)`` of ``sample()``'s shapes and dtypes
        (``term`` float32), drawn and copied as ``Buffer.prefetch`` does: a
        batch is valid until the next one is taken.

        Example:
            >>> with rb.prefetch(device="cuda") as batches:
            ...     obs, act, rew, term = next(batches)
        """
        length = check_window("seq_len", self.seq_len, self.size, 0)
        return _torch_batches.prefetch(self, check_int("batch_size", self.batch_size, 1), length,
                                       _torch_batches.dreamer, depth, device, pin_memory)

    def dataset(self, batches: int | None = None, seed=None):
        """A torch ``IterableDataset`` of ``sample()`` batches as tensors (``Buffer.dataset``).

        Example:
            >>> loader = DataLoader(rb.dataset(), batch_size=None, num_workers=2)
        """
        length = check_window("seq_len", self.seq_len, self.size, 0)
        return _torch_batches.dataset(self, check_int("batch_size", self.batch_size, 1), length,
                                      _torch_batches.dreamer, batches, seed)
