"""A versioned block of policy parameters in shared memory, for actor processes.

The trainer ``publish``es its weights; every actor reads the newest version
when it wants to (between episodes, every N steps) with no pipe, no queue
and no lock.  The block is keyed rings (``shmbuf.keyed.rings``) with one key and
``max_len = 1``: a publish is a keyed-ring append (data first, then the
count with release order), and a read is a keyed-ring read, validated as a
seqlock against a publish that races it.  So this module adds no protocol
of its own.

Layout: column ``data`` holds every tensor's bytes (each at a 64-byte
aligned offset), ``table`` a JSON list of ``[name, dtype, shape, offset]``
(so a reader needs no template), and ``version`` the publish count.
``1 + spare`` copies are kept: a read survives ``spare - 1`` publishes
during its copy (and is retried otherwise).
"""
from __future__ import annotations

import json

import numpy as np

from ._errors import CorruptSegmentError, WaitTimeoutError
from ._registry import register
from .keyed import rings as keyed
from .posix import signals as _signals
from .posix.wait import check_timeout, poll
from .segment.lifecycle import Shared
from .writing.cast import coerce, host_array

FACADE = "ParamBlock"
_ALIGN = 64
_KEY = np.zeros(1, np.int64)


def _newest(lengths):
    return np.zeros((len(lengths), 1), np.int64)


