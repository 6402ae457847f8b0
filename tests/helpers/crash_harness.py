"""Kill-loop harness: SIGKILL writers at random instants while a reader verifies.

Writers (forked, each attaching by name) add encoded steps, some one at a
time and some with add_batch, into a buffer small enough to recycle all the
time, with chunks so small that many kills land inside a chunk claim.  Each
round kills one random writer, starts a replacement that joins by name, and
samples and verifies windows.  Run by hand for the full sizes:

    python tests/helpers/crash_harness.py --rounds 1000
    python tests/helpers/crash_harness.py --restarts --rounds 1000   # SIGKILL the trainer

The second loop kills the trainer (the owner) instead and restarts it; each
restart takes the buffer over with ``attach(name, own=True)`` while the
writers keep writing (``run_trainer_restarts``).
"""
from __future__ import annotations

import argparse
import os
import select
import signal
import sys
import time
from dataclasses import dataclass, field

import numpy as np

# tests/, so that ``helpers`` imports when this file is run as a script.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import shmbuf  # noqa: E402
from helpers.procs import kill_pid  # noqa: E402
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
    kill_pid(pid)


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
                if not (0 < stats.live_steps <= capacity
                        and stats.oldest_step <= stats.newest_step + 1):
                    report.errors.append(f"inconsistent stats {stats}")
                _track_progress(buf, pids, progress)
            for make, counter in ((_reader_main, "reader_kills"),
                                  (_attacher_main, "attacher_kills")):
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


# -- the trainer killed and restarted: every restart adopts the buffer ------------------
@dataclass
class RestartReport:
    rounds: int = 0
    adoptions: int = 0
    windows_verified: int = 0
    torn_windows: int = 0
    lost_steps: int = 0
    steps_checked: int = 0
    max_in_flight: int = 0
    unjudged: int = 0
    errors: list = field(default_factory=list)

    def line(self) -> str:
        return (f"rounds {self.rounds}  trainer kills {self.rounds}  adoptions {self.adoptions}  "
                f"steps checked {self.steps_checked}  lost {self.lost_steps} (max in flight "
                f"{self.max_in_flight}; {self.unjudged} checks raced a recycle)  "
                f"windows verified {self.windows_verified}  "
                f"torn {self.torn_windows}")


def _tracked_writer_main(name: str, writer_id: int, published, episode_len: int) -> None:
    """Child body: add encoded steps; ``published[writer_id]`` is the last one published."""
    w = shmbuf.attach(name).writer()
    for pos in range(10_000_000):
        episode, t = divmod(pos, episode_len)
        w.add(**step_for(writer_id, pos, episode, t, t == episode_len - 1))
        published[writer_id] = pos
    os._exit(0)


def _trainer_main(name: str, spec_capacity: tuple, status_fd: int) -> None:
    """Child body: create the buffer (first run) or adopt it; sample and verify until killed."""
    capacity, chunk_size = spec_capacity
    try:
        if name is None:
            buf = shmbuf.create(SPEC, capacity, chunk_size=chunk_size, max_writers=16,
                                handle_signals=False)
        else:
            buf = shmbuf.attach(name, own=True, handle_signals=False)
    except BaseException as exc:  # said on the pipe: the harness reports it
        os.write(status_fd, f"error {type(exc).__name__}: {exc}\n".encode())
        raise
    os.write(status_fd, f"{buf.name} {os.getpid()}\n".encode())
    for _ in range(10_000_000):
        try:
            verify_batch(buf.sample_sequences(8, 6))
        except shmbuf.NotEnoughDataError:
            pass
        except AssertionError:
            os.write(status_fd, b"torn\n")
    os._exit(0)


def _read_status(fd: int, timeout: float) -> str:
    line = b""
    deadline = time.monotonic() + timeout
    while not line.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise TimeoutError(f"no word from the trainer in {timeout} s")
        byte = os.read(fd, 1)
        if not byte:
            raise EOFError("the trainer exited without a word")
        line += byte
    return line.decode().strip()


