"""Run an action at the k-th point of a call, to test what happens at every such point.

``At(k, action, matches)`` is a ``sys.setprofile`` hook (and a finder's
``preempt`` callback, called with no arguments): it counts the events that
``matches(frame, event, arg)`` accepts and runs ``action`` once, at the k-th,
with profiling off meanwhile so that the action's own calls are not counted.
A test runs the call for k = 0, 1, ... until ``fired`` stays False: then every
point was tried.
"""
from __future__ import annotations

import sys


class At:
    def __init__(self, k: int, action, matches):
        self.k, self.action, self.matches = k, action, matches
        self.calls, self.fired = 0, False

    def __call__(self, frame=None, event="c_call", arg=None):
        if not self.matches(frame, event, arg):
            return
        if self.calls == self.k:
            self.fired = True
            sys.setprofile(None)
            try:
                self.action()
            finally:
                sys.setprofile(self)
        self.calls += 1


def atomic_loads(frame, event, arg) -> bool:
    """Each call into the protocol's atomics (the points where a reader loads a shared
    word), and each call of a finder's ``preempt`` (made with no arguments)."""
    return event == "c_call" and (arg is None
                                  or getattr(arg, "__module__", None) == "shmbuf.protocol._atomic")


def calls_in(where: str):
    """Each Python call of a function defined below the folder ``where``."""
    def matches(frame, event, arg) -> bool:
        return event == "call" and frame.f_code.co_filename.startswith(where)
    return matches
