"""Compressed cold chunks on real Atari frames: memory, sampling, writing, keeping up.

    python benchmarks/bench_compress.py [--quick] [--steps N] [--json PATH]

Frames: ``_atari`` plays Breakout, MsPacman, Pong, SpaceInvaders and Seaquest with a random
policy (ale-py), 64x64x3 channels first (workload W1: obs uint8 (3, 64, 64), action f32 (6,),
reward f32, done bool); buffers are filled in episode order by cycling through those frames
(each chunk compresses on its own, so a cycle costs nothing but repeats).  Every row pairs a
compressing buffer with its baseline in the same run; targets are reported, never asserted.

Rows:
  c1   /dev/shm bytes of an N-step buffer after compact(), from statvfs and stats(),
       against the raw bytes of the same steps (target <= 0.1); c1p projects DreamerV3's
       5M-step default from c1's bytes per step.
  c2   noise frames: /dev/shm bytes compressed / raw buffer (<= 1.02x); c2s sampling them
       (50, 50) against the raw buffer (time ratio <= 1 / 0.95).
  c3   Writer.add per step, 2 spawned writers, compression on (the owner's thread
       compressing behind them) / off, interleaved rounds (time ratio <= 1 / 0.95).
  c4   sample_sequences(50, 50), every window in hot chunks / an uncompressed buffer (<= 1.05x).
  c5   the same batch with every window in cold chunks / the codec alone decoding the
       blocks the batch touches into one array that keeps them (<= 1.3x); c5h against
       the codec decoding each into one reused, cached block (its own speed, reported).
  c5r  sample(50, 50) with every window cold (zstd 1) / the same windows in an uncompressed
       buffer: what a cold batch costs against a raw one (reported).
  c5l  the same cold batch from an lz4 (level 1) buffer / from the zstd one, the same windows
       (reported); c5lb the obs bytes the lz4 buffer keeps / the zstd one's.
  c6   trainer wait per batch with 2 prefetch threads and 20 ms of compute per batch:
       cold chunks / raw buffer (<= 1.5x).
  c7a  2 writers stepping live ALE envs (Atari's own insert rate) behind the owner's
       compressor: the largest share of the capacity held by cold chunks still raw (reported;
       bounded = keeps up).
  c7b  the same with writers copying stored frames as fast as they can (a stress far above
       any env's rate).
  c7c  2 writers adding stored frames at 6,000 steps/s each while spinning their cores at
       100% (CPU-bound env workers on every core): the largest cold raw share (bounded =
       the catch-up thread takes CPU once the backlog passes its bound).
  c7w  steps a second the catch-up thread packs when it encodes on 2 threads / on 1 (it
       uses one thread per 4 usable cores), alternated, from a full cold buffer.
  c7r  steps a second one compressor thread packs (compact() of a full cold buffer) / the
       insert rate of c7a's writers (>= 1: it keeps up); c7rb the same against c7b's.
  c8   Buffer.save of a compressing buffer after compact() (its compressed blocks written as
       they are) / the same steps in an uncompressed buffer, interleaved rounds: c8 the time,
       c8d the bytes on disk (allocated blocks), c8l shmbuf.load of each save (the
       compressed blocks go back as they are), c8m the bytes of /dev/shm the loaded buffer
       holds right after load (its reserved_bytes).

``--only c8`` (keys separated by commas: c1, c2, c3, c4, c5, c7, c8) runs those sections alone.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _atari
from _store_report import Row, print_table

import shmbuf

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "bench_compress.json"
SPEC = {"obs": ((3, 64, 64), np.uint8), "action": ((6,), np.float32),
        "reward": ((), np.float32), "done": ((), np.bool_)}
ROW = sum(int(np.prod(s)) * np.dtype(d).itemsize for s, d in SPEC.values())
EPISODE_CAP = 1000        # frames per episode at most, so that every game contributes
DREAMER_DEFAULT = 5_000_000
WAIT = 120.0


def frames_file(per_game: int) -> str:
    """Play the games once and keep the frames (and done flags) in /tmp for this and children."""
    path = f"/tmp/shmbuf-bench-atari-{per_game}.npz"
    if not os.path.exists(path):
        parts = [_atari.play(g, per_game, seed=7, max_episode=EPISODE_CAP) for g in _atari.GAMES]
        frames = np.concatenate([p[0] for p in parts])
        done = np.concatenate([p[1] for p in parts])
        for i in np.cumsum([len(p[1]) for p in parts]) - 1:
            done[i] = True      # a game's last frame ends its episode
        np.savez(path + ".tmp.npz", frames=frames, done=done)
        os.replace(path + ".tmp.npz", path)
    return path


def load_frames(path: str) -> tuple[np.ndarray, np.ndarray]:
    z = np.load(path)
    return z["frames"], z["done"]


def fill(buf, frames, done, steps: int, start: int = 0, compact_every: int = 0) -> None:
    """``steps`` steps in episode order with ``extend`` (one episode at a time)."""
    n = len(frames)
    with buf.writer() as w:
        at, written = start % n, 0
        ends = np.flatnonzero(done)
        while written < steps:
            nxt = ends[np.searchsorted(ends, at)] + 1 if at <= ends[-1] else n
            k = int(min(nxt - at, steps - written))
            w.extend(obs=frames[at:at + k], action=np.zeros((k, 6), np.float32),
                     reward=np.zeros(k, np.float32), done=done[at:at + k])
            written += k
            at = (at + k) % n
            if compact_every and written % compact_every < k:
                buf.compact(timeout=WAIT)


def shm_used() -> int:
    st = os.statvfs("/dev/shm")
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def timed(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


# -- c1: memory ---------------------------------------------------------------------------
def c1_memory(path: str, steps: int) -> list[Row]:
    frames, done = load_frames(path)
    base = shm_used()
    buf = shmbuf.create(SPEC, steps, compress=shmbuf.Compress("obs"), overcommit=True)
    try:
        t0 = time.perf_counter()
        fill(buf, frames, done, steps, compact_every=max(steps // 20, 10_000))
        buf.compact(timeout=WAIT)
        took = time.perf_counter() - t0
        st = buf.stats()
        used = shm_used() - base
    finally:
        buf.close()
    raw = steps * ROW
    c = st.compression
    extra = {"steps": steps, "fill_and_compact_s": took, "statvfs_bytes": used,
             "stats_reserved_bytes": st.reserved_bytes, "obs_ratio": c.ratio,
             "hot_steps": c.hot_steps, "compressed_chunks": c.compressed_chunks,
             "raw_chunks": c.raw_chunks}
    rows = [Row("c1", f"/dev/shm after compact, {steps} steps (stats)", "B",
                [st.reserved_bytes], [raw], "raw bytes of the same steps", ("ratio", "<=", 0.1),
                paired=True, extra=extra),
            Row("c1v", f"/dev/shm after compact, {steps} steps (statvfs)", "B", [used], [raw],
                "raw bytes of the same steps (statvfs also sees other processes)",
                ("ratio", "<=", 0.1), paired=True)]
    per_step = st.reserved_bytes / steps
    rows.append(Row("c1p", "DreamerV3 5M steps, projected from c1", "B",
                    [per_step * DREAMER_DEFAULT], [ROW * DREAMER_DEFAULT],
                    "raw bytes of 5M W1 steps", ("ratio", "<=", 0.1), paired=True,
                    extra={"projected": True}))
    return rows


# -- c2: noise ------------------------------------------------------------------------------
def c2_noise(steps: int, reps: int) -> list[Row]:
    noise = _atari.noise(4096)
    done = np.zeros(len(noise), bool)
    done[499::500] = True
    bufs = [shmbuf.create(SPEC, steps, seed=1),
            shmbuf.create(SPEC, steps, seed=1, compress=shmbuf.Compress("obs", hot_steps=0))]
    try:
        for b in bufs:
            fill(b, noise, done, steps)
        bufs[1].compact(timeout=WAIT)
        mem = [b.stats().reserved_bytes for b in bufs]
        t = {0: [], 1: []}
        for _ in range(reps):
            for i, b in enumerate(bufs):
                t[i].extend(timed(lambda b=b: b.sample_sequences(50, 50), 3))
    finally:
        for b in bufs:
            b.close()
    return [Row("c2", "noise: /dev/shm bytes after compact", "B", [mem[1]], [mem[0]],
                "the same steps in a raw buffer", ("ratio", "<=", 1.02)),
            Row("c2s", "noise: sample_sequences(50, 50) time", "s", t[1], t[0],
                "the same call on the raw buffer", ("ratio", "<=", 1 / 0.95))]


# -- c3: writers ----------------------------------------------------------------------------
def _writer(name: str, path: str, wid: int, steps: int, barrier, results,
            rate: float | None = None) -> None:
    """Add ``steps`` stored frames as fast as possible, or at ``rate`` steps a second while
    spinning in between: an env worker that keeps its core busy (as CPU-bound envs do)."""
    frames, done = load_frames(path)
    buf = shmbuf.attach(name)
    try:
        w = buf.writer()
        act = np.zeros(6, np.float32)
        barrier.wait(WAIT)
        t0 = time.perf_counter()
        j = 0
        while j < steps:
            if rate is None or j < (time.perf_counter() - t0) * rate:
                i = (wid * 7919 + j) % len(frames)
                w.add(obs=frames[i], action=act, reward=0.0, done=bool(done[i]))
                j += 1
        results.put(time.perf_counter() - t0)
        w.close()
    finally:
        buf.close()


def _env_writer(name: str, game: str, wid: int, steps: int, barrier, results) -> None:
    """Step a live ALE env (random policy) and add each frame: Atari's real insert rate."""
    import ale_py
    import gymnasium as gym
    from PIL import Image
    gym.register_envs(ale_py)
    env = gym.make(f"ALE/{game}-v5", obs_type="rgb")
    rng = np.random.default_rng(wid)
    buf = shmbuf.attach(name)
    try:
        w = buf.writer()
        act = np.zeros(6, np.float32)
        obs, _ = env.reset(seed=wid)
        barrier.wait(WAIT)
        t0 = time.perf_counter()
        for _ in range(steps):
            frame = np.asarray(Image.fromarray(obs).resize((64, 64), Image.BOX)).transpose(2, 0, 1)
            obs, _, term, trunc, _ = env.step(int(rng.integers(env.action_space.n)))
            w.add(obs=frame, action=act, reward=0.0, done=bool(term or trunc))
            if term or trunc:
                obs, _ = env.reset()
        results.put(time.perf_counter() - t0)
        w.close()
    finally:
        buf.close()
        env.close()


