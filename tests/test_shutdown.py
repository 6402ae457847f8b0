"""Owner shutdown is visible: close, unlink, ``shmbuf rm`` and ``gc`` mark the buffer closed.

Writers, samplers, waiters and attachers in other processes learn it at
their next call (BufferClosedError, naming who closed it), so a worker loop
that writes forever ends, and a trainer's exit-time join returns.  Real
processes and real signals; every wait has a timeout; children are killed in
``finally``.
"""
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
from helpers.shm import exists as shm_exists
from helpers.stop_workers import Script, kill_all, wait_gone
from helpers.workers import SPEC, step_for, verify_batch

import shmbuf
from shmbuf import cli
from shmbuf.protocol import header as _header
from shmbuf.protocol.layout import CLOSED_OWNER
from shmbuf.segment import segment as _segment

WORKER = """
    import json, sys
    import shmbuf
    from helpers.workers import step_for
    buf = shmbuf.attach(sys.argv[1] if len(sys.argv) > 1 else {name!r})
    w = buf.writer()
    print("writing", flush=True)
    pos = 0
    try:
        while True:
            {call}
            pos += 1
    except shmbuf.BufferClosedError as exc:
        print(json.dumps({{"steps": pos, "error": str(exc)}}), flush=True)
"""
ADD = "w.add(**step_for(0, pos, 0, pos, False))"
ADD_BATCH = ("w.add_batch(**{k: __import__('numpy').stack([v, v]) "
             "for k, v in step_for(0, pos, 0, pos, False).items()})")


def start_worker(name, call=ADD):
    script = Script(WORKER.format(name=name, call=call))
    assert script.line() == "writing"
    return script


# A process that wrote a step, closed its writer and now only samples: gc
# keeps a dead owner's buffer while writers use it, so its removal is
# learnt by readers like this one.
SAMPLER = """
    import json
    import shmbuf
    from helpers.workers import step_for
    buf = shmbuf.attach({name!r})
    with buf.writer() as w:
        w.add(**step_for(0, 0, 0, 0, False))
    print("sampling", flush=True)
    calls = 0
    try:
        while True:
            buf.sample_steps(1)
            calls += 1
    except shmbuf.BufferClosedError as exc:
        print(json.dumps({{"steps": calls, "error": str(exc)}}), flush=True)
"""


def start_sampler(name):
    script = Script(SAMPLER.format(name=name))
    assert script.line() == "sampling"
    return script


@pytest.mark.slow
@pytest.mark.parametrize("how", ["close", "unlink"])
@pytest.mark.parametrize("call", [ADD, ADD_BATCH], ids=["add", "add_batch"])
def test_owner_close_or_unlink_stops_writers_elsewhere(how, call):
    buf = shmbuf.create(SPEC, 256)
    worker = start_worker(buf.name, call)
    try:
        buf.wait_ready(10, timeout=60)
        getattr(buf, how)()
        report = worker.json()
        assert report["steps"] > 0
        assert "was closed by its owner" in report["error"]
        assert f"pid {os.getpid()}" in report["error"] and buf.name in report["error"]
        assert worker.wait() == 0
        assert not shm_exists(buf.name)
    finally:
        worker.close()
        buf.close()


def test_owner_keeps_using_its_mapping_after_unlink(make_buffer):
    buf = make_buffer(SPEC, 64)
    buf.unlink()
    with buf.writer() as w:  # the process that closed it is not stopped
        for pos in range(8):
            w.add(**step_for(0, pos, 0, pos, False))
    verify_batch(buf.sample_sequences(2, 4))


@pytest.mark.parametrize("how", ["close", "unlink"])
def test_a_second_handle_in_the_closing_process_is_stopped_too(make_buffer, how):
    # A collector thread's handle, say: the exemption is the unlinking handle's,
    # not its process's.  Its values fit exactly, so add runs the C fast path.
    buf = make_buffer(SPEC, 64)
    other = shmbuf.attach(buf.name)
    mine, theirs = buf.writer(), other.writer()
    try:
        for pos in range(4):
            theirs.add(**step_for(1, pos, 0, pos, False))
            mine.add(**step_for(0, pos, 0, pos, False))
        getattr(buf, how)()
        with pytest.raises(shmbuf.BufferClosedError,
                           match=f"closed by its owner .pid {os.getpid()}."):
            theirs.add(**step_for(1, 4, 0, 4, False))
        for call in (lambda: other.sample_steps(1), lambda: other.sample_sequences(1, 2),
                     other.writer):
            with pytest.raises(shmbuf.BufferClosedError):
                call()
        if how == "unlink":   # the handle that unlinked carries on
            mine.add(**step_for(0, 4, 0, 4, False))
            verify_batch(buf.sample_sequences(2, 2))
    finally:
        mine.close()
        theirs.close()
        other.close()


