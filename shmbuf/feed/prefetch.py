"""``Buffer.prefetch``: batches sampled ahead by a background thread, on their device.

A thread samples each batch with ``out=`` into one of ``depth``
preallocated host buffers (pinned when the device is CUDA), so the gather
(numpy's ``take``, which releases the GIL, and the C window check, likewise)
overlaps the trainer's compute step.  For CUDA the thread then copies the
batch into that slot's device buffers with ``non_blocking=True`` on a side
stream and records an event; the consumer's stream waits for that event
before it can touch the batch, so no kernel ever sees a half-copied tensor.

Lifetime of a yielded batch: it stays valid until the next ``next()`` on
the iterator (or ``close()``).  Its slot is handed back to the thread only
then; on CUDA the thread also waits for an event recorded on the consumer's
stream at that moment, so kernels the trainer queued on the batch finish
before the slot is overwritten.  Keep a batch longer with ``.clone()``.

Errors raised in the thread (``NotEnoughDataError``, ``BufferClosedError``,
...) are raised by the consumer's next ``next()``.  ``close()``, leaving
the ``with`` block, or dropping the iterator stops the thread once the
batch in hand is done, and joins it.
"""
from __future__ import annotations

import threading
import weakref
from collections import deque

from .._args import check_int, generator
from .._errors import BufferClosedError, WaitTimeoutError

_JOIN_S = 60.0      # bound on the wait for a thread that finishes its batch
_POLL_S = 1.0       # how often a waiting consumer re-checks that the thread lives


def resolve_device(device, pin_memory):
    """``(torch.device, pin)`` for ``device`` (None: CUDA if available, else CPU) and
    ``pin_memory``; ValueError if unusable."""
    import torch

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device {device!r} is not a torch device ({exc}); use 'cpu' or "
                         "'cuda[:index]'") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r}: prefetch supports 'cpu' and 'cuda' devices")
    cuda = torch.cuda.is_available()
    if dev.type == "cuda" and not cuda:
        raise ValueError(f"device {device!r}: torch.cuda.is_available() is False on this "
                         "machine; use device='cpu'")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if pin_memory not in (None, True, False):
        raise TypeError(f"pin_memory must be None, True or False, got {pin_memory!r}")
    if pin_memory and not cuda:
        raise ValueError("pin_memory=True needs CUDA (torch.cuda.is_available() is False); "
                         "leave pin_memory=None")
    pin = dev.type == "cuda" if pin_memory is None else pin_memory
    return dev, pin


class _Slot:
    """One preallocated batch: host tensors (maybe pinned) and, for CUDA, device ones."""

    def __init__(self, spec, lead, device, pin):
        import torch

        from .torch_dataset import torch_dtype

        self.host = {k: torch.empty(lead + shape, dtype=torch_dtype(dtype, k), pin_memory=pin)
                     for k, (shape, dtype) in spec.items()}
        self.dev = None
        self.copied = self.released = None   # CUDA events
        if device.type == "cuda":
            self.dev = {k: torch.empty_like(v, device=device) for k, v in self.host.items()}
            self.copied = torch.cuda.Event()
            self.released = torch.cuda.Event()

    @property
    def batch(self):
        return self.host if self.dev is None else self.dev


class _State:
    """What the thread and the consumer share; the thread holds no reference to the iterator."""

    def __init__(self, depth):
        self.cond = threading.Condition()
        self.free = deque(range(depth))     # slots the thread may fill
        self.ready: deque[int] = deque()    # filled slots, oldest first
        self.error: BaseException | None = None
        self.stop = False


