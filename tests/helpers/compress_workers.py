"""Children for tests/test_compress.py: writers of real Atari frames, a compressor to SIGKILL,
and an owner that dies.

Every step writes ``obs = frames[idx]`` and ``idx``, so any reader checks any batch against
the ground truth with one comparison.  Frames come from a .npy file the test wrote.
"""
import os
import sys

import numpy as np

import shmbuf

WAIT = 60


def write_frames(name: str, frames_path: str, start: int, stop, ready, episode: int = 50):
    """Add steps until ``stop`` is set; ``ready`` once the first step is in."""
    frames = np.load(frames_path)
    buf = shmbuf.attach(name)
    try:
        with buf.writer() as w:
            j = 0
            while not stop.is_set():
                i = (start + j) % len(frames)
                w.add(obs=frames[i], idx=i, done=j % episode == episode - 1)
                if j == 0:
                    ready.set()
                j += 1
    finally:
        buf.close()


def compact_forever(name: str, started):
    """Compress every eligible chunk, again and again, until killed."""
    buf = shmbuf.attach(name)
    started.set()
    while True:
        buf.compact(timeout=WAIT)


def own_fill_and_die(name: str, frames_path: str, steps: int, hot: int, filled):
    """Create a compressing buffer (its owner thread stopped), fill it, report, wait to die."""
    frames = np.load(frames_path)
    spec = {"obs": (frames.shape[1:], np.uint8), "idx": ((), np.int64), "done": ((), np.bool_)}
    buf = shmbuf.create(spec, 1024, name=name, chunk_size=16, handle_signals=False,
                        compress=shmbuf.Compress("obs", hot_steps=hot))
    buf._packer.stop()    # nothing is compressed before the owner dies: the adopter does it
    with buf.writer() as w:
        for j in range(steps):
            w.add(obs=frames[j % len(frames)], idx=j % len(frames), done=j % 50 == 49)
    filled.set()
    os.kill(os.getpid(), 9)
    sys.exit(1)


def die_holding(name: str, phase: str, held):
    """Take a cold chunk's word to ``phase`` with the real compressor steps, then SIGKILL
    this process: "busy" (encoding), "punching" (blob published, raw pages whole) or
    "half-punched" (some raw pages given back)."""
    from shmbuf.protocol.packing import BUSY, pack_word
    buf = shmbuf.attach(name)
    packer = buf._packer
    chunk = int(packer.candidates()[0])
    if phase == "busy":
        seq = packer._state(chunk)[0]
        assert packer.words.take(chunk, packer.words.word(chunk),
                                 pack_word(seq, BUSY, 0, os.getpid()))
    else:
        got = packer._take(chunk)
        assert got is not None and got[2]
        if phase == "half-punched":
            col = packer.plan.columns[0]
            lo, hi = packer.plan.raw_range(col, chunk, inward=True)
            from shmbuf.protocol.packing import punch
            punch(packer.words.fd, lo, lo + (hi - lo) // 2 // 4096 * 4096)
    held.put(chunk)
    held.close()
    held.join_thread()      # the queue's feeder thread has sent it: now die
    os.kill(os.getpid(), 9)


def wait_for(release, timeout: float = WAIT):
    """Stay alive (a process whose pid a chunk word can name) until ``release`` is set."""
    release.wait(timeout)
