"""torchwm's DIAMOND ``ReplayBuffer`` and ``SequenceDataset``, on the shared step store.

One step is five core columns: ``obs`` and ``next_obs`` (H, W, C) uint8,
``action`` (action_dim,) of ``action_dtype``, ``reward`` float32 and ``done``
bool (the store's terminal column).

``next_obs`` has a column of its own, which doubles the frame memory (2.5 GB
for 100k 64x64x3 steps instead of 1.2 GB) and is always right.  Deriving it
from the next row of the same stream would save that, but at a terminal step
or a time-limit cut the next row is the next episode's reset frame (the
final frame would need a sparse side table that the fixed-schema store does
not have); the newest step of each stream could not be sampled until its
successor arrived (the bug the Dreamer and IRIS facades fix); and it would
trust every caller's ``next_obs`` to equal its next ``obs``, which frame
skipping and reset wrappers break.  With the column, the frame after a
window is its last step's stored ``next_obs``, terminal or not.

Deliberate differences from upstream (torchwm 0.4.2):
- actions are float32 by default, or ``action_dtype``; upstream stored int64
  and truncated continuous actions.  An integer buffer refuses floats.
- ``burn_in`` means something: that many context steps right before the
  sequence, in the same episode, come back as ``burn_in_obs`` and
  ``burn_in_actions``.  Upstream ignored it.
- sequences never continue past a terminal step or an ``end_episode()`` cut
  (they may end on one), never mix two writers' steps and never splice the
  newest data onto the oldest at the ring's wrap point;
- ``SequenceDataset``'s ``next_obs`` is the frame right after ``obs_seq``
  (upstream's was one frame later still);
- ``state_dict()`` holds only tensors and plain values, so the documented
  ``torch.load(path, weights_only=True)`` works; loading keeps the capacity;
- DataLoader workers read the live shared buffer, new steps included;
- too little data raises ``NotEnoughDataError``; ``seed=`` seeds each handle's
  own generator; inputs are checked before anything is written;
- ``age_weights=`` adds DIAMOND's own episode weighting by age
  (``shmbuf.select.AgeBuckets``), which torchwm's buffer lacks;
- ``position`` is ``steps % capacity``, a counter kept for compatibility (with
  several writer processes there is no single write position), as Dreamer's ``idx``.

Kept from upstream: ``dones`` are bool, and with ``action_dim == 1`` the
action axis is squeezed (``actions`` ``(B,)`` from ``sample``, ``(B, L)``
from ``sample_sequence``, ``(L,)`` in a ``SequenceDataset`` item).

``import shmbuf`` must not import torch: only the methods that build tensors
import it, and ``SequenceDataset`` implements torch's map-style Dataset
protocol (``__getitem__``, ``__len__``) without subclassing its ``Dataset``;
it lives in ``_diamond_dataset``, and ``shmbuf.diamond`` exports both.
"""
from __future__ import annotations

import numpy as np

from .._args import check_int
from .._errors import NotEnoughDataError
from ._base import Facade, register
from ._transitions import age_buckets, check_shape

_ACTION_KINDS = "iuf"


def _action_dtype(value) -> np.dtype:
    """``action_dtype`` as a numpy int or float dtype; None means float32."""
    if value is None:
        return np.dtype(np.float32)
    try:
        if type(value).__module__.startswith("torch"):
            import torch

            value = torch.empty((), dtype=value).numpy().dtype
        dtype = np.dtype(value)
    except (TypeError, RuntimeError):
        raise TypeError(f"action_dtype must be a numpy or torch dtype, got {value!r}") from None
    if dtype.kind not in _ACTION_KINDS:
        raise TypeError(f"action_dtype must be an integer or float dtype, got {dtype}")
    return dtype


def _device_name(value) -> str:
    import torch

    try:
        return str(torch.device(value))
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device must name a torch device such as 'cpu' or 'cuda:0', "
                         f"got {value!r} ({exc})") from None


def _frames(array: np.ndarray, device):
    """uint8 ``(..., H, W, C)`` frames as float32 ``(..., C, H, W)`` in [0, 1] on ``device``."""
    import torch

    if device == "cpu":
        # One single-threaded pass: torch's two, through its thread pool, cost
        # up to 40x more for small items when the cores are oversubscribed.
        chw = np.moveaxis(array, -1, -3)
        out = np.empty(chw.shape, np.float32)
        return torch.from_numpy(np.divide(chw, 255, out=out, dtype=np.float32))
    # Elsewhere, move the uint8 frames (a quarter of the bytes) and convert
    # there.  The divisor is a device tensor: CUDA multiplies by 1/255 for a
    # Python scalar, which is off by an ulp from the CPU's exact x / 255.
    frames = torch.from_numpy(array).to(device).movedim(-1, -3)
    frames = frames.to(torch.float32, memory_format=torch.contiguous_format)
    return frames.div_(torch.full((), 255.0, device=frames.device))