class Prefetcher:
    """Iterator of prefetched batches; made by ``Buffer.prefetch`` (see it and the module doc)."""

    _thread: threading.Thread | None = None

    def __init__(self, buffer, batch_size, length, *, depth=2, device="cpu", pin_memory=None,
                 rng=None, transform=None, **sample_kwargs):
        from .torch_dataset import batch_spec, check_sample_kwargs

        buffer._check_open()
        args = check_sample_kwargs(buffer, batch_size, length, sample_kwargs, "Buffer.prefetch")
        depth = check_int("depth", depth, 1, 64)
        self.device, pin = resolve_device(device, pin_memory)
        self.depth, self.pinned, self.transform = depth, pin, transform
        lead = (args["length"], args["batch_size"]) if args["time_major"] else (
            args["batch_size"], args["length"])
        spec = batch_spec(buffer, args)
        self._slots = [_Slot(spec, lead, self.device, pin) for _ in range(depth)]
        self._held = None          # the slot whose batch the consumer holds
        self._state = _State(depth)
        gen = None if rng is None else generator("rng", rng)
        stream = None
        if self.device.type == "cuda":
            import torch

            stream = torch.cuda.Stream(self.device)
        self._stream = stream
        self._thread = threading.Thread(
            target=_fill, name=f"shmbuf-prefetch-{buffer.name}", daemon=True,
            args=(self._state, self._slots, buffer, args, gen, stream))
        self._finalizer = weakref.finalize(self, _stop, self._state, self._thread, stream)
        self._thread.start()

    # -- the consumer -------------------------------------------------------------
    def __iter__(self):
        return self

    def __next__(self):
        st, thread = self._state, self._thread
        self._release_held()
        with st.cond:
            while not st.ready and st.error is None and not st.stop:
                if not st.cond.wait(_POLL_S) and not (thread is not None and thread.is_alive()):
                    break
            if st.stop:
                raise StopIteration
            if st.ready:
                i = st.ready.popleft()
            elif st.error is not None:
                error, st.error = st.error, None
                raise error
            else:
                raise StopIteration
        slot = self._slots[i]
        if slot.copied is not None:
            import torch

            torch.cuda.current_stream(self.device).wait_event(slot.copied)
        self._held = i
        return slot.batch if self.transform is None else self.transform(slot.batch)

    def _release_held(self) -> None:
        if self._held is None:
            return
        slot, i, self._held = self._slots[self._held], self._held, None
        if slot.released is not None:
            import torch

            slot.released.record(torch.cuda.current_stream(self.device))
        with self._state.cond:
            self._state.free.append(i)
            self._state.cond.notify_all()

    # -- lifecycle ------------------------------------------------------------------
    def close(self) -> None:
        """Stop the thread (after the batch in hand) and join it.  Idempotent.

        The batch last yielded stays readable; no other is made.
        """
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return (f"<shmbuf.Prefetcher depth={self.depth} device={self.device}"
                f"{' pinned' if self.pinned else ''}{' closed' if self.closed else ''}>")


def _stop(state: _State, thread: threading.Thread, stream=None) -> None:
    with state.cond:
        state.stop = True
        state.cond.notify_all()
    if thread is not threading.current_thread():
        thread.join(_JOIN_S)
    if stream is not None:
        stream.synchronize()   # no copy may still write device memory that is freed next


def _fill(state: _State, slots, buffer, args, gen, stream) -> None:
    """The thread: take a free slot, sample into it, (copy it to the device,) hand it over."""
    try:
        while True:
            with state.cond:
                while not state.free and not state.stop:
                    state.cond.wait()
                if state.stop:
                    return
                i = state.free.popleft()
            slot = slots[i]
            if stream is not None:
                slot.copied.synchronize()   # the previous copy out of this host buffer is done
            if not _sample(state, buffer, args, slot, gen):
                return   # closed while the rate limit made the thread wait
            if stream is not None:
                _to_device(slot, stream)
            with state.cond:
                state.ready.append(i)
                state.cond.notify_all()
    except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which raises it
        if buffer.closed and not isinstance(exc, BufferClosedError):
            closed = BufferClosedError(f"buffer {buffer.name!r} was closed while prefetching")
            closed.__cause__, exc = exc, closed
        with state.cond:
            state.error = exc
            state.cond.notify_all()


def _sample(state: _State, buffer, args, slot: _Slot, gen) -> bool:
    """Sample into ``slot``; False if the prefetcher was closed while a rate limit held it.

    Under a rate limit the thread waits for inserts in slices of ``_POLL_S``,
    so that ``close()`` never waits for writers.  The batch takes its budget
    when it is drawn, so a prefetched batch never consumed still counts.
    """
    if getattr(buffer, "_limiter", None) is None:   # no limit (a sharded buffer: per shard)
        buffer.sample_sequences(**args, out=slot.host, rng=gen)
        return True
    while not state.stop:
        try:
            buffer.sample_sequences(**args, out=slot.host, rng=gen, timeout=_POLL_S)
            return True
        except WaitTimeoutError:
            continue
    return False


def _to_device(slot: _Slot, stream) -> None:
    import torch

    dev, copied = slot.dev, slot.copied
    assert dev is not None and copied is not None, "a CUDA slot has device tensors and events"
    with torch.cuda.stream(stream):
        stream.wait_event(slot.released)      # the consumer's kernels on the old batch are done
        for k, host in slot.host.items():
            dev[k].copy_(host, non_blocking=True)
        copied.record(stream)
