"""python -m shmbuf ls | info NAME | rm [--force] NAME... | gc [--dry-run] [NAME...] | top NAME
                 | import SOURCE [--name X] [--download] | export NAME --to TARGET

``import`` and ``export`` need the datasets extra (``shmbuf.datasets._cli``);
``import`` holds the buffer it made until Ctrl-C or SIGTERM.

Exit codes: 0 success, 1 a named segment is missing, is not a shmbuf
buffer, or (rm without --force) has a live owner; 2 bad usage (argparse);
141 the reader of stdout left early (``shmbuf info NAME | head``).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from ._errors import CorruptSegmentError, SegmentNotFoundError, SegmentPermissionError
from .protocol.header import closed_word, owner_alive, owner_record
from .protocol.keyed import KeyWords
from .protocol.layout import CLOSED_GC, CLOSED_RM, KIND_KEYED
from .protocol.ring import Ring
from .segment.segment import PREFIX, SHM_DIR, Segment, list_segments, unlink
from .writing.ratelimit import Limiter


class _Info:
    """Header facts about one segment, read without joining it as a writer."""

    def __init__(self, name: str):
        self.segment = Segment.attach(name)
        try:
            self.layout, self.owner = self.segment.header(timeout=0)
        except BaseException:
            self.segment.close()
            raise
        self.name = name
        self.keyed = self.owner["kind"] == KIND_KEYED
        self.ring = Ring(self.segment.mmap, self.layout)

    @property
    def owner_pid(self) -> int:
        """The owner now: the creator, or the process that adopted the buffer."""
        return owner_record(self.segment.mmap)[0]

    @property
    def owner_alive(self) -> bool:
        return owner_alive(self.segment.mmap)

    @property
    def closed(self) -> bool:
        return bool(closed_word(self.segment.mmap))

    def state(self) -> str:
        """The owner's state, in a word or two: alive, dead, closed, adopted."""
        words = [f"pid {self.owner_pid}", "alive" if self.owner_alive else "dead"]
        if self.owner_pid != self.owner["owner_pid"]:
            words.append("adopted")
        if self.closed:
            words.append("closed")
        return " ".join(words)

    def held(self) -> int:
        """Bytes of /dev/shm the segment holds now (its allocated blocks)."""
        space = self.segment.space
        if space is None:
            return os.stat(os.path.join(SHM_DIR, self.name)).st_blocks * 512
        return space.reserved_bytes()

    def live(self) -> int:
        """Live steps of a step store; live entries over every key of keyed rings."""
        if not self.keyed:
            return self.ring.live_steps()
        words = KeyWords(self.segment.mmap, self.layout, int(self.owner["meta"]["max_len"]),
                         self.name)
        start, count = words.bounds(words.all)
        return int((count - start).clip(0).sum())

    def columns(self) -> list[tuple[str, object, object]]:
        """(name as the user knows it, shape, dtype) of every column."""
        names = {}
        user = self.owner["meta"].get("user", {}) if self.keyed else {}
        if user.get("facade") == "HistoryBuffer":  # its columns k0, k1, ... hold its keys
            names = {f"k{i}": entry[0] for i, entry in enumerate(user.get("keys", []))}
        meta = self.owner["meta"] if not self.keyed else {}
        if meta.get("facade") == "swm":   # a stable-worldmodel table: c0, c1, ... its columns
            names = {f"c{i}": name for i, name in enumerate(meta.get("columns", []))}
        return [(names.get(c.name, c.name), c.shape, c.dtype) for c in self.layout.user_columns]

    def writers(self) -> list[tuple[int, int, int]]:
        """(slot, pid, steps) of every slot held by a live process."""
        return [] if self.keyed else self.ring.live_writers()

    def close(self):
        del self.ring   # its views of the mapping go first: a mapping with views cannot close
        self.segment.close()


def _scan(names=None):
    """Every shmbuf-looking entry of /dev/shm: an _Info (caller closes), or (name, why not).

    An entry that is not a readable buffer is reported when its name starts
    with ``shmbuf-`` (a leftover a user may want to remove); other names are
    other programs' business.  ``names``: only these entries (default all).
    """
    for name in list_segments():
        if names is not None and name not in names:
            continue
        try:
            yield _Info(name)
        except (CorruptSegmentError, SegmentNotFoundError, SegmentPermissionError, ValueError,
                OSError) as exc:
            if name.startswith(PREFIX) and not isinstance(exc, SegmentNotFoundError):
                yield name, _why_not_a_buffer(name, exc)


