"""Buffer.dataset under a DataLoader: collated batches, worker streams, closing, bad input."""
import pickle

import numpy as np
import pytest
import torch
from helpers.trainer_workers import COUNTER_SPEC, fill_counter
from helpers.workers import SPEC, episode_steps, verify_window
from torch.utils.data import DataLoader

import shmbuf
from shmbuf.sampling.rng import WORKER, stream_seed

TIMEOUT = 60
METHODS = ["fork", "spawn", "forkserver"]


def _filled(make_buffer, n=3000, **kw):
    buf = make_buffer(COUNTER_SPEC, 4000, **kw)
    fill_counter(buf, n)
    return buf


def _loader(ds, method=None, workers=2, **kw):
    if not workers:
        return DataLoader(ds, batch_size=None, **kw)
    return DataLoader(ds, batch_size=None, num_workers=workers, multiprocessing_context=method,
                      timeout=TIMEOUT, **kw)


def test_items_are_collated_time_major_tensor_batches(make_buffer):
    buf = make_buffer(SPEC, 2000)
    with buf.writer() as w:
        for step in episode_steps(0, 1500, 100):
            w.add(**step)
    batches = list(_loader(buf.dataset(6, 10, batches=3), workers=0))
    assert len(batches) == 3
    for b in batches:
        assert set(b) == set(SPEC)
        assert b["obs"].shape == (10, 6, 3, 8, 8) and b["obs"].dtype == torch.uint8
        assert b["action"].shape == (10, 6, 6) and b["done"].dtype == torch.bool
        for i in range(6):
            verify_window(*(b[k][:, i].numpy() for k in ("obs", "action", "reward", "done")))
    flat = next(iter(buf.dataset(6, 10, time_major=False, tail=1)))
    assert flat["obs"].shape == (6, 10, 3, 8, 8)


def test_a_dataset_pickles_to_its_name_and_arguments(make_buffer):
    buf = _filled(make_buffer)
    raw = pickle.dumps(buf.dataset(8, 4))
    assert len(raw) < 2000
    again = pickle.loads(raw)
    assert again.name == buf.name and again._buffer is None
    assert next(iter(again))["x"].shape == (4, 8)
    again._buffer.close()


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_workers_draw_their_documented_streams(make_buffer, method):
    buf = _filled(make_buffer, seed=21)
    ds = buf.dataset(8, 4, batches=6)
    got = [b["x"] for b in _loader(ds, method, generator=torch.Generator().manual_seed(5))]
    assert len(got) == 6 and len({tuple(b.flatten().tolist()) for b in got}) == 6
    base = torch.empty((), dtype=torch.int64).random_(
        generator=torch.Generator().manual_seed(5)).item() & 0xFFFFFFFFFFFFFFFF
    rngs = [np.random.default_rng(stream_seed(21, (WORKER, w, base))) for w in range(2)]
    for j, batch in enumerate(got):   # in-order loader: batch j came from worker j % 2
        want = buf.sample_sequences(8, 4, rng=rngs[j % 2])["x"]
        assert np.array_equal(batch.numpy(), want)


@pytest.mark.slow
def test_unseeded_workers_and_epochs_never_repeat(make_buffer):
    buf = _filled(make_buffer)
    loader = _loader(buf.dataset(8, 4, batches=4), "fork", persistent_workers=True)
    epochs = [[tuple(b["x"].flatten().tolist()) for b in loader] for _ in range(3)]
    assert [len(e) for e in epochs] == [4, 4, 4]
    every = [b for e in epochs for b in e]
    assert len(set(every)) == len(every)


@pytest.mark.slow
def test_closing_the_buffer_ends_the_loader(make_buffer):
    buf = _filled(make_buffer)
    it = iter(_loader(buf.dataset(8, 4), "fork", prefetch_factor=2))
    for _ in range(3):
        next(it)
    buf.close()   # the owner: unlinks, so the workers' next check ends their iteration
    left = sum(1 for _ in it)   # ends (timeout= bounds each wait); at most what was queued
    assert left <= 2 * 2 + 2


def test_closing_ends_a_main_process_iteration(make_buffer):
    buf = _filled(make_buffer)
    it = iter(buf.dataset(8, 4))
    next(it)
    buf.close()
    assert list(it) == []


@pytest.mark.slow
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_worker_of_an_unlinked_buffer_raises_a_clear_error(make_buffer, method):
    buf = _filled(make_buffer)
    ds = buf.dataset(8, 4)
    name = buf.name
    buf.close()
    with pytest.raises(FileNotFoundError, match=f"{name}.*no longer exists"):
        next(iter(_loader(ds, method, workers=1)))


def test_bad_arguments_fail_at_the_door(make_buffer):
    buf = _filled(make_buffer)
    with pytest.raises(TypeError, match="unknown arguments \\['out'\\]"):
        buf.dataset(8, 4, out={})
    with pytest.raises(ValueError, match="batch_size"):
        buf.dataset(0, 4)
    with pytest.raises(ValueError, match="length"):
        buf.dataset(8, 5000)
    with pytest.raises(ValueError, match="uniform"):
        buf.dataset(8, 4, uniform="sometimes")
    with pytest.raises(ValueError, match="batches"):
        buf.dataset(8, 4, batches=0)
    with pytest.raises(TypeError, match="seed"):
        buf.dataset(8, 4, seed=1.5)
    strings = make_buffer({"s": ((), "<U4"), "done": ((), np.bool_)}, 100)
    with pytest.raises(TypeError, match="column 's'"):
        strings.dataset(2, 2)
    buf.close()
    with pytest.raises(shmbuf.BufferClosedError):
        buf.dataset(8, 4)


def test_a_batch_larger_than_the_data_raises_like_sample(make_buffer):
    buf = make_buffer(COUNTER_SPEC, 4000)
    fill_counter(buf, 30, episode_len=10)
    with pytest.raises(shmbuf.NotEnoughDataError):
        next(iter(buf.dataset(4, 20)))


@pytest.mark.slow
def test_a_worker_reuses_the_memory_the_trainer_freed(make_buffer):
    buf = _filled(make_buffer)
    seen, kept = set(), []
    for i, batch in enumerate(_loader(buf.dataset(8, 4, batches=40), "fork", workers=1)):
        seen.add(batch["x"].data_ptr())
        if i % 10 == 0:   # held by the trainer to the end: its region is never reused
            kept.append((batch, batch["x"].clone()))
        del batch
    assert len(seen) <= 4 + len(kept)   # the other regions came back and were reused
    assert all(torch.equal(b["x"], copy) for b, copy in kept)


@pytest.mark.slow
def test_kept_batches_are_never_overwritten(make_buffer):
    """The trainer keeps every batch: the worker runs out of regions and carries on."""
    buf = _filled(make_buffer)
    loader = _loader(buf.dataset(8, 4, batches=12, seed=4), "fork", workers=1,
                     generator=torch.Generator().manual_seed(1))
    kept = list(loader)
    again = list(_loader(buf.dataset(8, 4, batches=12, seed=4), "fork", workers=1,
                         generator=torch.Generator().manual_seed(1)))
    assert len(kept) == 12
    for a, b in zip(kept, again):
        assert torch.equal(a["x"], b["x"])