class ParamBlock(Shared):
    """Named arrays (a policy's ``state_dict``) that one trainer publishes and actors read.

    Make one with ``ParamBlock.create(template)`` in the trainer; pass it to
    actor processes (it pickles to its name) or ``ParamBlock.attach(name)``.
    One process publishes; any number read.

    Example:
        >>> block = ParamBlock.create(policy.state_dict())        # trainer
        >>> block.publish(policy.state_dict())                    # -> version 1
        >>> version, params = block.read()                        # actor: numpy arrays
    """

    KIND_NAME = "parameter block"

    def __init__(self, rings: keyed.KeyedRings):
        self._rings = rings
        self._table: list | None = None  # an attacher reads it from a published version
        self._track(rings.name, rings.owner)

    # -- construction -----------------------------------------------------------
    @classmethod
    def create(cls, template: dict, *, spare: int = 2, name: str | None = None,
               handle_signals: bool | None = None) -> "ParamBlock":
        """Create a block shaped like ``template``; the caller owns (and unlinks) it.

        Args:
            template: ``{name: array or tensor}``, e.g. ``model.state_dict()``;
                only the names, shapes and dtypes are used (nothing is published).
            spare: copies beyond the newest (>= 1); a read survives
                ``spare - 1`` publishes during its copy.
            name: segment name; generated if None.
            handle_signals: SIGTERM unlinks the block, as ``shmbuf.create``'s.

        Raises:
            ValueError / TypeError: an empty template or a value that is not
                a fixed-size numeric array.

        Example:
            >>> block = ParamBlock.create({"w": np.zeros((4, 2), np.float32)})
        """
        table, nbytes = _plan(template)
        _signals.check(handle_signals)
        raw = json.dumps(table).encode()
        spec = {"data": ((max(nbytes, 1),), np.uint8), "table": ((len(raw),), np.uint8),
                "version": ((), np.int64)}
        rings = keyed.create(spec, n_keys=1, max_len=1, spare=spare, name=name,
                             meta={"facade": FACADE})
        self = cls(rings)
        self._table = table
        return _signals.watch_or_close(self, handle_signals)

    @classmethod
    def attach(cls, name: str, *, own: bool = False,
               handle_signals: bool | None = None) -> "ParamBlock":
        """Attach to a block by name; the result never unlinks it, unless ``own``.

        Args:
            own: take the block over from a trainer that died (SIGKILL, a
                crash), as ``shmbuf.attach(name, own=True)`` does a buffer:
                this process becomes the owner, unlinks it at close and
                answers for SIGTERM (``handle_signals`` as in ``create``).
                Its newest version stays readable and actors read on.

        Raises:
            SegmentNotFoundError: no segment has that name.
            CorruptSegmentError: it is not a parameter block (left alone, even with ``own``).
            BufferClosedError: its owner closed it.
            OwnerAliveError: ``own=True`` and the owner is alive (the message
                names its pid), or a rival took it over first.

        Example:
            >>> block = ParamBlock.attach("shmbuf-1a2b3c4d5e6f", own=True)  # restarted trainer
        """
        try:
            rings = keyed.attach(name, own=own, handle_signals=handle_signals, made_by=FACADE)
        except CorruptSegmentError as exc:
            raise CorruptSegmentError(f"segment {name!r} is not a parameter block: {exc}") from None
        return cls(rings)

    @classmethod
    def _open_segment(cls, segment, layout, owner, *, seed=None, own: bool = False,
                      handle_signals: bool | None = None):
        """A ParamBlock over an attached keyed segment (the registry's way in)."""
        return cls(keyed.open_segment(segment, layout, owner, own=own,
                                      handle_signals=handle_signals, made_by=FACADE))

    # -- the trainer's side -------------------------------------------------------
    def publish(self, params: dict) -> int:
        """Publish a new version of every array; return its version number (1, 2, ...).

        Args:
            params: ``{name: array or tensor}`` with the template's names and
                shapes; values must fit the template's dtypes losslessly.

        Raises:
            KeyError / ValueError / TypeError: names, shapes or dtypes that do
                not fit; nothing is published.
        """
        self._check_open()
        table = self._layout()
        if set(params) != {entry[0] for entry in table}:
            raise KeyError(f"publish: expected the names {sorted(e[0] for e in table)}, got "
                           f"{sorted(params)}")
        blob = np.zeros(self._rings.spec["data"][0], np.uint8)
        for pname, dtype, shape, offset in table:
            dt = np.dtype(dtype)
            value = coerce(f"publish({pname!r})", host_array(params[pname]), dt, tuple(shape))
            n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
            blob[offset:offset + n] = np.ascontiguousarray(value, dt).reshape(-1).view(np.uint8)
        version = self.version() + 1
        raw = np.frombuffer(json.dumps(table).encode(), np.uint8)
        self._rings.append(_KEY, {"data": blob[None], "table": raw[None],
                                  "version": np.array([version], np.int64)})
        return version

    # -- the actors' side -----------------------------------------------------------
    def version(self) -> int:
        """The newest published version (0: none yet); cheap (no copy)."""
        self._check_open()
        return self._rings.bounds_of(0)[1]

    def read(self) -> tuple[int, dict[str, np.ndarray] | None]:
        """Copy the newest version out: ``(version, {name: array})``, or ``(0, None)``.

        The arrays are fresh (views of one private copy), never shared memory.

        Raises:
            SampleRetryError: publishes lapped every one of many read attempts.
        """
        self._check_open()
        out, lengths = self._rings.read(_KEY, _newest)
        if not lengths[0]:
            return 0, None
        blob = out["data"][0, 0]
        arrays = {}
        for pname, dtype, shape, offset in self._layout(out["table"][0, 0]):
            dt = np.dtype(dtype)
            count = int(np.prod(shape, dtype=np.int64))
            arrays[pname] = np.frombuffer(blob, dt, count, offset).reshape(shape)
        return int(out["version"][0, 0]), arrays

    def read_newer(self, than: int) -> tuple[int, dict[str, np.ndarray] | None] | None:
        """``read()`` if a version newer than ``than`` is published, else None (cheap).

        Example:
            >>> got = block.read_newer(my_version)
            >>> if got: my_version, params = got
        """
        if self.version() <= than:
            return None
        return self.read()

    def wait_version(self, min_version: int = 1, timeout: float | None = None) -> int:
        """Block until version ``min_version`` or a newer one is published; return it.

        Raises:
            WaitTimeoutError: ``timeout`` seconds passed first.
        """
        timeout = check_timeout(timeout)

        def ready():
            v = self.version()
            return v if v >= min_version else None

        return poll(ready, timeout, lambda: WaitTimeoutError(
            f"parameter block {self.name!r} is at version {self.version()} after {timeout} s; "
            f"wait_version wanted {min_version}. Is the trainer publishing?"))

    # -- internals --------------------------------------------------------------------
    def _layout(self, raw=None) -> list:
        if raw is not None:
            return json.loads(bytes(raw).decode())
        if self._table is None:  # attached: the table comes with every published version
            out, lengths = self._rings.read(_KEY, _newest)
            if not lengths[0]:
                raise CorruptSegmentError(f"parameter block {self.name!r} has nothing "
                                          "published; only its creator can publish the first "
                                          "version")
            self._table = json.loads(bytes(out["table"][0, 0]).decode())
        return self._table

    def _closed_mark(self):
        return self._rings._closed_mark()

    def _release(self) -> None:
        _signals.forget(self)
        self._rings.close()

    def __repr__(self):
        state = "closed" if self._closed else f"version={self.version()}"
        return f"<shmbuf.params.ParamBlock {self._name!r} {state}{' owner' if self.owner else ''}>"


def _plan(template: dict) -> tuple[list, int]:
    """``[[name, dtype, shape, offset], ...]`` and the total bytes, offsets 64-byte aligned."""
    if not isinstance(template, dict) or not template:
        raise ValueError(f"template must be a non-empty dict of name -> array, got {template!r}")
    table, offset = [], 0
    for pname, value in template.items():
        arr = host_array(value)
        if arr.dtype.kind not in "biuf" or arr.dtype.hasobject:
            raise TypeError(f"template[{pname!r}]: dtype {arr.dtype} is not a fixed-size number")
        table.append([str(pname), arr.dtype.str, list(arr.shape), offset])
        offset += -(-arr.nbytes // _ALIGN) * _ALIGN
    return table, offset


register(ParamBlock, FACADE)