def _values(array: np.ndarray, device):
    import torch

    return torch.from_numpy(np.ascontiguousarray(array)).to(device)


def _actions(array: np.ndarray, device):
    """``(..., action_dim)`` actions as a tensor; upstream squeezes ``action_dim == 1`` away."""
    return _values(array[..., 0] if array.shape[-1] == 1 else array, device)


@register
class ReplayBuffer(Facade):
    """DIAMOND's replay buffer in shared memory: HWC uint8 transitions with ``next_obs``.

    Any process may ``add`` (each process's steps form their own stream); the
    trainer samples tensors on ``device``.  Pickling sends a handle: the
    receiving process attaches to the same live memory.

    Args:
        capacity: steps held before the oldest are evicted (FIFO, a chunk at a time).
        obs_shape: ``(H, W, C)`` of the uint8 frames that ``add`` takes.
        action_dim: length of the action vector.
        device: torch device of what ``sample`` and ``sample_sequence`` return.
        action_dtype: dtype of the stored actions: None (float32, which holds
            discrete action indices exactly too) or any numpy/torch integer or
            float dtype.
        age_weights: None (default: sequences uniform over every valid
            window, as upstream), or DIAMOND's episode weighting by age, e.g.
            ``(0.1, 0.1, 0.1, 0.7)``: ``sample_sequence`` and
            ``SequenceDataset`` items then draw with
            ``shmbuf.select.AgeBuckets(age_weights)`` (the finished episodes
            of at least ``burn_in + sequence_length`` steps, oldest first, in
            equal groups; a group by weight, then an episode and a start
            uniformly).  ``sample`` (single transitions) stays uniform.
        seed: seed of this handle's own ``np.random.Generator``.
        name: shared-memory name (generated if None).
        compress: keep the frames (``obs`` and ``next_obs``) of cold chunks compressed in
            shared memory: True (``shmbuf.Compress``'s defaults) or a
            ``shmbuf.Compress``; None: raw.

    Raises:
        TypeError / ValueError: a bad argument, naming it; nothing is created.
        SegmentExistsError: ``name`` is taken.

    Example:
        >>> rb = ReplayBuffer(capacity=100_000, obs_shape=(64, 64, 3), action_dim=4)
        >>> rb.add(obs, action, reward, done, next_obs)    # HWC uint8 frames
        >>> rb.sample(32)["obs"].shape                      # (32, 3, 64, 64) float32
    """

    FACADE = "torchwm.diamond.ReplayBuffer"

    def __init__(self, capacity: int = 1000, obs_shape: tuple = (64, 64, 3),
                 action_dim: int = 1, device="cpu", *, action_dtype=None, age_weights=None,
                 seed=None, name: str | None = None, compress=None):
        shape = check_shape("obs_shape", obs_shape)
        if len(shape) != 3:
            raise ValueError(f"obs_shape must be (H, W, C), got {tuple(obs_shape)}")
        params = {"obs_shape": shape, "action_dim": check_int("action_dim", action_dim, 1),
                  "action_dtype": _action_dtype(action_dtype).str,
                  "device": _device_name(device), "age_weights": age_buckets(age_weights)[0]}
        frame = (tuple(shape), np.uint8)
        spec = {"obs": frame, "action": ((params["action_dim"],), params["action_dtype"]),
                "reward": ((), np.float32), "done": ((), np.bool_), "next_obs": frame}
        self._create(spec, capacity, params, name=name, seed=seed, compress=compress,
                     frames=("obs", "next_obs"))

    def _setup(self, params: dict) -> None:
        self.obs_shape = tuple(params["obs_shape"])
        self.action_dim = params["action_dim"]
        self.action_dtype = np.dtype(params["action_dtype"])
        self._device = params["device"]
        self._select = age_buckets(params.get("age_weights"))[1]
        self.age_weights = None if self._select is None else self._select.weights

    @classmethod
    def attach(cls, name: str, *, seed=None, device=None, own: bool = False,
               handle_signals=None) -> "ReplayBuffer":
        """Open, from any process, the buffer that another process created as ``name``.

        Args:
            name: the creator's ``rb.name``.
            seed: seed of this handle's own generator.
            device: where this handle's samples go; default the creator's device.
            own: take over a buffer whose creator died (``Facade.attach``).
            handle_signals: as in ``Facade.attach``.

        Raises:
            SegmentNotFoundError: no such segment.
            CorruptSegmentError: the segment was not made by this class.

        Example:
            >>> rb = ReplayBuffer.attach("shmbuf-1a2b3c4d5e6f", device="cpu")
        """
        device = None if device is None else _device_name(device)
        self = super().attach(name, seed=seed, own=own, handle_signals=handle_signals)
        if device is not None:
            self._device = device
        return self

    # -- identity and counters ----------------------------------------------------
    @property
    def capacity(self) -> int:
        """Steps held before the oldest are evicted."""
        return self.buffer.capacity

    @property
    def size(self) -> int:
        """Transitions stored now (upstream's ``size``), by every process together."""
        return len(self)

    @property
    def position(self) -> int:
        """``steps % capacity``: where upstream's single ring would write next.

        With several writer processes each fills its own chunk of rows, so
        this is a counter kept for compatibility (like Dreamer's ``idx``),
        not a row index.
        """
        self._check_open()
        return self.buffer.stats().steps_written % self.capacity

    @property
    def device(self):
        """The ``torch.device`` that samples go to; assignable."""
        import torch

        return torch.device(self._device)

    @device.setter
    def device(self, value) -> None:
        self._device = _device_name(value)

    # -- writing ------------------------------------------------------------------
    def add(self, obs, action, reward, done, next_obs) -> None:
        """Append one transition from this process.

        Args:
            obs: ``(H, W, C)`` uint8 frame (numpy or torch) the action was taken in.
            action: ``(action_dim,)`` values; a scalar is fine when ``action_dim == 1``.
            reward: a scalar.
            done: True / 1.0 if the episode ended with this step; no sampled
                sequence continues past it.
            next_obs: ``(H, W, C)`` uint8 frame the step led to.

        Raises:
            ValueError: a value has the wrong shape (a CHW frame, say).
            TypeError: a value would lose information in its column (float
                frames into uint8, floats into an integer action buffer, a
                ``done`` other than 0 or 1).  Messages name the argument, and
                nothing is written when any of these is raised.
            BufferClosedError: the buffer was closed in this process.

        Example:
            >>> rb.add(frame, np.array([0.3, -1.2, 0.0, 1.0]), 1.0, False, next_frame)
        """
        if self.action_dim == 1 and np.ndim(action) == 0:
            action = np.reshape(action, (1,))
        self._get_writer().add(obs=obs, action=action, reward=reward, done=done,
                               next_obs=next_obs)

    def end_episode(self) -> None:
        """Cut this process's stream without a terminal step (a time limit).

        Later steps start a new episode and no sequence spans the cut.  Not in
        upstream, which has no notion of truncation.

        Example:
            >>> if truncated: rb.end_episode()
        """
        self._get_writer().end_episode()

    # -- sampling -----------------------------------------------------------------
    def sample(self, batch_size: int) -> dict:
        """Draw ``batch_size`` transitions uniformly, with replacement, the newest included.

        Returns:
            A dict of tensors on ``device``: ``obs`` and ``next_obs``
            ``(B, C, H, W)`` float32 in [0, 1]; ``actions`` ``(B, action_dim)``
            of ``action_dtype`` (``(B,)`` when ``action_dim == 1``, as
            upstream); ``rewards`` ``(B,)`` float32; ``dones`` ``(B,)`` bool.

        Raises:
            NotEnoughDataError: the buffer is empty.
            TypeError / ValueError: a bad ``batch_size``.
            BufferClosedError: the buffer was closed in this process.

        Example:
            >>> batch = rb.sample(256)
            >>> batch["obs"].shape, batch["next_obs"].shape   # (256, 3, 64, 64) both
        """
        batch = self.buffer.sample_steps(batch_size)
        dev = self._device
        return {"obs": _frames(batch["obs"], dev), "next_obs": _frames(batch["next_obs"], dev),
                "actions": _actions(batch["action"], dev),
                "rewards": _values(batch["reward"], dev), "dones": _values(batch["done"], dev)}

    def sample_sequence(self, batch_size: int, sequence_length: int, burn_in: int = 0) -> dict:
        """Draw ``batch_size`` sequences of consecutive steps, each with ``burn_in`` context.

        A draw is a window of ``burn_in + sequence_length`` consecutive steps
        of one writer's stream and one episode (it may end on the terminal
        step), uniform over every such window (or by ``age_weights``, see the
        constructor).  Its first ``burn_in`` steps
        are the context (to warm up a recurrent state, or to condition on);
        the rest is the sequence.  The first ``burn_in`` steps of an episode
        are therefore never part of a sequence.

        Returns:
            A dict of tensors on ``device``, batch-major: ``obs`` and
            ``next_obs`` ``(B, L, C, H, W)`` float32 in [0, 1], where
            ``next_obs[:, t]`` is the frame after ``obs[:, t]`` (so
            ``next_obs[:, -1]`` is the frame after the sequence); ``actions``
            ``(B, L, action_dim)`` (``(B, L)`` when ``action_dim == 1``);
            ``rewards`` ``(B, L)`` float32; ``dones`` ``(B, L)`` bool;
            ``burn_in_obs`` ``(B, burn_in, C, H, W)`` and ``burn_in_actions``
            shaped like ``actions`` with ``burn_in`` steps, empty along time
            when ``burn_in == 0``.

        Raises:
            NotEnoughDataError: no episode holds ``burn_in + sequence_length`` steps
                yet (or ever can: more than the capacity).
            TypeError / ValueError: a bad argument, naming it.
            BufferClosedError: the buffer was closed in this process.

        Example:
            >>> seq = rb.sample_sequence(16, 5, burn_in=4)
            >>> seq["obs"].shape, seq["burn_in_obs"].shape   # (16, 5, 3, 64, 64), (16, 4, ...)
        """
        length, burn_in = self._window(sequence_length, burn_in)
        batch = self.buffer.sample_sequences(batch_size, length, time_major=False,
                                             select=self._select)
        dev, ctx, seq = self._device, np.s_[:, :burn_in], np.s_[:, burn_in:]
        return {"obs": _frames(batch["obs"][seq], dev),
                "next_obs": _frames(batch["next_obs"][seq], dev),
                "actions": _actions(batch["action"][seq], dev),
                "rewards": _values(batch["reward"][seq], dev),
                "dones": _values(batch["done"][seq], dev),
                "burn_in_obs": _frames(batch["obs"][ctx], dev),
                "burn_in_actions": _actions(batch["action"][ctx], dev)}

    def _window(self, sequence_length, burn_in, fit: bool = True) -> tuple[int, int]:
        """(window length, burn_in); with ``fit``, NotEnoughDataError unless the capacity
        can ever hold it (SequenceDataset checks that at ``__getitem__``, as upstream fails
        only there)."""
        sequence_length = check_int("sequence_length", sequence_length, 1)
        burn_in = check_int("burn_in", burn_in, 0)
        if fit:
            self._fits(burn_in + sequence_length)
        return burn_in + sequence_length, burn_in

    def _fits(self, length: int) -> None:
        if length > self.capacity:
            raise NotEnoughDataError(
                f"burn_in + sequence_length = {length} consecutive steps of one episode "
                f"are more than this buffer's capacity {self.capacity} can ever hold")

    # -- counts -------------------------------------------------------------------
    def __len__(self) -> int:
        """Steps held now, by every process's writers together."""
        return self.buffer.stats().live_steps

    def is_ready(self, n: int) -> bool:
        """True once the buffer holds at least ``n`` steps.

        A sequence also needs an episode of ``burn_in + sequence_length``
        steps; ``sample_sequence`` raises ``NotEnoughDataError`` until one exists.

        Example:
            >>> if rb.is_ready(1_000): batch = rb.sample(64)
        """
        return len(self) >= check_int("n", n, 0)

    # -- lifecycle and checkpoints ----------------------------------------------------
    def load_state_dict(self, state: dict) -> None:
        """Replace the contents with a ``state_dict()``, keeping this buffer's capacity.

        This process's own stream is closed first, so its open chunk is
        cleared too and later ``add`` calls start a new stream; the open
        chunks of other live writer processes are kept.  A checkpoint larger
        than the capacity keeps its newest steps.

        Raises:
            ValueError: the checkpoint was made by another class, or for
                another ``obs_shape``, ``action_dim`` or ``action_dtype``;
                nothing is restored.

        Example:
            >>> rb.load_state_dict(torch.load("buffer.pt", weights_only=True))
        """
        super().load_state_dict(state)

    def __repr__(self) -> str:
        shape = "x".join(map(str, self.obs_shape))
        return f"<shmbuf.diamond.ReplayBuffer {self.name!r} {shape} on {self._device}>"

