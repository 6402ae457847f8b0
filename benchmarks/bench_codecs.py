"""Which codec for cold chunks: ratio and speed on real Atari frames, and whether decoding runs
in parallel.

    python benchmarks/bench_codecs.py [--quick] [--json PATH]

Frames: ``_atari.play`` (ale-py, random policy, 64x64x3 channels first, DreamerV3's frame
shape), a few thousand consecutive steps per game, cut into blocks of ``B`` consecutive frames
(the unit a sampler decodes); plus uniform noise frames.  For each codec and level: the ratio
(raw / compressed bytes, over all blocks), compression and decompression MB/s of raw bytes (one
thread, the median of several passes), and ``par2``: the wall time of two threads each decoding
every block once divided by one thread decoding them once (about 0.5 when decoding releases the
GIL, about 1.0 when it holds it).  The baseline in every row is ``memcpy``: ``np.copyto`` of the
same raw bytes in the same run (decode MB/s / memcpy MB/s is the ``vs copy`` column).  Nothing is
asserted.  Results go to benchmarks/results/bench_codecs.json.

``--stall``: whether one decode call holds the GIL.  A thread decodes one large frame (all of
a game's frames in one call, tens of ms) while the main thread spins and records its longest
gap between two iterations.  A codec that holds the GIL stalls the spinner for the whole call
(the control row: ``sorted`` of a list, a C call that holds it); one that releases it stalls
it about a thread switch.  Timing-free in its verdict: the stall is compared with the call.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _atari

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "bench_codecs.json"
Codec = tuple[Callable[[bytes], bytes], Callable[[bytes, int], bytes]]


def _codecs() -> dict[str, Codec]:
    out: dict[str, Codec] = {}
    try:
        import zstandard as zstd
        for level in (-3, 1, 3, 6):
            c = zstd.ZstdCompressor(level=level)
            local = threading.local()  # a ZstdDecompressor is not thread-safe: one per thread

            def dec(b: bytes, n: int, local=local) -> bytes:
                d = getattr(local, "d", None)
                if d is None:
                    d = local.d = zstd.ZstdDecompressor()
                return d.decompress(b, max_output_size=n)
            out[f"zstd {level}"] = (c.compress, dec)
    except ImportError:
        print("zstandard not installed: skipped")
    try:
        import lz4.block as lz4b
        out["lz4 fast"] = (lambda b: lz4b.compress(b, store_size=False),
                           lambda b, n: lz4b.decompress(b, uncompressed_size=n))
        out["lz4 hc9"] = (lambda b: lz4b.compress(b, mode="high_compression", compression=9,
                                                  store_size=False),
                          lambda b, n: lz4b.decompress(b, uncompressed_size=n))
    except ImportError:
        print("lz4 not installed: skipped")
    try:
        import blosc2
        blosc2.set_nthreads(1)
        for name, codec in (("blosc2 zstd1", blosc2.Codec.ZSTD), ("blosc2 lz4", blosc2.Codec.LZ4)):
            out[name] = (lambda b, codec=codec: blosc2.compress2(b, codec=codec, clevel=1,
                                                                 typesize=1),
                         lambda b, n: blosc2.decompress2(b))
    except ImportError:
        print("blosc2 not installed: skipped")
    return out


def _median_rate(fn: Callable[[], object], nbytes: int, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e6


def _measure(name: str, codec: Codec, blocks: list[bytes], reps: int) -> dict:
    comp, dec = codec
    n = len(blocks[0])
    packed = [comp(b) for b in blocks]
    assert all(dec(p, n) == b for p, b in zip(packed, blocks)), name  # a broken codec is no result
    raw = n * len(blocks)
    stored = sum(len(p) for p in packed)
    c_rate = _median_rate(lambda: [comp(b) for b in blocks], raw, reps)
    d_rate = _median_rate(lambda: [dec(p, n) for p in packed], raw, reps)

    def decode_all() -> None:
        for p in packed:
            dec(p, n)

    def two() -> float:
        ts = [threading.Thread(target=decode_all) for _ in range(2)]
        t0 = time.perf_counter()
        for t in ts:
            t.start()
        for t in ts:
            t.join(60)
        return time.perf_counter() - t0

    one = statistics.median(_timed(decode_all) for _ in range(reps))
    par = statistics.median(two() for _ in range(reps)) / (2 * one)
    return {"codec": name, "ratio": raw / stored, "compress_MBps": c_rate,
            "decompress_MBps": d_rate, "par2": par}


def _longest_gap_during(call: Callable[[], object]) -> tuple[float, float]:
    """(longest gap of a spinning main thread, duration of ``call`` in another thread), in s."""
    done = threading.Event()
    took = [0.0]

    def run() -> None:
        t0 = time.perf_counter()
        call()
        took[0] = time.perf_counter() - t0
        done.set()

    th = threading.Thread(target=run)
    last, worst = time.perf_counter(), 0.0
    th.start()
    while not done.is_set():
        now = time.perf_counter()
        worst, last = max(worst, now - last), now
    th.join(60)
    return worst, took[0]


def _stall_rows(frames: np.ndarray, codecs: dict) -> list[dict]:
    raw = frames.tobytes()
    rows = []
    control = list(np.random.default_rng(0).random(3_000_000))
    cases = {"control: sorted (holds)": lambda: sorted(control)}
    for name, (comp, dec) in codecs.items():
        packed = comp(raw)
        cases[name] = lambda dec=dec, packed=packed: dec(packed, len(raw))
    try:   # the call shmbuf's reads make: a zstd frame decoded straight into an array
        from shmbuf.sampling.codec import Codec as ShmCodec
        shm = ShmCodec("zstd", 1)
        frame, into = shm.encode(raw), np.empty(len(raw), np.uint8)
        cases["shmbuf decode_into (zstd)"] = lambda: shm.decode_into(frame, into, len(raw))
    except ImportError:
        pass
    for name, call in cases.items():
        gaps = [_longest_gap_during(call) for _ in range(3)]
        gap, took = min(g for g, _ in gaps), statistics.median(t for _, t in gaps)
        rows.append({"case": name, "longest_gap_ms": 1e3 * gap, "call_ms": 1e3 * took,
                     "holds_gil": gap > 0.1 * took})   # for a tenth of the call or more
    return rows


def _timed(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", type=Path, default=DEFAULT_JSON)
    ap.add_argument("--stall", action="store_true", help="only the GIL stall rows")
    args = ap.parse_args()
    if args.stall:
        frames = _atari.play(_atari.GAMES[0], 4096, seed=1)[0]
        print(f"{'case':<26} {'call ms':>8} {'longest gap ms':>15} {'holds GIL':>10}")
        for r in _stall_rows(frames, _codecs()):
            print(f"{r['case']:<26} {r['call_ms']:>8.1f} {r['longest_gap_ms']:>15.2f} "
                  f"{str(r['holds_gil']):>10}", flush=True)
        return
    steps, reps = (1024, 3) if args.quick else (4096, 5)
    sources = {g: _atari.play(g, steps, seed=1)[0] for g in _atari.GAMES}
    sources["noise"] = _atari.noise(steps)
    codecs = _codecs()
    rows = []
    print(f"{'frames':<14} {'B':>3} {'codec':<13} {'ratio':>8} {'comp MB/s':>10} {'dec MB/s':>9} "
          f"{'vs copy':>8} {'par2':>5}")
    for block in (16, 64):
        for src, frames in sources.items():
            blocks = [frames[i:i + block].tobytes()
                      for i in range(0, len(frames) - block + 1, block)]
            dst = np.empty(block * frames[0].nbytes, np.uint8)
            srcs = [np.frombuffer(b, np.uint8) for b in blocks]
            copy = _median_rate(lambda dst=dst, srcs=srcs: [np.copyto(dst, s) for s in srcs],
                                dst.nbytes * len(srcs), reps)
            for name, codec in codecs.items():
                r = _measure(name, codec, blocks, reps) | {"frames": src, "block": block,
                                                           "memcpy_MBps": copy}
                rows.append(r)
                print(f"{src:<14} {block:>3} {name:<13} {r['ratio']:>8.1f} "
                      f"{r['compress_MBps']:>10.0f} {r['decompress_MBps']:>9.0f} "
                      f"{r['decompress_MBps'] / copy:>8.3f} {r['par2']:>5.2f}",
                      flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"steps_per_game": steps, "rows": rows}, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
