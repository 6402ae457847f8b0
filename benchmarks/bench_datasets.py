"""Datasets: import speed against h5py, and the memory of 8 DataLoader workers over one buffer.

    python benchmarks/bench_datasets.py [--import-mb 512] [--pss-mb 2048] [--workers 8]
                                        [--reps 3] [--dir PATH] [--json PATH]

Data: W1 rows (pixels uint8 (3, 64, 64), action f32 (6,), reward f32, terminated
bool; episodes of 500 steps) in an uncompressed, contiguous HDF5 file in
stable-worldmodel's layout (one dataset per column, ep_len, ep_offset).

1. Import speed, from a warm page cache (the file is read once first), rounds
   alternated, median of ``--reps``:
     h5py     every column read with h5py into fresh numpy arrays (baseline)
     import   shmbuf.datasets.from_swm_hdf5: segment created, rows read in
              64 MiB blocks and appended with Writer.extend
     alloc    shmbuf.create of the same buffer, prefaulted (close not timed): the
              cost of the segment's pages alone (tmpfs pages are 4 KiB unless
              /sys/kernel/mm/transparent_hugepage/shmem_enabled allows more,
              while numpy's large arrays get huge pages), a floor under import
     blocks   the importer's h5py reads alone, into reused 64 MiB blocks
   ratio = h5py time / import time (target >= 0.8).
2. Memory: ``--workers`` DataLoader workers (forkserver start, the default
   start method on Linux from Python 3.14, and what spawn does too) each draw
   batches of 16 windows of 32 pixel frames.  After every worker delivered
   batches, the Pss (``/proc/PID/smaps_rollup``) of the trainer and every
   worker is summed, for:
     empty    a dataset of no data (the interpreters, torch: the overhead)
     shmbuf   buf.dataset(...) over the imported buffer
     numpy    the same arrays in RAM, in a torch IterableDataset (pickled to
              each worker, so each holds a copy)
     h5py     an IterableDataset that reopens the file in each worker
   The figure is (total - empty) / data bytes (target for shmbuf <= 1.1).
   The file's page-cache pages are nobody's Pss: h5py's figure leaves out the
   page cache that it reads through on every batch.

Nothing asserts.  Everything written is removed at the end.  MB is 2**20 bytes here.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch

import shmbuf
from shmbuf.datasets import from_swm_hdf5

HERE = Path(__file__).resolve().parent
DEFAULT_JSON = HERE / "results" / "bench_datasets.json"
ROW = 3 * 64 * 64 + 6 * 4 + 4 + 1
EPISODE = 500


def write_file(path: Path, mb: int) -> int:
    """An uncompressed swm-layout file of about ``mb`` MiB, written in blocks; its bytes."""
    import h5py

    episodes = max(1, (mb << 20) // (ROW * EPISODE))
    n = episodes * EPISODE
    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as f:
        px = f.create_dataset("pixels", (n, 3, 64, 64), np.uint8)
        act = f.create_dataset("action", (n, 6), np.float32)
        f["reward"] = rng.normal(size=n).astype(np.float32)
        term = np.zeros(n, bool)
        term[EPISODE - 1::EPISODE * 2] = True
        f["terminated"] = term
        for a in range(0, n, 4096):
            b = min(a + 4096, n)
            px[a:b] = rng.integers(0, 256, (b - a, 3, 64, 64), dtype=np.uint8)
            act[a:b] = rng.normal(size=(b - a, 6))
        f["ep_len"] = np.full(episodes, EPISODE, np.int32)
        f["ep_offset"] = np.arange(episodes, dtype=np.int64) * EPISODE
    return n * ROW


def h5py_read(path: Path) -> dict:
    import h5py

    with h5py.File(path, "r") as f:
        return {k: f[k][:] for k in f}


def block_read(path: Path, block_bytes: int = 64 << 20) -> None:
    """The importer's reads alone: every column in blocks into reused arrays."""
    import h5py

    with h5py.File(path, "r") as f:
        cols = [f[k] for k in f if k not in ("ep_len", "ep_offset")]
        n = cols[0].shape[0]
        step = max(1, block_bytes // ROW)
        blocks = [np.empty((step,) + c.shape[1:], c.dtype) for c in cols]
        for a in range(0, n, step):
            b = min(a + step, n)
            for c, out in zip(cols, blocks):
                c.read_direct(out, np.s_[a:b], np.s_[0:b - a])


def import_speed(path: Path, reps: int) -> dict:
    h5py_read(path)  # warm the page cache
    t_h5, t_imp, t_alloc, t_blocks = [], [], [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        block_read(path)
        t_blocks.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        arrays = h5py_read(path)
        t_h5.append(time.perf_counter() - t0)
        del arrays
        t0 = time.perf_counter()
        buf = from_swm_hdf5(path, progress=False)
        t_imp.append(time.perf_counter() - t0)
        spec, capacity = buf.spec, buf.capacity
        buf.close()
        t0 = time.perf_counter()
        empty = shmbuf.create(spec, capacity, done_key="terminated")
        t_alloc.append(time.perf_counter() - t0)
        empty.close()
    ratios = [h / i for h, i in zip(t_h5, t_imp)]
    return {"h5py_s": statistics.median(t_h5), "import_s": statistics.median(t_imp),
            "alloc_s": statistics.median(t_alloc), "blocks_s": statistics.median(t_blocks),
            "ratio": statistics.median(ratios),
            "ratios": ratios}


# -- memory --------------------------------------------------------------------------------

def pss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1])
    raise RuntimeError(f"no Pss line for pid {pid}")


