"""The W1 and W2 backends of compare.py (the adapter is in ``base``, W3 in ``history``)."""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import time

import numpy as np
from _store_workload import EPISODE, _w1_rows
from _store_workload import fill as shm_fill
from bench_dreamer import UpstreamRing

import shmbuf

from .base import Backend, NotApplicable, Unavailable, columns, time_major_rows
from .history import AB, MAX_LEN, N_ENVS, STEPS, SeedDeque, ShmbufHistory, infos
from .pool import WAIT_S
from .writers import BATCH_ROWS, torchrl_td


# -- the ceilings -------------------------------------------------------------------------
class NumpyGather(Backend):
    key, label = "numpy_gather", "numpy gather (ceiling)"
    note = {"W1": "np.take of the same (L,B) windows from an in-process array; no IPC",
            "W2": "np.take of the same windows, in-process", "W3": "np.take of the same "
            "frames and action blocks from per-env numpy rings; append = row assignment"}

    def setup(self, wl):
        self.wl, self.rng = wl, np.random.default_rng(3)
        if wl.key == "W3":
            first = next(infos(False))
            self.arrays = {k: np.zeros((N_ENVS, wl.capacity) + v.shape[1:], v.dtype)
                           for k, v in first.items()}
            for t, info in enumerate(infos(False)):
                self._append(t, info)
            self.pos = STEPS
            self.info = first
            return
        self.arrays = columns(wl)

    def _append(self, t, info):
        slot = t % self.wl.capacity
        for k, v in info.items():
            self.arrays[k][:, slot] = v

    def ingest(self, n_writers, mode, rows):
        if self.wl.key != "W3":
            raise NotApplicable("sample-only ceiling")
        t0 = time.perf_counter()
        for _ in range(rows):
            self._append(self.pos, self.info)
            self.pos += 1
        return time.perf_counter() - t0

    def sample(self):
        wl = self.wl
        if wl.key == "W3":
            newest = self.pos - 1
            frames = (newest - AB * np.arange(wl.length)[::-1]) % wl.capacity
            blocks = (newest - np.arange((wl.length - 1) * AB)[::-1]) % wl.capacity
            pix = np.take(self.arrays["pixels"], frames, axis=1)
            act = np.take(self.arrays["action"], blocks, axis=1)
            return pix, act.reshape(N_ENVS, wl.length - 1, -1)
        idx = time_major_rows(self.rng, wl.capacity - wl.length + 1, wl.batch, wl.length)
        return {k: np.take(a, idx, axis=0) for k, a in self.arrays.items()}

    def _free(self):
        self.arrays = None


class NumpyCopy(NumpyGather):
    key, label = "numpy_copy", "numpy contiguous copy (ceiling)"
    note = {"W1": "sample: one contiguous slice of the same bytes, copied; ingest: the writer "
                  "processes copy the same bytes into a pre-touched /dev/shm mapping, 1 row, "
                  "16 or 500 contiguous rows per call, no bookkeeping (memory-bandwidth "
                  "ceiling)",
            "W2": "one contiguous slice of the same bytes, copied (memory-bandwidth floor)",
            "W3": "one contiguous slice of the same bytes, copied (memory-bandwidth floor)"}
    _shm = None

    def setup(self, wl):
        if wl.key == "W1" and not wl.filled:
            import posix_ipc

            self.wl, row = wl, sum(int(np.prod(s)) * np.dtype(d).itemsize
                                   for s, d in wl.spec.values())
            # "shmbuf-" + no test tag: a concurrent test session's leak check (which
            # removes the untagged non-shmbuf entries it sees appear) leaves it alone.
            self._shm = posix_ipc.SharedMemory(f"/shmbuf-cmp-memcpy-{os.getpid()}",
                                               posix_ipc.O_CREX,
                                               size=wl.capacity * row)
            self._shm.close_fd()
            self.tracker.own(_Named(self._shm.name.lstrip("/")))
            self.handle = (self._shm.name, wl.capacity, row)
            return
        super().setup(wl)

    def ingest(self, n_writers, mode, rows):
        if self._shm is None:
            raise NotApplicable("sample-only ceiling")
        return self._pooled("memcpy", self.handle, n_writers, mode, rows)

    def _free(self):
        shm, self._shm = self._shm, None
        if shm is not None:
            import posix_ipc

            try:
                shm.unlink()
            except posix_ipc.ExistentialError:
                pass   # removed by someone else: the run reports what it measured
        super()._free()

    def sample(self):
        wl = self.wl
        if wl.key == "W3":
            pix = self.arrays["pixels"]
            return pix[:, :wl.length].copy(), self.arrays["action"][:, :(wl.length - 1) * AB].copy()
        start = int(self.rng.integers(0, wl.capacity - wl.steps + 1))
        return {k: a[start:start + wl.steps].copy() for k, a in self.arrays.items()}


class _Named:
    def __init__(self, name):
        self.name = name


