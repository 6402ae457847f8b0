"""DIAMOND's ``SequenceDataset``: a torch map-style Dataset of windows drawn live.

It reads a shared DIAMOND ``ReplayBuffer`` (``diamond.py``; ``shmbuf.diamond``
exports both) and implements torch's Dataset protocol (``__getitem__``, ``__len__``)
without subclassing its ``Dataset``, so that importing it does not import torch.
"""
from __future__ import annotations

import numpy as np

from .._args import check_int
from ..sampling.rng import ProcessRandom
from .diamond import ReplayBuffer, _actions, _frames, _values


class SequenceDataset:
    """A torch map-style Dataset of windows drawn live from a shared ``ReplayBuffer``.

    ``dataset[i]`` is a fresh window, uniform over the valid ones in the
    buffer at that moment; the index only counts draws.  DataLoader workers
    read the live shared buffer (a spawned one attaches by name, a forked one
    shares the mapping), so steps added after the loader started show up.
    Each process draws its own random stream (``shmbuf.sampling.rng``):
    workers never repeat each other or the main process, and with ``seed`` a
    loader repeats itself when torch is seeded.

    Args:
        replay_buffer: the ``ReplayBuffer`` to read.
        sequence_length: steps per item, ``L``.
        burn_in: context steps right before the sequence, in the same episode;
            returned apart, as ``burn_in_obs`` and ``burn_in_actions``.
        epoch_length: ``len(dataset)``; default None: the number of steps the
            buffer holds at the time of the call (a ``DataLoader`` asks once per
            epoch, so epochs grow with the buffer).  ``shuffle=True`` refuses a
            length of 0 when the loader is built: build it once the buffer
            holds steps, or pass ``epoch_length``.
        seed: seed of the draws made in the main process, mixed into the
            workers' seeds.

    Raises:
        TypeError / ValueError: a bad argument, naming it.

    Items are dicts of CPU tensors: ``obs_seq`` (L, C, H, W) float32 in [0, 1];
    ``action_seq`` and its alias ``actions`` (L, action_dim), or (L,) when
    ``action_dim == 1`` as upstream; ``rewards`` (L,) float32 and ``dones``
    (L,) bool; ``next_obs`` (C, H, W), the frame right after
    ``obs_seq[-1]``; ``burn_in_obs`` and ``burn_in_actions`` (burn_in, ...).
    A draw with too little data raises ``NotEnoughDataError``.  Indexing
    never runs out: iterate through a DataLoader or ``range(len(dataset))``.

    Example:
        >>> ds = SequenceDataset(rb, sequence_length=5, burn_in=4)
        >>> loader = torch.utils.data.DataLoader(ds, batch_size=32, num_workers=2)
        >>> next(iter(loader))["obs_seq"].shape   # (32, 5, 3, 64, 64)
    """

    def __init__(self, replay_buffer: ReplayBuffer, sequence_length: int = 5, burn_in: int = 4,
                 *, epoch_length: int | None = None, seed: int | None = None):
        if not isinstance(replay_buffer, ReplayBuffer):
            raise TypeError(f"replay_buffer must be a shmbuf DIAMOND ReplayBuffer, got "
                            f"{type(replay_buffer).__name__}")
        # A window longer than the capacity fails at __getitem__, as upstream's does.
        self._length, self.burn_in = replay_buffer._window(sequence_length, burn_in, fit=False)
        self.replay_buffer = replay_buffer
        self.sequence_length = self._length - self.burn_in
        self.epoch_length = None if epoch_length is None else check_int("epoch_length",
                                                                         epoch_length, 0)
        self.seed = None if seed is None else check_int("seed", seed, 0)
        # One stream per process (shmbuf.sampling.rng): the owner, each DataLoader
        # worker (by id and the loader's seed) and any other child draw their own.
        self._random = ProcessRandom(self.seed, replay_buffer.buffer.port.owner_pid,
                                     replay_buffer.name)  # type: ignore[arg-type]  # open: named

    def __len__(self) -> int:
        return len(self.replay_buffer) if self.epoch_length is None else self.epoch_length

    def __getitem__(self, index: int) -> dict:
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)):
            raise TypeError(f"SequenceDataset indices are ints, got {type(index).__name__}")
        self.replay_buffer._fits(self._length)
        batch = self.replay_buffer.buffer.sample_sequences(
            1, self._length, time_major=False, rng=self._generator(),
            select=self.replay_buffer._select)
        w = {k: v[0] for k, v in batch.items()}
        ctx, seq = np.s_[:self.burn_in], np.s_[self.burn_in:]
        actions = _actions(w["action"][seq], "cpu")
        return {"obs_seq": _frames(w["obs"][seq], "cpu"), "action_seq": actions,
                "actions": actions, "rewards": _values(w["reward"][seq], "cpu"),
                "dones": _values(w["done"][seq], "cpu"),
                "next_obs": _frames(w["next_obs"][-1], "cpu"),
                "burn_in_obs": _frames(w["obs"][ctx], "cpu"),
                "burn_in_actions": _actions(w["action"][ctx], "cpu")}

    def _generator(self) -> np.random.Generator:
        """This process's generator (a DataLoader worker or a forked child gets its own)."""
        return self._random.get()

    def __repr__(self) -> str:
        return (f"<shmbuf.diamond.SequenceDataset of {self.replay_buffer.name!r} "
                f"sequence_length={self.sequence_length} burn_in={self.burn_in}>")
