"""Compressed cold chunks: real Atari frames, /dev/shm measured, every read bit-identical.

Frames come from ale-py (its wheel ships the ROMs): a random policy plays Breakout and
MsPacman, 64x64x3 channels first.  Each step stores ``obs = frames[idx]`` and ``idx``, so
a batch is checked against the ground truth with one comparison.  The same steps go into a
raw buffer and a compressing one made with the same seed; every read path must return the
same bytes from both.
"""
import multiprocessing as mp
import os
import shutil
import signal
import time

import numpy as np
import pytest

import shmbuf

pytest.importorskip("zstandard")   # the compress extra (the test extra installs it)
from helpers.atari import FRAME, SHM, check, fill, shm_used, spec
from helpers.atari import play as _play
from helpers.procs import join_all, reap, running

from shmbuf import Compress
from shmbuf.select import AgeBuckets, Mixture, Prioritized, Recency, Uniform

TIMEOUT = 60


@pytest.fixture(scope="module")
def frames():
    """1,200 real frames: 600 of Breakout, then 600 of MsPacman."""
    return np.concatenate([_play("Breakout", 600, 1), _play("MsPacman", 600, 2)])


@pytest.fixture(scope="module")
def frames_file(frames, tmp_path_factory):
    path = tmp_path_factory.mktemp("frames") / "frames.npy"
    np.save(path, frames)
    return str(path)


def words_left_by(buf, pids):
    """Chunk words still held by one of ``pids`` (a compressor that was killed)."""
    from shmbuf.protocol.packing import unpack_word
    held = []
    for w in buf.port.packing.words.tolist():
        _, phase, _, pid = unpack_word(w)
        if phase in (1, 2) and pid in pids:
            held.append(w)
    return held


# -- bad input at create: a clear error, nothing created -----------------------------------
@pytest.mark.parametrize("make, match", [
    (lambda: Compress("rgb"), "columns names 'rgb', which is not a column of the spec"),
    (lambda: Compress("obs", codec="gzip"), r"codec must be one of \['lz4', 'zstd'\]"),
    (lambda: Compress("obs", level=23), "level must be an int from -7 to 22"),
    (lambda: Compress("obs", codec="lz4", level=0), "level must be an int from 1 to 12"),
    (lambda: Compress("obs", hot_steps=-1), "hot_steps must be None or an int >= 0"),
    (lambda: Compress("obs", hot_steps=1001), r"hot_steps must be at most the capacity \(1000\)"),
    (lambda: Compress("done"), "columns names .done., the done_key"),
    (lambda: Compress([]), "columns must name at least one column"),
    (lambda: "obs", "compress must be a shmbuf.Compress"),
])
def test_bad_input_names_the_argument_and_creates_nothing(make, match):
    before = set(os.listdir(SHM))
    name = f"shmbuf-test-badcompress-{os.getpid()}"
    with pytest.raises((ValueError, TypeError), match=match):
        shmbuf.create(spec(), 1000, name=name, compress=make())
    assert not os.path.exists(os.path.join(SHM, name))
    assert {n for n in set(os.listdir(SHM)) - before if str(os.getpid()) in n} == set()


def test_unknown_codec_lists_the_installed_ones():
    with pytest.raises(ValueError, match=r"installed here: \[.*'zstd'"):
        Compress("obs", codec="brotli")


# -- memory ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_compact_gives_pages_back_to_dev_shm(make_buffer, frames):
    """statvfs and stats() agree: real frames need a small fraction of the raw bytes."""
    raw = make_buffer(spec(), 1024, chunk_size=16, seed=3)
    fill(raw, frames, 1200)
    base = shm_used()
    buf = make_buffer(spec(), 1024, chunk_size=16, seed=3, compress=Compress("obs", hot_steps=0))
    buf._packer.stop()      # only compact() compresses here: the figures are compact()'s
    fill(buf, frames, 1200)
    full = shm_used() - base
    assert buf.compact(timeout=TIMEOUT) > 0
    after = shm_used() - base
    st = buf.stats()
    c = st.compression
    assert c.cold_raw_chunks == 0 and c.compressed_chunks == 1024 // 16
    assert c.raw_bytes == 1024 * 3 * 64 * 64 and c.ratio > 10
    raw_bytes = raw.stats().reserved_bytes
    # Other processes share /dev/shm: the drop, not the level, is what this buffer did.
    assert full - after > 0.8 * (full - st.reserved_bytes)
    assert st.reserved_bytes < raw_bytes / 5
    assert st.reserved_bytes == os.fstat(buf._space.fd).st_blocks * 512
    check(frames, buf.sample_sequences(32, 16))


