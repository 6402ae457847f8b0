"""bench_trainer's spawned children: direct samplers.  No torch import here (a spawned
child that imports torch pays about 1.5 s and its memory)."""
from __future__ import annotations

import time

import shmbuf


def direct_sampler(name: str, batch_size: int, length: int, n_batches: int, barrier,
                   results) -> None:
    """Attach, wait for the others, then time ``n_batches`` sample_sequences calls."""
    with shmbuf.attach(name) as buf:
        buf.sample_sequences(batch_size, length)      # warm: pages mapped, code paths hot
        barrier.wait(60)
        t0 = time.perf_counter()
        for _ in range(n_batches):
            buf.sample_sequences(batch_size, length)
        results.put((t0, time.perf_counter(), n_batches))
