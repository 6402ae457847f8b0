"""``SliceSampler`` and ``PrioritizedSliceSampler`` drawn by shmbuf's window finder.

On a ``LazyShmStorage`` written by ``ShmWriter``, a batch is one
``Buffer.sample_sequences`` call: its windows lie in one stream and never
continue past a trajectory's end, rows recycled while they were copied are
redrawn, and the batch is handed to the replay buffer's ``storage.get``
without a second gather.  The layout is TorchRL's: flat, ``num_slices``
slices of ``slice_len`` steps, each contiguous, with the truncation marks
TorchRL's ``SliceSampler`` writes.

On any other storage (or one filled by TorchRL's writers) ``SliceSampler``
is TorchRL's own.  ``PrioritizedSliceSampler`` keeps its priorities in the
shmbuf buffer, where every process's ``update_priority`` lands; it needs
``ShmWriter`` data and never loads TorchRL's C++ extension.
"""
from __future__ import annotations

import numpy as np
import torch
from tensordict import is_tensor_collection
from torchrl._utils import _replace_last
from torchrl.data.replay_buffers.samplers import SliceSampler as _TorchRLSliceSampler

from ... import select
from . import _schema
from ._control import MODE, STREAMS
from ._storage import LazyShmStorage


def _streams(storage) -> bool:
    return isinstance(storage, LazyShmStorage) and storage._ctl[MODE] == STREAMS


class SliceSampler(_TorchRLSliceSampler):
    """TorchRL's ``SliceSampler``, with shmbuf's window finder on ``ShmWriter`` data.

    Same constructor as ``torchrl.data.SliceSampler``.  On a
    ``LazyShmStorage`` filled by ``ShmWriter``, trajectories are the
    writer's (its ``end_key`` / ``traj_key``, and each process's stream),
    so ``end_key``/``traj_key`` here are not read; every slice has
    ``slice_len`` steps (``strict_length=False`` and ``span`` do not make
    shorter ones), and ``cache_values``, ``compile`` and ``use_gpu`` have
    nothing to speed up.

    Raises:
        NotEnoughDataError: no trajectory holds a whole slice yet.

    Example:
        >>> rb = TensorDictReplayBuffer(storage=LazyShmStorage(100_000), writer=ShmWriter(),
        ...                             sampler=SliceSampler(slice_len=50), batch_size=2500)
        >>> rb.sample()["obs"].shape   # (2500, ...): 50 slices of 50 steps
    """

    _select: select.Selector | None = None   # a shmbuf.select regime; None: uniform

    def sample(self, storage, batch_size: int):
        if not _streams(storage):
            return super().sample(storage, batch_size)
        if self._batch_size_multiplier is not None:
            batch_size = batch_size * self._batch_size_multiplier
        seq_length, num_slices = self._adjusted_batch_size(batch_size)
        return self._draw(storage, num_slices, seq_length)

    def _draw(self, storage: LazyShmStorage, num_slices: int, seq_length: int):
        if storage.ndim != 1:
            raise RuntimeError(f"SliceSampler: a storage written by ShmWriter is sliced along "
                               f"dim 0 with ndim=1; this one has ndim={storage.ndim}")
        self._last_storage = storage
        # An empty() in another process may remove the data under the draw: then it draws
        # from the new generation (and finds it empty, or what was written since).
        return storage._on_data(lambda buf: self._draw_from(storage, buf, num_slices,
                                                            seq_length))

    def _draw_from(self, storage: LazyShmStorage, buf, num_slices: int, seq_length: int):
        batch = buf.sample_sequences(num_slices, seq_length, time_major=False, ids=True,
                                     select=self._select)
        ids = batch.pop("ids")
        n = num_slices * seq_length
        flat = {col: arr.reshape((n,) + arr.shape[2:]) for col, arr in batch.items()}
        data = _schema.build(storage._schema_cache, flat, n)
        index = torch.from_numpy(buf.port.rows_of_ids(ids.reshape(-1)))
        info = self._info(data, num_slices, seq_length)
        info.update(self._weights(buf, ids))
        storage._stash(index, storage._to_device(data))
        return index, info

    def _info(self, data, num_slices: int, seq_length: int) -> dict:
        """TorchRL's truncation and init marks for ``num_slices`` slices of ``seq_length``."""
        n = num_slices * seq_length
        info = {}
        td = is_tensor_collection(data)
        if self.truncated_key is not None:
            truncated = torch.zeros((n, 1), dtype=torch.bool)
            truncated.view(num_slices, -1)[:, -1] = True
            done_key = _replace_last(self.truncated_key, "done")
            terminated_key = _replace_last(self.truncated_key, "terminated")
            done = data.get(done_key, None) if td else None
            terminated = data.get(terminated_key, None) if td else None
            info[self.truncated_key] = truncated
            info[done_key] = truncated.clone() if done is None else done | truncated
            info[terminated_key] = torch.zeros_like(truncated) if terminated is None \
                else terminated
        existing = data.get(self.init_key, None) if td and self.init_key is not None else None
        if existing is not None:
            marker = torch.zeros_like(existing)
            marker[torch.arange(num_slices) * seq_length] = True
            info[self.init_key] = marker | existing
        return info

    def _weights(self, buf, ids) -> dict:
        return {}

    def __getstate__(self):
        state = super().__getstate__()
        state.pop("_last_storage", None)
        return state