def _why_not_a_buffer(name: str, exc: Exception) -> str:
    try:
        empty = os.stat(os.path.join(SHM_DIR, name)).st_size == 0
    except OSError:
        empty = False
    if empty:
        return ("an empty reservation, no header yet (a HistoryBuffer before its first "
                "append, or a creator that died before sizing it)")
    return str(exc)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def cmd_ls(args) -> int:
    # IN /DEV/SHM: the pages the segment holds now; MAX SIZE: its apparent size (a segment
    # is sparse, so that is what it would hold with every chunk written and raw).
    print(f"{'NAME':<32} {'IN /DEV/SHM':>11} {'MAX SIZE':>10} {'CAPACITY':>10} {'FILL':>10} "
          f"{'OWNER':>20} {'WRITERS':>7}")
    for info in _scan():
        if isinstance(info, tuple):
            name, why = info
            print(f"{name:<32} NOT A SHMBUF BUFFER: {why}; remove it with "
                  f"'python -m shmbuf rm --force {name}' if it is a leftover")
            continue
        try:
            print(f"{info.name:<32} {_human(info.held()):>11} {_human(info.segment.size):>10} "
                  f"{info.layout.capacity:>10} {info.live():>10} {info.state():>20} "
                  f"{len(info.writers()):>7}")
        finally:
            info.close()
    return 0


def cmd_info(args) -> int:
    info = _Info(args.name)
    try:
        lay, ring = info.layout, info.ring
        print(f"name         {info.name}")
        print(f"kind         {'keyed rings' if info.keyed else 'step store'}")
        # Pages are reserved as chunks are first claimed (shmbuf.posix.space).
        print(f"in /dev/shm  {_human(info.held())} (the pages it holds now)")
        print(f"max size     {_human(info.segment.size)} (every chunk written and raw)")
        print(f"owner        {info.state()}")
        print(f"meta         {_short_meta(info.owner['meta'])}")
        if info.keyed:
            print(f"capacity     {lay.n_chunks} keys x {info.owner['meta']['max_len']} entries")
            print(f"live entries {info.live()}")
        else:
            print(f"capacity     {lay.capacity} steps in {lay.n_chunks} chunks of "
                  f"{lay.chunk_size}")
        print("columns")
        for name, shape, dtype in info.columns():
            print(f"  {name:<16} shape {str(shape):<16} dtype {dtype}")
        if not info.keyed:
            c = ring.counts()  # the one consistent order
            print(f"live steps   {c.live}")
            print(f"written      {c.written}")
            print(f"evicted      {c.evicted}")
            print(f"episodes     {c.episodes_logged} ended, {c.episodes} on a terminal step")
            print(f"samples      {c.samples} calls, {c.sampled_rows} rows")
            print(f"streams      {c.streams}")
            limiter = Limiter.of(ring.rate, info.name, lambda: None)
            if limiter is not None:
                r = limiter.stats()
                print(f"rate limit   train_ratio {r.train_ratio:g}, min_steps {r.min_steps}, "
                      f"tolerance {r.tolerance:g}, writers {'wait' if r.block_writers else 'free'}"
                      f": inserted {r.inserted}, replayed {r.replayed}, ratio {r.ratio:.3f}, "
                      f"lag {r.lag:g}, waited {r.sample_wait_s:.1f} s sampling, "
                      f"{r.insert_wait_s:.1f} s inserting")
            packing = _compression(info)
            if packing:
                print(packing)
            print(f"writers      {len(info.writers())}")
            for slot, pid, steps in info.writers():
                print(f"  slot {slot:<4} pid {pid:<8} steps {steps}")
    finally:
        info.close()
    return 0


def _short_meta(meta: dict, limit: int = 300) -> str:
    """The metadata as printed, or its keys and size when it is long (a space's bounds)."""
    text = str(meta)
    if len(text) <= limit:
        return text
    return f"{len(text)} characters, keys {sorted(meta)} (shmbuf.attach(NAME).meta has it all)"


