"""What the Dreamer and IRIS facades share: one step is (obs, action, reward, done).

Both seed buffers are rings of single transitions with the same four arrays
and the same counters (``idx``, ``full``, ``steps``, ``episodes``); only their
sampling shapes differ.  Here: the column schema, the argument checks, and
those counters derived from the core's ``Stats``.
"""
from __future__ import annotations

import numpy as np

from .._args import check_int
from .._errors import NotEnoughDataError
from ._base import Facade


def transition_spec(obs_shape: tuple, action_size: int) -> dict:
    """The core schema: uint8 frames, float32 actions and rewards, bool terminals.

    Terminals are stored as bool, so a ``done`` of 0.5 is rejected instead of
    silently counting as an episode end; samplers hand them out as float32.
    """
    return {"obs": (tuple(obs_shape), np.uint8), "action": ((action_size,), np.float32),
            "reward": ((), np.float32), "done": ((), np.bool_)}


def check_shape(arg: str, shape) -> list:
    """A per-step shape as a list of positive ints (JSON-friendly for the header)."""
    if isinstance(shape, (int, np.integer)) and not isinstance(shape, bool):
        shape = (shape,)
    try:
        dims = list(shape)
    except TypeError:
        raise TypeError(f"{arg} must be a tuple of ints such as (3, 64, 64), "
                        f"got {shape!r}") from None
    return [check_int(f"{arg}[{i}]", d, 1) for i, d in enumerate(dims)]


def transition_params(size, obs_shape, action_size, seq_len, batch_size, frames: int) -> dict:
    """Checked constructor arguments.

    A ``seq_len`` longer than ``size`` is accepted, as upstream accepts it:
    such a buffer fails at ``sample()`` (``check_window``), the call that
    needs the window (torchwm's own tests build one).
    """
    size = check_int("size", size, 1)
    return {"size": size, "obs_shape": check_shape("obs_shape", obs_shape),
            "action_size": check_int("action_size", action_size, 1),
            "batch_size": check_int("batch_size", batch_size, 1),
            "seq_len": check_int("seq_len", seq_len, 1)}


def age_buckets(age_weights):
    """``age_weights`` as ``(list for the metadata, AgeBuckets selector)``, or ``(None, None)``.

    Errors name ``age_weights`` (the facades' constructor argument).
    """
    if age_weights is None:
        return None, None
    from ..select import AgeBuckets

    try:
        sel = AgeBuckets(age_weights)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"age_weights={age_weights!r}: {exc}") from None
    return list(sel.weights), sel


def check_window(arg: str, seq_len, size: int, frames: int) -> int:
    """``seq_len`` (an int >= 1), if a window of ``seq_len + frames`` steps fits ``size``.

    Raises:
        NotEnoughDataError: it never can: the buffer holds fewer steps.
        TypeError / ValueError: ``seq_len`` is not an int >= 1.
    """
    length = check_int(arg, seq_len, 1)
    if length + frames > size:
        raise NotEnoughDataError(
            f"{arg}={length} needs {length + frames} consecutive steps of one episode, but "
            f"this buffer holds at most size={size} steps; create it with size >= "
            f"{length + frames} or sample shorter windows")
    return length


class TransitionFacade(Facade):
    """Facade base for the (obs, action, reward, done) rings: counters and closing."""

    def _setup(self, params: dict) -> None:
        self.size = params["size"]
        self.obs_shape = tuple(params["obs_shape"])
        self.action_size = params["action_size"]
        self.seq_len = params["seq_len"]
        self.batch_size = params["batch_size"]

    def _add(self, obs, action, reward, done) -> None:
        self._check_open()
        self._get_writer().add(obs=obs, action=action, reward=reward, done=done)

    @property
    def steps(self) -> int:
        """Transitions added so far by every process (upstream: ``add`` calls)."""
        self._check_open()
        return self.buffer.stats().steps_written

    @property
    def episodes(self) -> int:
        """Terminal transitions added so far by every process."""
        self._check_open()
        return self.buffer.stats().episodes

    @property
    def idx(self) -> int:
        """``steps % size``: where upstream's single ring would write next.

        With several writer processes each one fills its own chunk of rows, so
        this is a counter kept for compatibility, not a row index: use
        ``steps`` and ``len()``-style counts instead of reading rows at ``idx``.
        """
        return self.steps % self.size

    @property
    def full(self) -> bool:
        """True once ``size`` transitions were added, as upstream: later adds evict the oldest."""
        return self.steps >= self.size

    def __repr__(self) -> str:
        where = f"{type(self).__module__}.{type(self).__name__}"
        if self.buffer is None:   # the constructor failed before the segment existed
            return f"<{where} unopened>"
        state = "closed" if self._closed else f"size={self.size}"
        return f"<{where} {self.name!r} {state}>"
