"""Error paths that name what went wrong: foreign entries in /dev/shm, batches too large for
memory, handles unpickled after their segment is gone."""
import os
import pickle
import time

import numpy as np
import pytest

import shmbuf

SHM = "/dev/shm"
SPEC = {"obs": ((3, 64, 64), np.uint8), "done": ((), np.bool_)}


def _name(what: str) -> str:
    return f"shmbuf-test-{what}-{os.getpid()}"


def test_attaching_a_directory_names_the_entry():
    name = _name("dir")
    os.mkdir(os.path.join(SHM, name))
    try:
        with pytest.raises(shmbuf.CorruptSegmentError) as info:
            shmbuf.attach(name)
        assert f"{SHM}/{name}" in str(info.value) and "a directory" in str(info.value)
        assert "Invalid parameter" not in str(info.value).split("(")[0]
    finally:
        os.rmdir(os.path.join(SHM, name))


@pytest.mark.parametrize("size", [0, 8192])
def test_a_foreign_entry_nobody_is_creating_is_refused_at_once(size):
    # Empty, or all zeros (no magic yet): it looks like a creator's until it is a second
    # old without the creation mark.
    name = _name(f"foreign{size}")
    path = os.path.join(SHM, name)
    with open(path, "wb") as f:
        f.write(bytes(size))
    try:
        old = time.time() - 10
        os.utime(path, (old, old))
        with pytest.raises(shmbuf.CorruptSegmentError) as info:
            shmbuf.attach(name)
        # Refused for what it is, not after the creator's wait (ATTACH_TIMEOUT) ran out.
        assert "no shmbuf process is creating it" in str(info.value), info.value
        assert f"rm --force {name}" in str(info.value)
    finally:
        os.unlink(path)


def test_a_batch_larger_than_memory_is_refused_before_allocating(make_buffer):
    buf = make_buffer(SPEC, 256)
    with buf.writer() as w:
        for _ in range(200):
            w.add(obs=np.zeros((3, 64, 64), np.uint8), done=False)
    with pytest.raises(shmbuf.SampleTooLargeError) as info:
        buf.sample_sequences(10**6, 50)          # 614 GB of frames
    text = str(info.value)
    assert isinstance(info.value, MemoryError)
    assert "batch_size=1000000" in text and str(10**6 * 50 * (3 * 64 * 64 + 1)) in text
    assert "available" in text and "Unable to allocate" not in text
    for make in (lambda: buf.dataset(10**6, 50), lambda: buf.prefetch(10**6, 50, device="cpu")):
        with pytest.raises(shmbuf.SampleTooLargeError, match="batch_size=1000000"):
            make()
    assert buf.sample_sequences(4, 50)["obs"].shape == (50, 4, 3, 64, 64)
    assert buf.stats().samples == 1                 # the refused calls drew nothing


def test_only_batches_past_the_floor_read_the_memory_figures(make_buffer, monkeypatch):
    """Reading /proc and the cgroup costs as much as a whole small draw: a batch under
    MEMORY_CHECK_FLOOR is not checked; one at the floor still is."""
    from shmbuf.store import reads

    buf = make_buffer(SPEC, 256)
    with buf.writer() as w:
        for _ in range(200):
            w.add(obs=np.zeros((3, 64, 64), np.uint8), done=False)
    asked = []
    monkeypatch.setattr(reads, "available_bytes", lambda: asked.append(1) or 0)
    row = 3 * 64 * 64 + 1
    assert buf.sample_sequences(4, 50)["obs"].shape == (50, 4, 3, 64, 64)
    assert asked == []                       # 4 * 50 rows: under the floor, not checked
    at_floor = -(-reads.MEMORY_CHECK_FLOOR // (50 * row))   # windows of 50 that reach it
    with pytest.raises(shmbuf.SampleTooLargeError, match=f"batch_size={at_floor} "):
        buf.sample_sequences(at_floor, 50)
    assert asked == [1]


def test_a_handle_unpickled_after_its_segment_is_gone_says_how_to_keep_a_buffer(tmp_path):
    buf = shmbuf.create(SPEC, 16)
    try:
        with buf.writer() as w:
            w.add(obs=np.zeros((3, 64, 64), np.uint8), done=True)
        blob = pickle.dumps(buf)      # a name, not the bytes
    finally:
        buf.close()                   # the owner's close removes the segment
    with pytest.raises(shmbuf.SegmentNotFoundError) as info:
        pickle.loads(blob)
    text = str(info.value)
    assert buf.name in text and "by name" in text
    assert "save(" in text and "shmbuf.load(" in text


def test_a_parameter_block_unpickled_after_its_segment_is_gone_says_the_same():
    from shmbuf.params import ParamBlock

    block = ParamBlock.create({"w": np.zeros(2, np.float32)})
    try:
        blob = pickle.dumps(block)
    finally:
        block.close()
    with pytest.raises(shmbuf.SegmentNotFoundError, match="pickle by name"):
        pickle.loads(blob)