def _compression(info: _Info) -> str | None:
    """The ``compression`` line of ``info`` and ``top``: None for a buffer that keeps raw."""
    conf = None if info.keyed else info.owner["meta"].get("compress")
    if conf is None or info.layout.pack is None or info.segment.space is None:
        return None
    from .protocol.packing import PackWords
    from .writing.compressor import pack_stats
    words = PackWords(info.segment.mmap, info.segment.space.fd, info.layout.pack, info.name)
    packed, raw, cold, raw_bytes, stored = pack_stats(info.ring, words, conf["hot_steps"])
    ratio = raw_bytes / stored if stored else 1.0
    return (f"compression  {conf['codec']} level {conf['level']} on {conf['columns']}, hot "
            f"{conf['hot_steps']} steps: {packed} chunks packed, {raw} raw ({cold} cold still "
            f"to do); {_human(raw_bytes)} held in {_human(stored)} ({ratio:.1f}x)")


def _describe(pid: int) -> str:
    """``pid`` with its command line, for messages about a live process."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        cmd = ""
    return f"pid {pid}" + (f" ({cmd[:80]})" if cmd else "")


def cmd_rm(args) -> int:
    status = 0
    for name in args.names:
        if not args.force:
            try:
                info = _Info(name)
            except (CorruptSegmentError, ValueError, OSError) as exc:
                if isinstance(exc, SegmentNotFoundError):
                    raise
                print(f"shmbuf rm: {name!r} is not a shmbuf buffer ({exc}); pass --force to "
                      "remove it anyway", file=sys.stderr)
                status = 1
                continue
            try:
                alive, pid, closed = info.owner_alive, info.owner_pid, info.closed
            finally:
                info.close()
            if alive and not closed:
                print(f"shmbuf rm: buffer {name!r} is owned by a live process, "
                      f"{_describe(pid)}; it removes the buffer itself when it closes. Pass "
                      "--force to remove it now (its writers then stop with "
                      "BufferClosedError)", file=sys.stderr)
                status = 1
                continue
        unlink(name, CLOSED_RM)  # marks it closed first: its writers stop
        print(f"removed {name}")
    return status


def cmd_gc(args) -> int:
    """Remove buffers that were closed, or whose owner is dead and that no live writer uses.

    A dead owner's buffer that live writers still fill is kept for adoption.
    With names, only those buffers are looked at (a name that is not there
    is skipped quietly: gc is about what is left, not about what was asked).
    """
    dead = []
    for info in _scan(set(args.names) if args.names else None):
        if isinstance(info, tuple):
            continue  # not a buffer: gc never removes what it cannot read
        try:
            if info.closed:
                dead.append(info.name)
            elif not info.owner_alive:
                writers = info.writers()
                if writers:
                    # A trainer that died while its workers write: a restarted
                    # one adopts it, so its data is not gc's to throw away.
                    print(f"kept {info.name}: its owner (pid {info.owner_pid}) is dead but "
                          f"{len(writers)} writer(s) still write to it; adopt it with "
                          f"shmbuf.attach({info.name!r}, own=True), or remove it with "
                          f"'python -m shmbuf rm {info.name}'")
                else:
                    dead.append(info.name)
        finally:
            info.close()
    for name in dead:
        if args.dry_run:
            print(f"would remove {name} (owner is dead)")
            continue
        try:
            unlink(name, CLOSED_GC)  # marks it closed first: writers left stop
            print(f"removed {name} (owner is dead)")
        except SegmentNotFoundError:
            pass
    if not dead:
        print("nothing to remove")
    return 0


def _top_sample(info: _Info) -> dict:
    if info.keyed:
        return {"t": time.monotonic(), "live": info.live()}
    c = info.ring.counts()
    return {"t": time.monotonic(), "live": c.live, "written": c.written, "evicted": c.evicted,
            "episodes": c.episodes_logged, "samples": c.samples, "rows": c.sampled_rows,
            "writers": {slot: (pid, steps) for slot, pid, steps in info.writers()}}


def _top_frame(info: _Info, before: dict, now: dict) -> list[str]:
    dt = max(now["t"] - before["t"], 1e-9)
    head = f"{info.name}  owner {info.state()}  fill {now['live']}/{info.layout.capacity}"
    if info.keyed:
        return [head]

    def rate(key):
        return (now[key] - before[key]) / dt

    lines = [head + f"  writers {len(now['writers'])}",
             f"ingest {rate('written'):10.1f} steps/s   episodes {rate('episodes'):8.1f}/s   "
             f"evicted {rate('evicted'):10.1f} steps/s",
             f"sampled {rate('rows'):9.1f} rows/s    sample calls {rate('samples'):8.1f}/s",
             f"totals: written {now['written']}  evicted {now['evicted']}  "
             f"episodes {now['episodes']}  sampled rows {now['rows']}"]
    packing = _compression(info)
    if packing:
        lines.append(packing)
    for slot, (pid, steps) in sorted(now["writers"].items()):
        old = before["writers"].get(slot, (pid, steps))[1]
        lines.append(f"  slot {slot:<4} pid {pid:<8} steps/s {(steps - old) / dt:10.1f}")
    return lines


def cmd_top(args) -> int:
    info = _Info(args.name)
    plain = args.plain or not sys.stdout.isatty()
    try:
        before = _top_sample(info)
        # Rates need two readings: the first frame comes after a short one.
        time.sleep(min(args.interval, 0.25))
        for i in range(args.iterations or sys.maxsize):
            now = _top_sample(info)
            if not plain:
                sys.stdout.write("\x1b[H\x1b[2J")
            print("\n".join(_top_frame(info, before, now)), flush=True)
            before = now
            if i + 1 < (args.iterations or sys.maxsize):
                time.sleep(args.interval)
    except KeyboardInterrupt:
        pass
    finally:
        info.close()
    return 0


def cmd_import(args) -> int:
    from .datasets._cli import run_import  # the optional extra: imported only here

    return run_import(args)


def cmd_export(args) -> int:
    from .datasets._cli import run_export

    return run_export(args)


def _dataset_parsers(sub) -> None:
    p = sub.add_parser("import", help="load a dataset into a new buffer and hold it (owner) "
                       "until Ctrl-C or SIGTERM")
    p.add_argument("source", help="minari:<dataset id> or swm:<file.h5>")
    p.add_argument("--name", help="the buffer's name (default: generated)")
    p.add_argument("--capacity", type=int, help="steps held (default: the whole dataset; "
                   "smaller keeps the newest episodes)")
    p.add_argument("--keys", help="comma-separated: Minari observation keys, or swm columns")
    p.add_argument("--download", action="store_true", help="fetch a Minari dataset that is "
                   "not held locally from Minari's remote")
    p.set_defaults(func=cmd_import)
    p = sub.add_parser("export", help="write a buffer's finished episodes as a dataset")
    p.add_argument("name")
    p.add_argument("--to", required=True, help="minari:<dataset id> or swm:<file.h5>")
    p.add_argument("--overwrite", action="store_true", help="replace an existing swm file")
    p.set_defaults(func=cmd_export)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shmbuf", description="Inspect and clean up shmbuf "
                                     "buffers in /dev/shm.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("ls", help="list shmbuf buffers").set_defaults(func=cmd_ls)
    p = sub.add_parser("info", help="schema and counters of one buffer")
    p.add_argument("name")
    p.set_defaults(func=cmd_info)
    p = sub.add_parser("rm", help="unlink buffers by name (mapped views stay valid)")
    p.add_argument("names", nargs="+")
    p.add_argument("--force", action="store_true",
                   help="also remove a buffer whose owner is alive, or an entry that is not "
                   "a shmbuf buffer")
    p.set_defaults(func=cmd_rm)
    p = sub.add_parser("gc", help="remove buffers whose owner process is dead (and that no "
                       "live writer uses)")
    p.add_argument("names", nargs="*", metavar="NAME",
                   help="only these buffers (default: every buffer in /dev/shm)")
    p.add_argument("--dry-run", action="store_true", help="only list what would be removed")
    p.set_defaults(func=cmd_gc)
    p = sub.add_parser("top", help="live fill, ingest and sample rates until Ctrl-C")
    p.add_argument("name")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    p.add_argument("--iterations", type=int, default=0, help="stop after N refreshes (0: never)")
    p.add_argument("--plain", action="store_true", help="append lines instead of redrawing "
                   "(the default when stdout is not a terminal)")
    p.set_defaults(func=cmd_top)
    _dataset_parsers(sub)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        status = args.func(args)
        sys.stdout.flush()  # here, where a reader that left is caught below
        return status
    except (SegmentNotFoundError, CorruptSegmentError, SegmentPermissionError) as exc:
        print(f"shmbuf {args.command}: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # The reader left (``shmbuf info NAME | head``): not an error of ours.
        # Point stdout at /dev/null so that the interpreter's final flush of
        # the dead pipe does not print a second traceback (Python's
        # documented recipe, "Note on SIGPIPE" in the signal module).
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 141  # what a shell reports for a tool that SIGPIPE ended
