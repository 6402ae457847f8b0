"""Ranks of a data-parallel job for tests/test_process_rng.py: each draws its batches.

``rank_draws`` runs in a spawned child as rank ``rank`` of a two-process job: with
``how="group"`` it joins a real gloo process group on 127.0.0.1 (``RANK`` unset), with
``how="env"`` it only sets ``RANK``, as a launcher does.  Like Lightning's
``seed_everything`` it seeds torch with 0 in every rank, then reports the ``x`` of:
two batches of ``DataLoader(buf.dataset(8, 4, seed=7), num_workers=1)`` with a forked
worker and two with a spawned one (the shared buffer ``name``), and, from a buffer the
rank makes itself with ``seed=7`` (so it is its owner, as every rank is of its own), one
``sample_sequences(8, 4)`` and one ``prefetch(8, 4)`` batch.
"""
import os

import numpy as np

from helpers.trainer_workers import COUNTER_SPEC, fill_counter

TIMEOUT = 60


def rank_draws(rank: int, how: str, port: int, name: str, results) -> None:
    os.environ.pop("RANK", None)
    if how == "env":
        os.environ["RANK"] = str(rank)
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    import shmbuf

    if how == "group":
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=2,
                                timeout=__import__("datetime").timedelta(seconds=TIMEOUT))
    try:
        torch.manual_seed(0)
        out = {}
        with shmbuf.attach(name) as buf:
            for method in ("fork", "spawn"):
                loader = DataLoader(buf.dataset(8, 4, seed=7), batch_size=None, num_workers=1,
                                    multiprocessing_context=method, timeout=TIMEOUT)
                it = iter(loader)
                out[f"loader_{method}"] = [next(it)["x"].tolist() for _ in range(2)]
                del it
        own = shmbuf.create(COUNTER_SPEC, 1024, seed=7, handle_signals=False)
        try:
            fill_counter(own, 1024)
            out["sample_sequences"] = own.sample_sequences(8, 4)["x"].tolist()
            with own.prefetch(8, 4, device="cpu") as batches:
                out["prefetch"] = np.asarray(next(batches)["x"]).tolist()
        finally:
            own.close()
        results.put((rank, out))
    finally:
        if how == "group":
            dist.destroy_process_group()
