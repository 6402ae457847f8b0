"""Dreamer's and IRIS's prefetch and dataset give their sample shapes as tensors, from the
same random stream as their numpy samplers."""
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import shmbuf
from shmbuf.compat.dreamer import ReplayBuffer
from shmbuf.compat.iris import IRISReplayBuffer

OBS = (3, 8, 8)


def _fill(rb, n=400, episode=23):
    rng = np.random.default_rng(0)
    for t in range(n):
        rb.add({"image": rng.integers(0, 256, OBS, dtype=np.uint8)} if isinstance(
            rb, ReplayBuffer) else rng.integers(0, 256, OBS, dtype=np.uint8),
            rng.standard_normal(4).astype(np.float32), float(t), float(t % episode == episode - 1))


def _same(tensors, arrays):
    assert len(tensors) == len(arrays) == 4
    for t, a in zip(tensors, arrays):
        assert isinstance(t, torch.Tensor) and t.shape == a.shape
        assert t.numpy().dtype == a.dtype and np.array_equal(t.numpy(), a)


def test_dreamer_prefetch_and_dataset_match_sample():
    with ReplayBuffer(1000, OBS, 4, seq_len=6, batch_size=5, seed=3) as rb:
        _fill(rb)
        with ReplayBuffer.attach(rb.name, seed=3) as twin:   # a fresh stream from seed 3
            with rb.prefetch(device="cpu") as batches:
                _same(next(batches), twin.sample())
        with ReplayBuffer.attach(rb.name, seed=4) as twin:
            _same(next(iter(rb.dataset(seed=4, batches=1))), twin.sample())


def test_iris_prefetch_and_dataset_match_sample_sequence():
    with IRISReplayBuffer(1000, OBS, 4, seq_len=5, batch_size=6, seed=8) as rb:
        _fill(rb)
        with IRISReplayBuffer.attach(rb.name, seed=8) as twin:
            with rb.prefetch(device="cpu", depth=1) as batches:
                got = next(batches)
                assert got[0].shape == (6, 6) + OBS and got[1].shape == (6, 5, 4)
                _same(got, twin.sample_sequence())
        with IRISReplayBuffer.attach(rb.name, seed=2) as twin:
            _same(next(iter(rb.dataset(seq_len=3, seed=2, batches=1))),
                  twin.sample_sequence(seq_len=3))


@pytest.mark.slow
def test_facade_dataset_under_spawned_workers():
    with ReplayBuffer(1000, OBS, 4, seq_len=6, batch_size=5) as rb:
        _fill(rb)
        loader = DataLoader(rb.dataset(batches=4), batch_size=None, num_workers=2,
                            multiprocessing_context="spawn", timeout=60)
        got = list(loader)
    assert len(got) == 4
    for obs, _act, _rew, term in got:
        assert obs.shape == (6, 5) + OBS and term.dtype == torch.float32


def test_bad_arguments_and_closed():
    with ReplayBuffer(1000, OBS, 4, seq_len=6, batch_size=5) as rb:
        _fill(rb, 100)
        with pytest.raises(ValueError, match="depth"):
            rb.prefetch(depth=0, device="cpu")
        with pytest.raises(ValueError, match="torch device"):
            rb.prefetch(device="nowhere")
    with pytest.raises(shmbuf.BufferClosedError):
        rb.prefetch(device="cpu")
    with pytest.raises(shmbuf.BufferClosedError):
        rb.dataset()
