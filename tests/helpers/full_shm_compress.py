"""A compressing buffer in a /dev/shm that runs full: run inside a private small tmpfs.

``python -m helpers.full_shm_compress`` expects /dev/shm to be a fresh tmpfs of a few MiB
(tests/test_compress.py mounts one in a mount namespace of its own).  Steps hold noise-free
synthetic frames that compress well.  It checks, printing one JSON line for the test:

- compact() with /dev/shm full: SharedMemoryFullError, every chunk still readable; the
  same for a round that encodes on several threads, which leaves no word held;
- a writer wrapping into packed chunks with /dev/shm full: SharedMemoryFullError at its
  claim (never SIGBUS), and the same add goes through once space is freed;
- samples stay true throughout (``obs`` is a function of ``idx``).
"""
import json
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

import shmbuf
from shmbuf.protocol.packing import BUSY, PUNCHING, unpack_word

FILLER = "/dev/shm/filler"
SPEC = {"obs": ((3, 64, 64), np.uint8), "idx": ((), np.int64), "done": ((), np.bool_)}


def frame(i: int) -> np.ndarray:
    f = np.zeros((3, 64, 64), np.uint8)
    f[:, i % 64, :] = 200
    f[0, :, (i // 64) % 64] = i % 251
    return f


def true(batch) -> bool:
    return all(np.array_equal(batch["obs"][t, b], frame(int(batch["idx"][t, b])))
               for t in range(batch["idx"].shape[0]) for b in range(batch["idx"].shape[1]))


def fill_up() -> int:
    """Write the filler until tmpfs refuses; return its size."""
    fd = os.open(FILLER, os.O_CREAT | os.O_WRONLY, 0o600)
    size = 0
    try:
        for step in (1 << 20, 1 << 16, 1 << 12):
            while True:
                try:
                    os.posix_fallocate(fd, size, step)
                except OSError:
                    break
                size += step
    finally:
        os.close(fd)
    return size


def main():
    st = os.statvfs("/dev/shm")
    out = {"shm_bytes": st.f_blocks * st.f_frsize}
    buf = shmbuf.create(SPEC, 1024, chunk_size=16, handle_signals=False,
                        compress=shmbuf.Compress("obs", hot_steps=32))
    try:
        buf._packer.stop()   # this script decides when compression runs
        w = buf.writer()
        j = 0
        for _ in range(300):
            w.add(obs=frame(j), idx=j, done=j % 40 == 39)
            j += 1
        fill_up()
        try:
            buf.compact(timeout=30)
            out["compact_full"] = None
        except shmbuf.SharedMemoryFullError as exc:
            out["compact_full"] = str(exc)
        out["true_after_compact_full"] = true(buf.sample_sequences(16, 12))
        # The same on several encoding threads (the catch-up thread's rounds): the round
        # waits for every worker and gives back each word they won.
        with ThreadPoolExecutor(3) as pool:
            try:
                buf._packer.round(timeout=30, pool=pool)
                out["parallel_full"] = None
            except shmbuf.SharedMemoryFullError as exc:
                out["parallel_full"] = str(exc)
        out["parallel_left_held"] = sum(
            1 for word in buf.port.packing.words.tolist()
            if unpack_word(word)[1] in (BUSY, PUNCHING) and unpack_word(word)[3] == os.getpid())
        out["true_after_parallel_full"] = true(buf.sample_sequences(16, 12))
        os.unlink(FILLER)
        out["compacted"] = buf.compact(timeout=30)
        out["reserved_packed"] = buf.stats().reserved_bytes
        # Round the ring: the chunks it reaches were packed, and need raw pages again.
        for _ in range(1024 - 300 + 64):
            w.add(obs=frame(j), idx=j, done=j % 40 == 39)
            j += 1
            if j % 64 == 0:
                buf.compact(timeout=30)
        buf.compact(timeout=30)
        fill_up()
        out["wrap_full"] = None
        try:
            for _ in range(2048):
                w.add(obs=frame(j), idx=j, done=j % 40 == 39)
                j += 1
        except shmbuf.SharedMemoryFullError as exc:
            out["wrap_full"] = str(exc)
        out["true_when_full"] = true(buf.sample_sequences(16, 12))
        os.unlink(FILLER)
        for _ in range(100):
            w.add(obs=frame(j), idx=j, done=j % 40 == 39)
            j += 1
        out["resumed"] = True
        out["true_at_end"] = true(buf.sample_sequences(16, 12))
        w.close()
    finally:
        buf.close()
        if os.path.exists(FILLER):
            os.unlink(FILLER)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