class PrioritizedSliceSampler(SliceSampler):
    """TorchRL's ``PrioritizedSliceSampler``, on priorities every process shares.

    Same constructor as ``torchrl.data.PrioritizedSliceSampler``.  A slice
    is drawn in proportion to ``score ** alpha``, its score being the max
    (``reduction="max"``) or mean (``"mean"``) of its steps' priorities;
    ``update_priority`` stores ``|priority| + eps`` for the steps the index
    names, from any process, and every process's next draw uses it.  A step
    never updated counts, at each draw, as having the largest priority set so
    far (1.0 before any), so every new step is likely to be drawn soon; TorchRL
    instead gives a new step the largest priority at the time it is written.
    ``info["priority_weight"]`` holds importance weights
    ``(score / min score) ** -beta`` over the batch (normalised in the batch,
    as no process keeps the sum of every window's score).

    Needs a ``LazyShmStorage`` written by ``ShmWriter``.  ``max_capacity``,
    ``dtype`` and ``max_priority_within_buffer`` are accepted for
    compatibility (the priorities live in the storage).

    Raises:
        ValueError: ``alpha`` or ``beta`` negative, or a ``reduction`` other
            than "max" and "mean".

    Example:
        >>> sampler = PrioritizedSliceSampler(max_capacity=100_000, alpha=0.7, beta=0.5,
        ...                                   slice_len=50)
        >>> data, info = rb.sample(return_info=True)
        >>> rb.update_priority(info["index"], td_error)
    """

    def __init__(self, max_capacity: int, alpha: float, beta: float, eps: float = 1e-8,
                 dtype: torch.dtype = torch.float, reduction: str = "max", *,
                 num_slices: int | None = None, slice_len: int | None = None,
                 end_key=None, end_keys=None, traj_key=None, ends=None, trajectories=None,
                 cache_values: bool = False, truncated_key=("next", "truncated"),
                 init_key="is_init", strict_length: bool = True, compile=False, span=False,
                 max_priority_within_buffer: bool = False):
        super().__init__(num_slices=num_slices, slice_len=slice_len, end_key=end_key,
                         end_keys=end_keys, traj_key=traj_key, ends=ends,
                         trajectories=trajectories, cache_values=cache_values,
                         truncated_key=truncated_key, init_key=init_key,
                         strict_length=strict_length, compile=compile, span=span)
        for arg, value in (("alpha", alpha), ("beta", beta), ("eps", eps)):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0 \
                    or not np.isfinite(value):
                raise ValueError(f"{arg} must be a finite number >= 0, got {value!r}")
        if reduction not in ("max", "mean"):
            raise ValueError(f"reduction must be 'max' or 'mean' (a slice's score from its "
                             f"steps' priorities), got {reduction!r}")
        self.max_capacity, self.dtype = max_capacity, dtype
        self._alpha, self._beta, self._eps = float(alpha), float(beta), float(eps)
        self.reduction = reduction
        self._maxfrac = 1.0 if reduction == "max" else 0.0
        self._select = select.Prioritized(exponent=self._alpha, maxfrac=self._maxfrac)

    @property
    def alpha(self) -> float:
        return self._alpha

    @alpha.setter
    def alpha(self, value: float) -> None:
        self._alpha = float(value)
        self._select = select.Prioritized(exponent=self._alpha, maxfrac=self._maxfrac)

    @property
    def beta(self) -> float:
        return self._beta

    @beta.setter
    def beta(self, value: float) -> None:
        self._beta = float(value)

    def sample(self, storage, batch_size: int):
        if not _streams(storage):
            raise RuntimeError(
                "PrioritizedSliceSampler (shmbuf) samples a LazyShmStorage written by "
                f"ShmWriter; got a {type(storage).__name__} "
                f"{'written by TorchRL writers' if isinstance(storage, LazyShmStorage) else ''}"
                ". Use ReplayBuffer(storage=LazyShmStorage(n), writer=ShmWriter(), ...)")
        return super().sample(storage, batch_size)

    def _weights(self, buf, ids) -> dict:
        prio = buf.priorities_of(ids).astype(np.float64)            # (slices, len)
        prio = np.where(np.isnan(prio), np.nanmax(prio) if np.isfinite(prio).any() else 1.0,
                        prio)
        score = self._maxfrac * prio.max(1) + (1 - self._maxfrac) * prio.mean(1)
        score = np.maximum(score, np.finfo(np.float64).tiny) ** self._alpha
        weight = (score / score.min()) ** -self._beta
        steps = np.repeat(weight, ids.shape[1]).astype(np.float32)
        return {"priority_weight": torch.from_numpy(steps)}

    def update_priority(self, index, priority, *, storage=None) -> None:
        """Set the priorities of the steps at storage ``index`` (rows), for every process.

        Raises:
            ValueError: a priority that is NaN or infinite; nothing is written.
            RuntimeError: no storage to update (sample first, or pass ``storage``).
        """
        storage = storage if storage is not None else getattr(self, "_last_storage", None)
        if storage is None or not _streams(storage):
            raise RuntimeError("update_priority: no LazyShmStorage written by ShmWriter to "
                               "update; sample from it first or pass storage=")
        if isinstance(index, tuple):
            index = index[0]
        rows = torch.as_tensor(index).reshape(-1).cpu().numpy().astype(np.int64)
        given = torch.as_tensor(priority, dtype=torch.float64).detach().cpu()
        given = given.expand(rows.shape) if given.numel() == 1 else given.reshape(rows.shape)
        value = given.abs().numpy() + self._eps
        if not np.isfinite(value).all():
            raise ValueError("priority: every priority must be finite; nothing was written")
        rows = np.ascontiguousarray(rows, np.int64)
        storage._on_data(lambda buf: buf.update_priorities(buf.port.step_ids(rows),
                                                           value.astype(np.float32)))

    def mark_update(self, index, *, storage=None) -> None:
        """New steps take the default priority by themselves."""

    def state_dict(self) -> dict:
        return {"alpha": self._alpha, "beta": self._beta, "eps": self._eps}

    def load_state_dict(self, state_dict: dict) -> None:
        self.alpha = state_dict.get("alpha", self._alpha)
        self._beta = state_dict.get("beta", self._beta)
        self._eps = state_dict.get("eps", self._eps)