# -- the DIY pipeline and the seeds' single-process designs ----------------------------------
class QueuePipeline(Backend):
    key, label = "queue", "DIY mp.Queue -> numpy ring"
    note = {"W1": "env workers put steps into a multiprocessing.Queue; the trainer copies "
                  "them into a numpy ring; sample = vectorised uniform windows (episodes "
                  "ignored) + np.take", "W2": "the same numpy ring sampler"}

    def setup(self, wl):
        if wl.key == "W3":
            raise NotApplicable("no per-env history API")
        self.wl, self.rng = wl, np.random.default_rng(4)
        if wl.filled:
            self.ring, self.idx, self.full = columns(wl), 0, True
        else:
            self.ring = {k: np.zeros((wl.capacity,) + s, d) for k, (s, d) in wl.spec.items()}
            self.idx, self.full, self.q = 0, False, self.ctx.Queue()

    def _consume(self, total: int):
        def run():
            cap, ring, got = self.wl.capacity, self.ring, 0
            obs, act, rew, done = ring["obs"], ring["action"], ring["reward"], ring["done"]
            while got < total:
                o, a, r, d = self.q.get(timeout=WAIT_S)
                n = len(o) if np.ndim(o) == 4 else 1
                i = self.idx
                rows = slice(i, i + n) if i + n <= cap else np.arange(i, i + n) % cap
                obs[rows], act[rows], rew[rows], done[rows] = o, a, r, d
                self.idx = (i + n) % cap
                got += n
            return time.perf_counter()
        return run

    def ingest(self, n_writers, mode, rows):
        return self._pooled("queue", self.q, n_writers, mode, rows,
                            consume=self._consume(n_writers * rows))

    def sample(self):
        wl = self.wl
        idx = time_major_rows(self.rng, wl.capacity - wl.length + 1, wl.batch, wl.length,
                              first=self.idx, size=wl.capacity)
        return {k: np.take(a, idx, axis=0) for k, a in self.ring.items()}

    def _free(self):
        q = getattr(self, "q", None)
        if q is not None:
            q.close()
            q.join_thread()
        self.ring = self.q = None


class SeedRing(Backend):
    key, label = "seed_ring", "seed: Dreamer numpy ring (1 proc)"
    note = {"W1": "torchwm's documented ring (bench_dreamer.UpstreamRing): one process, "
                  "add() per step, sample() loops over the batch; windows may cross episodes",
            "W2": "the same ring with obs (64,) f32 (plus its 1-float action, reward, "
                  "terminal columns)"}

    def setup(self, wl):
        if wl.key == "W3":
            raise NotApplicable("no per-env history API")
        self.wl = wl
        obs = (3, 64, 64) if wl.key == "W1" else (64,)
        ring = UpstreamRing(wl.capacity, obs, 6 if wl.key == "W1" else 1, wl.length, wl.batch)
        if wl.key == "W2":
            ring.observations = np.empty((wl.capacity, 64), np.float32)
        if wl.filled:
            cols = columns(wl)
            ring.observations[:] = cols["obs"]
            ring.terminals[:] = cols["done"]
            ring.rewards[:] = 0
            ring.actions[:] = 0
            ring.idx, ring.full = 0, True
            np.random.seed(5)
        else:
            for a in (ring.observations, ring.actions, ring.rewards, ring.terminals):
                a.fill(0)
            self.rows = _w1_rows(16, seed=7)
        self.ring = ring

    def ingest(self, n_writers, mode, rows):
        if n_writers != 1:
            raise NotApplicable("single-process design: no writer processes")
        add, one = self.ring.add, self.rows
        t0 = time.perf_counter()
        for i in range(rows):
            j = i & 15
            add({"image": one["obs"][j]}, one["action"][j], one["reward"][j],
                float(i % EPISODE == EPISODE - 1))
        return time.perf_counter() - t0

    def sample(self):
        return self.ring.sample()

    def _free(self):
        self.ring = None


# -- the peers ----------------------------------------------------------------------------------
class Cpprb(Backend):
    key, label = "cpprb", "cpprb MPReplayBuffer"
    note = {"W1": "no sequence sampling: sample(2500) draws the same number of single steps",
            "W2": "no sequence sampling: sample(1024) single steps"}

    def setup(self, wl):
        if wl.key == "W3":
            raise NotApplicable("no per-env history API")
        try:
            from cpprb import MPReplayBuffer
        except ImportError as exc:
            raise Unavailable(f"cpprb not importable ({exc}); pip install -e .[bench]") from None
        self.wl = wl
        env = {"obs": {"shape": wl.spec["obs"][0], "dtype": wl.spec["obs"][1]}, "done": {}}
        if wl.key == "W1":
            env.update(act={"shape": 6}, rew={})
        self.rb = MPReplayBuffer(wl.capacity, env, ctx=self.ctx)
        # Filled for ingest too: its writers read every stored row once to map the pages.
        cols = columns(wl)
        names = {"obs": "obs", "done": "done", "action": "act", "reward": "rew"}
        for lo in range(0, wl.capacity, 50_000):
            self.rb.add(**{names[k]: v[lo:lo + 50_000] for k, v in cols.items()})

    def ingest(self, n_writers, mode, rows):
        return self._pooled("cpprb", self.rb, n_writers, mode, rows)

    def sample(self):
        return self.rb.sample(self.wl.steps)

    def _free(self):
        self.rb = None