PACED_RATE = 6000     # steps a second per paced writer


def _run_writers(name: str, path: str, steps: int, live: bool = False,
                 paced: bool = False) -> float:
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_env_writer, args=(name, _atari.GAMES[k], k, steps, barrier,
                                                    results)) if live else
             ctx.Process(target=_writer, args=(name, path, k, steps, barrier, results,
                                               PACED_RATE if paced else None))
             for k in range(2)]
    try:
        for p in procs:
            p.start()
        took = [results.get(timeout=WAIT * (5 if live else 1)) for _ in procs]
        for p in procs:
            p.join(WAIT)
        return max(took) / steps
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(10)


def c3_writers(path: str, capacity: int, steps: int, reps: int) -> list[Row]:
    t: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(reps):
        for on in (False, True):
            buf = shmbuf.create(SPEC, capacity, compress=shmbuf.Compress(
                "obs", hot_steps=capacity // 20) if on else None)
            try:
                t[on].append(_run_writers(buf.name, path, steps))
            finally:
                buf.close()
    return [Row("c3", "Writer.add per step, 2 writers, compression on", "s", t[True], t[False],
                "compression off (same writers, interleaved)", ("ratio", "<=", 1 / 0.95))]


# -- c4-c6: sampling ------------------------------------------------------------------------
def c4_c6_sampling(path: str, capacity: int, reps: int) -> list[Row]:
    frames, done = load_frames(path)
    raw = shmbuf.create(SPEC, capacity, seed=3)
    hot = shmbuf.create(SPEC, capacity, seed=3, compress=shmbuf.Compress(
        "obs", hot_steps=capacity))
    cold = shmbuf.create(SPEC, capacity, seed=3, compress=shmbuf.Compress("obs", hot_steps=0))
    rows = []
    try:
        for b in (raw, hot, cold):
            fill(b, frames, done, capacity)
        cold.compact(timeout=WAIT)
        assert cold.stats().compression.cold_raw_chunks == 0
        t_raw, t_hot = [], []
        for _ in range(reps):
            t_raw.extend(timed(lambda: raw.sample_sequences(50, 50), 3))
            t_hot.extend(timed(lambda: hot.sample_sequences(50, 50), 3))
        rows.append(Row("c4", "sample(50, 50), every window hot", "s", t_hot, t_raw,
                        "the same call on an uncompressed buffer", ("ratio", "<=", 1.05)))
        t_cold, t_codec, t_hot_codec, t_both = [], [], [], []
        unpack = cold.port.unpacker
        for r in range(reps * 3):
            windows: list = []
            cold.port.finder.locate = _spy(cold.port.finder.locate, windows)  # the same windows for
            # the codec-alone baseline
            t0 = time.perf_counter()
            cold.sample_sequences(50, 50, rng=r)
            t_cold.append(time.perf_counter() - t0)
            del cold.port.finder.locate
            rows_ = np.concatenate([w.rows for w in windows])
            kept, hot_block = _codec_alone(unpack, rows_)
            t_codec.append(kept)
            t_hot_codec.append(hot_block)
            idx = np.ascontiguousarray(rows_.T)
            t0 = time.perf_counter()
            np.take(raw.port.views["obs"], idx, axis=0)     # the copy every batch makes
            t_both.append(hot_block + time.perf_counter() - t0)
        rows.append(Row("c5", "sample(50, 50), every window cold", "s", t_cold, t_codec,
                        "pread + decode of the blocks the batch touches into one array, "
                        "one thread", ("ratio", "<=", 1.3)))
        rows.append(Row("c5h", "sample(50, 50), every window cold", "s", t_cold, t_hot_codec,
                        "the same decodes into one reused block (in cache): the codec's "
                        "own speed", None))
        rows.append(Row("c5b", "sample(50, 50), every window cold", "s", t_cold, t_both,
                        "codec alone (into one reused block) + the raw gather of the same "
                        "rows", None))
        waits = {}
        for label, b in (("raw", raw), ("cold", cold)):
            waits[label] = _prefetch_waits(b, reps * 10)
        rows.append(Row("c6", "trainer wait per batch, 2 prefetch threads, cold", "s",
                        waits["cold"], waits["raw"], "the same on the raw buffer",
                        ("ratio", "<=", 1.5), paired=False))
    finally:
        for b in (raw, hot, cold):
            b.close()
    return rows


def c5_codecs(path: str, capacity: int, reps: int) -> list[Row]:
    """A cold batch against a raw one, and lz4 against zstd: the same steps in a raw buffer
    and in two buffers compacted whole (zstd level 1, lz4 level 1), sampled in interleaved
    rounds with the same seed each round, so all three read the same windows."""
    frames, done = load_frames(path)
    bufs = {"raw": shmbuf.create(SPEC, capacity, seed=3)}
    rows = []
    try:
        for codec in ("zstd", "lz4"):
            bufs[codec] = shmbuf.create(SPEC, capacity, seed=3, compress=shmbuf.Compress(
                "obs", codec=codec, level=1, hot_steps=0))
        for b in bufs.values():
            fill(b, frames, done, capacity)
        for codec in ("zstd", "lz4"):
            bufs[codec].compact(timeout=WAIT)
            assert bufs[codec].stats().compression.cold_raw_chunks == 0
        times: dict[str, list[float]] = {k: [] for k in bufs}
        for r in range(reps * 10):
            for k, b in bufs.items():
                t0 = time.perf_counter()
                b.sample_sequences(50, 50, rng=r)
                times[k].append(time.perf_counter() - t0)
        rows.append(Row("c5r", "sample(50, 50), every window cold (zstd 1)", "s",
                        times["zstd"], times["raw"], "the same windows, uncompressed buffer",
                        None))
        rows.append(Row("c5l", "sample(50, 50), every window cold (lz4 1)", "s",
                        times["lz4"], times["zstd"], "the same windows cold, zstd 1", None))
        stored = {k: bufs[k].stats().compression.stored_bytes for k in ("zstd", "lz4")}
        rows.append(Row("c5lb", "obs bytes kept compressed (lz4 1)", "B", [stored["lz4"]],
                        [stored["zstd"]], "the same frames, zstd 1", None))
    finally:
        for b in bufs.values():
            b.close()
    return rows


def _spy(locate, found: list):
    """``locate`` that also keeps every ``Windows`` it returns in ``found``."""
    def spy(*a, **k):
        w = locate(*a, **k)
        found.append(w)
        return w
    return spy


def _codec_alone(unpack, rows: np.ndarray) -> tuple[float, float]:
    """The codec alone (one thread, ``pread`` included) decoding each block ``rows`` touch:
    into one new array that keeps them all, as any batch holds its rows; and into one
    reused block-sized buffer, which stays in cache (the codec's own speed)."""
    plan = unpack.plan
    chunk = rows // plan.chunk_size
    key = np.unique(chunk * plan.n_blocks + (rows - chunk * plan.chunk_size) // plan.block_rows)
    dirs = {c: unpack.words.read_dir(c) for c in np.unique(key // plan.n_blocks).tolist()}
    col = plan.columns[0]
    n = plan.block_rows * col.row_bytes
    times = []
    for keep in (True, False):
        t0 = time.perf_counter()
        dest = np.empty((len(key) if keep else 1, n), np.uint8)
        for i, u in enumerate(key.tolist()):
            c, j = divmod(u, plan.n_blocks)
            off, length = (int(x) for x in dirs[c][col.bit, j])
            unpack.codec.decode_into(unpack.words.read_blob(c, off, length),
                                     dest[i if keep else 0], n)
        times.append(time.perf_counter() - t0)
    return times[0], times[1]


def _prefetch_waits(buf, batches: int, compute_s: float = 0.02) -> list[float]:
    its = [buf.prefetch(50, 50, device="cpu", depth=2) for _ in range(2)]
    waits = []
    try:
        for it in its:
            next(it)      # warm: both threads running
        for i in range(batches):
            t0 = time.perf_counter()
            next(its[i % 2])
            waits.append(time.perf_counter() - t0)
            time.sleep(compute_s)   # the trainer's step: GPU work releases the GIL
    finally:
        for it in its:
            it.close()
    return waits


# -- c7: keeping up -------------------------------------------------------------------------
def c7_keep_up(path: str, capacity: int, steps: int, live_steps: int,
               paced_steps: int) -> list[Row]:
    rows = []
    for key, live, n in (("c7a", True, live_steps), ("c7b", False, steps),
                         ("c7c", False, paced_steps)):
        buf = shmbuf.create(SPEC, capacity, compress=shmbuf.Compress("obs"))
        shares, stop = [], threading.Event()

        def watch(buf=buf, shares=shares, stop=stop):
            while not stop.wait(0.2):
                c = buf.stats().compression
                shares.append(c.cold_raw_chunks * buf.chunk_size / capacity)
        t = threading.Thread(target=watch, daemon=True)
        try:
            t.start()
            per_step = _run_writers(buf.name, path, n, live=live, paced=key == "c7c")
        finally:
            stop.set()
            t.join(WAIT)
            buf.close()
        what = {"c7a": "2 writers stepping live ALE envs",
                "c7b": "2 writers copying stored frames flat out",
                "c7c": f"2 writers at {PACED_RATE}/s each, spinning their cores"}[key]
        rows.append(Row(key, f"cold raw share of capacity, {what}", "x",
                        [max(shares) if shares else 0.0], [], "none (reported; median in JSON)",
                        None, paired=False,
                        extra={"median_share": statistics.median(shares) if shares else 0.0,
                               "last_share": shares[-1] if shares else 0.0,
                               "insert_steps_per_s": 2 / per_step, "samples": len(shares)}))
    one, two = [], []
    for _ in range(3):      # alternated: the catch-up thread encoding alone, then on 2
        one.append(_catch_up_speed(path, capacity, 1))
        two.append(_catch_up_speed(path, capacity, 2))
    rows.append(Row("c7w", "catch-up steps/s, encoding on 2 threads / on 1", "/s", two, one,
                    "the catch-up thread encoding alone", None))
    speed = _compress_speed(path, capacity)
    for key, row in (("c7r", rows[0]), ("c7rb", rows[1])):
        rate = row.extra["insert_steps_per_s"]
        rows.append(Row(key, "compressor steps/s, one thread / " + (
            "2 live ALE writers' inserts" if key == "c7r" else "2 flat-out copiers' inserts"),
            "/s", speed, [rate], "the writers' insert rate above", ("ratio", ">=", 1.0)
            if key == "c7r" else None, paired=False))
    return rows


def _catch_up_speed(path: str, capacity: int, workers: int) -> float:
    """Steps a second the catch-up thread packs with ``workers`` encoding threads, from a
    full cold buffer down to half its backlog bound (its first 50 ms poll included)."""
    frames, done = load_frames(path)
    buf = shmbuf.create(SPEC, capacity, compress=shmbuf.Compress("obs", hot_steps=0))
    try:
        packer = buf._packer
        packer.stop()
        fill(buf, frames, done, capacity)
        packer._stop.clear()
        packer.catch_up_workers = workers
        before = packer.pending()
        t0 = time.perf_counter()
        t = threading.Thread(target=packer._catch_up, daemon=True)
        t.start()
        try:
            while packer.pending() > packer.backlog // 2:
                if time.perf_counter() - t0 > WAIT:
                    raise TimeoutError("the catch-up thread did not catch up")
                time.sleep(0.005)
            took = time.perf_counter() - t0
        finally:
            packer._stop.set()
            t.join(WAIT)
        return (before - packer.pending()) * buf.chunk_size / took
    finally:
        buf.close()


def _compress_speed(path: str, capacity: int, reps: int = 3) -> list[float]:
    """Steps a second that one thread compresses (``compact()``, every chunk cold)."""
    frames, done = load_frames(path)
    out = []
    for r in range(reps):
        buf = shmbuf.create(SPEC, capacity, compress=shmbuf.Compress("obs", hot_steps=0))
        try:
            buf._packer.stop()
            fill(buf, frames, done, capacity, start=r * 7919)
            t0 = time.perf_counter()
            buf.compact(timeout=WAIT)
            out.append(buf.stats().compression.compressed_chunks * buf.chunk_size
                       / (time.perf_counter() - t0))
        finally:
            buf.close()
    return out


# -- c8: save and load ----------------------------------------------------------------------
def _disk_bytes(path: str) -> int:
    return sum(os.stat(os.path.join(path, f)).st_blocks * 512 for f in os.listdir(path))


def c8_save(path: str, capacity: int, reps: int) -> list[Row]:
    import shutil
    import tempfile

    frames, done = load_frames(path)
    bufs = []
    root = tempfile.mkdtemp(prefix="shmbuf-bench-save-")
    try:
        for comp in (None, shmbuf.Compress("obs")):
            buf = shmbuf.create(SPEC, capacity, compress=comp)
            bufs.append(buf)
            fill(buf, frames, done, capacity)
        bufs[1].compact(timeout=WAIT)
        took: list[list[float]] = [[], []]
        size: list[list[int]] = [[], []]
        loads: list[list[float]] = [[], []]
        held: list[list[int]] = [[], []]
        for r in range(reps):
            for i in ((0, 1) if r % 2 == 0 else (1, 0)):   # interleaved, order alternating
                out = os.path.join(root, f"{i}-{r}")
                t0 = time.perf_counter()
                bufs[i].save(out)
                took[i].append(time.perf_counter() - t0)
                size[i].append(_disk_bytes(out))
                t0 = time.perf_counter()
                loaded = shmbuf.load(out)
                loads[i].append(time.perf_counter() - t0)
                held[i].append(loaded.stats().reserved_bytes)
                loaded.close()
                shutil.rmtree(out)
        c = bufs[1].stats().compression
    finally:
        for b in bufs:
            b.close()
        shutil.rmtree(root, ignore_errors=True)
    extra = {"steps": capacity, "compressed_chunks": c.compressed_chunks,
             "raw_chunks": c.raw_chunks, "hot_steps": c.hot_steps}
    return [Row("c8", f"Buffer.save, {capacity} W1 steps, compressed", "s", took[1], took[0],
                "save of an uncompressed buffer", ("ratio", "<=", 1.0), extra=extra),
            Row("c8d", "the save's bytes on disk, compressed", "B", size[1], size[0],
                "save of an uncompressed buffer", ("ratio", "<=", 0.5)),
            Row("c8l", "shmbuf.load of the save, compressed", "s", loads[1],
                loads[0], "load of the uncompressed save"),
            Row("c8m", "/dev/shm held after load, compressed", "B", held[1],
                held[0], "the loaded uncompressed save")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=None, help="c1's buffer (default 1M, or "
                    "the largest that /dev/shm and memory hold)")
    ap.add_argument("--json", type=Path, default=DEFAULT_JSON)
    ap.add_argument("--only", default="c1,c2,c3,c4,c5,c7,c8",
                    help="sections to run, by key, separated by commas")
    args = ap.parse_args()
    only = set(args.only.split(","))
    per_game, capacity, reps, wsteps, live, paced = (
        (2000, 20_000, 3, 5_000, 1_000, 12_000) if args.quick
        else (6000, 100_000, 5, 20_000, 3_000, 60_000))
    path = frames_file(per_game)
    steps = args.steps or (100_000 if args.quick else 1_000_000)
    room = min(os.statvfs("/dev/shm").f_bavail * os.statvfs("/dev/shm").f_frsize,
               os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    # compact() runs every steps/20 steps, so at most about 1/10 of the raw bytes is held raw.
    if steps * ROW / 8 > room:
        steps = int(room * 8 // ROW)
        print(f"c1: /dev/shm or memory holds too little for the asked size; measuring "
              f"{steps} steps and projecting")
    rows: list[Row] = []
    sections = {"c1": lambda: c1_memory(path, steps), "c2": lambda: c2_noise(capacity // 4, reps),
                "c3": lambda: c3_writers(path, capacity, wsteps, reps),
                "c4": lambda: c4_c6_sampling(path, capacity, reps),
                "c5": lambda: c5_codecs(path, capacity, reps),
                "c7": lambda: c7_keep_up(path, capacity // 4, 4 * wsteps, live, paced),
                "c8": lambda: c8_save(path, capacity, reps)}
    for key, fn in sections.items():
        if key not in only:
            continue
        try:
            rows.extend(fn())
        except Exception as exc:   # one section's failure is a row, not a lost run
            rows.append(Row("err", "a section failed", "s", [], [], "-", None,
                            error=f"{type(exc).__name__}: {exc}"))
    print_table(rows)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"frames": path, "rows": [r.to_json() for r in rows]},
                                    indent=1))
    print(f"wrote {args.json}")
    left = [n for n in os.listdir("/dev/shm") if n.startswith("shmbuf-")]
    print(f"shmbuf segments in /dev/shm now: {len(left)}")


if __name__ == "__main__":
    main()
