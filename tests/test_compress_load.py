"""Loading a compressing buffer's save: its compressed blocks go back as they are.

Real Atari frames (Breakout, MsPacman: ``helpers.atari``), stored as ``obs = frames[idx]``
with ``idx``, so every read is checked against the ground truth; the same steps saved
from a raw buffer and loaded with the same seed give the reference for every read path.
/dev/shm is measured with statvfs, not only through ``stats()``.
"""
import json
import os
import subprocess

import numpy as np
import pytest

import shmbuf

pytest.importorskip("zstandard")   # the compress extra (the test extra installs it)
from helpers import atari
from helpers.atari import SHM, check, play, shm_used, spec

from shmbuf import Compress
from shmbuf.posix.wait import poll
from shmbuf.select import Recency, Uniform

TIMEOUT = 60
RAW_ROWS = 1024 * 3 * 64 * 64   # the obs bytes of a full 1024-step buffer, raw


@pytest.fixture(scope="module")
def frames():
    """1,000 real frames: 500 of Breakout, then 500 of MsPacman."""
    return np.concatenate([play("Breakout", 500, 3), play("MsPacman", 500, 4)])


def fill(buf, frames, steps, start=0):
    atari.fill(buf, frames, steps, start, episode=37)


@pytest.fixture(scope="module")
def saves(frames, tmp_path_factory):
    """The same steps (five streams, wrapped, episodes ended and cut) saved from a raw buffer
    and from a compacted compressing one: ``(raw save, compressed save, its compression)``."""
    root = tmp_path_factory.mktemp("saves")
    made = []
    try:
        for comp in (None, Compress("obs", hot_steps=64)):
            b = shmbuf.create(spec(), 1024, chunk_size=16, seed=11, compress=comp,
                              priorities=True)
            made.append(b)
            fill(b, frames, 500)
            with b.writer() as w:    # three env streams, filling chunks side by side
                for j in range(120):
                    idx = (np.arange(3) * 311 + j) % len(frames)
                    w.add_batch(obs=frames[idx], idx=idx, done=(idx % 23 == 0))
            with b.writer() as w:    # one more stream, cut without a terminal at its end
                for j in range(500):
                    w.add(obs=frames[(j * 7) % len(frames)], idx=(j * 7) % len(frames),
                          done=j % 29 == 28)
                w.end_episode()
        made[1].compact(timeout=TIMEOUT)
        for i, b in enumerate(made):
            b.save(root / str(i))
        yield root / "0", root / "1", made[1].stats().compression
    finally:
        for b in made:
            b.close()


def test_load_puts_the_compressed_chunks_back_compressed(saves, frames):
    raw_dir, packed_dir, source = saves
    assert json.loads((packed_dir / "manifest.json").read_text())["version"] == 2
    with shmbuf.load(raw_dir, seed=1) as raw:
        raw_reserved = raw.stats().reserved_bytes
    assert raw_reserved > RAW_ROWS
    seen = []
    for _ in range(3):   # other processes share /dev/shm: one quiet try is enough
        base = shm_used()
        with shmbuf.load(packed_dir, seed=1) as buf:
            seen.append(shm_used() - base)
            st = buf.stats()
            c = st.compression
            assert c.compressed_chunks == source.compressed_chunks > 50
            assert (c.raw_bytes, c.stored_bytes) == (source.raw_bytes, source.stored_bytes)
            assert c.cold_raw_chunks == 0
            # /dev/shm holds about the compressed bytes: the raw pages were never taken
            assert st.reserved_bytes == os.fstat(buf._space.fd).st_blocks * 512
            assert st.reserved_bytes < raw_reserved / 5
            check(frames, buf.sample_sequences(32, 16))
        if min(seen) < RAW_ROWS / 4:
            break
    assert min(seen) < RAW_ROWS / 4, seen   # statvfs, not only stats()


