"""torchwm's Dreamer ``ReplayBuffer`` with one shard per node.

The same constructor, ``add`` and ``sample()`` shapes as
``shmbuf.ReplayBuffer`` (see ``shmbuf.compat.dreamer``), except that ``size``
is per shard and ``sample()`` draws across all shards.  Each process that
calls ``add`` gets its own writer (shared memory on a node with a shard).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from shmbuf.compat._transitions import check_window, transition_params, transition_spec

if TYPE_CHECKING:
    from shmbuf.ray._writers import LocalWriter, ShippingWriter


class ReplayBuffer:
    """Dreamer's replay buffer over ``shmbuf.ray`` shards.

    Args:
        size: transitions held per shard.
        obs_shape: as ``shmbuf.ReplayBuffer``.
        action_size: as ``shmbuf.ReplayBuffer``.
        seq_len: as ``shmbuf.ReplayBuffer``.
        batch_size: as ``shmbuf.ReplayBuffer``.
        seed: seed of the sampler's generator.
        **create_kwargs: ``name``, ``namespace``, ``nodes``, ... of ``shmbuf.ray.create``.

    Example:
        >>> rb = shmbuf.ray.ReplayBuffer(100_000, (3, 64, 64), 6, name="dreamer-1")
        >>> rb.add({"image": frame}, action, 0.5, 0.0)      # in any Ray task or actor
        >>> obs, act, rew, term = rb.sample()               # (50, 50, 3, 64, 64) uint8, ...
    """

    def __init__(self, size: int, obs_shape: tuple, action_size: int, seq_len: int = 50,
                 batch_size: int = 50, *, seed=None, **create_kwargs):
        from shmbuf.ray._open import create

        p = transition_params(size, obs_shape, action_size, seq_len, batch_size, frames=0)
        self.size, self.seq_len, self.batch_size = p["size"], p["seq_len"], p["batch_size"]
        self.obs_shape, self.action_size = tuple(p["obs_shape"]), p["action_size"]
        self.sharded = create(transition_spec(self.obs_shape, self.action_size), self.size,
                              seed=seed, **create_kwargs)
        self._writer: LocalWriter | ShippingWriter | None = None

    @classmethod
    def _wrap(cls, sharded, seq_len: int, batch_size: int) -> "ReplayBuffer":
        self = cls.__new__(cls)
        self.sharded, self.seq_len, self.batch_size = sharded, seq_len, batch_size
        self.size = sharded.capacity_per_shard
        self.obs_shape = tuple(sharded.spec["obs"][0])
        self.action_size = sharded.spec["action"][0][0]
        self._writer = None
        return self

    def add(self, obs: Mapping, action, reward, done) -> None:
        """Append one transition from this process (see ``shmbuf.ReplayBuffer.add``)."""
        if not isinstance(obs, Mapping) or "image" not in obs:
            raise TypeError(f"add(obs=...): expected a dict with key 'image' holding a "
                            f"{self.obs_shape} uint8 frame, got {type(obs).__name__}")
        if self._writer is None:
            self._writer = self.sharded.writer()
        self._writer.add(obs=obs["image"], action=action, reward=reward, done=done)

    def flush(self) -> None:
        """Make this process's shipped steps visible (a no-op on a node with a shard)."""
        if self._writer is not None:
            self._writer.flush()

    def sample(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(obs, act, rew, term)``, time-major, drawn across all shards."""
        check_window("seq_len", self.seq_len, self.size, 0)  # deferred from the constructor
        b = self.sharded.sample_sequences(self.batch_size, self.seq_len)
        return b["obs"], b["action"], b["reward"], b["done"].astype(np.float32)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        self.sharded.close()

    def __reduce__(self):
        return ReplayBuffer._wrap, (self.sharded, self.seq_len, self.batch_size)
