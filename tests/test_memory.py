"""Memory on demand: /dev/shm pages are reserved as chunks are claimed, never SIGBUS.

A sparse segment's pages are taken by the first claimant of each chunk
(``fallocate`` before the ticket moves); readers look only below the tickets,
so reading never takes a page.  The full-/dev/shm case runs in a private small
tmpfs mounted in a mount namespace of its own (``unshare -m``, root only).
"""
import json
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
from helpers.procs import join_all, running

import shmbuf
from shmbuf.cli import main as cli_main
from shmbuf.protocol import layout as L
from shmbuf.select import AgeBuckets, Recency

SHM = "/dev/shm"
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
TIMEOUT = 60
ROW = 4096
SPEC = {"obs": ((ROW,), np.uint8), "done": ((), np.bool_)}


def chunk_bytes(buf):
    return buf.chunk_size * sum(c.row_bytes for c in buf._layout.columns)


def fill(buf, steps, episode=10):
    with buf.writer() as w:
        for i in range(steps):
            w.add(obs=np.full(ROW, i % 251, np.uint8), done=i % episode == episode - 1)


def test_create_reserves_only_the_header(make_buffer):
    buf = make_buffer(SPEC, 1 << 14, chunk_size=64)   # 64 MiB at full capacity
    st = buf.stats()
    assert st.total_bytes == buf._layout.total_bytes > 64 << 20
    assert st.reserved_bytes <= buf._layout.chunks_offset + L.PAGE
    fill(buf, 64 * 3)
    grown = buf.stats().reserved_bytes - st.reserved_bytes
    # three chunks' rows, their entries' page and one granule of the episode index
    assert 3 * chunk_bytes(buf) <= grown <= 3 * chunk_bytes(buf) + 6 * L.PAGE + (64 << 10)


def test_prefault_reserves_everything(make_buffer):
    buf = make_buffer(SPEC, 1 << 10, prefault=True)
    st = buf.stats()
    assert st.reserved_bytes == st.total_bytes


def test_ring_gone_round_holds_exactly_the_segment(make_buffer):
    buf = make_buffer(SPEC, 1 << 10, chunk_size=32)
    fill(buf, 3 << 10)
    st = buf.stats()
    assert st.live_steps > 0
    assert st.total_bytes - st.reserved_bytes < L.PAGE * 16  # only unused index pages remain


@pytest.mark.slow
def test_readers_take_no_page(make_buffer, tmp_path, capsys):
    """Every read path stays below the tickets: reading a sparse buffer reserves nothing."""
    torch = pytest.importorskip("torch")
    buf = make_buffer(SPEC, 1 << 14, chunk_size=64)
    fill(buf, 300)
    before = buf.stats().reserved_bytes
    reader = shmbuf.attach(buf.name)
    try:
        reader.sample_sequences(8, 5)
        reader.sample_sequences(4, 3, uniform="episodes")
        reader.sample_sequences(4, 3, select=Recency())
        reader.sample_sequences(4, 3, select=AgeBuckets([1, 2]))
        reader.snapshot()
        torch.save(reader.state_dict(), tmp_path / "r.pt")
        reader.save(tmp_path / "saved")
        list(reader.iter_episodes(include_open=True))
        reader.read_episode(10 ** 6)
        reader.episodes()
        reader.count_valid_starts(5)
        reader.count_episodes(5)
        reader.committed_rows()
        len(reader)
        reader.stats()
        with reader.prefetch(4, 5, device="cpu") as batches:
            next(iter(batches))
        assert cli_main(["info", buf.name]) == 0
        assert "in /dev/shm" in capsys.readouterr().out   # what it holds, labelled
        assert buf.stats().reserved_bytes == before
    finally:
        reader.close()


def test_capacity_larger_than_dev_shm_needs_overcommit():
    total = os.statvfs(SHM).f_blocks * os.statvfs(SHM).f_frsize
    if not total:
        pytest.skip("/dev/shm has no size limit")
    capacity = 2 * total // ROW
    with pytest.raises(shmbuf.SharedMemoryFullError, match="overcommit=True") as info:
        shmbuf.create(SPEC, capacity)
    fits = int(str(info.value).split("a capacity of about ")[1].split()[0])
    assert 0 < fits < capacity and L.plan(SPEC, fits).total_bytes <= total
    with shmbuf.create(SPEC, capacity, overcommit=True) as buf:
        assert buf.stats().reserved_bytes < 1 << 20
        fill(buf, 20)
        assert buf.sample_sequences(2, 3)["obs"].shape == (3, 2, ROW)


@pytest.mark.parametrize("flag", ["prefault", "overcommit"])
def test_flags_must_be_bools(flag):
    with pytest.raises(TypeError, match=flag):
        shmbuf.create(SPEC, 64, **{flag: "yes"})


def _claim_and_die(name):
    buf = shmbuf.attach(name)
    w = buf.writer()
    # after the claim, before any row
    w._on_claim = lambda chunk: os.kill(os.getpid(), signal.SIGKILL)
    w.add(obs=np.zeros(ROW, np.uint8), done=False)


@pytest.mark.slow
def test_writer_killed_after_its_reservation_leaks_nothing(make_buffer):
    buf = make_buffer(SPEC, 1 << 9, chunk_size=32)
    p = mp.get_context("spawn").Process(target=_claim_and_die, args=(buf.name,))
    with running([p]):
        join_all([p], TIMEOUT, expect=-signal.SIGKILL)   # it killed itself after its claim
    assert buf.stats().reserved_bytes >= chunk_bytes(buf)  # the dead claim's pages stay
    fill(buf, 3 << 9)   # round the ring thrice: the dead claim's chunk is reused
    st = buf.stats()
    # 3 << 9 steps are whole chunks, so the ring ends full: every chunk, the
    # dead claim's included, holds the newest steps.  Had the dead claim's
    # chunk stayed held, one chunk would be empty (and 32 steps missing).
    assert st.chunks_in_use == st.n_chunks and st.live_steps == 1 << 9, st
    assert st.reserved_bytes <= st.total_bytes


@pytest.mark.slow
def test_full_dev_shm_raises_at_a_claim_and_writing_resumes():
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs root and unshare(1) for a private tmpfs on /dev/shm")
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True, timeout=TIMEOUT)
    if probe.returncode:
        pytest.skip(f"unshare -m is not permitted here: {probe.stderr.decode().strip()}")
    script = ("mount -t tmpfs -o size=12m shmbuf-test /dev/shm && "
              f"exec {sys.executable} -m helpers.full_shm")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [TESTS_DIR] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    run = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True,
                         timeout=4 * TIMEOUT, env=env, cwd=TESTS_DIR)
    assert run.returncode == 0, run.stderr.decode()[-3000:]
    out = json.loads(run.stdout.decode().strip().splitlines()[-1])
    assert out["shm_bytes"] == 12 << 20
    assert len(out["full"]) == 2
    for report in out["full"]:
        assert report["steps"] > 0
        assert out["name"] in report["error"] and "left" in report["error"]
        assert "bytes" in report["error"] and "retried" in report["error"]
    assert out["reserved_full"] <= out["shm_bytes"]
    assert out["sampled"] == 16 and out["sampled_after"] == 16
    assert out["resumed"] == [256, 256]
    assert out["live_after"] >= out["live_before"] + 2 * 256 - 2 * 64
    assert out["exitcodes"] == [0, 0]