def test_hot_steps_stay_raw(make_buffer, frames):
    buf = make_buffer(spec(), 1024, chunk_size=16, compress=Compress("obs", hot_steps=256))
    fill(buf, frames, 1024)
    buf.compact(timeout=TIMEOUT)
    c = buf.stats().compression
    assert c.raw_chunks == 256 // 16 and c.compressed_chunks == (1024 - 256) // 16
    assert c.hot_steps == 256


def test_noise_stays_raw_and_costs_nothing(make_buffer):
    noise = np.random.default_rng(0).integers(0, 256, (600, *FRAME), np.uint8)
    raw = make_buffer(spec(), 512, chunk_size=16, seed=1)
    buf = make_buffer(spec(), 512, chunk_size=16, seed=1, compress=Compress("obs", hot_steps=0))
    for b in (raw, buf):
        fill(b, noise, 600)
    assert buf.compact(timeout=TIMEOUT) == 0
    c = buf.stats().compression
    assert c.compressed_chunks == 0 and c.cold_raw_chunks == 0 and c.stored_bytes == 0
    assert buf.stats().reserved_bytes <= 1.02 * raw.stats().reserved_bytes
    check(noise, buf.sample_sequences(16, 8))


def test_default_hot_steps_is_a_twentieth_of_the_capacity(make_buffer):
    buf = make_buffer(spec(), 100_000, compress=Compress("obs"))
    assert buf.stats().compression.hot_steps == 5000
    small = make_buffer(spec(), 1000, chunk_size=16, compress=Compress("obs"))
    assert small.stats().compression.hot_steps == 8 * 16


# -- writers wrapping around ---------------------------------------------------------------
def test_a_writer_wrapping_into_packed_chunks_gets_raw_pages(make_buffer, frames):
    buf = make_buffer(spec(), 512, chunk_size=16, compress=Compress("obs", hot_steps=0))
    fill(buf, frames, 512)
    buf.compact(timeout=TIMEOUT)
    small = buf.stats().reserved_bytes
    buf._packer.stop()     # nothing packs the new rows: the pages they need come back
    fill(buf, frames, 512, start=512)
    st = buf.stats()
    assert st.compression.compressed_chunks == 0
    assert st.reserved_bytes > small + 400 * 3 * 64 * 64
    check(frames, buf.sample_sequences(32, 16))
    assert buf.compact(timeout=TIMEOUT) == 512 // 16


# -- every read path, raw against compressed ------------------------------------------------
@pytest.fixture(scope="module")
def pair(frames):
    """A raw and a compressing buffer holding the same steps, made with the same seed."""
    made = []
    try:
        for comp in (None, Compress("obs", hot_steps=64)):
            b = shmbuf.create(spec(), 1024, chunk_size=16, seed=11, compress=comp,
                              priorities=True)
            fill(b, frames, 1100, episode=37)
            made.append(b)
        made[1].compact(timeout=TIMEOUT)
        assert made[1].stats().compression.compressed_chunks > 40
        yield made
    finally:
        for b in made:
            b.close()


@pytest.mark.parametrize("select", [
    Uniform(), Recency(0.7), AgeBuckets([1, 2]), Prioritized(0.6),
    Mixture([(0.5, Uniform()), (0.5, Recency(1.0))]), "episodes"])
def test_samples_are_bit_identical(pair, frames, select):
    raw, packed = pair
    kw = {"uniform": "episodes"} if select == "episodes" else {"select": select}
    for time_major in (True, False):
        a = raw.sample_sequences(24, 20, rng=5, time_major=time_major, **kw)
        b = packed.sample_sequences(24, 20, rng=5, time_major=time_major, **kw)
        assert a.keys() == b.keys()
        check(frames, b)
        if isinstance(select, Prioritized):
            continue   # its draws are not reproducible from a seed even between raw buffers
        for k in a:
            assert np.array_equal(a[k], b[k]), k


