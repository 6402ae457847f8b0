"""``shmbuf import`` and ``shmbuf export``: the CLI's side of ``shmbuf.datasets``.

An imported buffer lives in shared memory only while some process owns it
(the owner unlinks it when it exits), so ``shmbuf import`` holds it: it
imports, prints ``NAME<TAB>STEPS<TAB>EPISODES`` on stdout, and then stays
in the foreground as the buffer's owner until Ctrl-C or SIGTERM (both
remove the buffer) or until ``shmbuf rm --force NAME`` removes it.  Trainers
and DataLoader workers attach by name meanwhile.  If the holder is killed
(SIGKILL), the segment stays: ``shmbuf.attach(NAME, own=True)`` adopts it,
or ``shmbuf gc`` removes it.
"""
from __future__ import annotations

import os
import sys
import time

from .._errors import BufferClosedError, ShmbufError

_HOLD_POLL = 0.5  # seconds between checks that nobody removed the held buffer


def parse_source(text: str, flag: str) -> tuple[str, str]:
    """``minari:<id>`` or ``swm:<path>`` as ``(kind, rest)``; ValueError otherwise."""
    kind, sep, rest = text.partition(":")
    if not sep or kind not in ("minari", "swm") or not rest:
        raise ValueError(f"{flag} {text!r}: expected minari:<dataset id> or swm:<file.h5>")
    return kind, rest


def _import(args):
    from . import from_minari, from_swm_hdf5

    kind, rest = parse_source(args.source, "source")
    keys = args.keys.split(",") if args.keys else None
    if kind == "swm":
        if args.download:
            raise ValueError(f"--download fetches Minari datasets; {args.source!r} is a local "
                             "stable-worldmodel file")
        return from_swm_hdf5(rest, name=args.name, capacity=args.capacity, keys=keys)
    try:
        return from_minari(rest, name=args.name, capacity=args.capacity, keys=keys,
                           download=args.download)
    except FileNotFoundError as exc:
        if args.download or "download" not in str(exc):
            raise
        # Minari's own advice names its Python keyword; this is the CLI's.
        raise FileNotFoundError(
            f"Minari dataset {rest!r} is not held locally (MINARI_DATASETS_PATH or "
            "~/.minari/datasets); add --download to fetch it from Minari's remote, or "
            "'minari download ID' first") from None


def run_import(args) -> int:
    """Import, report on stdout, then hold the buffer until a signal or its removal."""
    buf = _reported("import", _import, args)
    if buf is None:
        return 1
    with buf:
        print(f"{buf.name}\t{len(buf)}\t{len(buf.episodes().index)}", flush=True)
        print(f"shmbuf import: holding {buf.name!r} (pid {os.getpid()}); attach with "
              f"shmbuf.attach({buf.name!r}). Ctrl-C or 'kill {os.getpid()}' removes it",
              file=sys.stderr, flush=True)
        try:
            while True:
                time.sleep(_HOLD_POLL)
                buf.wait_ready(1, timeout=0)  # raises once someone removed it
        except BufferClosedError:
            print(f"shmbuf import: {buf.name!r} was removed by another process",
                  file=sys.stderr)
        except KeyboardInterrupt:
            print(f"shmbuf import: removed {buf.name!r}", file=sys.stderr)
    return 0


def _export(args) -> int:
    from .. import attach

    kind, rest = parse_source(args.to, "--to")
    from . import to_minari, to_swm_hdf5

    with attach(args.name) as buf:
        if kind == "minari":
            return to_minari(buf, rest).total_episodes
        return to_swm_hdf5(buf, rest, overwrite=args.overwrite)


def run_export(args) -> int:
    """Write buffer ``args.name`` to ``args.to``."""
    n = _reported("export", _export, args)
    if n is None:
        return 1
    print(f"wrote {n} episodes of {args.name} to {args.to}")
    return 0


def _reported(verb: str, step, args):
    """``step(args)``, or None once the reason it failed is on stderr (exit status 1)."""
    try:
        return step(args)
    except ImportError as exc:
        print(f"shmbuf {verb}: {exc}; install the datasets extra: pip install "
              "'shmbuf[datasets]'", file=sys.stderr)
    except (ShmbufError, ValueError, KeyError, TypeError, OSError) as exc:
        print(f"shmbuf {verb}: {exc}", file=sys.stderr)
    return None
