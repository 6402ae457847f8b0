"""python -m shmbuf ls | info NAME | rm NAME | gc [--dry-run] | top NAME

Exit codes: 0 success, 1 a named segment is missing or is not a shmbuf
buffer, 2 bad usage (argparse).
"""
from __future__ import annotations

import argparse
import sys
import time

from ._errors import CorruptSegmentError, SegmentNotFoundError, SegmentPermissionError
from ._layout import KIND_KEYED
from ._layout import CLOSED_GC, CLOSED_RM
from ._ring import Ring, closed_word, owner_alive, owner_record
from ._segment import Segment, list_segments, unlink


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

    def writers(self) -> list[tuple[int, int, int]]:
        """(slot, pid, steps) of every slot held by a live process."""
        return self.ring.live_writers()

    def close(self):
        self.ring = None
        self.segment.close()


def _scan():
    """Every readable shmbuf segment in /dev/shm, as _Info (caller closes)."""
    for name in list_segments():
        try:
            yield _Info(name)
        except (CorruptSegmentError, SegmentNotFoundError, SegmentPermissionError, ValueError,
                OSError):
            continue  # not ours, gone meanwhile, or another user's


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def cmd_ls(args) -> int:
    print(f"{'NAME':<32} {'SIZE':>10} {'CAPACITY':>10} {'FILL':>10} {'OWNER':>12} {'WRITERS':>7}")
    for info in _scan():
        try:
            live = info.ring.live_steps() if info.owner["kind"] != KIND_KEYED else 0
            owner = f"{info.owner_pid} {'alive' if info.owner_alive else 'dead'}"
            print(f"{info.name:<32} {_human(info.segment.size):>10} {info.layout.capacity:>10} "
                  f"{live:>10} {owner:>12} {len(info.writers()):>7}")
        finally:
            info.close()
    return 0


def cmd_info(args) -> int:
    info = _Info(args.name)
    try:
        lay, ring = info.layout, info.ring
        print(f"name         {info.name}")
        print(f"kind         {'keyed rings' if info.owner['kind'] == KIND_KEYED else 'step store'}")
        print(f"size         {_human(info.segment.size)}")
        print(f"owner        pid {info.owner_pid} "
              f"({'alive' if info.owner_alive else 'dead'})"
              f"{'' if info.owner_pid == info.owner['owner_pid'] else ', adopted'}"
              f"{', closed' if info.closed else ''}")
        print(f"meta         {info.owner['meta']}")
        print(f"capacity     {lay.capacity} steps in {lay.n_chunks} chunks of {lay.chunk_size}")
        print("columns")
        for col in lay.user_columns:
            print(f"  {col.name:<16} shape {str(col.shape):<16} dtype {col.dtype}")
        if info.owner["kind"] != KIND_KEYED:
            c = ring.counts()  # the one consistent order
            print(f"live steps   {c.live}")
            print(f"written      {c.written}")
            print(f"evicted      {c.evicted}")
            print(f"episodes     {c.episodes}")
            print(f"samples      {c.samples}")
            print(f"streams      {c.streams}")
        print(f"writers      {len(info.writers())}")
        for slot, pid, steps in info.writers():
            print(f"  slot {slot:<4} pid {pid:<8} steps {steps}")
    finally:
        info.close()
    return 0


def cmd_rm(args) -> int:
    for name in args.names:
        unlink(name, CLOSED_RM)  # marks it closed first: its writers stop
        print(f"removed {name}")
    return 0


def cmd_gc(args) -> int:
    """Remove shmbuf segments whose owner process is dead; nothing else."""
    dead = []
    for info in _scan():
        try:
            if not info.owner_alive or info.closed:
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


def cmd_top(args) -> int:
    info = _Info(args.name)
    try:
        last, last_t = None, time.monotonic()
        for i in range(args.iterations or sys.maxsize):
            ring = info.ring
            now = time.monotonic()
            writers = {slot: (pid, steps) for slot, pid, steps in info.writers()}
            c = ring.counts()
            samples = c.samples
            dt = max(now - last_t, 1e-9)
            lines = [f"{info.name}  fill {c.live}/{info.layout.capacity}  "
                     f"written {c.written}  writers {len(writers)}"]
            if last is not None:
                lines.append(f"sample calls/s {(samples - last[1]) / dt:10.1f}")
                for slot, (pid, steps) in sorted(writers.items()):
                    before = last[0].get(slot, (pid, steps))[1]
                    lines.append(f"  slot {slot:<4} pid {pid:<8} steps/s {(steps - before) / dt:10.1f}")
            if not args.plain:
                sys.stdout.write("\x1b[H\x1b[2J")
            print("\n".join(lines), flush=True)
            last, last_t = (writers, samples), now
            if i + 1 < (args.iterations or sys.maxsize):
                time.sleep(args.interval)
    except KeyboardInterrupt:
        pass
    finally:
        info.close()
    return 0


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
    p.set_defaults(func=cmd_rm)
    p = sub.add_parser("gc", help="remove buffers whose owner process is dead")
    p.add_argument("--dry-run", action="store_true", help="only list what would be removed")
    p.set_defaults(func=cmd_gc)
    p = sub.add_parser("top", help="live fill, ingest and sample rates until Ctrl-C")
    p.add_argument("name")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    p.add_argument("--iterations", type=int, default=0, help="stop after N refreshes (0: never)")
    p.add_argument("--plain", action="store_true", help="append lines instead of redrawing")
    p.set_defaults(func=cmd_top)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (SegmentNotFoundError, CorruptSegmentError, SegmentPermissionError) as exc:
        print(f"shmbuf {args.command}: {exc}", file=sys.stderr)
        return 1