def test_out_and_sample_steps_are_bit_identical(pair, frames):
    raw, packed = pair
    outs = [{"obs": np.zeros((20, 8, *FRAME), np.uint8), "idx": np.zeros((20, 8), np.int64),
             "done": np.zeros((20, 8), bool)} for _ in range(2)]
    for b, out in zip(pair, outs):
        b.sample_sequences(8, 20, rng=9, out=out)
    assert all(np.array_equal(outs[0][k], outs[1][k]) for k in outs[0])
    check(frames, outs[1])
    a, b = raw.sample_steps(64, rng=4), packed.sample_steps(64, rng=4)
    assert np.array_equal(a["obs"], b["obs"]) and np.array_equal(a["idx"], b["idx"])


def test_episodes_are_bit_identical(pair, frames):
    raw, packed = pair
    ea = list(raw.iter_episodes(include_open=True))
    eb = list(packed.iter_episodes(include_open=True))
    assert len(ea) == len(eb) > 10
    for x, y in zip(ea, eb):
        assert all(np.array_equal(x[k], y[k]) for k in x)
        check(frames, y)
    n = raw.episodes().index[-1]
    x, y = raw.read_episode(int(n)), packed.read_episode(int(n))
    assert all(np.array_equal(x[k], y[k]) for k in x)


def test_checkpoints_are_bit_identical(pair, frames):
    raw, packed = pair
    a, b = raw.snapshot(), packed.snapshot()
    for k in a["columns"]:
        assert np.array_equal(a["columns"][k], b["columns"][k]), k
    check(frames, b["columns"])
    sa, sb = raw.state_dict(), packed.state_dict()
    assert all(np.array_equal(sa["columns"][k].numpy(), sb["columns"][k].numpy())
               for k in sa["columns"])


def test_dataset_and_prefetch_are_bit_identical(pair, frames):
    got = []
    for b in pair:
        with b.prefetch(8, 12, device="cpu", rng=3) as it:
            got.append([next(it)["obs"].numpy().copy() for _ in range(3)])
    assert all(np.array_equal(x, y) for x, y in zip(*got))
    items = [next(iter(b.dataset(6, 10, batches=1, seed=2))) for b in pair]
    assert np.array_equal(items[0]["obs"].numpy(), items[1]["obs"].numpy())
    check(frames, {k: v.numpy() for k, v in items[1].items()})


@pytest.mark.slow
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_dataloader_workers_read_compressed_chunks(pair, frames, method):
    """Workers attach by name, decode in their own process, and hand over true batches."""
    from torch.utils.data import DataLoader
    loader = DataLoader(pair[1].dataset(8, 12, batches=3), batch_size=None, num_workers=2,
                        multiprocessing_context=method, timeout=TIMEOUT)
    batches = list(loader)
    assert len(batches) == 3
    for b in batches:
        check(frames, {k: v.numpy() for k, v in b.items()})


@pytest.mark.slow
def test_save_and_load_keep_every_step_and_the_compression(pair, frames, tmp_path):
    loaded = []
    try:
        for i, b in enumerate(pair):
            b.save(tmp_path / str(i))
            loaded.append(shmbuf.load(tmp_path / str(i), seed=11))
        assert loaded[0].stats().compression is None
        c = loaded[1].stats().compression
        assert c is not None and c.hot_steps == 64
        loaded[1].compact(timeout=TIMEOUT)
        assert loaded[1].stats().compression.compressed_chunks > 40
        a, b = loaded[0].snapshot()["columns"], loaded[1].snapshot()["columns"]
        assert all(np.array_equal(a[k], b[k]) for k in a)
        check(frames, b)
    finally:
        for b in loaded:
            b.close()
            shutil.rmtree(tmp_path, ignore_errors=True)


def disk_bytes(path) -> int:
    """Bytes the files under ``path`` take on disk (allocated blocks: holes take none)."""
    return sum(os.stat(os.path.join(path, f)).st_blocks * 512 for f in os.listdir(path))