class TorchRL(Backend):
    key, label = "torchrl", "TorchRL ReplayBuffer"
    note = {"W1": "ReplayBuffer(LazyMemmapStorage, SliceSampler(slice_len=50, end_key='done'),"
                  " shared=True); filled with whole episodes; returns a flat batch-major "
                  "(B*L) TensorDict, not time-major",
            "W2": "LazyMemmapStorage + SliceSampler(slice_len=4, end_key='done'), "
                  "cache_values=False (the default)"}

    def setup(self, wl):
        if wl.key == "W3":
            raise NotApplicable("no per-env history API")
        try:
            logging.getLogger("torchrl").setLevel(logging.WARNING)
            from torchrl.data import LazyMemmapStorage, ReplayBuffer
            from torchrl.data.replay_buffers.samplers import SliceSampler
        except Exception as exc:  # noqa: BLE001 - ImportError or a broken torch ABI
            raise Unavailable(f"torchrl not importable ({type(exc).__name__}: {exc})") from None
        if mp.get_start_method(allow_none=True) != "spawn":
            raise Unavailable("TorchRL's shared lock and cursor come from the default start "
                              "method; compare.py sets it to spawn in main()")
        self.wl = wl
        sampler = SliceSampler(slice_len=wl.length, end_key="done")
        self.rb = ReplayBuffer(storage=LazyMemmapStorage(wl.capacity), sampler=sampler,
                               batch_size=wl.steps, shared=True)
        if not wl.filled:   # a shared buffer's storage must exist before it is pickled
            self.rb.extend(torchrl_td(_w1_rows(BATCH_ROWS, seed=9), 1))
            return
        cols = columns(wl)
        for lo in range(0, wl.capacity, 50_000):
            self.rb.extend(torchrl_td({k: v[lo:lo + 50_000] for k, v in cols.items()}, 1))

    def ingest(self, n_writers, mode, rows):
        return self._pooled("torchrl", self.rb, n_writers, mode, rows)

    def sample(self):
        return self.rb.sample()

    def _free(self):
        self.rb = None


# -- shmbuf ---------------------------------------------------------------------------------------
class ShmbufCore(Backend):
    key, label = "shmbuf", "shmbuf core"
    note = {"W1": "Writer.add / add_batch / extend (500-step episodes) from spawned processes; "
                  "sample_sequences(50, 50), time-major, windows within one episode",
            "W2": "sample_sequences(256, 4)"}

    def setup(self, wl):
        if wl.key == "W3":
            raise NotApplicable("keyed history is the HistoryBuffer facade's job")
        self.wl = wl
        self.buf = self.tracker.own(shmbuf.create(wl.spec, wl.capacity, seed=0))
        if wl.filled:
            n = 1024 if wl.capacity >= 1_000_000 else 16
            rows = _w1_rows(16, seed=99) if wl.key == "W1" else {
                "obs": np.ones((n, 64), np.float32), "done": np.zeros(n, np.bool_)}
            shm_fill(self.buf, rows, int(wl.capacity * 1.02))

    def ingest(self, n_writers, mode, rows):
        return self._pooled("shmbuf", self.buf, n_writers, mode, rows)

    def sample(self):
        return self.buf.sample_sequences(self.wl.batch, self.wl.length)

    def _free(self):
        buf, self.buf = getattr(self, "buf", None), None
        if buf is not None:
            buf.close()


class ShmbufDreamer(ShmbufCore):
    key, label = "shmbuf_dreamer", "shmbuf Dreamer facade"
    note = {"W1": "shmbuf.ReplayBuffer (torchwm API): add() per step, no batch call (16 add()"
                  " calls per 16 rows); sample() time-major"}

    def setup(self, wl):
        if wl.key != "W1":
            raise NotApplicable("the Dreamer facade stores uint8 images only")
        self.wl = wl
        self.rb = self.tracker.own(shmbuf.ReplayBuffer(wl.capacity, (3, 64, 64), 6,
                                                       seq_len=wl.length, batch_size=wl.batch,
                                                       seed=0))
        if wl.filled:
            shm_fill(self.rb.buffer, _w1_rows(16, seed=99), int(wl.capacity * 1.02))

    def ingest(self, n_writers, mode, rows):
        return self._pooled("dreamer", self.rb, n_writers, mode, rows)

    def sample(self):
        return self.rb.sample()

    def _free(self):
        rb, self.rb = getattr(self, "rb", None), None
        if rb is not None:
            rb.close()


BACKENDS = (NumpyGather, NumpyCopy, QueuePipeline, Cpprb, TorchRL, SeedRing, SeedDeque,
            ShmbufCore, ShmbufDreamer, ShmbufHistory)
# The order of the backends in the report's tables and in the chart.
ORDER = [c.key for c in BACKENDS] + ["numpy_gather"]
W3_DEFAULTS = dict(capacity=MAX_LEN, batch=N_ENVS)