@pytest.mark.slow
def test_every_read_of_the_loaded_buffer_is_bit_identical(saves, frames, tmp_path):
    raw_dir, packed_dir, _ = saves
    a, b = shmbuf.load(raw_dir, seed=5), shmbuf.load(packed_dir, seed=5)
    try:
        b._packer.stop()   # the loaded chunks, as load left them
        assert b.stats().compression.compressed_chunks > 50
        for kw in ({"select": Uniform()}, {"select": Recency(0.7)}, {"uniform": "episodes"}):
            for time_major in (True, False):
                x = a.sample_sequences(24, 20, rng=7, time_major=time_major, **kw)
                y = b.sample_sequences(24, 20, rng=7, time_major=time_major, **kw)
                check(frames, y)
                assert all(np.array_equal(x[k], y[k]) for k in x)
        x, y = a.sample_steps(64, rng=4), b.sample_steps(64, rng=4)
        assert all(np.array_equal(x[k], y[k]) for k in x)
        ea, eb = a.episodes(), b.episodes()
        assert np.array_equal(ea.length, eb.length) and np.array_equal(ea.index, eb.index)
        xs, ys = list(a.iter_episodes(include_open=True)), list(b.iter_episodes(include_open=True))
        assert len(xs) == len(ys) > 20
        for x, y in zip(xs, ys):
            check(frames, y)
            assert all(np.array_equal(x[k], y[k]) for k in x)
        n = int(ea.index[-1])
        x, y = a.read_episode(n), b.read_episode(n)
        assert all(np.array_equal(x[k], y[k]) for k in x)
        sa, sb = a.snapshot(), b.snapshot()
        for k in ("stream", "episode", "ends", "chunks"):
            assert np.array_equal(sa[k], sb[k]), k
        assert all(np.array_equal(sa["columns"][k], sb["columns"][k]) for k in sa["columns"])
        check(frames, sb["columns"])
        da, db = a.state_dict(), b.state_dict()
        assert all(np.array_equal(da["columns"][k].numpy(), db["columns"][k].numpy())
                   for k in da["columns"])
        # a second save writes the same blocks again, and loads back to the same steps
        b.save(tmp_path / "again")
        first = np.load(packed_dir / "_packed.npy")
        again = np.load(tmp_path / "again" / "_packed.npy")
        assert np.array_equal(first, again)
        assert np.array_equal(np.load(packed_dir / "_blocks.npy"),
                              np.load(tmp_path / "again" / "_blocks.npy"))
        with shmbuf.load(tmp_path / "again", seed=5) as c:
            kept = b.stats().compression.compressed_chunks
            assert c.stats().compression.compressed_chunks == kept
            sc = c.snapshot()
            assert all(np.array_equal(sa["columns"][k], sc["columns"][k]) for k in sa["columns"])
    finally:
        a.close()
        b.close()


def _held(path) -> int:
    return sum(os.stat(f).st_blocks * 512 for f in path.iterdir())


def _apparent(path) -> int:
    return sum(os.stat(f).st_size for f in path.iterdir())


def test_a_compacted_save_is_sparse_and_loads_the_same_once_its_holes_are_filled(
        saves, frames, tmp_path):
    raw_dir, packed_dir, _ = saves
    # The compressed rows of obs.npy are holes: the save holds far less than it spans.
    assert _held(packed_dir) < _apparent(packed_dir) / 4
    # The copies the saving guide gives keep the holes.
    subprocess.run(["cp", "-r", "--sparse=always", str(packed_dir), str(tmp_path / "cp")],
                   check=True, timeout=TIMEOUT)
    archive = tmp_path / "save.tar"
    subprocess.run(["tar", "-S", "-cf", str(archive), "-C", str(packed_dir), "."],
                   check=True, timeout=TIMEOUT)
    (tmp_path / "tar").mkdir()
    subprocess.run(["tar", "-xf", str(archive), "-C", str(tmp_path / "tar")],
                   check=True, timeout=TIMEOUT)
    assert archive.stat().st_size < _apparent(packed_dir) / 4
    for copy in ("cp", "tar"):
        assert _held(tmp_path / copy) < _apparent(packed_dir) / 4, copy
    # A copy that writes every byte (object storage, tar without -S) fills the holes with
    # zeros: it is as large as a raw save, and loads the same steps.
    filled = tmp_path / "filled"
    filled.mkdir()
    for f in packed_dir.iterdir():
        (filled / f.name).write_bytes(f.read_bytes())
    assert _held(filled) >= _apparent(packed_dir)
    with shmbuf.load(raw_dir, seed=3) as a, shmbuf.load(filled, seed=3) as b:
        assert b.stats().compression.compressed_chunks > 50
        x, y = a.snapshot()["columns"], b.snapshot()["columns"]
        assert all(np.array_equal(x[k], y[k]) for k in x)
        check(frames, y)