def test_save_writes_compressed_blocks_as_they_are(pair, frames, tmp_path):
    import json
    raw_dir, packed_dir = tmp_path / "raw", tmp_path / "packed"
    pair[0].save(raw_dir)
    pair[1].save(packed_dir)
    manifest = json.loads((packed_dir / "manifest.json").read_text())
    assert manifest["version"] == 2 and manifest["packed"]["codec"] == "zstd"
    assert manifest["packed"]["blocks"] > 40
    # the save of an uncompressed buffer is the version 1 save, file for file
    assert json.loads((raw_dir / "manifest.json").read_text())["version"] == 1
    assert not (raw_dir / "_packed.npy").exists() and not (raw_dir / "_blocks.npy").exists()
    assert disk_bytes(packed_dir) * 4 < disk_bytes(raw_dir)
    loaded = []
    try:
        for d in (raw_dir, packed_dir):
            loaded.append(shmbuf.load(d, seed=11))
        assert np.array_equal(pair[0].snapshot()["columns"]["obs"], loaded[1].snapshot()[
            "columns"]["obs"])
        want, got = loaded[0].snapshot(), loaded[1].snapshot()   # a load renumbers episodes
        for k in want["columns"]:
            assert np.array_equal(want["columns"][k], got["columns"][k])
        assert np.array_equal(want["episode"], got["episode"])
        assert np.array_equal(want["ends"], got["ends"])
        check(frames, got["columns"])
        a = loaded[0].sample_sequences(8, 16)
        b = loaded[1].sample_sequences(8, 16)
        assert all(np.array_equal(a[k], b[k]) for k in a)
    finally:
        for b in loaded:
            b.close()


