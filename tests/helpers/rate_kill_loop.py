"""Kill loop for the rate limiter: writers and the trainer SIGKILLed at random instants.

The harness owns a rate-limited buffer.  3 writer processes add steps
numbered ``writer id << 32 | n``; a trainer process samples.  Each round
SIGKILLs one of them at a random instant (often while it waits on the
limiter) and starts a replacement, which attaches by name; then both sides
must make progress again within ``HANG_SECONDS`` (else: a hang).  At the end
no step is lost: every writer's published steps are held, numbered 0, 1,
2, ... without a gap, and the counters add up (a writer killed between
numbering a step and publishing it leaves the clock at most one step
ahead).  Run by hand for more rounds:

    python tests/helpers/rate_kill_loop.py --rounds 500
"""
from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import time
from dataclasses import dataclass

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import shmbuf  # noqa: E402
from helpers.stop_workers import Script  # noqa: E402
from shmbuf.posix.wait import poll  # noqa: E402

HANG_SECONDS = 20
SPEC = {"x": ((), np.int64), "done": ((), np.bool_)}
LIMIT = shmbuf.RateLimit(4, min_steps=32, writer_timeout=None)

WRITER = """
    import numpy as np, shmbuf
    buf = shmbuf.attach({name!r})
    w = buf.writer()
    print("ready", flush=True)
    n = 0
    while True:
        w.add(x=np.int64(({wid} << 32) | n), done=np.bool_(n % 97 == 96))
        n += 1
"""
TRAINER = """
    import shmbuf
    buf = shmbuf.attach({name!r})
    print("ready", flush=True)
    while True:
        buf.sample_sequences(4, 2)
"""


@dataclass
class Report:
    rounds: int = 0
    writer_kills: int = 0
    trainer_kills: int = 0
    hangs: int = 0
    steps_checked: int = 0
    lost: int = 0
    outside_band: int = 0

    def line(self) -> str:
        return (f"rounds {self.rounds}  kills: {self.writer_kills} writers, "
                f"{self.trainer_kills} trainers  hangs {self.hangs}  steps checked "
                f"{self.steps_checked}  lost {self.lost}  outside the band {self.outside_band}")


def _progress(buf, field: str, seconds: float) -> bool:
    before = getattr(buf.stats().rate, field)
    try:
        poll(lambda: getattr(buf.stats().rate, field) > before or None, seconds,
             lambda: TimeoutError(field))
        return True
    except TimeoutError:
        return False


def run(rounds: int, seed: int = 0) -> Report:
    rng = random.Random(seed)
    report = Report()
    procs: dict[str, Script] = {}
    with shmbuf.create(SPEC, 1 << 18, chunk_size=64, rate_limit=LIMIT) as buf:
        wid = 0

        def start(role: str) -> None:
            nonlocal wid
            code = TRAINER.format(name=buf.name) if role == "trainer" else WRITER.format(
                name=buf.name, wid=wid)
            wid += role != "trainer"
            s = Script(code)
            assert s.line() == "ready"
            procs[role] = s

        try:
            for role in ("w0", "w1", "w2", "trainer"):
                start(role)
            for _ in range(rounds):
                time.sleep(rng.uniform(0, 0.03))          # a random instant, not a sync
                role = rng.choice(sorted(procs))
                procs.pop(role).close()                   # SIGKILL
                if role == "trainer":
                    report.trainer_kills += 1
                else:
                    report.writer_kills += 1
                start(role)
                if not (_progress(buf, "inserted", HANG_SECONDS)
                        and _progress(buf, "replayed", HANG_SECONDS)):
                    report.hangs += 1
                s = buf.stats().rate
                report.outside_band += not (-s.tolerance <= s.lag <= s.tolerance)
                report.rounds += 1
        finally:
            for s in procs.values():
                s.close()
        _check_steps(buf, report)
    return report


def _check_steps(buf, report: Report) -> None:
    """Every published step of every writer is held, each writer's numbered without a gap."""
    rows = buf.committed_rows()
    x = buf.arrays["x"][rows]
    ids, seqs = x >> 32, x & 0xFFFFFFFF
    for w in np.unique(ids):
        mine = np.sort(seqs[ids == w])
        report.steps_checked += len(mine)
        # Chunks go in FIFO turn, a writer's oldest first: what it holds is the
        # newest part of what it published, without a gap.
        report.lost += int(mine[-1] + 1 - mine[0] - len(np.unique(mine)))   # gaps
        report.lost += len(mine) - len(np.unique(mine))             # duplicates
    st = buf.stats()
    written, live = st.steps_written, st.live_steps
    ahead = st.rate.inserted - written
    held = live + st.oldest_step   # oldest_step: the steps evicted by recycling
    if not (0 <= ahead <= report.writer_kills and held <= written <= held + report.writer_kills):
        report.lost += 1   # the counters do not add up


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(run(args.rounds, args.seed).line())


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    main()
