"""Child-side writers of compare.py's W1 ingest: one class per backend, same rows for all.

Each writer is built in a spawned child from the handle its backend pickled
(a shmbuf buffer or facade attaches by name; cpprb and TorchRL send their
shared memory; the Queue pipeline sends its queue).  ``write(mode, rows)``
appends ``rows`` W1 rows: ``"add"`` one step per call, ``"batch16"`` 16 env
rows per call, ``"ep500"`` a whole 500-step episode per call (backends
without such a call loop over the rows, as a user would).  Episodes end
every 500 steps of each stream.  The rows are
built once, outside the timed loop, in the form each API takes, so only
the buffer's own cost is timed.

Before it reports ready, every writer reads one byte per page of the shared
memory it writes into, as a worker that has run for one pass of the ring
has: a fresh process takes a minor fault on its first write to each page
(3 per 12 KiB step), which costs every shared-memory design 2-3x on its
first pass (bench_store rows 3 vs 3p).  The Queue pipeline's ring lives in
the trainer and is prefaulted there.
"""
from __future__ import annotations

import logging

import numpy as np
from _store_workload import EPISODE, _w1_rows, _write_add, _write_rows, touch_mapping

BATCH_ROWS = 16
EPISODE_ROWS = 500


class _Rows:
    """Eight single steps and one 16-row batch of W1 data, numpy."""

    def __init__(self, wid: int):
        self.one = _w1_rows(8, seed=wid)
        self.batch = _w1_rows(BATCH_ROWS, seed=100 + wid)
        self.batch_last = dict(self.batch, done=np.ones(BATCH_ROWS, np.bool_))
        ep = _w1_rows(EPISODE_ROWS, seed=200 + wid)
        ep["done"][-1] = True
        self.episode = ep

    def episodes(self, rows: int):
        return [self.episode] * (rows // EPISODE_ROWS)

    def batches(self, rows: int):
        for call in range(rows // BATCH_ROWS):
            yield self.batch_last if call % EPISODE == EPISODE - 1 else self.batch


class ShmbufWriter:
    def __init__(self, buf, wid):
        self.buf, self.rows = buf, _Rows(wid)        # buf arrived by pickle: attached
        touch_mapping(buf)
        self.w = buf.writer()

    def write(self, mode, rows):
        if mode == "add":
            _write_add(self.w, self.rows.one, rows)
        elif mode == "ep500":
            extend = self.w.extend
            for ep in self.rows.episodes(rows):
                extend(**ep)
        else:
            _write_rows(self.w, self.rows.batch, rows, batched=True)

    def close(self):
        self.w.close()
        self.buf.close()


class DreamerWriter:
    """shmbuf's Dreamer facade: ``add(obs, action, reward, done)``, no batch call."""

    def __init__(self, rb, wid):
        self.rb, self.rows = rb, _Rows(wid)
        touch_mapping(rb.buffer)

    def write(self, mode, rows):
        add = self.rb.add
        if mode == "add":
            obs, act = self.rows.one["obs"], self.rows.one["action"]
            for i in range(rows):
                add({"image": obs[i & 7]}, act[i & 7], float(i & 255),
                    float(i % EPISODE == EPISODE - 1))
            return
        calls = self.rows.episodes(rows) if mode == "ep500" else self.rows.batches(rows)
        for cols in calls:
            for j in range(len(cols["done"])):
                add({"image": cols["obs"][j]}, cols["action"][j], cols["reward"][j],
                    cols["done"][j])

    def close(self):
        self.rb.close()


class QueueWriter:
    """The DIY env worker: every step (or 16-row batch) is pickled into a Queue."""

    def __init__(self, steps_q, wid):
        self.q, self.rows = steps_q, _Rows(wid)

    def write(self, mode, rows):
        put = self.q.put
        if mode == "add":
            obs, act = self.rows.one["obs"], self.rows.one["action"]
            for i in range(rows):
                put((obs[i & 7], act[i & 7], float(i & 255), i % EPISODE == EPISODE - 1))
            return
        for cols in (self.rows.episodes(rows) if mode == "ep500" else self.rows.batches(rows)):
            put((cols["obs"], cols["action"], cols["reward"], cols["done"]))

    def close(self):
        self.q.close()
        self.q.join_thread()   # everything put is flushed before the process exits


class CpprbWriter:
    def __init__(self, rb, wid):
        self.rb, self.rows = rb, _Rows(wid)
        # cpprb keeps its arrays private: copying every stored transition (the parent
        # filled the buffer) reads each page once.
        rb.get_all_transitions()

    def write(self, mode, rows):
        add = self.rb.add
        if mode == "add":
            obs, act = self.rows.one["obs"], self.rows.one["action"]
            for i in range(rows):
                add(obs=obs[i & 7], act=act[i & 7], rew=float(i & 255),
                    done=float(i % EPISODE == EPISODE - 1))
            return
        for cols in (self.rows.episodes(rows) if mode == "ep500" else self.rows.batches(rows)):
            add(obs=cols["obs"], act=cols["action"], rew=cols["reward"], done=cols["done"])

    def close(self):
        self.rb = None


def _touch(arr: np.ndarray) -> None:
    int(arr.reshape(-1).view(np.uint8)[::4096].sum())


def torchrl_td(cols: dict, batch_dims: int):
    """W1 numpy columns as a TensorDict with ``batch_dims`` leading dims (0 or 1)."""
    import torch
    from tensordict import TensorDict

    shape = list(np.shape(cols["done"]))[:batch_dims]
    return TensorDict({k: torch.as_tensor(np.asarray(v)) for k, v in cols.items()},
                      batch_size=shape)


class TorchRLWriter:
    """``rb.add(td)`` per step, ``rb.extend(td)`` per 16 rows, on the shared buffer."""

    def __init__(self, rb, wid):
        logging.getLogger("torchrl").setLevel(logging.WARNING)
        self.rb, rows = rb, _Rows(wid)
        one = rows.one
        self.steps = [torchrl_td({k: v[i] for k, v in one.items()}, 0) for i in range(8)]
        self.last = torchrl_td({k: (np.True_ if k == "done" else v[0]) for k, v in one.items()},
                               0)
        self.batch, self.batch_last = torchrl_td(rows.batch, 1), torchrl_td(rows.batch_last, 1)
        self.episode = torchrl_td(rows.episode, 1)
        for leaf in rb.storage._storage.values(include_nested=True, leaves_only=True):
            _touch(leaf.numpy())

    def write(self, mode, rows):
        if mode == "add":
            add = self.rb.add
            for i in range(rows):
                add(self.last if i % EPISODE == EPISODE - 1 else self.steps[i & 7])
            return
        extend = self.rb.extend
        if mode == "ep500":
            for _ in range(rows // EPISODE_ROWS):
                extend(self.episode)
            return
        for call in range(rows // BATCH_ROWS):
            extend(self.batch_last if call % EPISODE == EPISODE - 1 else self.batch)

    def close(self):
        self.rb = None


class MemcpyWriter:
    """The ingest ceiling: plain copies of the same bytes into a pre-touched /dev/shm
    mapping, one row (``add``), 16 contiguous rows (``batch16``) or 500 (``ep500``)
    per call, no bookkeeping; each writer cycles through its own quarter of the
    segment.  With ``ep500`` and 2 writers it is the machine's copy bandwidth for
    two processes copying the same bytes at the same time."""

    def __init__(self, handle, wid):
        import mmap

        import posix_ipc

        name, rows, row_bytes = handle
        shm = posix_ipc.SharedMemory(name)
        try:
            self.mm = mmap.mmap(shm.fd, rows * row_bytes)
        finally:
            shm.close_fd()
        self.a = np.frombuffer(self.mm, np.uint8).reshape(rows, row_bytes)
        _touch(self.a)
        quarter = rows // 4
        self.lo, self.span = wid % 4 * quarter, quarter - EPISODE_ROWS
        self.src = np.random.default_rng(wid).integers(0, 256, (EPISODE_ROWS, row_bytes),
                                                        dtype=np.uint8)
        self.pos = 0

    def write(self, mode, rows):
        a, src, lo, span = self.a, self.src, self.lo, self.span
        pos = self.pos
        if mode == "add":
            for i in range(rows):
                a[lo + (pos + i) % span] = src[i & 15]
        elif mode == "ep500":
            for call in range(rows // EPISODE_ROWS):
                j = lo + (pos + call * EPISODE_ROWS) % span
                a[j:j + EPISODE_ROWS] = src
        else:
            src = src[:BATCH_ROWS]
            for call in range(rows // BATCH_ROWS):
                j = lo + (pos + call * BATCH_ROWS) % span
                a[j:j + BATCH_ROWS] = src
        self.pos = (pos + rows) % span

    def close(self):
        self.a = None
        self.mm.close()


WRITERS = {"shmbuf": ShmbufWriter, "dreamer": DreamerWriter, "queue": QueueWriter,
           "cpprb": CpprbWriter, "torchrl": TorchRLWriter, "memcpy": MemcpyWriter}
