"""Drop-in for ``stable_worldmodel.buffer.HistoryBuffer``, in shared memory.

Each env is one key of ``shmbuf.keyed.rings`` rings: it keeps its own last
``max_len`` entries whatever the other envs do, workers append their own
envs from other processes, and ``get`` is one vectorised gather, validated
against concurrent appends.  See ``HistoryBuffer`` for the contract and the
deliberate differences from upstream.
"""
from __future__ import annotations

import functools

import numpy as np

from .._args import check_int
from .._errors import (
    BufferClosedError,
    CorruptSegmentError,
    SchemaPendingError,
    SegmentNotFoundError,
)
from .._registry import register
from ..disk import keyed_save as _keyed_save
from ..disk.saved import bad_save
from ..keyed import rings as keyed
from ..posix import signals as _signals
from ..sampling.rng import ProcessRandom
from ..segment.lifecycle import Shared, unpickled
from ..segment.segment import Reservation, generate_name
from . import _history_out, _infos
from ._base import to_numpy
from ._strided import contiguous_window


class HistoryBuffer(Shared):
    """Per-env ring buffer over batched info dicts, shared across processes.

    Drop-in for ``stable_worldmodel.buffer.HistoryBuffer``: ``append`` takes a
    dict of values with a leading env dim; ``get(n)`` returns per env the
    ``n`` strided frames anchored at the newest entry (ages ``0, ab, 2ab, ...``
    with ``ab = action_block``), oldest first.  Shapes: a per-step ``(n_envs,)``
    value gives ``(E, n)``; ``(n_envs, T, ...)`` gives ``(E, n*T, ...)``; a
    key in ``block_keys`` gives ``(E, n-1, ab*D)``, block ``i`` being the
    ``ab`` entries after frame ``i`` up to and including frame ``i+1``
    (NaN zeroed; omitted when ``n == 1``).

    Warm-up: an env with ``L`` entries has ``k = min(n, (L-1)//ab + 1)`` real
    frames; the rest repeat its **oldest strided** entry (upstream's actual
    behaviour, which differs from "oldest entry" when ``(L-1) % ab != 0``),
    and the missing blocks are zero.  If ``max_len < (n-1)*ab + 1`` the
    padding never ends, as upstream.

    Differences from upstream (bugs fixed): ``append`` copies (later mutation
    of the caller's arrays never leaks in); it validates every value first and
    writes all envs or none; the key set is fixed by ``spec=`` or the first
    append, and a missing or unknown key is a KeyError; only NaN is zeroed in
    blocks (upstream also clamps +-inf); ``env_ids=[]`` gives empty arrays
    instead of IndexError.  Strings and python scalars are broadcast to every
    env as upstream, stored with a fixed-width dtype: a shared column cannot
    widen in place, so strings get at least 32 characters, and a longer one
    later is a TypeError (declare the width with ``spec=``); ``get`` returns
    the width of its longest string, as upstream (``'hello'`` gives ``<U5``).
    Lists, None and other objects are a TypeError.  Torch inputs come back as
    torch tensors on the input's device; numpy as numpy.

    Sharing: the constructor takes the segment's name (a taken name raises
    ``SegmentExistsError`` there), but the segment is sized only once the
    schema is known: by ``spec=`` or by the first append **in the
    constructing process**, which owns it and unlinks it on ``close()``,
    garbage collection or exit.  A handle pickled earlier (to a spawned
    worker) attaches lazily once the segment is sized; before that its
    ``get`` returns None and its ``append`` raises ``SchemaPendingError``.
    Pass ``spec=`` when workers may append first.  Each env must be appended
    by one process (and thread) at a time (``append(info, env_ids=[...])``);
    any number of processes may ``get`` meanwhile, and ``reset`` may come
    from anywhere.  ``get_view`` is the zero-copy variant;
    ``state_dict``/``load_state_dict`` checkpoint through ``torch.save``;
    ``save``/``load`` write and read a directory of ``.npy`` files.

    Stopping and crashing, as ``shmbuf.create``'s buffers: once the owner
    closes it (or SIGTERM ends the owner, which unlinks it by default, see
    ``handle_signals``), every other process's next ``append``, ``get`` or
    ``reset`` raises ``BufferClosedError``; after a SIGKILL,
    ``HistoryBuffer.attach(name, own=True)`` takes it over.

    Args:
        n_envs: number of parallel environments.
        max_len: entries retained per env (env steps).
        action_block: frameskip, the stride of ``get``.
        block_keys: keys returned as macro-blocks (typically ``('action',)``).
        spec: optional ``{key: (per-env per-step shape, dtype)}``; a torch
            dtype makes ``get`` return torch tensors for that key.
        seed: seed of ``rng``, this process's ``np.random.Generator`` (each
            process its own, see ``shmbuf.sampling.rng``); nothing here is
            random, it exists for uniformity with the others.
        name: segment name; generated if None.
        handle_signals: None (default): install shmbuf's SIGTERM handler if
            this is the main thread and SIGTERM has its default action, so
            that SIGTERM unlinks the buffer and then ends the process by
            SIGTERM; True: also chain a handler already in place; False:
            install nothing.  As ``shmbuf.create``; details: ``shmbuf.posix.signals``.

    Raises:
        ValueError / TypeError: a bad argument (the message names it).
        SegmentExistsError: ``name`` is taken.

    Example:
        >>> buf = HistoryBuffer(n_envs=2, max_len=5, action_block=2, block_keys=('action',))
        >>> buf.append({'pixels': np.zeros((2, 1, 64, 64, 3), np.uint8),
        ...             'action': np.zeros((2, 1, 2), np.float32)})
        >>> buf.get(3)['pixels'].shape   # (2, 3, 64, 64, 3)
    """

    KIND_NAME = "HistoryBuffer"
    SPARE = keyed.DEFAULT_SPARE
    _rings: keyed.KeyedRings | None = None           # None while there is no schema
    _schema: tuple[_infos.KeySchema, ...] | None = None

    def __init__(self, n_envs: int, max_len: int, action_block: int = 1, block_keys=(), *,
                 spec=None, seed=None, name: str | None = None,
                 handle_signals: bool | None = None):
        self._set_params(**_checked_params(n_envs, max_len, action_block, block_keys))
        schema = _infos.schema_from_spec(spec) if spec is not None else None
        _signals.check(handle_signals)
        self._random = ProcessRandom(seed, name=name or "")
        # The name is taken now; the first append sizes the segment (see the class doc).
        self._reservation = Reservation(generate_name() if name is None else name)
        self._track(self._reservation.name, owner=True, resource=self._reservation)
        if schema is not None:
            self._create(schema)
        _signals.watch_or_close(self, handle_signals)

    def _set_params(self, n_envs, max_len, action_block, block_keys) -> None:
        self.n_envs, self.max_len, self.action_block = n_envs, max_len, action_block
        self.block_keys = frozenset(block_keys)
        self._all = np.arange(n_envs, dtype=np.int64)

    def _params(self) -> dict:
        return {"n_envs": self.n_envs, "max_len": self.max_len,
                "action_block": self.action_block, "block_keys": sorted(self.block_keys)}

    # -- the keyed rings ------------------------------------------------------------
    def _create(self, schema) -> None:
        """Size the reserved segment as keyed rings for ``schema``; they own the name now."""
        meta = {"facade": "HistoryBuffer", "params": self._params(),
                "keys": _infos.schema_meta(schema)}
        try:
            rings = keyed.create({s.column: (s.shape, s.dtype) for s in schema}, self.n_envs,
                                 self.max_len, spare=self.SPARE, meta=meta,
                                 reservation=self._reservation)
        except ValueError as exc:
            if "meta" in str(exc):
                raise ValueError(f"HistoryBuffer: the key names are too long to record "
                                 f"({exc}); use fewer or shorter keys") from None
            raise
        self._disown()
        self._bind(rings, schema)

    def _bind(self, rings, schema) -> None:
        self._rings, self._schema = rings, schema
        self._layout = _history_out.Layout(schema, self.block_keys, self.action_block)
        self._ring_views = rings.views

    def _adopt(self, rings, params_from_rings: bool = False) -> None:
        """Bind attached ``rings`` (a HistoryBuffer's) once their params fit; else close them."""
        try:
            meta = rings.meta
            if params_from_rings:
                self._set_params(**meta["params"])
            elif meta["params"] != self._params():
                raise CorruptSegmentError(f"segment {rings.name!r} was made with "
                                          f"{meta['params']}, but this handle expects "
                                          f"{self._params()}")
            self._bind(rings, _infos.schema_from_meta(meta["keys"], rings.spec))
        except BaseException:
            rings.close()
            raise

    def _ensure(self):
        """The rings, attaching lazily in other processes; None while there is no schema."""
        self._check_open()
        if self._rings is None and not self.owner:
            try:
                assert self._name is not None, "an attached HistoryBuffer has its name"
                rings = keyed.attach_if_published(self._name, made_by=self.KIND_NAME)
            except SegmentNotFoundError:
                raise BufferClosedError(
                    f"HistoryBuffer {self._name!r} was closed by its owner (its name is gone) "
                    "before this handle attached to it; no more entries can be appended or "
                    "read. A worker stops here; attach to a new buffer to continue") from None
            if rings is not None:
                self._adopt(rings)
        return self._rings

    def _env_ids(self, env_ids, verb: str, distinct: bool = False) -> np.ndarray:
        return self._all if env_ids is None else _infos.env_ids(env_ids, self.n_envs, verb,
                                                                   distinct)

    # -- the seed API -----------------------------------------------------------
    def append(self, info_dict: dict, env_ids=None) -> None:
        """Append one entry per env from a batched info dict.

        Args:
            info_dict: ``{key: value}`` with a leading dim of ``n_envs`` (or
                ``len(env_ids)``): numpy arrays or torch tensors; str and
                python/numpy scalars are broadcast to every env.
            env_ids: the envs the rows belong to (distinct; negative ids
                count from the end; all if None).  A worker that owns some
                envs appends just their rows; ``[]`` with 0-row values is a
                no-op.

        Raises:
            KeyError: a key is missing or unknown (keys are fixed).
            ValueError / TypeError: a wrong leading dim, shape or dtype, a lossy
                cast, or an unsupported value; nothing is written.
            SchemaPendingError: this process did not construct the buffer and
                the buffer has no schema yet (pass ``spec=``).

        Example:
            >>> buf.append({'pixels': frames[:2], 'action': acts[:2]}, env_ids=[0, 1])
        """
        envs = self._env_ids(env_ids, "append", distinct=True)
        if self._ensure() is None:
            if not self.owner:
                raise SchemaPendingError(
                    f"HistoryBuffer {self._name!r} has no schema yet: only the process that "
                    "constructed it creates it, at its first append; pass spec= to the "
                    "constructor so that workers can append first")
            schema = _infos.schema_from_info(info_dict, len(envs))
            values = _infos.coerce_info(schema, info_dict, len(envs))
            self._create(schema)
        else:
            values = _infos.coerce_info(self._schema, info_dict, len(envs))  # type: ignore[arg-type]  # rings, so a schema
        self._rings.append(envs, values)  # type: ignore[union-attr]  # made or found just above

    def get(self, n: int, env_ids=None) -> dict | None:
        """Return the last ``n`` strided entries per env, padded in warm-up.

        Args:
            n: strided entries per env.
            env_ids: envs to build history for, in this order, duplicates
                allowed (all if None).  ``[]`` gives arrays with 0 rows.

        Returns:
            ``{key: array or tensor}`` as described in the class docstring,
            or None if ``n <= 0``, any selected env is empty, or nothing was
            ever appended.

        Raises:
            SampleRetryError: writers lapped an env's ring on every try.

        Example:
            >>> out = buf.get(3, env_ids=[1, 0])
        """
        self._check_open()
        n = check_int("n", n, None)
        if n <= 0:
            return None
        envs = self._env_ids(env_ids, "get")
        rings = self._ensure()
        if rings is None:
            return None
        layout = self._layout
        if not len(envs):
            return layout.assemble(n, {}, empty=True)
        arrays, lengths = rings.read(None if env_ids is None else envs,
                                     functools.partial(layout.ages.lookup, n), layout.parts(n))
        if np.count_nonzero(lengths) < len(lengths):
            return None   # some selected env is empty
        return layout.assemble(n, arrays)

    def get_view(self, n: int, env_id: int) -> dict | None:
        """Zero-copy ``get(n, [env_id])`` for one env, without the env dim, when possible.

        Returns views into the shared ring where the window needs no padding
        (the env holds at least ``(n-1)*ab + 1`` entries), does not wrap around
        the ring's end, and each key's frames can be one strided view (per-step
        time dim T == 1, or ``action_block == 1``); otherwise None: use ``get``.
        Block keys are raw views: NaN is **not** zeroed.  Torch keys come back
        as CPU tensors sharing the memory.  The views are live: they stay
        intact for at least ``SPARE`` further appends to that env, after which
        later appends overwrite them.  Copy what you keep.

        Example:
            >>> view = buf.get_view(3, 0)
            >>> frames = view['pixels'] if view is not None else buf.get(3, [0])['pixels'][0]
        """
        self._check_open()
        n, env = check_int("n", n, None), check_int("env_id", env_id, None)
        if not -self.n_envs <= env < self.n_envs:
            raise IndexError(f"get_view: env id {env} is out of range for n_envs={self.n_envs}")
        rings: keyed.KeyedRings | None = self._ensure()
        if n <= 0 or rings is None or (self.action_block > 1 and self._layout.long_steps):
            return None
        env = env % self.n_envs
        window = contiguous_window(n, self.action_block, *rings.bounds_of(env), rings.ring_len)
        if window is None:
            return None
        return self._layout.view(self._ring_views, env, n, *window)

    def reset(self, env_ids=None) -> None:
        """Clear the given envs (all if None; ``[]``: none); other envs keep their history.

        Example:
            >>> buf.reset(env_ids=[0])
        """
        envs = self._env_ids(env_ids, "reset")
        rings = self._ensure()
        if rings is not None and len(envs):
            rings.reset(envs)

    def _lengths(self, env_ids=None) -> np.ndarray:
        envs = self._env_ids(env_ids, "num_strided")
        rings = self._ensure()
        if rings is None or not len(envs):
            return np.zeros(len(envs), np.int64)
        return rings.lengths(envs)

    def num_strided(self, env_ids=None) -> list[int]:
        """Real strided frames per env: ``(L-1)//action_block + 1``, or 0 when empty.

        Example:
            >>> n = min(8, *buf.num_strided())   # shrink n instead of padding
        """
        lengths = self._lengths(env_ids)
        return np.where(lengths > 0, (lengths - 1) // self.action_block + 1, 0).tolist()

    def __len__(self) -> int:
        """Minimum entry count over all envs."""
        return int(self._lengths().min())

    # -- identity and lifecycle ---------------------------------------------------
    @classmethod
    def attach(cls, name: str, *, own: bool = False,
               handle_signals: bool | None = None) -> "HistoryBuffer":
        """Attach to a HistoryBuffer made by another process; never unlinks it, unless ``own``.

        Waits (a few seconds at most) for a constructor that has not sized
        the segment yet.

        Args:
            name: the segment's name (``buf.name``).
            own: take the buffer over from an owner that died (SIGKILL, a
                crash): this process becomes the owner, unlinks it at close
                and answers for SIGTERM (``handle_signals`` as in the
                constructor).  The entries and the workers attached before
                the crash carry on; of rival adopters exactly one wins.

        Raises:
            SegmentNotFoundError: no such segment.
            CorruptSegmentError: the segment is not a HistoryBuffer (or got no
                schema in time); it is left alone, even with ``own``.
            BufferClosedError: its owner closed it (it is being removed).
            OwnerAliveError: ``own=True`` and the owner is alive (the message
                names its pid), or a rival took it over first.

        Example:
            >>> planner_view = HistoryBuffer.attach("shmbuf-1a2b3c4d5e6f")
            >>> buf = HistoryBuffer.attach("shmbuf-1a2b3c4d5e6f", own=True)  # after a crash
        """
        return cls._from_rings(keyed.attach(name, own=own, handle_signals=handle_signals,
                                            made_by=cls.KIND_NAME))

    @property
    def rng(self) -> np.random.Generator:
        """This process's generator (``seed=``; a forked or spawned child gets its own)."""
        return self._random.get()

    @classmethod
    def _handle(cls, name: str, params: dict | None = None,
                owner: bool = False) -> "HistoryBuffer":
        """A handle on segment ``name``, not bound to its rings yet; ``owner``: adopted."""
        self = cls.__new__(cls)
        self._random = ProcessRandom()
        self._track(name, owner=owner)  # an adopter's rings unlink the segment, not the handle
        if params is not None:
            self._set_params(**params)
        return self

    @classmethod
    def _open_segment(cls, segment, layout, owner, *, seed=None, own: bool = False,
                      handle_signals: bool | None = None):
        """A HistoryBuffer over an attached keyed segment (the registry's way in)."""
        return cls._from_rings(keyed.open_segment(segment, layout, owner, own=own,
                                                  handle_signals=handle_signals,
                                                  made_by=cls.KIND_NAME))

    @classmethod
    def _from_rings(cls, rings, params: dict | None = None) -> "HistoryBuffer":
        """A handle on attached (or adopted) ``rings``, with their or (checked) ``params``."""
        self = cls._handle(rings.name, params, rings.owner)
        self._adopt(rings, params_from_rings=params is None)
        return self

    def _closed_mark(self):
        return None if self._rings is None else self._rings._closed_mark()

    def unlink(self) -> None:
        """Remove the segment's name now (the owner), before the first append too.

        The owner goes on using the buffer, as after any unlink: the first
        append still sizes the reserved segment (which nobody else can reach).
        """
        super().unlink()
        if self._rings is None and self.owner and self._reservation is not None:
            self._reservation.removed_by_owner()

    def _release(self) -> None:
        _signals.forget(self)
        if self._rings is not None:
            self._rings.close()
        self._ring_views = None

    def __reduce__(self):
        return unpickled, (_rebuild, self._name, self._params())

    def __repr__(self):
        state = "closed" if self._closed else ("no schema yet" if self._rings is None else
                                               f"keys={[s.key for s in self._schema or ()]}")
        return (f"<shmbuf HistoryBuffer {self._name!r} n_envs={self.n_envs} "
                f"max_len={self.max_len} {state}>")

    # -- checkpoints ----------------------------------------------------------------
    def state_dict(self) -> dict:
        """Copies of every env's live entries, as torch tensors and plain values.

        ``torch.save(buf.state_dict(), path)`` then ``torch.load(path,
        weights_only=True)`` works.  Entries are concatenated per env, oldest
        first, env 0 first; ``lengths`` says how many each env has.

        Example:
            >>> torch.save(buf.state_dict(), "history.pt")
        """
        rings = self._ensure()
        if rings is None:
            lengths, entries = np.zeros(self.n_envs, np.int64), {}
        else:
            lengths, entries = rings.snapshot()
        return _infos.checkpoint(self._schema or (), self._params(), lengths, entries)

    def load_state_dict(self, state: dict) -> None:
        """Replace every env's history with a ``state_dict``'s, in order.

        Keeps this buffer's ``max_len`` (an env with more entries keeps its
        newest), ``action_block`` and ``block_keys``.  Restore while no
        worker appends.

        Raises:
            ValueError: another format, ``n_envs`` or schema; nothing is changed.

        Example:
            >>> buf.load_state_dict(torch.load("history.pt", weights_only=True))
        """
        theirs, lengths, entries = _infos.read_checkpoint(to_numpy(dict(state)), self.n_envs)
        if self._ensure() is not None:
            mine = {s.key: (s.shape, s.dtype.str) for s in self._schema}  # type: ignore[union-attr]  # rings, so a schema
            other = {s.key: (s.shape, s.dtype.str) for s in theirs}
            if mine != other:
                raise ValueError(f"state: checkpoint schema {other} does not match this "
                                 f"buffer's {mine}")
        elif not theirs:
            return
        elif not self.owner:
            raise SchemaPendingError(f"HistoryBuffer {self._name!r} has no schema yet; "
                                     "restore in the constructing process")
        else:
            self._create(theirs)
        self._rings.restore(lengths, {s.column: entries[s.key] for s in self._schema})  # type: ignore[union-attr]  # both set above

    # -- saving to disk ---------------------------------------------------------------
    def save(self, path, *, overwrite: bool = False, durable: bool = False) -> int:
        """Write every env's live entries to the directory ``path``, while workers append.

        The format (one ``.npy`` per key, ``_lengths.npy``, a JSON manifest;
        readable and mmap-able with numpy alone) is described in
        ``shmbuf.disk.keyed_save``.  Envs are copied a group at a time, each
        validated against concurrent appends, so no torn entry is saved and
        at most ``disk.keyed_save.GROUP_BYTES`` of entries (or one env's
        ``max_len``) are held in memory.  ``HistoryBuffer.load`` (or
        ``shmbuf.load``) rebuilds the buffer from it.

        Args:
            path: a directory to create.
            overwrite: if ``path`` exists, replace it, but only if it is a
                shmbuf save (or empty); otherwise ``SaveExistsError``.
            durable: fsync the files before the manifest names them.

        Returns:
            The entries saved, over every env.

        Raises:
            SaveExistsError: ``path`` exists (see ``overwrite``).
            ValueError: nothing was ever appended (there is no schema to save).
            BufferClosedError: closed, here or by the owner in another process.

        Example:
            >>> buf.save("ckpt/history")
            >>> buf2 = HistoryBuffer.load("ckpt/history")
        """
        rings = self._ensure()
        if rings is None:
            raise ValueError(f"{self._describe()} has no schema yet (nothing was appended); "
                             "there is nothing to save")
        return _keyed_save.save(rings, path, overwrite=overwrite, durable=durable)

    @classmethod
    def load(cls, path, name: str | None = None, *, seed=None,
             handle_signals: bool | None = None) -> "HistoryBuffer":
        """A new HistoryBuffer (this process owns it) holding a save's entries.

        ``n_envs``, ``max_len``, ``action_block``, ``block_keys`` and the keys
        (torch ones too) are the saved buffer's; each env gets its saved
        entries back in their order.

        Args:
            path: the save's directory (``save``).
            name: the new segment's name; generated if None.
            seed: as in the constructor.
            handle_signals: as in the constructor.

        Raises:
            FileNotFoundError: no directory at ``path``.
            CorruptSaveError: the save is incomplete, truncated or tampered
                with, or was made by another class (the message names it);
                nothing is created.
            SegmentExistsError: ``name`` is taken.

        Example:
            >>> buf = HistoryBuffer.load("ckpt/history")
        """
        manifest, lengths, entries = _keyed_save.open_save(path, cls.KIND_NAME)
        params, schema = _saved_setup(path, manifest)
        self = cls(**params, seed=seed, name=name, handle_signals=handle_signals)
        try:
            self._create(schema)
            self._rings.restore(lengths, entries)  # type: ignore[union-attr]  # just created
        except BaseException:
            self.close()
            raise
        return self


def _checked_params(n_envs, max_len, action_block, block_keys) -> dict:
    """The constructor's parameters, checked (a bad one is an error naming it)."""
    return {"n_envs": check_int("n_envs", n_envs), "max_len": check_int("max_len", max_len),
            "action_block": check_int("action_block", action_block),
            "block_keys": _infos.block_keys(block_keys)}


def _saved_setup(path, manifest: dict) -> tuple[dict, tuple[_infos.KeySchema, ...]]:
    """The constructor's parameters and the schema recorded in a save's manifest."""
    meta = manifest["meta"]
    try:
        params = meta["params"]
        setup = _checked_params(params["n_envs"], params["max_len"], params["action_block"],
                                params["block_keys"])
        schema = _infos.schema_from_meta(meta["keys"], manifest["spec"])
        if len(schema) != len(manifest["spec"]) or any(type(s.key) is not str for s in schema):
            raise ValueError(f"keys {meta['keys']!r} do not name the columns "
                             f"{sorted(manifest['spec'])}")
        if (setup["n_envs"], setup["max_len"]) != (manifest["n_keys"], manifest["max_len"]):
            raise ValueError(f"params {params} do not fit {manifest['n_keys']} keys of "
                             f"{manifest['max_len']} entries")
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise bad_save(path, f"its HistoryBuffer setup does not add up ({exc!r})") from None
    return setup, schema


def _rebuild(name: str, params: dict) -> HistoryBuffer:
    """Unpickle: attach now if the segment is sized, else a handle that attaches lazily."""
    # SegmentNotFoundError once the owner closed
    rings = keyed.attach_if_published(name, made_by=HistoryBuffer.KIND_NAME)
    if rings is None:
        return HistoryBuffer._handle(name, params)
    return HistoryBuffer._from_rings(rings, params)


register(HistoryBuffer, HistoryBuffer.KIND_NAME)