@pytest.mark.parametrize("damage", ["flip", "truncate", "entry"])
def test_a_damaged_compressed_save_is_a_corrupt_save_error(pair, tmp_path, damage):
    pair[1].save(tmp_path / "s")
    table = np.load(tmp_path / "s" / "_packed.npy")
    blocks = tmp_path / "s" / "_blocks.npy"
    header = os.path.getsize(blocks) - int(table[-1, 3] + table[-1, 4])
    if damage == "flip":        # a byte inside a block (zstd frames carry a checksum)
        with open(blocks, "r+b") as f:
            at = header + int(table[3, 3] + table[3, 4] // 2)
            f.seek(at)
            byte = f.read(1)
            f.seek(at)
            f.write(bytes([byte[0] ^ 0xFF]))
    elif damage == "truncate":
        os.truncate(blocks, os.path.getsize(blocks) - 10)
    else:                       # an entry pointing past the rows
        table[0, 1] = 10**9
        with open(tmp_path / "s" / "_packed.npy", "r+b") as f:
            f.seek(os.path.getsize(tmp_path / "s" / "_packed.npy") - table.nbytes)
            f.write(table.tobytes())
    from helpers.shm import own_entries
    before = own_entries()     # only this session's: other programs' come and go meanwhile
    with pytest.raises(shmbuf.CorruptSaveError, match="_blocks.npy|_packed.npy"):
        shmbuf.load(tmp_path / "s")
    assert own_entries() - before == set()


def test_a_following_saver_keeps_compressed_and_raw_chunks_true(make_buffer, frames, tmp_path):
    buf = make_buffer(spec(), 512, chunk_size=16, seed=5, compress=Compress("obs", hot_steps=64))
    fill(buf, frames, 400)
    buf.compact(timeout=TIMEOUT)
    saver = buf.save(tmp_path / "s", follow=True)
    try:
        saver.flush()
        fill(buf, frames, 300, start=400)   # wraps: new raw chunks, some recycled
        saver.flush()
    finally:
        saver.close()
    import json
    assert json.loads((tmp_path / "s" / "manifest.json").read_text())["version"] == 2
    assert saver.missed == 0
    with shmbuf.load(tmp_path / "s", capacity=1024) as back:
        got = back.snapshot()["columns"]
        check(frames, got)
        assert np.array_equal(got["idx"], np.arange(700))   # every step, compressed or raw


# -- crashes --------------------------------------------------------------------------------
@pytest.mark.slow
def test_samples_stay_true_while_writers_run_and_the_compressor_is_killed(
        make_buffer, frames, frames_file):
    from helpers import compress_workers as cw
    buf = make_buffer(spec(), 1024, chunk_size=16, compress=Compress("obs", hot_steps=32))
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    readies = [ctx.Event() for _ in range(2)]
    writers = [ctx.Process(target=cw.write_frames, args=(buf.name, frames_file, 400 * k, stop, r))
               for k, r in enumerate(readies)]
    killed, rng, batches, left_held = set(), np.random.default_rng(0), 0, 0
    with running(writers):
        assert all(r.wait(TIMEOUT) for r in readies)
        for _ in range(6):
            started = ctx.Event()
            comp = ctx.Process(target=cw.compact_forever, args=(buf.name, started))
            with running([comp]):
                assert started.wait(TIMEOUT)
                deadline = time.monotonic() + rng.uniform(0.02, 0.3)
                while time.monotonic() < deadline:   # sample while it compresses
                    if len(buf) >= 64:
                        check(frames, buf.sample_sequences(16, 24))
                        batches += 1
                os.kill(comp.pid, signal.SIGKILL)
                comp.join(TIMEOUT)
            killed.add(comp.pid)
            left_held += len(words_left_by(buf, {comp.pid}))
            check(frames, buf.sample_sequences(16, 24))
        stop.set()
        join_all(writers, TIMEOUT)
        buf.compact(timeout=TIMEOUT)          # takes over what the dead left held
        assert words_left_by(buf, killed) == []
        c = buf.stats().compression
        assert c.cold_raw_chunks == 0 and c.compressed_chunks > 0
        for _ in range(5):
            check(frames, buf.sample_sequences(32, 24))
        for ep in buf.iter_episodes():
            check(frames, ep)
        assert batches > 0


@pytest.mark.slow
def test_an_adopter_goes_on_compressing(frames_file, frames):
    from helpers import compress_workers as cw
    name = f"shmbuf-test-compressadopt-{os.getpid()}"
    ctx = mp.get_context("spawn")
    filled = ctx.Event()
    owner = ctx.Process(target=cw.own_fill_and_die, args=(name, frames_file, 1100, 64, filled))
    buf = None
    try:
        owner.start()
        assert filled.wait(TIMEOUT)
        join_all([owner], TIMEOUT, expect=-signal.SIGKILL)
        reader = shmbuf.attach(name)       # not the owner: it compresses nothing
        try:
            assert reader.stats().compression.compressed_chunks == 0
        finally:
            reader.close()
        buf = shmbuf.attach(name, own=True, handle_signals=False)

        def packed():
            c = buf.stats().compression
            return True if c.cold_raw_chunks == 0 and c.compressed_chunks else None
        from shmbuf.posix.wait import poll
        poll(packed, TIMEOUT, lambda: TimeoutError("the adopter never compressed"))
        check(frames, buf.sample_sequences(16, 20))
    finally:
        reap([owner])
        if buf is not None:
            buf.close()
        else:
            try:
                shmbuf.attach(name, own=True, handle_signals=False).close()
            except (shmbuf.SegmentNotFoundError, shmbuf.OwnerAliveError):
                pass


# -- the command line -------------------------------------------------------------------------
def test_info_shows_compression(make_buffer, frames, capsys):
    from shmbuf.cli import main
    buf = make_buffer(spec(), 512, chunk_size=16, compress=Compress("obs", hot_steps=0))
    fill(buf, frames, 512)
    buf.compact(timeout=TIMEOUT)
    assert main(["info", buf.name]) == 0
    out = capsys.readouterr().out
    assert "compression  zstd level 1 on ['obs']" in out
    assert "32 chunks packed, 0 raw (0 cold still to do)" in out
    assert main(["top", buf.name, "--iterations", "1", "--plain", "--interval", "0.01"]) == 0
    assert "32 chunks packed" in capsys.readouterr().out


# -- a full /dev/shm --------------------------------------------------------------------------
def run_in_small_shm(module: str, size: str) -> dict:
    """Run ``python -m module`` with /dev/shm a fresh tmpfs of ``size`` of its own (a
    mount namespace, root only); return the JSON line it printed last."""
    import json
    import subprocess
    import sys
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs root and unshare(1) for a private tmpfs on /dev/shm")
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True, timeout=TIMEOUT,
                           check=False)
    if probe.returncode:
        pytest.skip(f"unshare -m is not permitted here: {probe.stderr.decode().strip()}")
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    script = (f"mount -t tmpfs -o size={size} shmbuf-test /dev/shm && "
              f"exec {sys.executable} -m {module}")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [tests_dir] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    run = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True,
                         timeout=4 * TIMEOUT, env=env, cwd=tests_dir, check=False)
    assert run.returncode == 0, run.stderr.decode()[-3000:]   # a SIGBUS would be -7 here
    return json.loads(run.stdout.decode().strip().splitlines()[-1])


