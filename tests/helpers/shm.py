"""Which /dev/shm entries this test session made: the only ones a test may judge or remove.

Generated names carry the session's tag (``$SHMBUF_NAME_TAG``, set by conftest.py and
inherited by children); names a test picks itself start with ``shmbuf-test-`` and carry
the session's pid as a ``-``-separated part.  Everything else belongs to someone else:
another test session, a training run, PyTorch's shared tensors.
"""
import os

SHM = "/dev/shm"


def ours(name: str) -> bool:
    if name.startswith("shmbuf-test-"):
        return _SESSION_PID in name.split("-")
    return name.startswith("shmbuf-" + os.environ.get("SHMBUF_NAME_TAG", "\0"))


def exists(name: str) -> bool:
    """Whether /dev/shm holds an entry ``name`` now."""
    return os.path.exists(os.path.join(SHM, name))


def own_entries() -> set[str]:
    """The /dev/shm entries this test session made that exist now."""
    names = os.listdir(SHM) if os.path.isdir(SHM) else []
    return {n for n in names if ours(n)}


# The pytest process's pid (a test's child has another one): the tag holds it.
_SESSION_PID = os.environ.get("SHMBUF_NAME_TAG", "t0-")[1:-1]
