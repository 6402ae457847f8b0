"""Writes the fixtures of tests/test_previous_version.py with the shmbuf of the layout before
the layer folders (0.1.0 as first released), so that the tests can check that this version
attaches its segments and loads its saves.

Run it with that version first on the path, from the repository root:
    PYTHONPATH=/path/to/old/checkout python tests/data/make_v0_1_0.py tests/data/v0_1_0
"""
import os
import shutil
import sys

import numpy as np

import shmbuf

SPEC = {"obs": ((3, 4, 4), np.uint8), "action": ((2,), np.float32),
        "reward": ((), np.float32), "done": ((), np.bool_)}


def fill(buf, streams=2, steps=60):
    """Deterministic steps: every value says (stream, t)."""
    writers = [buf.writer() for _ in range(streams)]
    for t in range(steps):
        for s, w in enumerate(writers):
            w.add(obs=np.full((3, 4, 4), (7 * s + t) % 251, np.uint8),
                  action=np.array([s, t], np.float32), reward=float(s * 1000 + t),
                  done=(t % 13 == 12))


def main(out):
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    with shmbuf.create(SPEC, 256, chunk_size=16, priorities=True) as buf:
        fill(buf)
        batch = buf.sample_sequences(4, 3, ids=True)
        priorities = np.arange(12, dtype=np.float32).reshape(batch["ids"].shape) + 1
        buf.update_priorities(batch["ids"], priorities)
        buf.save(os.path.join(out, "store_save"))
        # The segment itself, as bytes: a buffer made by this version, to attach.
        with open(os.path.join("/dev/shm", buf.name), "rb") as f:
            raw = f.read()
        eps = {f"ep{i}_{k}": v for i, ep in enumerate(buf.iter_episodes()) for k, v in ep.items()}
        np.savez_compressed(os.path.join(out, "segment.npz"), raw=np.frombuffer(raw, np.uint8),
                            name=np.array(buf.name), **eps)
    rb = shmbuf.ReplayBuffer(200, (3, 4, 4), 2, seq_len=4, batch_size=2)
    try:
        for t in range(40):
            rb.add({"image": np.full((3, 4, 4), t, np.uint8)}, np.array([t, -t], np.float32),
                   float(t), t % 10 == 9)
        rb.save(os.path.join(out, "dreamer_save"))
    finally:
        rb.close()
    hb = shmbuf.HistoryBuffer(2, 5)
    try:
        for t in range(7):
            hb.append({"pixels": np.full((2, 3), t, np.uint8),
                       "action": np.full((2, 1), -t, np.float32)})
        hb.save(os.path.join(out, "history_save"))
    finally:
        hb.close()


if __name__ == "__main__":
    main(sys.argv[1])