def test_writers_wrap_into_loaded_chunks_and_compaction_goes_on(saves, frames):
    _, packed_dir, _ = saves
    with shmbuf.load(packed_dir, seed=2) as buf:
        buf._packer.stop()          # nothing packs the new rows: the pages they need come back
        small = buf.stats().reserved_bytes
        packed = buf.stats().compression.compressed_chunks
        fill(buf, frames, 300, start=5000)     # recycles the oldest loaded chunks
        st = buf.stats()
        assert st.compression.compressed_chunks < packed
        assert st.reserved_bytes > small + 250 * 3 * 64 * 64
        snap = buf.snapshot()["columns"]
        check(frames, snap)
        assert np.array_equal(snap["idx"][-300:], np.arange(5000, 5300) % len(frames))
        for _ in range(5):
            check(frames, buf.sample_sequences(32, 16))
        fill(buf, frames, 900, start=6000)     # every loaded chunk recycled
        assert buf.stats().compression.compressed_chunks == 0
        n = buf.compact(timeout=TIMEOUT)
        c = buf.stats().compression
        assert n > 50 and c.compressed_chunks == n and c.cold_raw_chunks == 0
        check(frames, buf.snapshot()["columns"])
        check(frames, buf.sample_sequences(32, 16))


def test_the_compressor_goes_on_in_the_loaded_buffer(saves, frames):
    from shmbuf.protocol.packing import PACKED, unpack_word
    _, packed_dir, _ = saves
    with shmbuf.load(packed_dir, seed=2) as buf:
        words = buf.port.packing.words
        _, count = buf._ring.chunk_states()
        raw = [c for c in range(len(count))   # the newest saved steps: loaded raw, hot
               if count[c] and unpack_word(int(words[c]))[1] != PACKED]
        assert raw
        fill(buf, frames, 128, start=9000)     # they turn cold

        def caught_up():
            c = buf.stats().compression
            packed = [x for x in raw if unpack_word(int(words[x]))[1] == PACKED]
            return True if c.cold_raw_chunks == 0 and packed else None
        poll(caught_up, TIMEOUT, lambda: TimeoutError("the loaded buffer's thread never packed"))
        assert buf._packer.last_error is None
        check(frames, buf.snapshot()["columns"])


@pytest.mark.parametrize("capacity", [2048, 1030])
def test_blocks_that_cannot_be_kept_are_decoded(saves, frames, capacity):
    """Another chunk size (2048: 32-step chunks, two saved blocks each) and a capacity
    below the save's rows (1030: a chunk is cut, and the blocks it shifts off the block
    grid are decoded) load every step true."""
    raw_dir, packed_dir, _ = saves
    with shmbuf.load(raw_dir, capacity=capacity, seed=4) as a, \
            shmbuf.load(packed_dir, capacity=capacity, seed=4) as b:
        # (its compressor thread may pack decoded chunks meanwhile: they are cold)
        assert b.chunk_size == (32 if capacity == 2048 else 16)
        assert b.stats().compression.compressed_chunks > 0
        sa, sb = a.snapshot(), b.snapshot()
        assert all(np.array_equal(sa["columns"][k], sb["columns"][k]) for k in sa["columns"])
        check(frames, sb["columns"])
        x, y = a.sample_sequences(16, 20, rng=3), b.sample_sequences(16, 20, rng=3)
        assert all(np.array_equal(x[k], y[k]) for k in x)


@pytest.mark.parametrize("capacity, chunk, kept", [(1008, 32, True), (1000, 16, False)])
def test_a_ring_with_a_short_last_chunk_loads_true(make_buffer, frames, tmp_path, capacity,
                                                   chunk, kept):
    """A capacity that is not a multiple of the chunk size: the source's short chunk shifts
    its stream's later chunks against the loaded buffer's.  A shift of whole blocks (16
    steps of 1008 % 32) still puts their blocks back compressed; another (8 steps) decodes
    them.  Either way the loaded steps are the saved ones."""
    src = make_buffer(spec(), capacity, chunk_size=chunk, seed=3,
                      compress=Compress("obs", hot_steps=64))
    fill(src, frames, 1500)
    src.compact(timeout=TIMEOUT)
    src.save(tmp_path / "s")
    packed = src.stats().compression.compressed_chunks
    with shmbuf.load(tmp_path / "s", seed=3) as back:
        back._packer.stop()
        if kept:
            assert back.stats().compression.compressed_chunks >= packed - 1
        want, got = src.snapshot()["columns"], back.snapshot()["columns"]
        assert all(np.array_equal(want[k], got[k]) for k in want)
        check(frames, back.sample_sequences(32, 16))


