"""SIGTERM removes an owner's segments; SIGINT is Python's; what is installed, and when.

Each case runs the owner as a real program (``python -c``), sends it a real
signal, and checks its exit status, its output and /dev/shm.
"""
import signal
import subprocess
import textwrap
import threading

import pytest
from helpers.shm import exists as shm_exists
from helpers.stop_workers import Script, kill_all, wait_gone
from helpers.workers import SPEC

from shmbuf import cli

pytestmark = pytest.mark.slow

OWNER = """\
import json, os, signal, sys, time
import shmbuf
from helpers.workers import SPEC
{setup}
{make}
try:
    print(json.dumps({{"name": buf.name, "handler": str(signal.getsignal(signal.SIGTERM))}}),
          flush=True)
{wait}
finally:
    print("finally ran", flush=True)
"""
SLEEP = "while True: time.sleep(1)"
# The owners of each kind, less their closing parenthesis: a step store, and a
# HistoryBuffer (keyed rings, whose constructor takes the same handle_signals).
OWNED = {"store": "shmbuf.create(SPEC, 256",
         "history": "shmbuf.HistoryBuffer(2, 4, spec={'x': ((), 'f4')}"}


def owner_script(setup="", make="buf = shmbuf.create(SPEC, 256)", wait=SLEEP):
    """An owner program: ``setup``, then ``make`` a buffer, print it, then ``wait`` in a try."""
    return Script(OWNER.format(setup=textwrap.dedent(setup), make=textwrap.dedent(make),
                               wait=textwrap.indent(textwrap.dedent(wait), "    ")))


def test_sigterm_unwinds_unlinks_and_ends_by_sigterm():
    owner = Script("""
        import json, multiprocessing as mp, time
        import shmbuf
        from helpers.stop_workers import write_forever
        from helpers.workers import SPEC
        if __name__ == "__main__":
            with shmbuf.create(SPEC, 4096) as buf:
                p = mp.get_context("spawn").Process(target=write_forever, args=(buf, 0))
                p.start()
                buf.wait_ready(100, timeout=60)
                try:
                    print(json.dumps({"name": buf.name, "worker": p.pid}), flush=True)
                    while True:
                        time.sleep(1)
                finally:
                    print("finally ran", flush=True)
    """)
    worker = None
    try:
        info = owner.json()
        worker = info["worker"]
        owner.signal(signal.SIGTERM)
        assert owner.line() == "finally ran"
        assert owner.wait() == -signal.SIGTERM  # the usual death by SIGTERM, after cleanup
        assert not shm_exists(info["name"])
        err = owner.stderr()
        assert "BufferClosedError" in err and "closed by its owner" in err  # the worker stopped
        assert "Traceback" not in err.split("BufferClosedError")[-1] or "Terminated" not in err
        wait_gone([worker])
    finally:
        owner.close()
        kill_all([worker] if worker else [])


@pytest.mark.parametrize("kind", OWNED)
def test_sigterm_runs_finalizers_of_buffers_outside_with_blocks(kind):
    owner = owner_script(make=f"buf = {OWNED[kind]})")  # module-level: unlinked at exit
    try:
        info = owner.json()
        assert "_on_signal" in info["handler"]
        owner.signal(signal.SIGTERM)
        assert owner.line() == "finally ran"
        assert owner.wait() == -signal.SIGTERM
        assert not shm_exists(info["name"])
    finally:
        owner.close()


def test_a_second_sigterm_during_cleanup_ends_the_process_at_once():
    owner = owner_script(wait="""
        try:
            print("waiting", flush=True)
            while True: time.sleep(1)
        finally:
            print("cleaning", flush=True)
            time.sleep(600)
        """)
    name = None
    try:
        name = owner.json()["name"]
        assert owner.line() == "waiting"
        owner.signal(signal.SIGTERM)
        assert owner.line() == "cleaning"
        owner.signal(signal.SIGTERM)
        assert owner.wait() == -signal.SIGTERM
    finally:
        owner.close()
        if name and shm_exists(name):
            cli.main(["rm", "--force", name])  # a forced stop leaves it, as SIGKILL would


def test_an_existing_handler_is_left_alone_unless_asked():
    owner = owner_script(setup="""
        def mine(signum, frame):
            print("mine ran", flush=True)
            sys.exit(7)
        signal.signal(signal.SIGTERM, mine)""")
    try:
        info = owner.json()
        assert "mine" in info["handler"]
        owner.signal(signal.SIGTERM)
        assert owner.line() == "mine ran"
        assert owner.line() == "finally ran"
        assert owner.wait() == 7  # the program's own handler decided
        assert not shm_exists(info["name"])  # its SystemExit unwound, the finalizer unlinked
    finally:
        owner.close()


def test_handle_signals_true_chains_to_the_existing_handler():
    owner = owner_script(setup="""
        def mine(signum, frame):
            print("mine ran", flush=True)
        signal.signal(signal.SIGTERM, mine)""",
        make="buf = shmbuf.create(SPEC, 256, handle_signals=True)")
    try:
        info = owner.json()
        assert "_on_signal" in info["handler"]
        owner.signal(signal.SIGTERM)
        assert owner.line() == "mine ran"
        assert owner.line() == "finally ran"
        assert owner.wait() == -signal.SIGTERM
        assert not shm_exists(info["name"])
    finally:
        owner.close()


