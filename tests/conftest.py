"""Shared fixtures: every test must leave /dev/shm as it found it."""
import os
import sys

import numpy as np
import pytest

import shmbuf

# tests/ on sys.path whatever pytest's --import-mode, so that tests import the
# helpers package (tests/helpers/) as ``helpers``; spawned children inherit the path.
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
if TESTS_DIR not in sys.path:
    sys.path.insert(0, TESTS_DIR)

SHM = "/dev/shm"
# Generated names carry this session's tag (children inherit it), so the leak
# check below sees only segments this test session made, even when other
# sessions run tests on the same machine at the same time.
TAG = f"t{os.getpid()}-"
os.environ["SHMBUF_NAME_TAG"] = TAG
# Ray (tests/test_ray.py) must resolve this host's address as loopback, in the driver
# too, before anything imports ray: all of its traffic stays on 127.0.0.1.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


from helpers.shm import ours as _ours  # noqa: E402  (needs tests/ on sys.path, set above)


def _listing() -> set[str]:
    return set(os.listdir(SHM)) if os.path.isdir(SHM) else set()


@pytest.fixture(autouse=True)
def no_leaked_segments(request):
    """Fail any test that leaves a segment of its own behind (and remove it).

    A new entry that this session did not name is reported (a warning on the
    test) and left alone: users run the suite beside training.
    """
    before = _listing()
    yield
    new = _listing() - before
    leaked = sorted(n for n in new if _ours(n))
    for name in leaked:
        try:
            os.unlink(os.path.join(SHM, name))
        except FileNotFoundError:
            pass
    foreign = sorted(n for n in new if not _ours(n) and not n.startswith("sem."))
    if foreign:
        request.node.warn(pytest.PytestWarning(
            f"new /dev/shm entries not made by this test session (left alone): {foreign}"))
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
