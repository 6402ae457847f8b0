"""Adoption: ``attach(name, own=True)`` takes over a buffer whose owner died.

The owner record (pid + start time) is taken by one compare-and-swap, so of
several restarted trainers exactly one wins; the adopter unlinks at close
and answers for SIGTERM; writers attached before the crash keep writing.
HistoryBuffers and parameter blocks (keyed rings) are adopted the same way (the rival and
SIGTERM tests here take each kind; more in test_history_lifecycle.py and test_gym_actors.py).
"""
import json
import os
import signal

import numpy as np
import pytest
from helpers import crash_harness
from helpers.adopters import dead_owner_param_block, rival_adopters
from helpers.history_workers import dead_owner_history
from helpers.shm import exists as shm_exists
from helpers.stop_workers import Script
from helpers.workers import SPEC, verify_batch

import shmbuf
from shmbuf import cli
from shmbuf.posix.wait import poll
from shmbuf.protocol.layout import CLOSED_OWNER
from shmbuf.segment import segment as _segment

OWNER = """
    import shmbuf, time
    from helpers.workers import SPEC
    buf = shmbuf.create(SPEC, 512, chunk_size=8)
    print(buf.name, flush=True)
    while True:
        time.sleep(1)
"""


def dead_owner_buffer():
    """The name of a buffer whose owner was SIGKILLed (the caller adopts or removes it)."""
    owner = Script(OWNER)
    try:
        return owner.line()
    finally:
        owner.close()  # SIGKILL: nothing is cleaned up


# Buffers of each kind whose owner died: a step store, a HistoryBuffer's keyed rings, and a
# parameter block (keyed rings too).
DEAD_OWNERS = [dead_owner_buffer, dead_owner_history, dead_owner_param_block]
DEAD_OWNER_IDS = ["store", "history", "params"]


def test_a_live_owner_is_never_replaced(make_buffer):
    buf = make_buffer(SPEC, 64)
    with pytest.raises(shmbuf.OwnerAliveError, match=f"owned by pid {os.getpid()}, which is alive"):
        shmbuf.attach(buf.name, own=True)
    with pytest.raises(shmbuf.ShmbufError):
        shmbuf.attach(buf.name, own=True)
    assert buf.stats().owner_pid == os.getpid()


@pytest.mark.slow
def test_the_adopter_owns_and_writers_keep_writing():
    name = dead_owner_buffer()
    worker = Script(f"""
        import json, shmbuf
        from helpers.workers import step_for
        w = shmbuf.attach({name!r}).writer()
        print("writing", flush=True)
        pos = 0
        try:
            while True:
                w.add(**step_for(0, pos, pos // 7, pos % 7, pos % 7 == 6)); pos += 1
        except shmbuf.BufferClosedError as exc:
            print(json.dumps(str(exc)), flush=True)
    """)
    buf = None
    try:
        assert worker.line() == "writing"
        buf = shmbuf.attach(name, own=True)
        assert buf.owner and buf.stats().owner_pid == os.getpid() and buf.stats().owner_alive
        before = buf.stats().steps_written
        poll(lambda: True if buf.stats().steps_written > before + 100 else None, 60,
             lambda: AssertionError("the writer stopped after the adoption"))
        verify_batch(buf.sample_sequences(4, 5))
        buf.close()  # the adopter unlinks, and its writers learn it
        assert not shm_exists(name)
        message = json.loads(worker.line())
        assert "closed by its owner" in message and f"pid {os.getpid()}" in message
        assert worker.wait() == 0
    finally:
        worker.close()
        if buf is not None:
            buf.close()
        if shm_exists(name):
            _segment.unlink(name)


@pytest.mark.slow
@pytest.mark.parametrize("dead_owner", DEAD_OWNERS, ids=DEAD_OWNER_IDS)
def test_of_rival_adopters_exactly_one_wins(dead_owner):
    name = dead_owner()
    try:
        results = rival_adopters(lambda: shmbuf.attach(name, own=True, handle_signals=False))
        winners = [r["won"] for r in results if "won" in r]
        assert len(winners) == 1, results
        for r in results:
            if "lost" in r:
                assert f"owned by pid {winners[0]}" in r["lost"]
        assert not shm_exists(name)  # the winner unlinked it at close
    finally:
        if shm_exists(name):
            _segment.unlink(name)


