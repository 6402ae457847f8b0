"""Processes that get stopped: scripts run as real programs, and the workers they start.

Tests of signals and shutdown run a trainer as ``python -c SCRIPT`` (so that
signals, exit statuses and exit-time joins are the real thing), read the
lines it prints with a timeout, and kill whatever is left in ``finally``.
"""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import textwrap
import time

from helpers.procs import reap
from helpers.workers import step_for
from shmbuf.posix.procs import start_time
from shmbuf.posix.wait import poll

TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT = 60


def write_forever(buf, writer_id: int, episode_len: int = 50) -> None:
    """Worker body: add encoded steps until the buffer says it is closed (then raise)."""
    w = buf.writer()
    pos = 0
    while True:
        episode, t = divmod(pos, episode_len)
        w.add(**step_for(writer_id, pos, episode, t, t == episode_len - 1))
        pos += 1


_SIGINT_LINE = "import signal as _s; _s.signal(_s.SIGINT, _s.default_int_handler)\n"


class Script:
    """``python -c code`` with tests/ on the path; lines of its stdout, read with a timeout."""

    def __init__(self, code: str, **kw):
        env = dict(os.environ, PYTHONPATH=TESTS_DIR + os.pathsep + os.environ.get("PYTHONPATH", ""))
        # SIGINT raises KeyboardInterrupt in the script even when a shell that
        # started the tests in the background (`cmd &`) handed them SIGINT
        # ignored.  Set by the script's first line, not by a preexec_fn, which
        # can deadlock a child forked from a process with threads.
        self.proc = subprocess.Popen([sys.executable, "-c", _SIGINT_LINE + textwrap.dedent(code)],
                                     env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)
        self.pid = self.proc.pid
        self._buf = b""

    def line(self, timeout: float = TIMEOUT) -> str:
        """The next line it prints; AssertionError (with its stderr) if none comes in time."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            ready = select.select([self.proc.stdout], [], [], max(left, 0))[0] if left > 0 else []
            chunk = os.read(self.proc.stdout.fileno(), 65536) if ready else b""
            if not chunk:
                self.kill()
                raise AssertionError(f"no line from the script within {timeout} s; "
                                     f"stderr:\n{self.stderr()}")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode()

    def json(self, timeout: float = TIMEOUT):
        return json.loads(self.line(timeout))

    def wait(self, timeout: float = TIMEOUT) -> int:
        """Its exit status (negative: the signal that ended it); AssertionError on a hang."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"the script did not exit within {timeout} s "
                                 f"(hung); stderr:\n{self.stderr()}") from None

    def stderr(self, timeout: float = TIMEOUT) -> str:
        """What it wrote to stderr; bounded, since its children may still hold the pipe."""
        if self.proc.poll() is None:
            return "(still running)"
        out, deadline = b"", time.monotonic() + timeout
        fd = self.proc.stderr.fileno()
        while (left := deadline - time.monotonic()) > 0:
            if not select.select([fd], [], [], left)[0]:
                return out.decode(errors="replace") + "\n(stderr still open: a child holds it)"
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            out += chunk
        return out.decode(errors="replace")

    def signal(self, signum: int) -> None:
        os.kill(self.pid, signum)

    def kill(self) -> None:
        """SIGKILL it if it still runs, and reap it."""
        reap([self.proc])

    def close(self) -> None:
        self.kill()
        self.proc.stdout.close()
        self.proc.stderr.close()


def wait_gone(pids, timeout: float = TIMEOUT) -> None:
    """Poll until every pid is gone (exited and reaped, or a zombie); raise on timeout."""
    def gone():
        return True if all(start_time(p) is None for p in pids) else None

    poll(gone, timeout, lambda: AssertionError(
        f"processes {[p for p in pids if start_time(p) is not None]} still run "
        f"{timeout} s later"))


def kill_all(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


