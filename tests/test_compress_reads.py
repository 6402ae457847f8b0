"""How a read decodes cold blocks: straight into the batch, through a scratch block, or
gathered; every way must return the raw buffer's bytes, whatever the codec, and a block
that does not decode in a chunk nobody recycled is a corrupt segment, never zeros.

Chunks of 64 rows hold four 16-row blocks, and windows of 40 to 50 rows cover some blocks
whole (decoded into the batch itself), end inside others (decoded once, then sliced) and
overlap (one block feeding several windows).
"""
import os

import numpy as np
import pytest
from helpers.atari import play, spec

import shmbuf

pytest.importorskip("zstandard")
TIMEOUT = 60


@pytest.fixture(scope="module")
def frames():
    return np.concatenate([play("Pong", 300, 3), play("Breakout", 300, 4)])


def _fill(buf, frames, steps):
    with buf.writer() as w:
        for j in range(steps):
            w.add(obs=frames[j % len(frames)], idx=j % len(frames), done=j % 97 == 96)


def _made(frames, comp, capacity=512):
    buf = shmbuf.create(spec(), capacity, chunk_size=64, seed=21, compress=comp)
    try:
        _fill(buf, frames, capacity + 100)
        if comp is not None:
            assert buf.compact(timeout=TIMEOUT) > 0
    except BaseException:
        buf.close()
        raise
    return buf


@pytest.fixture(scope="module")
def raw(frames):
    buf = _made(frames, None)
    yield buf
    buf.close()


@pytest.mark.parametrize("codec", ["zstd", "lz4"])
def test_every_layout_of_a_cold_batch_is_bit_identical(raw, frames, codec):
    if codec == "lz4":
        pytest.importorskip("lz4")
    packed = _made(frames, shmbuf.Compress("obs", codec=codec, hot_steps=0))
    try:
        c = packed.stats().compression
        assert c.raw_chunks == 0 and c.compressed_chunks == 512 // 64
        for length, batch in ((50, 40), (40, 64), (16, 8), (1, 33)):
            for time_major in (False, True):
                a = raw.sample_sequences(batch, length, rng=length, time_major=time_major)
                b = packed.sample_sequences(batch, length, rng=length, time_major=time_major)
                assert np.array_equal(b["obs"], frames[b["idx"]])
                assert np.array_equal(a["obs"], b["obs"]) and np.array_equal(a["idx"], b["idx"])
    finally:
        packed.close()


def test_a_block_that_does_not_decode_is_a_corrupt_segment(frames):
    packed = _made(frames, shmbuf.Compress("obs", hot_steps=0))
    try:
        plan = packed.port.packing.plan
        dirs = packed.port.unpacker.words.read_dir(0)
        off, length = (int(x) for x in dirs[plan.columns[0].bit, 1])
        assert length > 32
        fd = os.open(f"/dev/shm/{packed.name}", os.O_RDWR)
        try:   # the middle of chunk 0's second block, as a stray write would leave it
            os.pwrite(fd, b"\x55" * 16, plan.slot(0) + off + length // 2)
        finally:
            os.close(fd)
        with pytest.raises(shmbuf.CorruptSegmentError, match="chunk 0 .* block 1 does not decode"):
            for r in range(200):     # until a window reads chunk 0's second block
                packed.sample_sequences(16, 40, rng=r)
    finally:
        packed.close()


def test_rows_named_one_by_one_read_decoded(frames):
    """``port.read_rows``: every row of the buffer, each the step it holds, decoded where
    its chunk is packed; the rows of the open chunk that hold no step read as zeros."""
    packed = _made(frames, shmbuf.Compress("obs", hot_steps=0))
    try:
        rows = np.arange(packed.capacity)
        committed = np.isin(rows, packed.committed_rows())
        assert 0 < (~committed).sum() < 64
        got, held = packed.port.read_rows(["obs", "idx"], rows)
        assert np.array_equal(held, committed)
        assert np.array_equal(got["obs"][held], frames[got["idx"][held]])
        assert not got["obs"][~held].any() and not got["idx"][~held].any()
        # The raw column holds the packed rows' given-back pages: zeros, not the frames.
        assert not np.array_equal(packed.arrays["obs"][held], got["obs"][held])
        some, some_held = packed.port.read_rows(["idx"], rows[held][::7])
        assert some_held.all() and np.array_equal(some["idx"], got["idx"][held][::7])
    finally:
        packed.close()
