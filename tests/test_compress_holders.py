"""Whose chunk is it: a chunk word names its compressor by pid, and the chunk's stamp adds
that compressor's start time, so a pid reused by an unrelated process does not keep the
chunk from being compressed, nor a writer from recycling it.

The word and stamp a dead holder leaves are written with the protocol's own stores; the pid
they name belongs to a live child, standing in for the process that got the dead one's pid.
"""
import multiprocessing as mp

import numpy as np
import pytest
from helpers.atari import FRAME, play
from helpers.procs import running

import shmbuf
from shmbuf.posix.procs import stamp_of, start_time
from shmbuf.protocol.packing import BUSY, PACKED, pack_word, unpack_word

pytest.importorskip("zstandard")
TIMEOUT = 60


@pytest.fixture(scope="module")
def frames():
    return play("Breakout", 256, 5)


@pytest.fixture
def live_pid():
    """The pid of a live child that takes no part in the buffer."""
    from helpers import compress_workers as cw
    ctx = mp.get_context("spawn")
    release = ctx.Event()
    p = ctx.Process(target=cw.wait_for, args=(release,))
    with running([p], TIMEOUT):
        try:
            yield p.pid
        finally:
            release.set()


def _held(frames, pid, stamp):
    """A buffer of 8 cold chunks whose chunk 2 a compressor ``pid`` holds (``BUSY``)."""
    spec = {"obs": (FRAME, np.uint8), "idx": ((), np.int64), "done": ((), np.bool_)}
    buf = shmbuf.create(spec, 128, chunk_size=16, compress=shmbuf.Compress("obs", hot_steps=0))
    try:
        buf._packer.stop()
        with buf.writer() as w:
            for j in range(128):
                w.add(obs=frames[j], idx=j, done=j % 40 == 39)
        words = buf.port.packing
        seq = buf._ring.chunk_state(2)[0]
        assert words.take(2, words.word(2), pack_word(seq, BUSY, 0, pid))
        atomic_store(words, 2, stamp)
    except BaseException:
        buf.close()
        raise
    return buf


def atomic_store(words, chunk, stamp):
    from shmbuf.protocol import _atomic
    _atomic.store_release(words.mm, words.plan.stamps_offset + chunk * 8, stamp)


@pytest.mark.parametrize("reused", [True, False])
def test_a_holder_whose_pid_was_reused_is_adopted(frames, live_pid, reused):
    start = start_time(live_pid)
    assert start is not None
    stamp = stamp_of(live_pid, start + 1 if reused else start)
    buf = _held(frames, live_pid, stamp)
    try:
        packed = buf._packer.round(limit=8, timeout=TIMEOUT)
        _, phase, _, pid = unpack_word(buf.port.packing.word(2))
        if reused:      # the stamp says the holder is not the process with that pid now
            assert packed == 8 and phase == PACKED and pid == 0
        else:           # a live holder: its chunk is left alone
            assert packed == 7 and (phase, pid) == (BUSY, live_pid)
        batch = buf.snapshot()["columns"]
        assert np.array_equal(batch["obs"], frames[batch["idx"]])
    finally:
        buf.close()


@pytest.mark.parametrize("reused", [True, False])
def test_a_writer_recycles_a_chunk_whose_holder_pid_was_reused(frames, live_pid, reused):
    start = start_time(live_pid)
    buf = _held(frames, live_pid, stamp_of(live_pid, start + 1 if reused else start))
    try:
        with buf.writer() as w:     # the ring is full: these go round into chunks 0, 1, 2
            for j in range(128, 128 + 48):
                w.add(obs=frames[j % len(frames)], idx=j % len(frames), done=False)
        idx = buf.snapshot()["columns"]["idx"]
        old = set(idx.tolist())
        # Reused pid: chunk 2 is recycled in turn.  Live holder: the writer leaves it and
        # takes chunk 3 instead, so chunk 2's rows (32..47) are still there.
        assert (set(range(32, 48)) <= old) is (not reused)
        _, phase, _, pid = unpack_word(buf.port.packing.word(2))
        assert (pid == live_pid) is (not reused)
    finally:
        buf.close()
