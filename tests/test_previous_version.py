"""This version attaches the segments and loads the saves of the previous one (0.1.0).

The fixtures in tests/data/v0_1_0 were written by that version (tests/data/make_v0_1_0.py
says how): a step store's save with priorities, a Dreamer facade's save, a
HistoryBuffer's save, and the raw bytes of a live step store's segment with
the episodes it held.
"""
import os
import pathlib

import numpy as np
import pytest

import shmbuf

DATA = pathlib.Path(__file__).parent / "data" / "v0_1_0"


def _episodes(buf):
    return [ep for ep in buf.iter_episodes()]


def _saved_episodes():
    saved = np.load(DATA / "segment.npz")
    n = 1 + max(int(k[2:k.index("_")]) for k in saved.files if k.startswith("ep"))
    return [{k.split("_", 1)[1]: saved[k] for k in saved.files if k.startswith(f"ep{i}_")}
            for i in range(n)]


def _same(got, want):
    assert len(got) == len(want) > 0
    for g, w in zip(got, want):
        assert set(g) == set(w)
        for k in w:
            np.testing.assert_array_equal(g[k], w[k])


def test_a_segment_made_by_the_previous_version_attaches():
    raw = np.load(DATA / "segment.npz")["raw"]
    name = f"shmbuf-test-prev-{os.getpid()}"
    path = os.path.join("/dev/shm", name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.write(fd, raw.tobytes())
        os.close(fd)
        with shmbuf.attach(name) as buf:
            assert isinstance(buf, shmbuf.Buffer) and buf.capacity == 256 and buf.priorities
            _same(_episodes(buf), _saved_episodes())
            assert buf.sample_sequences(3, 4)["obs"].shape == (4, 3, 3, 4, 4)
    finally:
        os.unlink(path)


def test_a_save_made_by_the_previous_version_loads():
    with shmbuf.load(DATA / "store_save") as buf:
        assert type(buf) is shmbuf.Buffer and buf.priorities
        _same(_episodes(buf), _saved_episodes())
        got = buf.sample_sequences(8, 2, ids=True)
        assert np.isfinite(buf.priorities_of(got["ids"])).all()


def test_a_facade_save_of_the_previous_version_loads_as_its_facade():
    rb = shmbuf.load(DATA / "dreamer_save")
    try:
        assert isinstance(rb, shmbuf.ReplayBuffer)
        assert len(rb.buffer) == 40
    finally:
        rb.close()


def test_a_history_save_of_the_previous_version_loads():
    hb = shmbuf.load(DATA / "history_save")
    try:
        assert isinstance(hb, shmbuf.HistoryBuffer)
        out = hb.get(3)
        # The newest 3 entries of each env, frames concatenated: 4, 5, 6 (HistoryBuffer.get).
        want = np.repeat(np.array([4, 5, 6], np.uint8), 3)
        np.testing.assert_array_equal(out["pixels"], np.stack([want, want]))
        np.testing.assert_array_equal(out["action"], np.array([[-4, -5, -6]] * 2, np.float32))
    finally:
        hb.close()


@pytest.mark.parametrize("save", ["store_save", "dreamer_save"])
def test_the_previous_saves_load_into_a_smaller_buffer_where_allowed(save):
    if save == "dreamer_save":
        with pytest.raises(ValueError, match="capacity"):
            shmbuf.load(DATA / save, capacity=64)
        return
    with shmbuf.load(DATA / save, capacity=64) as buf:
        assert buf.capacity == 64 and len(buf) <= 64
