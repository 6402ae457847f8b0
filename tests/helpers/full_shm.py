"""A /dev/shm that fills up while two writers run: run inside a private small tmpfs.

``python -m helpers.full_shm`` expects /dev/shm to be a fresh tmpfs of a few MiB
(tests/test_memory.py mounts one in a mount namespace of its own).  It holds a
filler file, creates an overcommitted buffer, and starts two spawned writers
that add steps until a chunk claim raises SharedMemoryFullError.  The parent
samples while they wait, removes the filler, and lets them go on: each must
write again.  It prints one JSON line with what happened; the test judges it.
"""
import json
import multiprocessing as mp
import os
import signal
import sys

import numpy as np

import shmbuf
from helpers.procs import join_all, running

ROW = 4096
FILLER = "/dev/shm/filler"
FILLER_BYTES = 4 << 20
AFTER = 256  # steps each writer adds once space is freed (4 chunks of 64)
WAIT = 60


def writer(name, wid, reports, go_on, started):
    buf = shmbuf.attach(name)
    w = buf.writer()
    obs = np.full(ROW, wid, np.uint8)
    steps, error = 0, None
    try:
        w.add(obs=obs, done=False)  # both hold a chunk before either can fill /dev/shm
        steps += 1
        started.wait(WAIT)
        while True:
            try:
                w.add(obs=obs, done=steps % 50 == 49)
            except shmbuf.SharedMemoryFullError as exc:
                error = str(exc)
                break
            steps += 1
        reports.put(("full", wid, steps, error))
        if not go_on.wait(WAIT):
            raise TimeoutError("the parent never freed space")
        for _ in range(AFTER):
            w.add(obs=obs, done=False)  # the failed add is retried first
        reports.put(("resumed", wid, AFTER, None))
    finally:
        w.close()
        buf.close()


def main():
    total = os.statvfs("/dev/shm")
    out = {"shm_bytes": total.f_blocks * total.f_frsize}
    ctx = mp.get_context("spawn")
    # Their semaphores live in /dev/shm: make them first.
    reports, go_on, started = ctx.Queue(), ctx.Event(), ctx.Barrier(2)
    # "x": a /dev/shm that is not the private one (its filler name taken) is left alone.
    with open(FILLER, "xb") as f:
        os.posix_fallocate(f.fileno(), 0, FILLER_BYTES)
    spec = {"obs": ((ROW,), np.uint8), "done": ((), np.bool_)}
    buf = shmbuf.create(spec, 1 << 16, chunk_size=64, overcommit=True, seed=0)
    procs = [ctx.Process(target=writer, args=(buf.name, i, reports, go_on, started))
             for i in range(2)]
    try:
        with running(procs, WAIT):
            full = [reports.get(timeout=WAIT) for _ in procs]
            out["full"] = [{"wid": r[1], "steps": r[2], "error": r[3]}
                           for r in full if r[0] == "full"]
            out["reserved_full"] = buf.stats().reserved_bytes
            batch = buf.sample_sequences(16, 8)  # the trainer goes on with what is held
            out["sampled"] = int(batch["obs"].shape[1])
            out["live_before"] = len(buf)
            os.unlink(FILLER)
            go_on.set()
            out["resumed"] = [reports.get(timeout=WAIT)[2] for _ in procs]
            out["live_after"] = len(buf)
            out["sampled_after"] = int(buf.sample_sequences(16, 8)["obs"].shape[1])
            out["exitcodes"] = join_all(procs, WAIT, expect=None)  # the test judges them
        out["sigbus"] = -signal.SIGBUS
        out["name"] = buf.name
    finally:
        buf.close()
    print(json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
