"""How ``compat.embodied`` turns its selectors into windows of the shared store.

An *item* is a window of ``length`` consecutive steps of one stream; the
store's column ``item`` holds, on the step that completes an item, the
item's buffer-wide serial (``Buffer.next_serial``), and ``-1`` on the first
``length - 1`` steps of a stream.  The live items are the newest
``capacity`` serials, so a drawn window is kept only if the serial on its
last step is at least ``made - capacity``.

Two ways to pick windows:

- a shmbuf selector (``Uniform``, ``Prioritized``) draws among the valid
  windows, and those of evicted items are drawn again;
- by serial (``Recency``'s ages, ``Fifo``'s oldest, the online queue): the
  step that completes the item is found by its serial, its window's start
  by the ``stream`` and ``pos`` columns, and the store validates it.
"""
from __future__ import annotations

import os

import numpy as np

from ..sampling.windows import Windows, enough, in_rounds

_ROUNDS = 64


def stream_id() -> int:
    """A new stream's id: 62 random bits, never 0 (what a row never written holds)."""
    return int.from_bytes(os.urandom(8), "little") >> 2 | 1


class Items:
    """The facade's view of its items: what to draw from, and how to find one.

    Everything it needs of the store below the public ``Buffer`` API goes
    through the buffer's ``StorePort`` (``port``), taken once here.
    """

    def __init__(self, buffer, length: int, capacity: int):
        self.buffer, self.length, self.capacity = buffer, length, capacity
        self.port = buffer.port
        self.made = buffer.serial_count   # items made by every process (raises once closed)
        arrays = buffer.arrays
        self.item, self.stream, self.pos = arrays["item"], arrays["stream"], arrays["pos"]

    def core(self, selector, rng, n: int) -> Windows:
        """``n`` windows a ``shmbuf.select`` selector draws (evicted items included)."""
        return self.port.draw(selector, rng, n, self.length)

    def uniform(self, rng, n: int) -> Windows:
        """``n`` windows uniform over every valid start (``core(Uniform(), ...)``,
        straight to the port's finder: the draw every uniform sample makes)."""
        return self.port.finder.draw(rng, n, self.length)

    def fresh(self, w: Windows) -> np.ndarray:
        """Per window of ``w``: True if one of its steps never got a priority (in the
        claim its chunk has now)."""
        if not w.rows.size:
            return np.zeros(len(w.rows), bool)
        _, explicit = self.port.priority_values(w.rows.reshape(-1))
        return ~explicit.reshape(w.rows.shape).all(axis=1)

    def zero(self, w: Windows) -> None:
        """Set the priorities of the steps of windows ``w`` to 0 (those still held)."""
        ids = self.port.step_ids(w.rows)
        self.buffer.update_priorities(ids, np.zeros(ids.shape, np.float32))

    def sample(self, draw: Draw, batch: int, targets: dict) -> None:
        """Fill ``targets`` (``prepare_out``'s fresh arrays for ``batch`` windows,
        batch-major, ``"ids"`` included) with the windows ``draw`` picks, through the
        store's copy and seqlock re-check: a window recycled while it was copied is
        drawn again, exactly as for ``sample_sequences``."""
        port = self.port
        port.check_live()   # no process closed the buffer (the caller's made() checked
        port.sample(draw, port.random.get(), batch, self.length, targets)   # this handle)

    def live(self) -> tuple[int, int]:
        """(oldest live serial, serials made): the live items are ``[lo, made)``."""
        made = self.made()
        return max(0, made - self.capacity), made

    def keep_live(self, w: Windows, made: int) -> Windows:
        """The windows of ``w`` whose item is live (its serial, on its last step, is
        among the newest ``capacity`` of the ``made`` items made so far)."""
        lo = made - self.capacity
        if lo <= 0 or not len(w.rows):
            return w   # no item was evicted yet
        last = self.item[w.rows[:, -1]]
        if np.minimum.reduce(last) >= lo:
            return w
        return w.take(last >= lo)

    def by_serial(self, serials: np.ndarray) -> Windows:
        """The windows of the items ``serials`` names that are still held (others dropped)."""
        serials = np.asarray(serials, np.int64)
        ends = self._rows_of(serials)
        ends = ends[ends >= 0]
        if not len(ends):
            return Windows(np.empty((0, self.length), np.int64), np.empty((0, 1), np.int64),
                           np.empty((0, 1), np.int64))
        starts = self._starts(ends)
        starts = starts[starts >= 0]
        w = self.port.locate(starts, self.length)
        # The row may have been recycled since it was found: keep the named items only.
        return w.take(np.isin(self.item[w.rows[:, -1]], serials))

    def online(self, since: int) -> tuple[list, int]:
        """(serials of the items made from ``since`` on whose last step's stream position
        is a multiple of ``length``, oldest first; the serial to look from next time)."""
        lo, made = self.live()
        since = max(since, lo)
        if since >= made:
            return [], max(since, made)
        live = self.port.live_chunks()
        base, count = live.base, live.count
        newer = self.item[base + count - 1] >= since
        if not newer.any():
            return [], since
        at = np.concatenate([np.arange(b, b + n)
                             for b, n in zip(base[newer].tolist(), count[newer].tolist())])
        serial = self.item[at]
        # An item whose serial was taken but whose step is not published yet is not
        # queued (it is drawn like any other later); a dead actor's serial never comes.
        pick = (serial >= since) & (serial < made) & (self.pos[at] % self.length == 0)
        return np.sort(serial[pick]).tolist(), made

    def _rows_of(self, serials: np.ndarray) -> np.ndarray:
        """The row of the step that completed each item of ``serials`` (-1 if not held).

        A chunk's committed rows are one stream's steps in order, so their
        serials increase: a chunk can hold ``s`` only if its first and last
        rows bracket it, and within it a binary search finds the row.
        """
        live = self.port.live_chunks()
        base, count = live.base, live.count
        first, last = self.item[base], self.item[base + count - 1]
        out = np.full(len(serials), -1, np.int64)
        for i, serial in enumerate(serials.tolist()):
            maybe = (first <= serial) & (serial <= last)
            for b, n in zip(base[maybe].tolist(), count[maybe].tolist()):
                span = self.item[b:b + n]
                at = int(np.searchsorted(span, serial))
                if at < n and span[at] == serial:
                    out[i] = b + at
                    break
        return out

    def _starts(self, ends: np.ndarray) -> np.ndarray:
        """Start rows of the windows ending at ``ends`` (-1 where the start is gone)."""
        live = self.port.live_chunks()
        base, count = live.base, live.count
        f_stream, f_pos = self.stream[base], self.pos[base]
        out = np.full(len(ends), -1, np.int64)
        for i, end in enumerate(ends.tolist()):
            s, p0 = int(self.stream[end]), int(self.pos[end]) - self.length + 1
            at = np.flatnonzero((f_stream == s) & (f_pos <= p0) & (p0 < f_pos + count))
            if len(at):
                out[i] = int(base[at[-1]]) + p0 - int(f_pos[at[-1]])
        return out


