"""Error paths that name what went wrong: foreign entries in /dev/shm, batches too large for
memory, handles unpickled after their segment is gone."""
import os
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
