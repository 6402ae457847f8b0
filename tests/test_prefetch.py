"""Buffer.prefetch: the same batches as sample_sequences, delivered ahead, never overwritten
while the consumer holds them; errors reach the consumer; close stops the thread."""
import gc

import numpy as np
import pytest
import torch
from helpers.trainer_workers import COUNTER_SPEC, fill_counter
from helpers.workers import SPEC, episode_steps, verify_window

import shmbuf
from shmbuf.posix.wait import poll

TIMEOUT = 60
cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                          reason="no CUDA device on this machine: the CPU path is tested above")


def _filled(make_buffer, n=3000, **kw):
    buf = make_buffer(COUNTER_SPEC, 4000, **kw)
    fill_counter(buf, n)
    return buf


def _wait_for(cond, what):
    poll(lambda: True if cond() else None, TIMEOUT, lambda: AssertionError(f"timed out: {what}"))


def test_batches_are_the_samples_of_the_same_stream(make_buffer):
    buf = _filled(make_buffer)
    with buf.prefetch(8, 5, device="cpu", rng=7) as it:
        got = [next(it)["x"].clone() for _ in range(5)]
    ref = np.random.default_rng(7)
    for batch in got:
        assert np.array_equal(batch.numpy(), buf.sample_sequences(8, 5, rng=ref)["x"])


def test_windows_are_whole_with_any_kwargs(make_buffer):
    buf = make_buffer(SPEC, 2000)
    with buf.writer() as w:
        for step in episode_steps(0, 1500, 100):
            w.add(**step)
    with buf.prefetch(6, 10, device="cpu", time_major=False, depth=3) as it:
        for _, b in zip(range(4), it):
            assert b["obs"].shape == (6, 10, 3, 8, 8) and isinstance(b["obs"], torch.Tensor)
            for i in range(6):
                verify_window(*(b[k][i].numpy() for k in ("obs", "action", "reward", "done")))


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_a_held_batch_is_never_overwritten(make_buffer, depth):
    buf = _filled(make_buffer)
    it = buf.prefetch(16, 8, device="cpu", depth=depth)
    try:
        held = next(it)
        copy = held["x"].clone()
        st = it._state
        # The thread fills every other slot, then must wait for this one.
        _wait_for(lambda: len(st.ready) == depth - 1 and not st.free, "the thread to fill")
        assert torch.equal(held["x"], copy)
        nxt = next(it)             # hands `held` back: it may be refilled from now on
        if depth == 1:
            assert nxt["x"].data_ptr() == held["x"].data_ptr()
        else:
            assert nxt["x"].data_ptr() != held["x"].data_ptr()
    finally:
        it.close()


def test_errors_in_the_thread_reach_the_consumer(make_buffer):
    buf = make_buffer(COUNTER_SPEC, 4000)
    fill_counter(buf, 30, episode_len=10)
    with buf.prefetch(4, 20, device="cpu") as it:
        with pytest.raises(shmbuf.NotEnoughDataError):
            next(it)


def test_close_stops_the_thread_and_ends_the_iteration(make_buffer):
    buf = _filled(make_buffer)
    it = buf.prefetch(8, 4, device="cpu")
    first = next(it)
    it.close()
    assert not it._thread.is_alive() and it.closed
    it.close()  # idempotent
    assert first["x"].shape == (4, 8)   # the batch in hand stays readable
    with pytest.raises(StopIteration):
        next(it)


def test_leaving_the_with_block_joins_and_dropping_stops(make_buffer):
    buf = _filled(make_buffer)
    with buf.prefetch(8, 4, device="cpu") as it:
        next(it)
        thread = it._thread
    assert not thread.is_alive()
    it = buf.prefetch(8, 4, device="cpu")
    thread = it._thread
    del it
    gc.collect()
    thread.join(TIMEOUT)
    assert not thread.is_alive()


def test_closing_the_buffer_under_it_raises_buffer_closed(make_buffer):
    buf = _filled(make_buffer)
    it = buf.prefetch(8, 4, device="cpu", depth=2)
    try:
        next(it)
        buf.close()
        with pytest.raises(shmbuf.BufferClosedError):
            for _ in range(4):   # at most the one batch made before the close
                next(it)
    finally:
        it.close()


def test_bad_arguments_fail_at_the_door(make_buffer):
    buf = _filled(make_buffer)
    with pytest.raises(ValueError, match="depth"):
        buf.prefetch(8, 4, depth=0, device="cpu")
    with pytest.raises(ValueError, match="not a torch device"):
        buf.prefetch(8, 4, device="gpu9")
    with pytest.raises(ValueError, match="'cpu' and 'cuda'"):
        buf.prefetch(8, 4, device="meta")
    with pytest.raises(TypeError, match="pin_memory"):
        buf.prefetch(8, 4, device="cpu", pin_memory="yes")
    with pytest.raises(TypeError, match="unknown arguments"):
        buf.prefetch(8, 4, device="cpu", out={})
    with pytest.raises(ValueError, match="length"):
        buf.prefetch(8, 0, device="cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="cuda.is_available"):
            buf.prefetch(8, 4, device="cuda")
        with pytest.raises(ValueError, match="pin_memory=True needs CUDA"):
            buf.prefetch(8, 4, device="cpu", pin_memory=True)
    buf.close()
    with pytest.raises(shmbuf.BufferClosedError):
        buf.prefetch(8, 4, device="cpu")


@cuda
def test_cuda_batches_are_pinned_copies_in_order(make_buffer):
    buf = _filled(make_buffer)
    with buf.prefetch(8, 5, device="cuda", rng=3, depth=2) as it:
        assert it.pinned and all(t.is_pinned() for t in it._slots[0].host.values())
        got = []
        for _ in range(6):
            batch = next(it)
            assert batch["x"].device.type == "cuda"
            got.append((batch["x"] * 1).cpu())    # a kernel queued on the consumer stream
    ref = np.random.default_rng(3)
    for batch in got:
        assert np.array_equal(batch.numpy(), buf.sample_sequences(8, 5, rng=ref)["x"])


@cuda
def test_cuda_without_pinning(make_buffer):
    buf = _filled(make_buffer)
    with buf.prefetch(8, 5, device="cuda", pin_memory=False) as it:
        assert not it.pinned and next(it)["x"].is_cuda
