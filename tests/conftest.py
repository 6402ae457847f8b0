"""Shared fixtures: every test must leave /dev/shm as it found it."""
import os

import numpy as np
import pytest

import shmbuf

SHM = "/dev/shm"


def _entries():
    # sem.* entries are multiprocessing's semaphores, which its resource
    # tracker owns and removes; every other new entry is a segment we made.
    names = os.listdir(SHM) if os.path.isdir(SHM) else []
    return {n for n in names if not n.startswith("sem.")}


@pytest.fixture(autouse=True)
def no_leaked_segments():
    """Fail any test that leaves a new /dev/shm entry behind (and remove it)."""
    before = _entries()
    yield
    leaked = sorted(_entries() - before)
    for name in leaked:
        try:
            os.unlink(os.path.join(SHM, name))
        except FileNotFoundError:
            pass
    assert not leaked, f"test left shared-memory segments behind: {leaked}"


PIXEL_SPEC = {
    "obs": ((3, 8, 8), np.uint8),
    "action": ((6,), np.float32),
    "reward": ((), np.float32),
    "done": ((), np.bool_),
}


@pytest.fixture
def pixel_spec():
    return dict(PIXEL_SPEC)


@pytest.fixture
def make_buffer():
    """create() that closes (and so unlinks) every buffer at teardown."""
    made = []

    def make(spec=None, capacity=1000, **kw):
        buf = shmbuf.create(spec or dict(PIXEL_SPEC), capacity, **kw)
        made.append(buf)
        return buf

    yield make
    for buf in made:
        buf.close()
