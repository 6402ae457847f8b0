"""HistoryBuffer and keyed rings stop, crash and restart like the step store.

The owner's close marks the segment closed, so workers stop with
BufferClosedError; a closed segment cannot be attached; after a SIGKILL,
``attach(name, own=True)`` takes the buffer over; SIGTERM unlinks it.
Owners, workers and adopters are real processes; every wait has a timeout.
Rival adopters, SIGTERM and ``handle_signals=False`` with a HistoryBuffer
owner are parametrized cases of test_adopt.py and test_signals.py.
"""
import multiprocessing as mp
import os
import pickle
import signal

import numpy as np
import pytest

import shmbuf
from shmbuf import _ring, _signals, cli, keyed
from shmbuf._layout import CLOSED_OWNER
from shmbuf._segment import _mark_closed
from shmbuf._segment import unlink as unlink_segment
from shmbuf.compat.history import HistoryBuffer
from shmbuf.params import ParamBlock
from shmbuf._wait import poll
from helpers.history_workers import (SPEC, attach_until_closed, check_entries,
                                     dead_owner_history, until_closed)
from helpers.keyed_workers import history_info
from helpers.stop_workers import TIMEOUT, shm_exists

OTHER_PID = 1  # a closer that is not this process (init never closes anything of ours)


def closed_by_another_process(segment_holder) -> None:
    """Set the closed mark as an owner in another process would (the name stays)."""
    assert _ring.mark_closed(segment_holder._segment.mmap, CLOSED_OWNER, OTHER_PID)


def receive(conn, timeout: float = TIMEOUT):
    assert conn.poll(timeout), f"no report from the child within {timeout} s"
    return conn.recv()