def test_a_facades_second_handle_is_stopped_and_the_unlinking_one_is_not():
    rb = shmbuf.ReplayBuffer(64, (3, 8, 8), 2, seq_len=2, batch_size=2)
    other = shmbuf.attach(rb.name)
    try:
        args = (np.zeros((3, 8, 8), np.uint8), np.zeros(2, np.float32), 0.0, False)
        rb.add({"image": args[0]}, *args[1:])
        other.add({"image": args[0]}, *args[1:])
        rb.unlink()
        rb.add({"image": args[0]}, *args[1:])
        with pytest.raises(shmbuf.BufferClosedError):
            other.add({"image": args[0]}, *args[1:])
    finally:
        other.close()
        rb.close()


def test_keyed_rings_and_parameter_blocks_stop_a_second_handle_in_the_process():
    from shmbuf.params import ParamBlock

    hist = shmbuf.HistoryBuffer(2, 4)
    block = ParamBlock.create({"w": np.zeros(3, np.float32)})
    handles = []
    try:
        hist.append({"x": np.array([1.0, 2.0])})
        block.publish({"w": np.ones(3, np.float32)})
        h2, b2 = shmbuf.attach(hist.name), shmbuf.attach(block.name)
        handles += [h2, b2]
        hist.unlink()
        block.unlink()
        hist.append({"x": np.array([3.0, 4.0])})           # the unlinking handles go on
        assert hist.get(1)["x"].tolist() == [[3.0], [4.0]]
        assert block.publish({"w": np.full(3, 2, np.float32)}) == 2
        for call in (lambda: h2.append({"x": np.array([5.0, 6.0])}), lambda: h2.get(1),
                     b2.read, b2.version):
            with pytest.raises(shmbuf.BufferClosedError, match="closed by its owner"):
                call()
    finally:
        for h in handles + [hist, block]:
            h.close()


def test_samplers_waiters_and_attachers_learn_it(make_buffer):
    buf = make_buffer(SPEC, 64)
    with buf.writer() as w:
        for pos in range(8):
            w.add(**step_for(0, pos, 0, pos, False))
    other = shmbuf.attach(buf.name)
    try:
        # As if another process had closed it (pid 1 is never us): marked, name still there.
        with _raw(buf.name) as mm:
            from shmbuf.protocol import header as _header
            assert _header.mark_closed(mm, CLOSED_OWNER, 1)
            assert not _header.mark_closed(mm, CLOSED_OWNER, 2)  # the first closer stays
        for call in (lambda: other.sample_sequences(2, 2), lambda: other.sample_steps(2),
                     lambda: other.wait_ready(1, timeout=5), other.writer,
                     lambda: shmbuf.attach(buf.name)):
            with pytest.raises(shmbuf.BufferClosedError, match="closed by its owner .pid 1."):
                call()
        assert other.stats().live_steps == 8  # a monitor can still look
    finally:
        other.close()


def test_a_waiting_worker_wakes_up_when_the_owner_closes():
    buf = shmbuf.create(SPEC, 64)
    waiter = Script(f"""
        import shmbuf
        buf = shmbuf.attach({buf.name!r})
        print("waiting", flush=True)
        try:
            buf.wait_ready(10, timeout=60)
        except shmbuf.BufferClosedError:
            print("closed", flush=True)
    """)
    try:
        assert waiter.line() == "waiting"
        buf.close()
        assert waiter.line() == "closed"
        assert waiter.wait() == 0
    finally:
        waiter.close()
        buf.close()


@pytest.mark.slow
@pytest.mark.parametrize("command", ["rm", "gc"])
def test_shmbuf_rm_and_gc_mark_closed_before_removing(command, capsys):
    if command == "rm":
        owner = None
        buf = shmbuf.create(SPEC, 256)
        name = buf.name
    else:  # gc takes only buffers whose owner died and no writer uses: a child's, SIGKILLed
        owner = Script("""
            import numpy as np, shmbuf
            from helpers.workers import SPEC
            buf = shmbuf.create(SPEC, 256, handle_signals=False)
            print(buf.name, flush=True)
            import time; time.sleep(600)
        """)
        name = owner.line()
        owner.kill()
        buf = None
    worker = start_worker(name) if command == "rm" else start_sampler(name)
    try:
        assert cli.main(["rm", "--force", name] if command == "rm" else ["gc", name]) == 0
        report = worker.json()
        assert ("'shmbuf rm'" if command == "rm" else "'shmbuf gc'") in report["error"]
        assert worker.wait() == 0
        assert not shm_exists(name)
    finally:
        worker.close()
        if owner is not None:
            owner.close()
        if buf is not None:
            buf.close()


