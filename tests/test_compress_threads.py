"""The owner's compressor threads: one at the lowest CPU priority, and a catch-up thread at
a middling one that works only while more chunks are cold and raw than the backlog bound,
so that env workers busy on every core cannot keep the buffer's memory raw."""
import os
import threading

import numpy as np
import pytest
from helpers.atari import play, spec

import shmbuf
from shmbuf.posix.wait import poll

pytest.importorskip("zstandard")
TIMEOUT = 60


def _nice_of(tid: int) -> int:
    with open(f"/proc/self/task/{tid}/stat", "rb") as f:
        raw = f.read()
    return int(raw[raw.rfind(b")") + 2:].split()[16])   # field 19: nice


def test_the_compressor_threads_and_their_priorities(make_buffer):
    from shmbuf.writing import compressor
    base = os.getpriority(os.PRIO_PROCESS, 0)
    buf = make_buffer(spec(), 1024, chunk_size=16, compress=shmbuf.Compress("obs"))
    threads = {t.name: t for t in threading.enumerate() if t.name.startswith("shmbuf-compress")}
    assert set(threads) == {"shmbuf-compress", "shmbuf-compress-catch-up"}
    want = {"shmbuf-compress": compressor.THREAD_NICE,
            "shmbuf-compress-catch-up": compressor.CATCH_UP_NICE}
    for name, t in threads.items():
        assert _nice_of(t.native_id) == max(want[name], base), name
    buf._packer.stop()
    assert not any(t.is_alive() for t in threads.values())


@pytest.mark.parametrize("workers", [1, 3])
def test_the_catch_up_thread_works_only_past_the_backlog(workers):
    """Alone (as on a small machine) or encoding on 3 threads (as on a 12-core one)."""
    frames = play("Breakout", 200, 9)
    buf = shmbuf.create(spec(), 1024, chunk_size=16,
                        compress=shmbuf.Compress("obs", hot_steps=0))
    packer = buf._packer
    try:
        packer.stop()                    # nothing compresses while the backlog builds
        assert packer.backlog == 1024 // 10 // 16
        with buf.writer() as w:
            for j in range(1024):
                w.add(obs=frames[j % 200], idx=j % 200, done=j % 50 == 49)
        assert packer.pending() == 1024 // 16
        packer._stop.clear()
        packer.catch_up_workers = workers
        t = threading.Thread(target=packer._catch_up, daemon=True)   # the catch-up alone
        t.start()
        try:
            poll(lambda: True if packer.pending() <= packer.backlog // 2 else None, TIMEOUT,
                 lambda: AssertionError("the catch-up thread left the backlog as it was"))
        finally:
            packer._stop.set()
            t.join(TIMEOUT)
        assert not t.is_alive()
        c = buf.stats().compression
        assert c.compressed_chunks >= 1024 // 16 - packer.backlog // 2
        assert not [t for t in threading.enumerate()
                    if t.name.startswith("shmbuf-compress-catch-up")]   # its pool is gone
        snap = buf.snapshot()["columns"]
        assert np.array_equal(snap["obs"], frames[snap["idx"]])
        batch = buf.sample_sequences(16, 16)
        assert np.array_equal(batch["obs"], frames[batch["idx"]])
    finally:
        buf.close()