def stop(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(TIMEOUT)


# -- the closed mark -------------------------------------------------------------------------
def test_every_call_of_keyed_rings_checks_the_closed_mark():
    with keyed.create({"x": ((), np.int64)}, n_keys=2, max_len=3) as rings:
        rings.append([0], {"x": np.array([7])})
        other = keyed.attach(rings.name)
        try:
            closed_by_another_process(rings)
            for call in (lambda r: r.append([1], {"x": np.array([1])}),
                         lambda r: r.read(None, lambda n: np.zeros((len(n), 1), np.int64)),
                         lambda r: r.bounds(), lambda r: r.bounds_of(0), lambda r: r.counts(),
                         lambda r: r.lengths(), lambda r: r.reset([0]), lambda r: r.snapshot()):
                for handle in (rings, other):
                    with pytest.raises(shmbuf.BufferClosedError,
                                       match=f"closed by its owner \\(pid {OTHER_PID}\\)"):
                        call(handle)
        finally:
            other.close()


def test_the_process_that_closed_keeps_its_mapping():
    buf = HistoryBuffer(2, 4, spec=SPEC)
    buf.append(history_info([0, 1], 1))
    buf.unlink()  # marks it closed in this process: this process carries on
    buf.append(history_info([0, 1], 2))
    assert buf.get(1)["step"].tolist() == [[2], [2]]
    buf.close()


def test_attach_refuses_a_closed_segment_and_lazy_handles_learn_it():
    buf = HistoryBuffer(2, 4)
    early = pickle.loads(pickle.dumps(buf))  # attaches lazily, once the segment is sized
    try:
        buf.append(history_info([0, 1], 1))
        _mark_closed(buf.name, CLOSED_OWNER)  # closed, its name not removed yet
        for attach in (HistoryBuffer.attach, shmbuf.attach, keyed.attach,
                       keyed.attach_if_published, lambda n: HistoryBuffer.attach(n, own=True),
                       lambda n: pickle.loads(pickle.dumps(buf))):
            with pytest.raises(shmbuf.BufferClosedError, match="closed by its owner"):
                attach(buf.name)
        with pytest.raises(shmbuf.BufferClosedError, match="closed by its owner"):
            early.get(1)
    finally:
        early.close()
        buf.close()
    assert not shm_exists(buf.name)


def test_a_lazy_handle_whose_owner_closed_before_sizing_gets_buffer_closed():
    buf = HistoryBuffer(2, 4)
    early = pickle.loads(pickle.dumps(buf))
    buf.close()  # never sized: only the name was taken, and now it is gone
    try:
        for call in (lambda: early.get(1), lambda: early.append(history_info([0, 1], 1)),
                     lambda: early.reset()):
            with pytest.raises(shmbuf.BufferClosedError, match="closed by its owner"):
                call()
    finally:
        early.close()


def test_a_parameter_block_reader_learns_that_the_trainer_closed():
    with ParamBlock.create({"w": np.zeros(3, np.float32)}) as block:
        block.publish({"w": np.ones(3, np.float32)})
        actor = ParamBlock.attach(block.name)
        try:
            closed_by_another_process(block._rings)
            with pytest.raises(shmbuf.BufferClosedError, match="closed by its owner"):
                actor.wait_version(2, timeout=TIMEOUT)
            with pytest.raises(shmbuf.BufferClosedError):
                actor.read()
        finally:
            actor.close()


@pytest.mark.slow
@pytest.mark.parametrize("op", ["append", "get"])
def test_a_worker_stops_with_buffer_closed_when_the_owner_closes(op):
    ctx = mp.get_context("spawn")
    buf = HistoryBuffer(4, 8, action_block=1, spec=SPEC)
    buf.append(history_info(np.arange(4), 0))  # something to get
    name = buf.name
    report, child_end = ctx.Pipe()
    worker = ctx.Process(target=until_closed, args=(buf, [1, 3], child_end, op))
    try:
        worker.start()
        assert receive(report) == "running"
        buf.close()  # marks it closed, then unlinks it
        kind, calls, message = receive(report)
        assert kind == "closed", message
        assert "closed by its owner" in message and f"pid {os.getpid()}" in message
        assert repr(name) in message
        worker.join(TIMEOUT)
        assert worker.exitcode == 0
        assert not shm_exists(name)
    finally:
        buf.close()
        stop([worker])


# -- adoption ----------------------------------------------------------------------------------
def remove(name: str) -> None:
    if shm_exists(name):
        unlink_segment(name)


def test_a_live_owner_is_never_replaced():
    with HistoryBuffer(2, 4, spec=SPEC) as buf:
        for adopt in (lambda: HistoryBuffer.attach(buf.name, own=True),
                      lambda: shmbuf.attach(buf.name, own=True),
                      lambda: keyed.attach(buf.name, own=True)):
            with pytest.raises(shmbuf.OwnerAliveError,
                               match=f"owned by pid {os.getpid()}, which is alive"):
                adopt()
        assert shm_exists(buf.name) and buf.owner
        buf.append(history_info([0, 1], 1))


def test_adopting_another_kind_of_keyed_rings_leaves_them_alone():
    with ParamBlock.create({"w": np.zeros(2, np.float32)}) as block:
        with pytest.raises(shmbuf.CorruptSegmentError, match="not made by a HistoryBuffer"):
            HistoryBuffer.attach(block.name, own=True)
        assert shm_exists(block.name) and block.owner


@pytest.mark.slow
def test_the_adopter_keeps_the_data_and_the_workers_keep_appending():
    name = dead_owner_history()
    ctx = mp.get_context("spawn")
    report, child_end = ctx.Pipe()
    worker = ctx.Process(target=attach_until_closed, args=(name, [2, 3], child_end))
    buf = None
    try:
        worker.start()
        assert receive(report) == "running"  # attached before the adoption
        buf = HistoryBuffer.attach(name, own=True)
        assert buf.owner and (buf.n_envs, buf.max_len) == (4, 8)
        out = buf.get(5, [0])
        assert out["step"].tolist() == [[1, 2, 3, 4, 5]]  # the dead owner's entries
        check_entries(out, [0])
        seen = int(buf.get(1, [2])["step"][0, 0])
        poll(lambda: True if buf.get(1, [2])["step"][0, 0] > seen + 50 else None, TIMEOUT,
             lambda: AssertionError("the worker stopped appending after the adoption"))
        check_entries(buf.get(8, [2, 3]), [2, 3])
        buf.append(history_info([0], 6), env_ids=[0])  # the adopter appends too
        buf.close()  # the adopter unlinks, and the worker learns it
        assert not shm_exists(name)
        kind, _, message = receive(report)
        assert kind == "closed" and f"closed by its owner (pid {os.getpid()})" in message
        worker.join(TIMEOUT)
        assert worker.exitcode == 0
    finally:
        if buf is not None:
            buf.close()
        stop([worker])
        remove(name)


@pytest.mark.slow
def test_shmbuf_attach_adopts_a_history_buffer_and_gc_spares_it(capsys):
    name = dead_owner_history()
    try:
        with shmbuf.attach(name, own=True, handle_signals=False) as buf:
            assert isinstance(buf, HistoryBuffer) and buf.owner and len(buf) == 0
            assert buf.num_strided([0]) == [5]
            assert cli.main(["gc"]) == 0
            assert shm_exists(name)  # its creator is dead, but its owner now is alive
            assert cli.main(["info", name]) == 0
            assert f"pid {os.getpid()} alive adopted" in capsys.readouterr().out
        assert not shm_exists(name)
    finally:
        remove(name)


# -- SIGTERM (a script owner's death by SIGTERM: test_signals.py, test_adopt.py) ----------------
def test_owners_install_the_handler_until_the_last_closes():
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        pytest.skip("the test runner has its own SIGTERM handler")
    history = HistoryBuffer(2, 4)  # owns its name before it has a schema
    assert _signals.installed()
    block = ParamBlock.create({"w": np.zeros(2, np.float32)})
    history.close()
    assert _signals.installed()
    block.close()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    with HistoryBuffer(2, 4, handle_signals=False), \
            ParamBlock.create({"w": np.zeros(1)}, handle_signals=False):
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_handle_signals_is_checked_before_anything_is_created():
    before = set(os.listdir("/dev/shm"))
    for make in (lambda: HistoryBuffer(2, 4, handle_signals="yes"),
                 lambda: ParamBlock.create({"w": np.zeros(1)}, handle_signals=1),
                 lambda: keyed.attach("shmbuf-test-none", own=True, handle_signals="no")):
        with pytest.raises(TypeError, match="handle_signals must be None, True or False"):
            make()
    assert set(os.listdir("/dev/shm")) <= before