def _rm_force(name: str) -> None:
    """``shmbuf rm --force NAME`` in a process of its own, as a user at a shell would."""
    done = subprocess.run([sys.executable, "-m", "shmbuf", "rm", "--force", name],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "removed" in done.stdout, done.stderr


@pytest.mark.slow
@pytest.mark.parametrize("when", ["before", "after"])
def test_rm_force_while_create_writes_its_header_is_noticed(monkeypatch, when):
    # The window of a large create: the name exists, the header is not (or only just)
    # published.  create must not return a buffer that nobody can attach to.
    name = f"shmbuf-test-rm-during-create-{os.getpid()}"
    real = _header.publish_header

    def publish(mm, header):
        if when == "before":
            _rm_force(name)
        real(mm, header)
        if when == "after":
            _rm_force(name)

    monkeypatch.setattr(_header, "publish_header", publish)
    with pytest.raises(shmbuf.SegmentNotFoundError, match="removed while it was being created"):
        shmbuf.create(SPEC, 256, name=name)
    monkeypatch.undo()
    assert not shm_exists(name)
    with pytest.raises(shmbuf.SegmentNotFoundError):
        shmbuf.attach(name)


@pytest.mark.slow
def test_rm_force_of_a_history_buffers_reserved_name_stops_its_first_append():
    hist = shmbuf.HistoryBuffer(2, 4)   # holds the name; the segment is sized at the first append
    try:
        _rm_force(hist.name)
        with pytest.raises(shmbuf.SegmentNotFoundError, match="removed while it was being created"):
            hist.append({"x": np.array([1.0, 2.0])})
        assert not shm_exists(hist.name)
    finally:
        hist.close()


@pytest.mark.slow
def test_rm_force_after_create_stops_the_creators_own_handle():
    buf = shmbuf.create(SPEC, 256)
    try:
        w = buf.writer()
        w.add(**step_for(0, 0, 0, 0, False))
        _rm_force(buf.name)
        with pytest.raises(shmbuf.BufferClosedError, match="'shmbuf rm'"):
            w.add(**step_for(0, 1, 0, 1, False))
    finally:
        buf.close()


def test_marking_leaves_foreign_and_missing_segments_alone(make_buffer):
    name = f"shmbuf-test-foreign-{os.getpid()}"
    with open(os.path.join("/dev/shm", name), "wb") as f:
        f.write(b"\xff" * 4096)
    try:
        _segment._mark_closed(name, CLOSED_OWNER)
        with open(os.path.join("/dev/shm", name), "rb") as f:
            assert f.read() == b"\xff" * 4096
        _segment._mark_closed("shmbuf-test-never-made", CLOSED_OWNER)  # quiet
    finally:
        os.unlink(os.path.join("/dev/shm", name))


TRAINER = """
    import json, multiprocessing as mp, os
    import shmbuf
    from shmbuf.posix.wait import poll
    from helpers.stop_workers import write_forever
    from helpers.workers import SPEC, verify_batch

    if __name__ == "__main__":
        ctx = mp.get_context("spawn")
        with shmbuf.create(SPEC, 4096) as buf:
            procs = [ctx.Process(target=write_forever, args=(buf, i)) for i in range(2)]
            for p in procs:
                p.start()
            buf.wait_ready(500, timeout=60)
            # Both workers writing, and the sampler's first-call imports done, before the
            # test sends SIGINT (a KeyboardInterrupt inside an import is Python's own hazard).
            poll(lambda: True if buf.stats().writers == 2 else None, 60,
                 lambda: TimeoutError("the workers did not start"))
            verify_batch(buf.sample_sequences(4, 5))
            try:
                print(json.dumps({"name": buf.name, "workers": [p.pid for p in procs]}),
                      flush=True)
                while True:
                    verify_batch(buf.sample_sequences(4, 5))
            finally:
                print("unwound", flush=True)
"""


@pytest.mark.slow
def test_sigint_to_the_trainer_alone_ends_everything():
    """The bug: workers wrote into the unlinked segment forever and the exit-time join hung."""
    trainer = Script(TRAINER)
    workers = []
    try:
        info = trainer.json()
        workers = info["workers"]
        trainer.signal(signal.SIGINT)  # the trainer only, as `kill -INT`
        assert trainer.line() == "unwound"
        status = trainer.wait()  # multiprocessing's exit-time join returns
        err = trainer.stderr()
        assert status == -signal.SIGINT, err  # an uncaught KeyboardInterrupt
        assert "KeyboardInterrupt" in err
        assert err.count("was closed by its owner") == 2, err  # each worker's last words
        wait_gone(workers)
        assert not shm_exists(info["name"])
    finally:
        trainer.close()
        kill_all(workers)


class _raw:
    """A plain read-write mapping of /dev/shm/NAME (bypasses shmbuf)."""

    def __init__(self, name):
        self.path = os.path.join("/dev/shm", name)

    def __enter__(self):
        import mmap

        fd = os.open(self.path, os.O_RDWR)
        try:
            self.mm = mmap.mmap(fd, 0)
        finally:
            os.close(fd)
        return self.mm

    def __exit__(self, *exc):
        self.mm.close()