class Empty(torch.utils.data.IterableDataset):
    """Batches of zeros: what the interpreters and torch cost alone."""

    def __iter__(self):
        while True:
            yield {"pixels": torch.zeros(32, 16, 3, 64, 64, dtype=torch.uint8)}


class Windows(torch.utils.data.IterableDataset):
    """16 random windows of 32 frames a batch from ``pixels`` (numpy arrays, or a file)."""

    def __init__(self, arrays=None, path=None):
        self.arrays, self.path = arrays, path

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        rng = np.random.default_rng(info.id if info else 0)
        if self.path is not None:
            import h5py

            pixels = h5py.File(self.path, "r")["pixels"]  # reopened in each worker
        else:
            pixels = self.arrays["pixels"]
        n = len(pixels)
        while True:
            starts = rng.integers(0, n - 32, 16)
            yield {"pixels": torch.from_numpy(np.stack([pixels[s:s + 32] for s in starts],
                                                       axis=1))}


def total_pss(dataset, workers: int, batches: int) -> int:
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=workers,
                                         multiprocessing_context="forkserver",
                                         prefetch_factor=2)
    it = iter(loader)
    try:
        for _ in range(batches * workers):
            next(it)
        pids = [os.getpid()] + [w.pid for w in it._workers]  # every worker has delivered
        return sum(pss_kib(p) for p in pids) << 10
    finally:
        it._shutdown_workers()


def memory(path: Path, workers: int, batches: int) -> dict:
    out = {"empty": total_pss(Empty(), workers, batches)}
    with from_swm_hdf5(path, progress=False) as buf:
        data = sum(a.nbytes for a in buf.arrays.values())
        out["shmbuf"] = total_pss(buf.dataset(16, 32), workers, batches)
    arrays = h5py_read(path)
    out["numpy"] = total_pss(Windows(arrays=arrays), workers, batches)
    del arrays
    out["h5py"] = total_pss(Windows(path=str(path)), workers, batches)
    return {"data_bytes": data, "pss_bytes": out,
            "ratio": {k: (v - out["empty"]) / data for k, v in out.items() if k != "empty"}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--import-mb", type=int, default=512)
    p.add_argument("--pss-mb", type=int, default=2048,
                   help="buffer size for the memory part; the numpy row holds "
                   "(workers + 1) copies, so mind the machine's RAM")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--batches", type=int, default=3, help="batches per worker before Pss")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--no-memory", action="store_true", help="the import part only")
    p.add_argument("--dir", type=Path, default=None)
    p.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore", message="This DataLoader will create")  # > 2 cores' worth
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        path = Path(tmp) / "import.h5"
        nbytes = write_file(path, args.import_mb)
        speed = import_speed(path, args.reps)
        os.unlink(path)
        mb = nbytes / 2**20
        print(f"{'import':<10} {'MiB':>8} {'h5py s':>8} {'import s':>9} {'alloc s':>8} "
              f"{'blocks s':>9} {'ratio':>6}  ratios")
        print(f"{'swm h5':<10} {mb:8.0f} {speed['h5py_s']:8.3f} {speed['import_s']:9.3f} "
              f"{speed['alloc_s']:8.3f} {speed['blocks_s']:9.3f} {speed['ratio']:6.2f}  "
              f"{', '.join(f'{r:.2f}' for r in speed['ratios'])}")
        mem = None
        if not args.no_memory:
            path = Path(tmp) / "pss.h5"
            write_file(path, args.pss_mb)
            mem = memory(path, args.workers, args.batches)
    if mem is not None:
        report_memory(mem, args.workers)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"import": speed, "import_bytes": nbytes, "memory": mem,
                                     "workers": args.workers, "cpus": os.cpu_count(),
                                     "python": sys.version.split()[0],
                                     "shmbuf": shmbuf.__version__}, indent=1))
    return 0


def report_memory(mem: dict, workers: int) -> None:
    data = mem["data_bytes"]
    print(f"\n{workers} DataLoader workers, data {data / 2**20:.0f} MiB; total Pss of "
          f"trainer + workers (MiB), and (total - empty) / data")
    for k, v in mem["pss_bytes"].items():
        ratio = mem["ratio"].get(k)
        print(f"{k:<10} {v / 2**20:10.0f}" + (f" {ratio:8.2f}x" if ratio is not None else
                                               "   (overhead)"))


if __name__ == "__main__":
    sys.exit(main())
