"""DataLoader batches handed over through a worker's reused memory (shmbuf.feed.handoff)."""
import gc
import multiprocessing as mp
import pickle

import pytest
import torch
from helpers.handoff_workers import LEAD, lend_batches
from helpers.procs import join_all, running

TIMEOUT = 60


@pytest.fixture(params=[True, False], ids=["fd-kept", "fd-closed"])
def lender(request):
    """A forked process that lent 3 regions; yields (connection, its pickled handoffs, the
    process, whether it kept the memfd's descriptor open: if not, /proc cannot reach it)."""
    ctx = mp.get_context("fork")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=lend_batches, args=(there, 3, request.param))
    with running([proc], TIMEOUT):
        try:
            assert here.poll(TIMEOUT), "the lender never sent its batches"
            yield here, here.recv(), proc, request.param
        finally:
            if proc.is_alive():
                here.send("stop")


def _states(conn) -> list:
    conn.send("state")
    assert conn.poll(TIMEOUT)
    return conn.recv()


def test_a_handoff_is_a_few_ints_and_the_trainer_reads_the_workers_memory(lender):
    """The first handoff also carries the memfd (so /proc is not needed), the rest an address."""
    conn, payloads, _, _ = lender
    assert all(len(p) < 800 for p in payloads)   # no data
    assert b"DupFd" in payloads[0] and not any(b"DupFd" in p for p in payloads[1:])
    batches = [pickle.loads(p) for p in payloads]
    for i, batch in enumerate(batches):
        assert batch["x"].shape == LEAD + (3,) and batch["x"].dtype == torch.int64
        assert (batch["x"] == i).all() and (batch["y"] == i + 0.5).all()
    assert _states(conn) == [1, 1, 1, 0]


def test_freeing_a_batch_gives_its_region_back_and_kept_ones_stay_lent(lender):
    conn, payloads, _, _ = lender
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
    conn, payloads, proc, _ = lender
    first = pickle.loads(payloads[0])      # mapped while the worker lives
    conn.send("stop")
    join_all([proc], TIMEOUT)
    assert (first["x"] == 0).all()         # the mapping outlives the worker
    from shmbuf.feed import handoff as _handoff

    _handoff._mapped.clear()               # a process that never mapped this pool
    with pytest.raises(RuntimeError, match=r"worker pid \d+.*(exited|cannot open)"):
        pickle.loads(payloads[1])


def test_a_process_that_missed_the_descriptor_opens_the_pool_through_proc(lender):
    """Through /proc while the worker keeps the descriptor; else a clear error."""
    conn, payloads, _, kept = lender
    first = pickle.loads(payloads[0])   # takes the descriptor, as the trainer does
    assert (first["x"] == 0).all()
    from shmbuf.feed import handoff as _handoff

    _handoff._mapped.clear()    # now like a process that never saw the first batch
    if kept:
        third = pickle.loads(payloads[2])
        assert (third["x"] == 2).all()
        assert _states(conn) == [1, 1, 1, 0]   # 1 was never received: still lent
    else:
        # ENOENT for the closed descriptor; ENXIO when the kernel is tearing the
        # worker's files down at that moment: either way the same clear error.
        with pytest.raises(RuntimeError, match=r"cannot open at /proc/\d+/fd/\d+ "
                                               r"\(No such (file|device)"):
            pickle.loads(payloads[2])
        assert _states(conn) == [1, 1, 1, 0]   # the unreadable batch is still lent
