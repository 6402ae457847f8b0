"""DataLoader batches handed over through a worker's reused memory (shmbuf._handoff)."""
import gc
import multiprocessing as mp
import pickle

import pytest
import torch

from helpers.handoff_workers import LEAD, lend_batches

TIMEOUT = 60


@pytest.fixture
def lender():
    """A forked process that lent 3 regions; yields (connection, its pickled handoffs)."""
    ctx = mp.get_context("fork")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=lend_batches, args=(there, 3))
    proc.start()
    try:
        assert here.poll(TIMEOUT), "the lender never sent its batches"
        yield here, here.recv(), proc
    finally:
        if proc.is_alive():
            here.send("stop")
        proc.join(TIMEOUT)
        if proc.is_alive():
            proc.kill()
            proc.join(TIMEOUT)


def _states(conn) -> list:
    conn.send("state")
    assert conn.poll(TIMEOUT)
    return conn.recv()


def test_a_handoff_is_a_few_ints_and_the_trainer_reads_the_workers_memory(lender):
    conn, payloads, _ = lender
    assert all(len(p) < 600 for p in payloads)   # no data, no descriptor: an address
    batches = [pickle.loads(p) for p in payloads]
    for i, batch in enumerate(batches):
        assert batch["x"].shape == LEAD + (3,) and batch["x"].dtype == torch.int64
        assert (batch["x"] == i).all() and (batch["y"] == i + 0.5).all()
    assert _states(conn) == [1, 1, 1, 0]


def test_freeing_a_batch_gives_its_region_back_and_kept_ones_stay_lent(lender):
    conn, payloads, _ = lender
    batches = [pickle.loads(p) for p in payloads]
    kept = batches[1]["x"].numpy()   # a numpy view holds the region too
    del batches
    gc.collect()
    assert _states(conn) == [0, 1, 0, 0]
    assert (kept == 1).all()
    del kept
    gc.collect()
    assert _states(conn) == [0, 0, 0, 0]


def test_a_batch_of_a_worker_that_exited_is_a_clear_error(lender):
    conn, payloads, proc = lender
    first = pickle.loads(payloads[0])      # mapped while the worker lives
    conn.send("stop")
    proc.join(TIMEOUT)
    assert proc.exitcode == 0
    assert (first["x"] == 0).all()         # the mapping outlives the worker
    from shmbuf import _handoff

    _handoff._mapped.clear()               # a process that never mapped this pool
    with pytest.raises(RuntimeError, match=r"worker pid \d+.*(exited|cannot open)"):
        pickle.loads(payloads[1])