class Draw:
    """The selector object the store calls (``draw``): one facade selector over ``Items``.

    ``pick(items, rng, n)`` of a facade selector returns located windows;
    this loop keeps the live ones and asks again for the rest.  The store's
    ``finder`` it is called with is the one ``Items.port`` draws through.
    ``made``: the items made when the sample began (``Items.made()``), which
    fixes the live ones for the whole draw.
    """

    def __init__(self, items: Items, selector, queued, made: int):
        self.items, self.selector, self.queued, self.made = items, selector, queued, made

    def draw(self, finder, rng, n, length, tail):
        items, made = self.items, self.made
        found: list[Windows] = []
        need = n
        take: list[int] = []
        while self.queued and len(take) < need:
            try:
                take.append(self.queued.popleft())
            except IndexError:   # another sampling thread took the last one
                break
        if take:
            w = items.keep_live(items.by_serial(np.array(take)), made)
            found.append(w)
            need -= len(w.rows)
        if not need:
            return enough(found, need, n, f"live items of length {length}")
        pick, keep_live = self.selector.pick, items.keep_live
        first = keep_live(pick(items, rng, need), made)
        if not found and not len(first.rows):
            first = keep_live(pick(items, rng, need), made)   # all evicted (a lone item's
            # usual miss): once more before the rounds
        if not found and len(first.rows) == need:
            return first   # the usual case: round 0 found them all (as in_rounds would)

        # Drawn windows of evicted items are dropped: ask for more as rounds fail.
        def picked(round_, need):
            if round_ == 0:
                return first
            return keep_live(pick(items, rng, need << min(2 * round_, 12)), made)

        need = in_rounds(found, need, picked, _ROUNDS)
        return enough(found, need, n, f"live items of length {length}")


def by_age(items: Items, rng, n: int, cdf: np.ndarray) -> Windows:
    """Items by age (0 = newest) with upstream's rule: the probabilities whose running
    sum is ``cdf`` over ages, stretched over the live items while there are fewer of
    them than ``len(cdf)``."""
    lo, made = items.live()
    live = made - lo
    if live <= 0:
        return items.by_serial(np.empty(0, np.int64))
    ages = np.searchsorted(cdf, rng.random(n) * cdf[-1], side="right")
    ages = np.minimum(ages, len(cdf) - 1)
    if live < len(cdf):
        ages = (ages * live) // len(cdf)
    return items.by_serial(made - 1 - ages)


def oldest(items: Items, rng, n: int) -> Windows:
    """The oldest live item that is still held, ``n`` times."""
    lo, made = items.live()
    for serial in range(lo, made):
        w = items.by_serial(np.array([serial]))
        if len(w.rows):
            return w.take(np.zeros(n, np.int64))
    return items.by_serial(np.empty(0, np.int64))