@pytest.mark.slow
def test_full_dev_shm_gives_shared_memory_full_error_never_sigbus():
    out = run_in_small_shm("helpers.full_shm_compress", "8m")
    assert out["shm_bytes"] == 8 << 20
    assert out["compact_full"] is not None and "compressed columns" in out["compact_full"]
    assert out["wrap_full"] is not None and "again" in out["wrap_full"]
    assert out["compacted"] > 0 and out["resumed"]
    assert out["true_after_compact_full"] and out["true_when_full"] and out["true_at_end"]
    assert out["parallel_full"] is not None and "compressed columns" in out["parallel_full"]
    assert out["parallel_left_held"] == 0 and out["true_after_parallel_full"]


@pytest.mark.slow
def test_a_full_dev_shm_keeps_each_streams_steps_its_newest_run():
    # Wrapping into a compressed chunk with /dev/shm full fails at the claim; the chunk
    # must stay next to recycle, not keep its old steps for a lap (out of FIFO order).
    out = run_in_small_shm("helpers.full_shm_fifo", "64m")
    assert out["shm_bytes"] == 64 << 20
    assert all(e is not None and "Nothing was written" in e for e in out["full"]), out["full"]
    for wid, held in enumerate(out["runs"]):
        newest = out["written"][wid] - 1
        assert len(held) == 1 and held[0][1] == newest, (wid, held)
    assert out["true"]


# -- the facades ------------------------------------------------------------------------------
def test_facades_take_compress(frames):
    from shmbuf.compat.diamond import ReplayBuffer as DiamondBuffer
    from shmbuf.compat.dreamer import ReplayBuffer
    from shmbuf.compat.iris import IRISReplayBuffer
    made = [ReplayBuffer(512, FRAME, 6, seq_len=8, batch_size=4,
                         compress=Compress("obs", hot_steps=0)),
            IRISReplayBuffer(512, FRAME, 6, seq_len=8, batch_size=4, compress=True),
            DiamondBuffer(512, (64, 64, 3), compress=True)]
    try:
        for rb in made:
            c = rb.buffer.stats().compression
            assert c is not None
        assert made[2].buffer.stats().compression.columns == ("obs", "next_obs")
        rb = made[0]
        for i in range(300):
            rb.add({"image": frames[i]}, np.zeros(6, np.float32), 0.0, float(i % 50 == 49))
        rb.buffer.compact(timeout=TIMEOUT)
        assert rb.buffer.stats().compression.compressed_chunks > 0
        obs = rb.sample()[0]
        assert any(np.array_equal(obs[0, 0], f) for f in frames[:300])
        with pytest.raises(TypeError, match="compress must be True, False, None or a shmbuf"):
            ReplayBuffer(512, FRAME, 6, compress="zstd")
    finally:
        for rb in made:
            rb.close()


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["busy", "punching", "half-punched"])
def test_a_compressor_killed_while_holding_a_chunk(make_buffer, frames, phase):
    """Reads stay true, compact() takes the word over, and a writer reaching the chunk gets
    whole raw pages, whatever the compressor was doing when it died."""
    from helpers import compress_workers as cw
    buf = make_buffer(spec(), 512, chunk_size=16, compress=Compress("obs", hot_steps=0))
    buf._packer.stop()
    fill(buf, frames, 512)
    ctx = mp.get_context("spawn")
    held = ctx.Queue()
    p = ctx.Process(target=cw.die_holding, args=(buf.name, phase, held))
    with running([p]):
        held.get(timeout=TIMEOUT)
        join_all([p], TIMEOUT, expect=-signal.SIGKILL)
    assert len(words_left_by(buf, {p.pid})) == 1
    check(frames, buf.snapshot()["columns"])      # every chunk, that one included
    for _ in range(3):
        check(frames, buf.sample_sequences(32, 16))
    if phase == "busy":        # another compressor takes the word over
        assert buf.compact(timeout=TIMEOUT) > 0
        assert words_left_by(buf, {p.pid}) == []
        assert buf.stats().compression.cold_raw_chunks == 0
        check(frames, buf.snapshot()["columns"])
    # A writer going round the ring reaches that chunk: whole raw pages again, then
    # steps that read back true (a hole would read zeros, or SIGBUS on a full /dev/shm).
    fill(buf, frames, 512, start=512)
    assert words_left_by(buf, {p.pid}) == []
    assert buf.stats().compression.compressed_chunks == 0
    assert buf.stats().reserved_bytes >= 512 * 3 * 64 * 64
    check(frames, buf.snapshot()["columns"])
    assert buf.compact(timeout=TIMEOUT) == 512 // 16
    check(frames, buf.sample_sequences(32, 16))


