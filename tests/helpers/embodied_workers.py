"""Child processes of tests/test_compat_embodied.py (importable by spawn and forkserver)."""
import numpy as np


def add_steps(replay, worker: int, steps: int, queue) -> None:
    """Add ``steps`` steps whose ``step`` counts up and ``worker`` names the worker."""
    try:
        for t in range(steps):
            replay.add({"step": np.int64(t), "worker": np.int64(worker),
                        "is_first": t == 0}, worker=worker)
        queue.put(("ok", worker))
    except BaseException as exc:   # noqa: BLE001 - reported to the parent, which asserts
        queue.put(("error", repr(exc)))


def add_other_shape(replay, queue) -> None:
    """Add a step whose ``step`` has another shape than the schema fixed elsewhere."""
    try:
        replay.add({"step": np.zeros(3, np.int64), "worker": np.int64(0),
                    "is_first": False})
        queue.put(("ok", None))
    except BaseException as exc:   # noqa: BLE001 - reported to the parent
        queue.put(("error", f"{type(exc).__name__}: {exc}"))


def sample_steps(replay, batches: int, queue) -> None:
    """Sample ``batches`` batches of 4 and report every (worker, first step) seen."""
    try:
        seen = []
        for _ in range(batches):
            data = replay.sample(4)
            for w, s in zip(data["worker"][:, 0].tolist(), data["step"].tolist()):
                seen.append((w, s))
        queue.put(("ok", seen))
    except BaseException as exc:   # noqa: BLE001 - reported to the parent
        queue.put(("error", repr(exc)))


def add_forever(replay, worker: int, queue) -> None:
    """Add steps until killed; say so after the first ``replay.length`` of them."""
    t = 0
    while True:
        replay.add({"step": np.int64(t), "worker": np.int64(worker), "is_first": t == 0},
                   worker=worker)
        t += 1
        if t == replay.length:
            queue.put(("adding", worker))

