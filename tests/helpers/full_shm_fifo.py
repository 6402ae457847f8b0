"""FIFO order after a full /dev/shm: run inside a private 64 MiB tmpfs.

``python -m helpers.full_shm_fifo`` expects /dev/shm to be a fresh 64 MiB tmpfs
(tests/test_compress.py mounts one in a mount namespace of its own).  Two writers
fill a compressing buffer (capacity 8,192, chunk 64, ``Compress("obs", hot_steps=256)``,
compacted every 1,024 steps) past its capacity; then /dev/shm is filled, so the next
chunk each writer wraps into (a compressed one) cannot get its raw pages back: each
writer's add raises SharedMemoryFullError.  Space is freed and each writer adds 1,024
more steps.  Every step holds ``(wid, idx)``; the script prints one JSON line with, per
writer, the runs of consecutive ``idx`` the buffer holds, for the test to judge: a
stream's held steps must be one run ending at its newest step.
"""
import json
import os

import numpy as np

import shmbuf
from helpers.full_shm_compress import FILLER, fill_up, frame

SPEC = {"obs": ((3, 64, 64), np.uint8), "idx": ((), np.int64), "wid": ((), np.int64),
        "done": ((), np.bool_)}
CAPACITY, CHUNK, HOT, COMPACT_EVERY = 8192, 64, 256, 1024


def runs(idx: np.ndarray) -> list[list[int]]:
    """``[first, last]`` of each run of consecutive values in ``idx`` (sorted)."""
    idx = np.sort(idx)
    cut = np.flatnonzero(np.diff(idx) != 1)
    firsts = np.concatenate([idx[:1], idx[cut + 1]])
    lasts = np.concatenate([idx[cut], idx[-1:]])
    return [[int(a), int(b)] for a, b in zip(firsts, lasts)]


def main():
    st = os.statvfs("/dev/shm")
    out = {"shm_bytes": st.f_blocks * st.f_frsize}
    buf = shmbuf.create(SPEC, CAPACITY, chunk_size=CHUNK, handle_signals=False,
                        compress=shmbuf.Compress("obs", hot_steps=HOT))
    try:
        buf._packer.stop()   # this script decides when compression runs
        writers = [buf.writer() for _ in range(2)]
        written = [0, 0]

        def add(wid):
            i = written[wid]
            writers[wid].add(obs=frame(i), idx=i, wid=wid, done=i % 100 == 99)
            written[wid] += 1

        for step in range(2 * (CAPACITY - CAPACITY // 4)):   # past the capacity: wrapped
            add(step % 2)
            if (step + 1) % COMPACT_EVERY == 0:
                buf.compact(timeout=30)
        buf.compact(timeout=30)
        fill_up()
        out["full"] = [None, None]
        for wid in range(2):
            try:
                for _ in range(CAPACITY):
                    add(wid)
            except shmbuf.SharedMemoryFullError as exc:
                out["full"][wid] = str(exc)
        os.unlink(FILLER)
        for _ in range(1024):
            for wid in range(2):
                add(wid)
        snap = buf.snapshot()
        idx, wid = snap["columns"]["idx"], snap["columns"]["wid"]
        out["written"] = written
        out["runs"] = [runs(idx[wid == w]) for w in range(2)]
        batch = buf.sample_sequences(32, 16)
        out["true"] = all(np.array_equal(batch["obs"][t, b], frame(int(batch["idx"][t, b])))
                          for t in range(16) for b in range(32))
        for w in writers:
            w.close()
    finally:
        buf.close()
        if os.path.exists(FILLER):
            os.unlink(FILLER)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