@pytest.mark.parametrize("kind", OWNED)
def test_handle_signals_false_installs_nothing(kind):
    owner = owner_script(make=f"buf = {OWNED[kind]}, handle_signals=False)")
    name = None
    try:
        info = owner.json()
        name = info["name"]
        assert info["handler"] in ("0", "Handlers.SIG_DFL")
        owner.signal(signal.SIGTERM)
        assert owner.wait() == -signal.SIGTERM
        assert shm_exists(name)  # SIGTERM's default action: no cleanup (gc's job)
    finally:
        owner.close()
        if name and shm_exists(name):
            cli.main(["rm", name])  # its owner is dead: no --force needed
            assert not shm_exists(name)


def test_an_ignored_sigterm_stays_ignored():
    owner = Script(OWNER.format(setup="signal.signal(signal.SIGTERM, signal.SIG_IGN)",
                                make="buf = shmbuf.create(SPEC, 256)",
                                wait="    print(sys.stdin.readline().strip(), flush=True)"),
                   stdin=subprocess.PIPE)
    try:
        info = owner.json()
        assert info["handler"] in ("1", "Handlers.SIG_IGN")
        owner.signal(signal.SIGTERM)
        owner.proc.stdin.write(b"still here\n")
        owner.proc.stdin.flush()
        assert owner.line() == "still here"
        assert owner.line() == "finally ran"
        assert owner.wait() == 0
        assert not shm_exists(info["name"])
    finally:
        owner.close()


def test_sigterm_with_no_open_owned_buffer_acts_as_before():
    owner = owner_script(make="""
        buf = shmbuf.create(SPEC, 256)
        buf.close()
        assert "_on_signal" not in str(signal.getsignal(signal.SIGTERM))  # put back
        keep = shmbuf.create(SPEC, 256, handle_signals=False)  # owned, but not watched
        buf = shmbuf.create(SPEC, 256)
        buf.unlink(); buf._closed = True  # closed as far as the handler can tell
        buf = keep
        """)
    try:
        info = owner.json()
        owner.signal(signal.SIGTERM)
        assert owner.wait() == -signal.SIGTERM  # at once: no "finally ran"
        assert "finally ran" not in owner.proc.stdout.read().decode()
    finally:
        owner.close()
        if shm_exists(info["name"]):
            cli.main(["rm", "--force", info["name"]])


def test_sigint_is_left_to_python_and_the_buffer_survives_an_interrupt():
    """A notebook's interrupt button: KeyboardInterrupt, and the buffer is still there."""
    owner = Script("""
        import os, signal
        import shmbuf
        from helpers.workers import SPEC, step_for, verify_batch
        before = signal.getsignal(signal.SIGINT)
        buf = shmbuf.create(SPEC, 512)
        w = buf.writer()
        pos = 0
        try:
            for pos in range(10):
                w.add(**step_for(0, pos, 0, pos, False))
            print(buf.name, flush=True)
            while True:
                pos += 1; w.add(**step_for(0, pos, 0, pos, False))
        except KeyboardInterrupt:
            pass
        w.end_episode()  # the interrupted add may or may not have published its step
        w.add(**step_for(0, pos + 1, 1, 0, False))
        verify_batch(buf.sample_sequences(2, 3))
        print(os.path.exists("/dev/shm/" + buf.name), signal.getsignal(signal.SIGINT) is before,
              flush=True)
        buf.close()
    """)
    try:
        name = owner.line()
        owner.signal(signal.SIGINT)
        assert owner.line() == "True True"
        assert owner.wait() == 0
        assert not shm_exists(name)
    finally:
        owner.close()


def test_nothing_is_installed_from_another_thread(make_buffer):
    before = signal.getsignal(signal.SIGTERM)
    made, errors = [], []

    def body():
        made.append(make_buffer(SPEC, 16))
        try:
            make_buffer(SPEC, 16, handle_signals=True)
        except ValueError as exc:
            errors.append(str(exc))

    t = threading.Thread(target=body)
    t.start()
    t.join(60)
    assert made and signal.getsignal(signal.SIGTERM) is before
    assert errors and "main thread" in errors[0]


def test_the_handler_is_put_back_after_the_last_owned_buffer_closes():
    # In a fresh interpreter, where SIGTERM has its default action: this one may hold a
    # handler that earlier tests left (ray.init installs Ray's), and the test must run anyway.
    script = Script("""
        import signal
        import shmbuf
        from helpers.workers import SPEC
        from shmbuf.posix import signals as _signals
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        a = shmbuf.create(SPEC, 16)
        assert _signals.installed()
        b = shmbuf.create(SPEC, 16)
        a.close()
        assert _signals.installed()
        b.close()
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        try:
            shmbuf.create(SPEC, 16, handle_signals="yes")
        except TypeError as exc:
            assert "handle_signals" in str(exc)
        else:
            raise AssertionError("handle_signals='yes' was accepted")
        print("checked", flush=True)
    """)
    try:
        assert script.line() == "checked"
        assert script.wait() == 0, script.stderr()
    finally:
        script.close()