def _flip(path, at: int, bits: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ bits]))


@pytest.mark.parametrize("crc", [True, False])
def test_a_damaged_block_is_a_corrupt_save_error_and_creates_nothing(saves, tmp_path, crc):
    """A damaged byte in the middle of one block: the CRC catches even one flipped bit (one
    that zstd may decode past, unnoticed); a save made before the CRC: the trial decode
    catches a flipped byte.  The error names _blocks.npy; nothing is left in /dev/shm."""
    import shutil
    _, packed_dir, _ = saves
    path = tmp_path / "s"
    shutil.copytree(packed_dir, path)
    table = np.load(path / "_packed.npy")
    if not crc:     # the entries of a save made before the CRC: 5 fields
        np.save(path / "_packed.npy", np.ascontiguousarray(table[:, :5]))
        with shmbuf.load(path) as back:        # an undamaged one loads, compressed
            assert back.stats().compression.compressed_chunks > 50
    blocks = path / "_blocks.npy"
    header = os.path.getsize(blocks) - int(table[-1, 3] + table[-1, 4])
    _flip(blocks, header + int(table[7, 3] + table[7, 4] // 2), 0x01 if crc else 0xFF)
    before = set(os.listdir(SHM))
    with pytest.raises(shmbuf.CorruptSaveError, match="_blocks.npy"):
        shmbuf.load(path)
    assert not {n for n in set(os.listdir(SHM)) - before if n.startswith("shmbuf")}


def test_load_never_reserves_nor_maps_the_rows_it_puts_back_compressed(saves, monkeypatch):
    """Every reservation and page mapping during the load, recorded on their way through:
    none touches the obs rows of a chunk that holds its saved blocks (a reservation there
    that was punched again afterwards would still cost its pages for a while)."""
    from shmbuf.posix.space import Space
    from shmbuf.protocol.packing import PACKED, unpack_word
    from shmbuf.segment.pages import ChunkPages

    reserved, mapped = [], []
    reserve, populate = Space.reserve, ChunkPages.populate

    def spy_reserve(self, offset, length, what):
        reserved.append((offset, offset + length))
        return reserve(self, offset, length, what)

    def spy_populate(self, chunk):
        mapped.append(chunk)
        return populate(self, chunk)
    monkeypatch.setattr(Space, "reserve", spy_reserve)
    monkeypatch.setattr(ChunkPages, "populate", spy_populate)
    _, packed_dir, _ = saves
    with shmbuf.load(packed_dir, seed=1) as buf:
        buf._packer.stop()
        obs = buf._layout.column("obs")
        kept = [c for c, w in enumerate(buf.port.packing.words.tolist())
                if unpack_word(w)[1] == PACKED and unpack_word(w)[2] & 1]
        assert len(kept) > 50
        for c in kept:
            lo = obs.offset + c * 16 * obs.row_bytes
            hi = lo + 16 * obs.row_bytes
            assert not [r for r in reserved if r[0] < hi and r[1] > lo], c
            assert c not in mapped


@pytest.mark.parametrize("rows", [8, 32])
def test_an_entry_edited_to_other_rows_is_a_corrupt_save_error(saves, tmp_path, rows):
    """A block's CRC covers its bytes; the rows its entry names are checked against the
    block's own header (8: fewer than it holds) and the block grid (32: more than a
    block), so an edited entry is refused at load, not found by a reader later."""
    import shutil
    _, packed_dir, _ = saves
    path = tmp_path / "s"
    shutil.copytree(packed_dir, path)
    table = np.load(path / "_packed.npy")
    table[5, 2] = rows
    np.save(path / "_packed.npy", table)
    before = set(os.listdir(SHM))
    with pytest.raises(shmbuf.CorruptSaveError, match="_blocks.npy|_packed.npy"):
        shmbuf.load(path)
    assert not {n for n in set(os.listdir(SHM)) - before if n.startswith("shmbuf")}
