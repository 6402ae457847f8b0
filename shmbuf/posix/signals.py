"""SIGTERM for owners: unwind, unlink what this process owns, then die of SIGTERM.

SIGTERM's default action ends a process without any cleanup, so an owner
stopped by a scheduler, Kubernetes or ``kill`` would leave its segments in
/dev/shm.  What shmbuf installs, exactly (nothing else, no other signal):

- One SIGTERM handler per process, installed by the first ``create`` (or
  ``attach(name, own=True)``) that runs in the main thread while SIGTERM has
  its default disposition.  A handler already in place (a function, or
  SIG_IGN) is left alone, and so is every non-main thread, unless
  ``handle_signals=True`` asks for it (then a function in place is chained).
  ``handle_signals=False`` installs nothing.
- On SIGTERM while this process owns an open buffer: the previous handler
  runs first if it was a function, then ``Terminated`` (a ``SystemExit``,
  code 143) is raised in the main thread.  ``with`` blocks and ``finally``
  clauses unwind, atexit handlers and finalizers run, owners mark their
  buffers closed and unlink them (writers elsewhere then stop with
  BufferClosedError).  After the interpreter has finalized, the process
  kills itself with SIGTERM's default action (``_exitsig``), so its parent
  sees the usual death by SIGTERM.
- On SIGTERM while it owns no open buffer, or a second SIGTERM while it is
  already exiting: the previous disposition acts at once (by default the
  process dies).  The previous handler is put back when the last owned
  buffer closes in the main thread.

SIGINT is left to Python: it raises KeyboardInterrupt, which unwinds ``with``
blocks; an interactive user (a notebook's interrupt) keeps the buffer.
SIGKILL cannot be caught: the segment stays for ``attach(name, own=True)``
or ``shmbuf gc``.
"""
from __future__ import annotations

import os
import signal
import threading
import weakref

from . import _exitsig

_SIGNAL = signal.SIGTERM
_owned: "weakref.WeakSet" = weakref.WeakSet()
_previous = None        # the disposition ours replaced; None while ours is not installed
_exiting = False


class Terminated(SystemExit):
    """Raised in the main thread by SIGTERM while this process owns a buffer."""


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def installed() -> bool:
    """True while shmbuf's SIGTERM handler is the one in place."""
    return _previous is not None and signal.getsignal(_SIGNAL) is _on_signal


def check(handle_signals) -> None:
    """Validate ``handle_signals`` at the door, before anything is created."""
    if handle_signals is not None and not isinstance(handle_signals, bool):
        raise TypeError(f"handle_signals must be None, True or False, got {handle_signals!r}")


def watch(handle, handle_signals: bool | None) -> None:
    """``handle`` now owns a segment: see that SIGTERM unlinks it (module docstring).

    Args:
        handle_signals: None (default): install the handler when in the main
            thread and SIGTERM has its default action; True: install it
            anyway, chaining a handler already in place (ValueError outside
            the main thread); False: install nothing.
    """
    check(handle_signals)
    if handle_signals is False:
        return
    _owned.add(handle)
    if installed():
        return
    if not _in_main_thread():
        if handle_signals:
            raise ValueError("handle_signals=True: signal handlers can only be installed from "
                             "the main thread; create the buffer there, or pass "
                             "handle_signals=False and stop it yourself")
        return
    current = signal.getsignal(_SIGNAL)
    if current is not signal.SIG_DFL and not handle_signals:
        return  # the program manages SIGTERM itself
    _install(current)


def watch_or_close(handle, handle_signals: bool | None):
    """``watch(handle, handle_signals)`` and return ``handle``; close it if that fails."""
    try:
        watch(handle, handle_signals)
    except BaseException:
        handle.close()
        raise
    return handle


def forget(handle) -> None:
    """``handle`` no longer owns an open segment; restore the old handler after the last."""
    _owned.discard(handle)
    if not _owned and installed() and _in_main_thread() and not _exiting:
        _uninstall()


def _install(previous) -> None:
    global _previous
    _previous = previous if previous is not None else signal.SIG_DFL
    signal.signal(_SIGNAL, _on_signal)


def _uninstall() -> None:
    global _previous
    previous, _previous = _previous, None
    signal.signal(_SIGNAL, previous)


def _owns_open_buffer() -> bool:
    return any(not getattr(h, "closed", True) and getattr(h, "owner", False) for h in _owned)


def _on_signal(signum, frame):
    global _exiting
    if _exiting or not _owns_open_buffer():
        _act_as_before(signum, frame)
        return
    _exiting = True
    _exitsig.arm(signum)  # after Python finalizes, die of this signal
    previous = _previous
    if callable(previous):
        previous(signum, frame)
    raise Terminated(128 + signum)


def _act_as_before(signum, frame) -> None:
    """What the disposition we replaced would have done with this signal."""
    previous = _previous
    if callable(previous):
        previous(signum, frame)
    elif previous is not signal.SIG_IGN:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def _after_fork_in_child() -> None:
    global _exiting
    _exiting = False
    _exitsig.disarm()


os.register_at_fork(after_in_child=_after_fork_in_child)