@pytest.mark.parametrize("hot", [None, 0])
def test_close_unmaps_a_buffer_this_thread_read(frames, hot):
    """A thread's reader slot must not keep a closed buffer's mapping (and its pages) alive."""
    buf = shmbuf.create(spec(), 512, chunk_size=16,
                        compress=None if hot is None else Compress("obs", hot_steps=hot))
    name = buf.name
    try:
        fill(buf, frames, 512)
        buf.compact(timeout=TIMEOUT)
        check(frames, buf.sample_sequences(8, 16))
    finally:
        buf.close()
    del buf
    with open("/proc/self/maps") as f:
        assert name not in f.read()


def test_a_buffer_twice_the_size_of_dev_shm_fits_when_compressed(make_buffer):
    """create refuses a raw capacity /dev/shm could never hold; compressed, the cold rows are
    given back, so only the raw columns and the hot rows have to fit."""
    st = os.statvfs(SHM)
    steps = 2 * st.f_blocks * st.f_frsize // (3 * 64 * 64)
    with pytest.raises(shmbuf.SharedMemoryFullError, match="overcommit=True"):
        make_buffer(spec(), steps)
    buf = make_buffer(spec(), steps, compress=Compress("obs"))
    assert buf.stats().total_bytes > st.f_blocks * st.f_frsize
    assert buf.stats().reserved_bytes < 1 << 20


def test_write_steps_refuses_a_compressed_column(frames):
    """A packed step's bytes live in its block: an in-place write would be lost."""
    buf = shmbuf.create(spec(), 512, chunk_size=16, priorities=True,
                        compress=Compress("obs", hot_steps=0))
    try:
        fill(buf, frames, 512)
        buf.compact(timeout=TIMEOUT)
        batch = buf.sample_sequences(4, 8, ids=True)
        with pytest.raises(ValueError, match="column 'obs' is compressed"):
            buf.write_steps(batch["ids"], obs=np.zeros((8, 4, *FRAME), np.uint8))
        check(frames, buf.sample_sequences(16, 8))
        assert buf.write_steps(batch["ids"], idx=batch["idx"]) == 32   # raw columns: fine
    finally:
        buf.close()


def test_the_dreamerv3_replay_takes_compress(frames, tmp_path):
    from shmbuf.compat.embodied import Replay
    images = frames.transpose(0, 2, 3, 1)          # DreamerV3's (64, 64, 3)
    r = Replay(8, 512, directory=tmp_path / "saved", compress=Compress("image", hot_steps=0),
               handle_signals=False)
    try:
        for t in range(400):
            r.add({"image": images[t], "step": np.int64(t)}, worker=0)
        c = r.buffer.stats().compression
        assert c is not None and c.columns == ("k0",)
        r.buffer.compact(timeout=TIMEOUT)
        assert r.buffer.stats().compression.compressed_chunks > 0
        data = r.sample(16)
        assert np.array_equal(data["image"], images[data["step"]])
        r.save()                                 # the chunk files hold the true frames
        back = Replay(8, 512, directory=tmp_path / "saved", handle_signals=False)
        try:
            back.load()
            data = back.sample(16)
            assert np.array_equal(data["image"], images[data["step"]])
        finally:
            back.close()
    finally:
        r.close()
    with pytest.raises(ValueError, match="columns names 'rgb', which is not a key"):
        bad = Replay(8, 512, compress=Compress("rgb"), handle_signals=False,
                     spec={"image": ((64, 64, 3), np.uint8)})
        bad.close()
    with pytest.raises(TypeError, match="compress must be True, False, None or a shmbuf"):
        Replay(8, 512, compress="zstd", handle_signals=False)


def test_long_metadata_and_compression_share_the_layout(make_buffer, frames):
    """Metadata past the header's room and the packing area both live after the index."""
    meta = {"notes": "x" * 5000}
    buf = make_buffer(spec(), 512, chunk_size=16, meta=meta,
                      compress=Compress("obs", hot_steps=0))
    fill(buf, frames, 512)
    buf.compact(timeout=TIMEOUT)
    other = shmbuf.attach(buf.name)
    try:
        assert other.meta["notes"] == meta["notes"]
        assert other.stats().compression.compressed_chunks == 512 // 16
        check(frames, other.sample_sequences(16, 12))
    finally:
        other.close()
