"""``ShardedBuffer.prefetch``: global batches made ahead by a background thread.

The thread keeps ``depth`` plans in flight (their remote shares are being
sampled on the other nodes meanwhile) and fills ``depth + 1`` preallocated
batches in turn.  A yielded batch stays valid until the next ``next()``:
its memory is reused only after that.  Errors in the thread are raised by
the ``next()`` that would have returned the batch; ``close()`` (or leaving
the ``with`` block) stops the thread within one batch.

With ``device`` set, batches come out as torch tensors: ``"cpu"`` gives
zero-copy views of the numpy batch; a CUDA device gets a copy made with
``non_blocking=True`` from pinned host memory (``pin_memory`` defaults to
True there), and the host batch is reused only after that copy finished.
"""
from __future__ import annotations

import collections
import queue
import threading
import time

import numpy as np

from shmbuf.ray import _sampler

_POLL_S = 0.05


class Prefetcher:
    """An iterator of global batches; see the module doc."""

    def __init__(self, rb, batch_size: int, length: int, *, depth: int, tail: int,
                 time_major: bool, device, pin_memory, timeout_s: float, rng):
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth!r}")
        self._rb, self._rng = rb, rng
        self._args = (batch_size, length, tail, time_major)
        self._depth = depth
        self._timeout = timeout_s
        self._device = None if device is None else str(device)
        cuda = self._device is not None and self._device.startswith("cuda")
        pin = cuda if pin_memory is None else bool(pin_memory)
        lead = (length, batch_size) if time_major else (batch_size, length)
        self._free: queue.Queue = queue.Queue()
        for _ in range(depth + 1):
            self._free.put(_allocate(rb.spec, lead, pin))
        self._ready: queue.Queue = queue.Queue()
        self._held = None
        self._stop = threading.Event()
        self.timing = _sampler.new_timing()
        self.wait_s = 0.0           # time next() spent waiting for a batch
        self._thread = threading.Thread(target=self._run, name="shmbuf.ray.prefetch",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        b, length, tail, tm = self._args
        plans = collections.deque()
        try:
            while not self._stop.is_set():
                while len(plans) < self._depth:
                    plans.append(_sampler.plan(self._rb, b, length, tail, tm, self._rng))
                out = self._take_free()
                if out is None:
                    return
                _sampler.finish(self._rb, plans.popleft(), out, self._rng, self.timing)
                self._ready.put(out)
        except BaseException as exc:   # handed to the consumer by next()
            self._ready.put(_Failure(exc))

    def _take_free(self):
        while not self._stop.is_set():
            try:
                return self._free.get(timeout=_POLL_S)
            except queue.Empty:
                continue
        return None

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        self._release_held()
        t0 = time.perf_counter()
        deadline = time.monotonic() + self._timeout
        while True:
            if self._stop.is_set():
                raise StopIteration
            try:
                item = self._ready.get(timeout=_POLL_S)
                break
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"prefetch: no batch within {self._timeout} s") from None
        self.wait_s += time.perf_counter() - t0
        if isinstance(item, _Failure):
            self.close()
            raise item.exc
        self._held = item
        return self._deliver(item)

    def _deliver(self, batch: dict):
        if self._device is None:
            return batch
        import torch

        tensors = {k: torch.from_numpy(v) for k, v in batch.items()}
        if self._device == "cpu":
            return tensors
        moved = {k: t.to(self._device, non_blocking=True) for k, t in tensors.items()}
        event = torch.cuda.Event()
        event.record()
        self._held = (batch, event)
        return moved

    def _release_held(self) -> None:
        held, self._held = self._held, None
        if held is None:
            return
        if isinstance(held, tuple):        # a device copy may still read the host batch
            held[1].synchronize()
            held = held[0]
        self._free.put(held)

    def close(self) -> None:
        """Stop the thread (within one batch) and drop the remaining batches.  Idempotent."""
        self._stop.set()
        self._thread.join(timeout=self._timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Failure:
    def __init__(self, exc: BaseException):
        self.exc = exc


def _allocate(spec: dict, lead: tuple, pin: bool) -> dict:
    if not pin:
        return {k: np.empty(lead + tuple(shape), dtype) for k, (shape, dtype) in spec.items()}
    import torch

    return {k: torch.empty(lead + tuple(shape), dtype=_torch_dtype(dtype),
                           pin_memory=True).numpy() for k, (shape, dtype) in spec.items()}


def _torch_dtype(dtype):
    import torch

    return torch.from_numpy(np.empty(0, dtype)).dtype