def _check_fifo(buf, published, n_writers: int, report: RestartReport) -> None:
    """Nothing published was lost: steps leave only by recycling, in FIFO turn.

    1. The counters add up: every step counted as written is live or was
       evicted by a chunk recycle, except the few in flight (each writer
       counts a step just before publishing it, and a recycler empties a
       chunk just before adding its rows to ``evicted``).  Written is read
       first, then live, then evicted, so however long this process is
       descheduled in between, a step of the first count is in one of the
       other two (or in flight).  Recycling happens only in the tickets'
       FIFO turn, so a step that vanished any other way (a reset, a chunk
       reclaimed from a live writer) shows here.
    2. A writer's newest chunk is never recycled while it lives, so the
       buffer still holds the last step each writer had published before
       the check, unless a chunk was recycled during the check itself (a
       writer may move on and its last chunk come to its turn while this
       process is descheduled): such rounds are counted, not judged.
    """
    floor = [published[w] for w in range(n_writers)]
    ring, action = buf._ring, buf._views["action"]
    written = ring.steps_written()
    live = ring.live_steps()
    evicted = ring.counter("evicted")
    gap = written - live - evicted
    report.max_in_flight = max(report.max_in_flight, gap)
    if gap > n_writers * (1 + ring.layout.chunk_size):
        report.lost_steps += gap
        report.errors.append(f"counters do not add up: written {written} > live {live} "
                             f"+ evicted {evicted} (+ in flight)")
    chunks = ring.live_chunks()
    starts = np.repeat(chunks.base, chunks.count)
    offsets = np.arange(len(starts)) - np.repeat(np.cumsum(chunks.count) - chunks.count,
                                                  chunks.count)
    rows = action[starts + offsets, :4]  # one gather: the shortest window for a race
    kept = ring.unchanged(chunks.chunk, chunks.seq)
    if not kept.all():
        report.unjudged += 1
        return
    writer, pos = rows[:, 0].astype(np.int64), rows[:, 3].astype(np.int64)
    for w in range(n_writers):
        mine = pos[writer == w]
        report.steps_checked += len(mine)
        if floor[w] >= 0 and (not len(mine) or mine.max() < floor[w]):
            report.lost_steps += 1
            report.errors.append(f"writer {w} published step {floor[w]}, the buffer's newest "
                                 f"is {mine.max() if len(mine) else None}")


def run_trainer_restarts(rounds: int = 50, n_writers: int = 3, capacity: int = 4096,
                         chunk_size: int = 16, seed: int = 0, episode_len: int = 11
                         ) -> RestartReport:
    """SIGKILL the trainer (the owner) at random instants; each restart adopts the buffer.

    Writers keep writing throughout.  After each adoption the harness checks
    that nothing published was lost (``_check_fifo``) and verifies samples;
    the trainers verify theirs too and report torn windows.
    """
    from multiprocessing import RawArray

    rng = np.random.default_rng(seed)
    report = RestartReport()
    published = RawArray("q", [-1] * n_writers)
    status_r, status_w = os.pipe()
    writers, trainer, name, watcher = [], None, None, None
    try:
        trainer = _spawn(_trainer_main, None, (capacity, chunk_size), status_w)
        name = _read_status(status_r, HANG_SECONDS).split()[0]
        watcher = shmbuf.attach(name)
        for wid in range(n_writers):
            writers.append(_spawn(_tracked_writer_main, name, wid, published, episode_len))
        watcher.wait_ready(min_steps=capacity // 2, timeout=60)
        for _ in range(rounds):
            report.rounds += 1
            time.sleep(rng.uniform(0, 0.01))  # a random kill instant, not a sync
            _kill(trainer)
            trainer = _spawn(_trainer_main, name, (capacity, chunk_size), status_w)
            said = _read_status(status_r, HANG_SECONDS)
            while said == "torn":  # reports of the dead trainer still in the pipe
                report.torn_windows += 1
                said = _read_status(status_r, HANG_SECONDS)
            got, _, rest = said.partition(" ")   # "<name> <pid>", or "error <why>"
            if got == "error":
                report.errors.append(f"round {report.rounds}: the restarted trainer failed: "
                                     f"{rest}")
                continue
            if got == name and rest == str(trainer) and watcher.stats().owner_pid == trainer:
                report.adoptions += 1
            else:
                report.errors.append(f"round {report.rounds}: trainer {trainer} said {got} {rest}")
            _check_fifo(watcher, published, n_writers, report)
            for _ in range(2):
                try:
                    report.windows_verified += verify_batch(watcher.sample_sequences(8, 6))
                except AssertionError as exc:
                    report.torn_windows += 1
                    report.errors.append(str(exc))
        _kill(trainer)
        trainer = None
        while select.select([status_r], [], [], 0)[0]:  # what the trainers said last; no wait
            chunk = os.read(status_r, 1 << 16)
            report.torn_windows += chunk.decode().split().count("torn")
            if not chunk:
                break
    finally:
        for pid in writers + ([trainer] if trainer else []):
            _kill(pid)
        if watcher is not None:
            watcher.close()
        if name is not None:
            try:  # the last trainer was killed: adopt once more, and remove it
                shmbuf.attach(name, own=True, handle_signals=False).close()
            except shmbuf.SegmentNotFoundError:
                pass
        os.close(status_r)
        if status_w is not None:
            os.close(status_w)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1000)
    parser.add_argument("--writers", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--restarts", action="store_true",
                        help="kill and restart the trainer instead (each restart adopts)")
    args = parser.parse_args()
    report: Report | RestartReport
    if args.restarts:
        report = run_trainer_restarts(args.rounds, args.writers, seed=args.seed)
        failed = report.lost_steps
    else:
        report = run(args.rounds, args.writers, seed=args.seed)
        failed = report.hangs
    print(report.line())
    for err in report.errors[:10]:
        print("  ", err)
    sys.exit(1 if report.errors or report.torn_windows or failed else 0)


if __name__ == "__main__":
    main()
