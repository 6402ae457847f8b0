"""A Buffer's checkpoints: snapshot, restore, state_dict and save.

A mixin of ``Buffer``: it holds no state of its own.
"""
from __future__ import annotations

from ..disk import checkpoint as _checkpoint
from ..disk import save as _save
from .state import BufferState


class Checkpoints(BufferState):
    """Copies of a ``Buffer``'s live steps, in memory or on disk (see its docs)."""

    # -- checkpoints --------------------------------------------------------------
    def snapshot(self) -> dict:
        """Copy every live step, oldest first, for a checkpoint.

        Returns:
            ``{"format", "spec", "columns": {col: (n, ...) array}, "stream": (n,),
            "episode": (n,), "ends": (n,), "chunks": (c,)}``: numpy arrays and plain
            Python values only (``ends``: the episode-index number of the episode a
            row ends, else -1; ``chunks``: the first row of each chunk).

        Example:
            >>> np.savez("ckpt.npz", **buf.snapshot()["columns"])
        """
        self._check_open()
        return self._with_rate(_checkpoint.snapshot(self._port))

    def restore(self, state: dict) -> None:
        """Replace the contents with a ``snapshot()``; the capacity stays this buffer's.

        Streams, episode boundaries and their order are kept; a snapshot
        larger than the capacity keeps its newest steps.  Chunks that live
        writers are filling right now are left as they are.

        Raises:
            ValueError: the snapshot's schema, shapes or dtypes differ; nothing
                is changed.

        Example:
            >>> fresh.restore(buf.snapshot())
        """
        self._restore(state)

    def _restore(self, state: dict, place: int | None = None) -> bool | None:
        """``restore``; with ``place`` (``shmbuf.load`` into this new buffer: the ids'
        ``base``), each saved chunk goes back under its saved ticket: then whether all
        did (``disk.checkpoint.restore``), else None."""
        self._check_open()
        placed = _checkpoint.restore(self, self._port, state, place)
        self._restore_rate(state)
        return placed

    # -- saving to disk ---------------------------------------------------------------
    def save(self, path, *, follow: bool = False, overwrite: bool = False,
             durable: bool | None = None, interval: float = 1.0):
        """Write the live steps to the directory ``path``, consistently, while writers run.

        Each chunk is written straight from shared memory and then validated
        as a sample is (a chunk recycled meanwhile is left out), so no torn
        step is saved and no more than the files' own page cache is used.
        The format (one ``.npy`` per column, a JSON manifest, readable with
        numpy alone) is described in ``shmbuf.disk.saved``; ``shmbuf.load``
        rebuilds a buffer from it.  Chunks that are compressed in shared
        memory (``create(..., compress=...)``) are saved as their compressed
        blocks, undecoded, and ``load`` puts them back compressed.

        Args:
            path: a directory to create.
            follow: instead of one copy, keep saving: return a ``Saver`` that
                appends every chunk as it is sealed (so a reboot loses at
                most the open chunks) until ``Saver.close()`` or this
                buffer's close.
            overwrite: if ``path`` exists, replace it, but only if it is a
                shmbuf save (or empty); otherwise ``SaveExistsError``.
            durable: fsync the files before the manifest names them.
                Default: False for one copy (like ``np.save``), True with
                ``follow``.
            interval: seconds between the ``Saver``'s looks for sealed chunks.

        Returns:
            The steps saved (an int), or the running ``Saver`` with ``follow``.

        Raises:
            SaveExistsError: ``path`` exists (see ``overwrite``).
            BufferClosedError: the buffer is closed.

        Example:
            >>> buf.save("ckpt/replay")
            >>> buf2 = shmbuf.load("ckpt/replay")
        """
        self._check_live()
        if follow:
            saver = _save.Saver(self, path, interval=interval, overwrite=overwrite,
                                  durable=True if durable is None else durable)
            self._savers.add(saver)
            return saver
        return _save.save(self, path, overwrite=overwrite, durable=bool(durable))

    def state_dict(self) -> dict:
        """The live steps as torch tensors and plain values, for ``torch.save``.

        ``torch.load(path, weights_only=True)`` reads it back.  It holds every
        live step, oldest chunk first, with its stream and episode number, so
        ``load_state_dict`` rebuilds the same streams and episodes.  Taken
        while writers run it is a set of whole chunks (a chunk recycled while
        it is copied is left out, and its stream is split there).  It costs
        one copy of the live steps in memory, no more (the saving guide, "Checkpoints").

        Returns:
            ``{"format", "spec", "raw_bytes", "columns": {col: tensor (n, ...)},
            "stream": int64 (n,), "episode": int64 (n,), "ends": int64 (n,),
            "chunks": int64 (c,)}``, as ``snapshot``.

        Example:
            >>> torch.save(buf.state_dict(), "replay.pt")
        """
        self._check_open()
        return self._with_rate(_checkpoint.state_dict(self._port))

    def load_state_dict(self, state: dict) -> None:
        """Replace the contents with a ``state_dict()``; the capacity stays this buffer's.

        As ``restore``: streams, episode boundaries and their order are kept,
        and a larger checkpoint keeps its newest steps.

        Raises:
            ValueError: not a state_dict, or the schema differs; nothing is changed.

        Example:
            >>> buf.load_state_dict(torch.load("replay.pt", weights_only=True))
        """
        self._check_open()
        state = _checkpoint.from_state_dict(state)
        _checkpoint.restore(self, self._port, state)
        self._restore_rate(state)

    def _with_rate(self, state: dict) -> dict:
        """A checkpoint with the rate limiter's counters (``"rate"``), if the buffer has one."""
        if self._limiter is not None:
            state["rate"] = self._limiter.state()
        return state

    def _restore_rate(self, state: dict) -> None:
        """After a restore: continue the checkpoint's rate counters, so that a resumed run
        holds its ratio from where it stopped instead of catching up in a burst."""
        if self._limiter is not None and state.get("rate") is not None:
            self._limiter.restore(state["rate"])

    # -- lifecycle ----------------------------------------------------------------


def restore_loaded(buf, state: dict, place: int | None) -> bool | None:
    """``shmbuf.load``'s restore into the buffer it just made: ``Buffer.restore`` with each
    saved chunk put back under its saved ticket when ``place`` (the ids' ``base``) is given;
    then whether every chunk went back (``disk.checkpoint.restore``), else None."""
    return buf._restore(state, place)