@pytest.mark.slow
@pytest.mark.parametrize("dead_owner", DEAD_OWNERS, ids=DEAD_OWNER_IDS)
def test_the_adopter_answers_for_sigterm(dead_owner):
    name = dead_owner()
    adopter = Script(f"""
        import shmbuf, time
        buf = shmbuf.attach({name!r}, own=True)
        print("adopted", flush=True)
        while True:
            time.sleep(1)
    """)
    try:
        assert adopter.line() == "adopted"
        adopter.signal(signal.SIGTERM)
        assert adopter.wait() == -signal.SIGTERM
        assert not shm_exists(name)
    finally:
        adopter.close()
        if shm_exists(name):
            _segment.unlink(name)


@pytest.mark.slow
def test_gc_spares_an_adopted_buffer_and_a_closed_one_cannot_be_adopted(capsys):
    name = dead_owner_buffer()
    try:
        with shmbuf.attach(name, own=True) as buf:
            assert cli.main(["gc", name]) == 0
            assert shm_exists(name)  # its creator is dead, but its owner now is alive
            assert cli.main(["info", name]) == 0
            out = capsys.readouterr().out
            assert f"pid {os.getpid()} alive adopted" in out, out
            buf.unlink()
        name = dead_owner_buffer()
        _segment._mark_closed(name, CLOSED_OWNER)  # closed, its name not yet removed
        with pytest.raises(shmbuf.BufferClosedError, match="closed by its owner"):
            shmbuf.attach(name, own=True)
        assert cli.main(["gc", name]) == 0
        assert not shm_exists(name)
    finally:
        if shm_exists(name):
            _segment.unlink(name)


def test_a_live_owner_of_keyed_rings_is_never_replaced():
    with shmbuf.HistoryBuffer(n_envs=2, max_len=4, spec={"x": ((), "f4")}) as hb:
        with pytest.raises(shmbuf.OwnerAliveError,
                           match=f"owned by pid {os.getpid()}, which is alive"):
            shmbuf.attach(hb.name, own=True)
        assert hb.owner


@pytest.mark.slow
def test_trainer_kill_loop_every_restart_adopts():
    report = crash_harness.run_trainer_restarts(rounds=50, seed=3)
    print(report.line())
    assert report.rounds == 50 and report.adoptions == 50
    assert report.torn_windows == 0 and report.lost_steps == 0, report.errors[:5]
    assert not report.errors, report.errors[:5]
    assert report.windows_verified > 50 * 8


@pytest.mark.slow
def test_a_facade_is_adopted_as_itself():
    owner = Script("""
        import numpy as np, time
        from shmbuf import ReplayBuffer
        rb = ReplayBuffer(100, (3, 8, 8), 6, seq_len=2, batch_size=4)
        for t in range(10):
            rb.add({"image": np.zeros((3, 8, 8), np.uint8)}, np.zeros(6), 0.0, False)
        print(rb.name, flush=True)
        while True:
            time.sleep(1)
    """)
    try:
        name = owner.line()
    finally:
        owner.close()
    try:
        with shmbuf.ReplayBuffer.attach(name, own=True) as rb:
            assert rb.owner and len(rb.buffer) == 10
            rb.add({"image": np.zeros((3, 8, 8), np.uint8)}, np.zeros(6), 0.0, False)
        assert not shm_exists(name)
    finally:
        if shm_exists(name):
            _segment.unlink(name)


def test_adopting_with_the_wrong_class_leaves_the_buffer_alone():
    name = dead_owner_buffer()  # a plain Buffer
    try:
        with pytest.raises(shmbuf.CorruptSegmentError, match="not by ReplayBuffer"):
            shmbuf.ReplayBuffer.attach(name, own=True)
        assert shm_exists(name)
        with shmbuf.attach(name, own=True) as buf:  # still adoptable by the right class
            assert buf.owner
        assert not shm_exists(name)
    finally:
        if shm_exists(name):
            _segment.unlink(name)
