"""Kill-loop harness: SIGKILL writers at random instants while a reader verifies.

Writers (forked, each attaching by name) add encoded steps, some one at a
time and some with add_batch, into a buffer small enough to recycle all the
time, with chunks so small that many kills land inside a chunk claim.  Each
round kills one random writer, starts a replacement that joins by name, and
samples and verifies windows.  Run by hand for the full sizes:

    python tests/helpers/crash_harness.py --rounds 1000
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from dataclasses import dataclass, field

import numpy as np

# tests/, so that ``helpers`` imports when this file is run as a script.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import shmbuf  # noqa: E402
from helpers.workers import SPEC, step_for, verify_batch  # noqa: E402

HANG_SECONDS = 20


@dataclass
class Report:
    rounds: int = 0
    kills: int = 0
    kills_mid_claim: int = 0
    reader_kills: int = 0
    attacher_kills: int = 0
    windows_verified: int = 0
    torn_windows: int = 0
    hangs: int = 0
    slowest_writer_steps_per_round: float = 0.0
    errors: list = field(default_factory=list)

    def line(self) -> str:
        return (f"rounds {self.rounds}  kills {self.kills} ({self.kills_mid_claim} inside a chunk "
                f"claim; +{self.reader_kills} readers, "
                f"{self.attacher_kills} attachers)  windows verified {self.windows_verified}  "
                f"torn {self.torn_windows}  hangs {self.hangs}  slowest surviving writer "
                f"{self.slowest_writer_steps_per_round:.0f} steps/round")


def _writer_main(name: str, writer_id: int, batch: int, episode_len: int) -> None:
    """Child body: add encoded steps until killed (bounded by a step limit)."""
    buf = shmbuf.attach(name)
    w = buf.writer()
    pos = 0
    for _ in range(10_000_000):
        if batch:
            steps = [step_for(writer_id * 100 + e, pos, *divmod(pos, episode_len),
                              pos % episode_len == episode_len - 1) for e in range(batch)]
            w.add_batch(**{k: np.stack([s[k] for s in steps]) for k in steps[0]})
        else:
            episode, t = divmod(pos, episode_len)
            w.add(**step_for(writer_id * 100, pos, episode, t, t == episode_len - 1))
        pos += 1
    os._exit(0)


def _reader_main(name: str) -> None:
    buf = shmbuf.attach(name)
    for _ in range(10_000_000):
        verify_batch(buf.sample_sequences(8, 6))
    os._exit(0)


def _attacher_main(name: str) -> None:
    buf = shmbuf.attach(name)
    buf.stats()
    os.read(os.open("/dev/null", os.O_RDONLY), 1)
    signal.pause()


def _spawn(target, *args) -> int:
    pid = os.fork()
    if pid == 0:
        try:
            target(*args)
        finally:
            os._exit(1)
    return pid


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    os.waitpid(pid, 0)


def _left_mid_claim(buf, pid: int) -> int:
    """1 if the dead ``pid`` left a chunk half-claimed (odd seq), else 0."""
    table = buf._ring.slot_table
    slots = [s for s in range(len(table)) if int(table[s, 0]) & 0xFFFFFFFF == pid]
    states = buf._ring.chunk_table[:, 0].astype(np.int64)
    odd = (states >> 32) & 1 == 1
    owners = (states >> 16) & 0x7FFF
    return int(bool(slots) and bool(np.any(odd & np.isin(owners, slots))))


def _track_progress(buf, pids, progress) -> None:
    """Record, per live writer pid, (rounds seen, steps its slot has counted)."""
    table = buf._ring.slot_table
    for slot in range(len(table)):
        pid = int(table[slot, 0]) & 0xFFFFFFFF
        if pid in pids:
            seen = progress.setdefault(pid, [0, int(table[slot, 2]), int(table[slot, 2])])
            seen[0] += 1
            seen[2] = int(table[slot, 2])


def _check_progress(progress, report) -> None:
    """Every writer that lived through 10+ rounds of kills kept writing."""
    rates = [(last - first) / rounds for rounds, first, last in progress.values() if rounds >= 10]
    if rates:
        report.slowest_writer_steps_per_round = min(rates)
    stalled = [pid for pid, (rounds, first, last) in progress.items()
               if rounds >= 10 and last == first]
    if stalled:
        report.errors.append(f"writers {stalled} made no progress while others were killed")


def _on_alarm(signum, frame):
    raise TimeoutError(f"the reader blocked for more than {HANG_SECONDS} s")


def run(rounds: int = 200, n_writers: int = 3, capacity: int = 192, chunk_size: int = 2,
        seed: int = 0, episode_len: int = 9) -> Report:
    rng = np.random.default_rng(seed)
    report = Report()
    pids: dict[int, int] = {}   # pid -> writer id
    old_alarm = signal.signal(signal.SIGALRM, _on_alarm)
    with shmbuf.create(SPEC, capacity, chunk_size=chunk_size, max_writers=n_writers + 4,
                       seed=seed) as buf:
        try:
            for wid in range(n_writers):
                pids[_spawn(_writer_main, buf.name, wid, 4 if wid % 2 else 0, episode_len)] = wid
            buf.wait_ready(min_steps=capacity // 2, timeout=60)
            next_id = n_writers
            progress: dict[int, list] = {}
            for _ in range(rounds):
                report.rounds += 1
                victim = list(pids)[rng.integers(len(pids))]
                time.sleep(rng.uniform(0, 0.004))  # a random kill instant, not a sync
                _kill(victim)
                pids.pop(victim)
                report.kills += 1
                report.kills_mid_claim += _left_mid_claim(buf, victim)
                batch = 4 if next_id % 2 else 0
                pids[_spawn(_writer_main, buf.name, next_id, batch, episode_len)] = next_id
                next_id += 1
                signal.alarm(HANG_SECONDS)
                try:
                    for _ in range(3):
                        try:
                            report.windows_verified += verify_batch(buf.sample_sequences(8, 6))
                        except AssertionError as exc:
                            report.torn_windows += 1
                            report.errors.append(str(exc))
                except TimeoutError as exc:
                    report.hangs += 1
                    report.errors.append(str(exc))
                finally:
                    signal.alarm(0)
                stats = buf.stats()
                if not (0 < stats.live_steps <= capacity and stats.oldest_step <= stats.newest_step + 1):
                    report.errors.append(f"inconsistent stats {stats}")
                _track_progress(buf, pids, progress)
            for make, counter in ((_reader_main, "reader_kills"), (_attacher_main, "attacher_kills")):
                for _ in range(3):
                    pid = _spawn(make, buf.name)
                    time.sleep(rng.uniform(0.005, 0.02))  # let it get going before the kill
                    _kill(pid)
                    setattr(report, counter, getattr(report, counter) + 1)
                    report.windows_verified += verify_batch(buf.sample_sequences(8, 6))
            _check_progress(progress, report)
            for pid in list(pids):
                pids.pop(pid)
                _kill(pid)
            # Every chunk of the dead writers must be reclaimable: one writer
            # alone can now cycle the whole capacity twice.
            with buf.writer() as w:
                for pos in range(2 * capacity):
                    w.add(**step_for(999, pos, 0, pos, False))
            if buf.stats().live_steps < capacity - chunk_size:
                report.errors.append(f"capacity leaked: {buf.stats()}")
            report.windows_verified += verify_batch(buf.sample_sequences(16, 6))
        finally:
            signal.signal(signal.SIGALRM, old_alarm)
            for pid in pids:
                _kill(pid)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1000)
    parser.add_argument("--writers", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    report = run(args.rounds, args.writers, seed=args.seed)
    print(report.line())
    for err in report.errors[:10]:
        print("  ", err)
    sys.exit(1 if report.errors or report.torn_windows or report.hangs else 0)


if __name__ == "__main__":
    main()
