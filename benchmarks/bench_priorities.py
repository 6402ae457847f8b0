"""Shared priorities and the Prioritized draw: issue 19's targets, paired in one run.

    python benchmarks/bench_priorities.py            # about 2 minutes on 2 cores
    python benchmarks/bench_priorities.py --quick    # 10^6 instead of 10^7 steps
    python benchmarks/bench_priorities.py --against REV [--quick]   # this install vs REV

``--against REV`` builds revision REV in a temporary git worktree
(``build_ext --inplace``) and runs the same draw in two long-lived processes,
one importing that checkout and one this install, alternating them in every
round, so that a regression shows as a ratio (this / REV) in one run.  The
workload: 50 windows of 50 chosen with ``Prioritized(exponent=0.8,
maxfrac=0.5)`` among 10^4 and 10^7 held steps of a 17-byte row (obs uint8
(16,), done), every priority set; ``draw`` is the choice alone (the private
draw function, found under whichever name the revision has), ``sample`` the
public ``sample_sequences(50, 50, select=...)``.  The temporary checkout is
removed at the end.

Rows (each figure the median of its repetitions, min-max in brackets; the two
sides of a ratio alternate, and the ratio is the median of the pairs' ratios):

  P1  choose 50 windows of 50 (no gather) among 10^7 held steps of a small row
      (obs f32 (16,)), every step's priority set (lognormal), exponent 0.8,
      maxfrac 0.5                                       target <= 200 us
  P1g P1 at 10^7 held steps / the same at 10^4          target <= 4x
  P1u the uniform draw of the same 50 windows at 10^7 (reference)
  P2  a 50x50 Prioritized batch from a full W1 buffer / the uniform batch   <= 1.25x
  P3  update_priorities of 2,500 ids among 10^7 steps   target <= 300 us
  P4  Writer.add per step, priorities=True / False      target <= 1.05x
  P5  TorchRL PrioritizedSliceSampler, 50 slices of 50 W1 steps, per batch
      (sample + priority update) / shmbuf's              target shmbuf >= 5x faster
  P6  cpprb MPPrioritizedReplayBuffer, 256 rows sampled + priorities updated
      / shmbuf's sample_sequences(256, 1) + update_priorities (reference)

Nothing is asserted.  The machine may be shared: the run prints the load
average before and after.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import shmbuf
from shmbuf.sampling import prioritized as _prioritized

SMALL = {"obs": ((16,), np.float32), "done": ((), np.bool_)}
W1 = {"obs": ((3, 64, 64), np.uint8), "action": ((6,), np.float32),
      "reward": ((), np.float32), "done": ((), np.bool_)}
EPISODE = 500
EXPONENT, MAXFRAC = 0.8, 0.5


def _select():
    """``select=Prioritized(...)`` when shmbuf.select exists (issue 19a), else None."""
    try:
        from shmbuf.select import Prioritized
    except ImportError:
        return None
    return Prioritized(exponent=EXPONENT, maxfrac=MAXFRAC)


def step_ids(buf, rows):
    """The step ids of ``rows`` as the buffer hands them out (``Buffer.port``), or as the
    ring numbers them in an older shmbuf that has no port yet (``--against``)."""
    port = getattr(type(buf), "port", None)
    return buf.port.step_ids(rows) if port is not None else buf._ring.priorities.ids(rows)


def fill(buf, steps: int, spec: dict, seed: int = 0) -> None:
    """``steps`` steps in episodes of EPISODE, through extend; every priority set (lognormal)."""
    rng = np.random.default_rng(seed)
    run = {k: np.zeros((EPISODE,) + shape, dt) for k, (shape, dt) in spec.items()}
    run["done"][-1] = True
    if "obs" in run and run["obs"].dtype == np.uint8:
        run["obs"][:] = rng.integers(0, 255, run["obs"].shape, dtype=np.uint8)
    with buf.writer() as w:
        for _ in range(steps // EPISODE):
            w.extend(**run)
    rows = buf.committed_rows()
    ids = step_ids(buf, rows)   # every held step's id, to set them all
    for at in range(0, len(ids), 1 << 20):
        part = ids[at:at + (1 << 20)]
        buf.update_priorities(part, rng.lognormal(0, 1, len(part)).astype(np.float32))


def timed(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def paired(a, b, reps: int, inner: int = 1) -> tuple[list[float], list[float], list[float]]:
    """Alternate ``a`` and ``b``; per-call times of each and the pairs' ratios."""
    ta, tb = [], []
    for _ in range(reps):
        ta.append(statistics.median(timed(a, inner)))
        tb.append(statistics.median(timed(b, inner)))
    return ta, tb, [x / y for x, y in zip(ta, tb)]


def fmt(ts) -> str:
    ts = sorted(ts)
    unit, k = ("ns", 1e9) if ts[-1] < 1e-5 else ("us", 1e6) if ts[-1] < 0.01 else ("ms", 1e3)
    return f"{statistics.median(ts) * k:9.1f} {unit} [{ts[0] * k:.1f}-{ts[-1] * k:.1f}]"


def row(label: str, value: str, target: str = "") -> None:
    print(f"{label:<64} {value:<40} {target}", flush=True)


def bench_draw(big: int) -> None:
    rng = np.random.default_rng(1)
    bufs = {}
    try:
        for n in (10_000, big):
            bufs[n] = shmbuf.create(SMALL, n, seed=0, priorities=True)
            fill(bufs[n], n, SMALL)
        draws = {n: (lambda f=b.port.finder: _prioritized.draw(f, rng, 50, 50, 0, EXPONENT,
                                                               MAXFRAC))
                 for n, b in bufs.items()}
        for f in draws.values():
            f()
        t_big, t_small, ratio = paired(draws[big], draws[10_000], 15, 20)
        row(f"P1  choose 50 windows (L=50) among {big:.0e} steps", fmt(t_big), "<= 200 us")
        row("P1s the same among 1e+04 steps", fmt(t_small))
        row(f"P1g growth {big:.0e} / 1e+04 (median of paired ratios)",
            f"{statistics.median(ratio):9.2f}x [{min(ratio):.2f}-{max(ratio):.2f}]", "<= 4x")
        b = bufs[big]
        uni = timed(lambda: b.port.finder.draw(rng, 50, 50, 0), 300)
        row(f"P1u uniform draw of 50 windows among {big:.0e} steps (reference)", fmt(uni))
        ids = step_ids(b, b.committed_rows())
        picks = [ids[rng.integers(0, len(ids), 2500)] for _ in range(64)]
        vals = [rng.lognormal(0, 1, 2500).astype(np.float32) for _ in range(64)]
        it = iter(range(10 ** 9))

        def update():
            i = next(it) % 64
            b.update_priorities(picks[i], vals[i])

        update()
        row(f"P3  update_priorities of 2,500 ids among {big:.0e} steps", fmt(timed(update, 300)),
            "<= 300 us")
    finally:
        for b in bufs.values():
            b.close()


def bench_w1_batch(capacity: int) -> None:
    select = _select()
    with shmbuf.create(W1, capacity, seed=0, priorities=True) as buf:
        fill(buf, capacity, W1)
        rng = np.random.default_rng(2)
        uniform = lambda: buf.sample_sequences(50, 50)   # noqa: E731
        if select is not None:
            prio = lambda: buf.sample_sequences(50, 50, select=select)   # noqa: E731
        else:   # before shmbuf.select: the same draw through the sample loop's pieces
            def prio():
                w = _prioritized.draw(buf.port.finder, rng, 50, 50, 0, EXPONENT, MAXFRAC)
                targets = shmbuf.store.reads._prepare_out(None, buf.spec, (50, 50))
                buf._gather(w.rows, np.arange(50), targets, True, 50)
                assert buf.port.finder.still_valid(w).all()
        uniform(), prio()
        tp, tu, ratio = paired(prio, uniform, 40, 3)
        row("P2  Prioritized 50x50 W1 batch", fmt(tp))
        row("P2u uniform 50x50 W1 batch, same run", fmt(tu))
        row("P2r Prioritized / uniform (median of paired ratios)",
            f"{statistics.median(ratio):9.2f}x [{min(ratio):.2f}-{max(ratio):.2f}]", "<= 1.25x")
        bench_torchrl(buf, select, rng)


def bench_add() -> None:
    bufs = [shmbuf.create(SMALL, 1 << 20, seed=0, priorities=p) for p in (True, False)]
    try:
        writers = [b.writer() for b in bufs]
        obs, done = np.zeros(16, np.float32), np.bool_(False)
        blocks = [lambda w=w: [w.add(obs=obs, done=done) for _ in range(20_000)] for w in writers]
        for f in blocks:
            f()
        tp, tn, ratio = paired(blocks[0], blocks[1], 15)
        row("P4  Writer.add per step, priorities=True", fmt([t / 20_000 for t in tp]))
        row("P4n Writer.add per step, priorities=False", fmt([t / 20_000 for t in tn]))
        row("P4r priorities=True / False (median of paired ratios)",
            f"{statistics.median(ratio):9.3f}x [{min(ratio):.3f}-{max(ratio):.3f}]", "<= 1.05x")
        for w in writers:
            w.close()
    finally:
        for b in bufs:
            b.close()


def bench_torchrl(buf, select, rng) -> None:
    """TorchRL's PrioritizedSliceSampler on the same W1 rows, per batch with its update."""
    try:
        import torch
        from tensordict import TensorDict
        from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer
        from torchrl.data.replay_buffers.samplers import PrioritizedSliceSampler

        n = buf.capacity
        sampler = PrioritizedSliceSampler(max_capacity=n, alpha=EXPONENT, beta=0.4,
                                          slice_len=50, traj_key="episode",
                                          strict_length=True)
    except (ImportError, RuntimeError) as exc:   # its C++ segment trees must load
        row("P5  TorchRL PrioritizedSliceSampler", f"unavailable ({type(exc).__name__}: "
            f"{str(exc).split('.')[0][:50]})")
        return
    rows = buf.committed_rows()
    data = {k: torch.from_numpy(np.ascontiguousarray(v[rows])) for k, v in buf.arrays.items()}
    data["episode"] = torch.arange(len(rows)) // EPISODE
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(n), sampler=sampler,
                                batch_size=2500)
    rb.extend(TensorDict(data, batch_size=[len(rows)]))

    def theirs():
        batch = rb.sample()
        rb.update_priority(batch["index"], torch.rand(2500))

    def ours():
        if select is not None:
            batch = buf.sample_sequences(50, 50, select=select, ids=True)
            buf.update_priorities(batch["ids"], rng.random((50, 50)))
        else:
            w = _prioritized.draw(buf.port.finder, rng, 50, 50, 0, EXPONENT, MAXFRAC)
            targets = shmbuf.store.reads._prepare_out(None, buf.spec, (50, 50))
            buf._gather(w.rows, np.arange(50), targets, True, 50)
            buf.update_priorities(step_ids(buf, w.rows), rng.random((50, 50)))

    theirs(), ours()
    tt, to, ratio = paired(theirs, ours, 15, 3)
    row("P5  TorchRL PrioritizedSliceSampler batch + update", fmt(tt))
    row("P5s shmbuf Prioritized batch + update_priorities", fmt(to))
    row("P5r TorchRL / shmbuf (median of paired ratios)",
        f"{statistics.median(ratio):9.2f}x [{min(ratio):.2f}-{max(ratio):.2f}]", ">= 5x")


def bench_cpprb(n: int) -> None:
    try:
        import cpprb
    except ImportError as exc:
        row("P6  cpprb MPPrioritizedReplayBuffer", f"unavailable: {exc}")
        return
    rng = np.random.default_rng(3)
    rb = cpprb.MPPrioritizedReplayBuffer(n, {"obs": {"shape": 16}, "done": {}}, alpha=0.6)
    with shmbuf.create(SMALL, n, seed=0, priorities=True) as buf:
        fill(buf, n, SMALL)
        rows = buf.committed_rows()
        rb.add(obs=buf.arrays["obs"][rows], done=buf.arrays["done"][rows])
        select = _select()

        def theirs():
            b = rb.sample(256, beta=0.4)
            rb.update_priorities(b["indexes"], rng.random(256))

        def ours():
            if select is not None:
                from shmbuf.select import Prioritized
                b = buf.sample_sequences(256, 1, select=Prioritized(exponent=0.6), ids=True)
                ids = b["ids"]
            else:
                w = _prioritized.draw(buf.port.finder, rng, 256, 1, 0, 0.6, MAXFRAC)
                buf.arrays["obs"][w.rows[:, 0]]
                ids = step_ids(buf, w.rows)
            buf.update_priorities(ids, rng.random(ids.shape))

        theirs(), ours()
        tt, to, ratio = paired(theirs, ours, 15, 20)
        row("P6  cpprb MPPrioritizedReplayBuffer 256 rows + update", fmt(tt))
        row("P6s shmbuf Prioritized(0.6) 256 rows + update_priorities", fmt(to))
        row("P6r cpprb / shmbuf (median of paired ratios)",
            f"{statistics.median(ratio):9.2f}x [{min(ratio):.2f}-{max(ratio):.2f}]")


# -- --against REV: this install and a revision's checkout, alternating ---------------------
# Runs in a process whose shmbuf is either side's: only what both have, found by probing
# (the private draw moved between revisions), or the public API.
AGAINST_WORKER = r'''
import json, statistics, sys, time
import numpy as np
import shmbuf
from shmbuf.select import Prioritized

SPEC = {"obs": ((16,), np.uint8), "done": ((), np.bool_)}   # a 17-byte row
EPISODE, EXPONENT, MAXFRAC = 500, 0.8, 0.5

def private_draw():
    for name in ("shmbuf.sampling.prioritized", "shmbuf._prioritized"):
        try:
            return __import__(name, fromlist=["draw"]).draw
        except ImportError:
            pass
    return None

def finder_of(buf):
    port = getattr(buf, "port", None)
    return port.finder if port is not None else getattr(buf, "_finder", None)

def ids_of(buf, rows):
    port = getattr(buf, "port", None)
    if port is not None:
        return port.step_ids(rows)
    ring = buf._ring
    return ring.step_ids(rows) if hasattr(ring, "step_ids") else ring.priorities.ids(rows)

def fill(buf, steps):
    rng = np.random.default_rng(0)
    run = {k: np.zeros((EPISODE,) + s, d) for k, (s, d) in SPEC.items()}
    run["done"][-1] = True
    with buf.writer() as w:
        for _ in range(steps // EPISODE):
            w.extend(**run)
    ids = ids_of(buf, buf.committed_rows())
    for at in range(0, len(ids), 1 << 20):
        part = ids[at:at + (1 << 20)]
        buf.update_priorities(part, rng.lognormal(0, 1, len(part)).astype(np.float32))

sizes = [int(n) for n in sys.argv[1].split(",")]
bufs = {}
try:
    for n in sizes:
        bufs[n] = shmbuf.create(SPEC, n, seed=0, priorities=True)
        fill(bufs[n], n)
    rng, select = np.random.default_rng(1), Prioritized(exponent=EXPONENT, maxfrac=MAXFRAC)
    draw = private_draw()
    calls = {}
    for n, buf in bufs.items():
        finder = finder_of(buf)
        if draw is not None and finder is not None:
            calls[("draw", n)] = (lambda d=draw, f=finder:
                                  d(f, rng, 50, 50, 0, EXPONENT, MAXFRAC))
        calls[("sample", n)] = lambda b=buf: b.sample_sequences(50, 50, select=select)
    for call in calls.values():
        call()
    print(json.dumps({"ready": shmbuf.__file__}), flush=True)
    for line in sys.stdin:
        inner = int(line)
        out = {}
        for (what, n), call in calls.items():
            times = []
            for _ in range(inner):
                t = time.perf_counter()
                call()
                times.append(time.perf_counter() - t)
            out[f"{what} {n:.0e}"] = statistics.median(times)
        print(json.dumps(out), flush=True)
finally:
    for buf in bufs.values():
        buf.close()
'''


def _start_worker(tree: Path, sizes: str):
    env = dict(os.environ, PYTHONPATH=str(tree))
    proc = subprocess.Popen([sys.executable, "-c", AGAINST_WORKER, sizes], env=env,
                            cwd=tempfile.gettempdir(), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    return proc


def _ask(proc, inner: int) -> dict:
    proc.stdin.write(f"{inner}\n")
    proc.stdin.flush()
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError("a worker of --against ended early (its stderr is above)")
    return json.loads(line)


def against(rev: str, big: int, rounds: int = 15, inner: int = 20) -> None:
    """Time the draw in this install and in revision ``rev``'s checkout, alternating."""
    # benchmarks/versus.py builds a revision in place in a temporary worktree.
    from versus import ROOT, build

    this = Path(shmbuf.__file__).resolve().parent.parent
    sizes = f"10000,{big}"
    with tempfile.TemporaryDirectory(prefix="shmbuf-against-") as tmp:
        tree, procs = None, {}
        try:
            tree = build(rev, Path(tmp))
            procs = {"this": _start_worker(this, sizes), rev: _start_worker(tree, sizes)}
            for side, proc in procs.items():
                line = proc.stdout.readline()
                if not line:
                    raise RuntimeError(f"the {side} worker failed to start")
                print(f"{side}: {json.loads(line)['ready']}", flush=True)
            runs: dict = {side: [] for side in procs}
            for r in range(rounds):
                order = list(procs) if r % 2 == 0 else list(procs)[::-1]
                for side in order:
                    runs[side].append(_ask(procs[side], inner))
        finally:
            for proc in procs.values():
                if proc.stdin:
                    proc.stdin.close()
                try:
                    proc.wait(timeout=120)
                except Exception:   # noqa: BLE001 - killed below, whatever went wrong
                    proc.kill()
                    proc.wait(10)
            if tree is not None and tree.parent == Path(tmp):
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                                str(tree)], capture_output=True)
    print(f"Prioritized draw, 50 windows of 50, 17-byte rows: this install against {rev}; "
          f"{rounds} alternating rounds of {inner} calls (median per round)")
    print(f"{'case':<16} {'this':<30} {rev:<30} {'this / ' + rev}")
    mine, theirs = runs["this"], runs[rev]
    for case in mine[0]:
        if case not in theirs[0]:
            print(f"{case:<16} {fmt([m[case] for m in mine]):<30} (not in {rev})")
            continue
        a, b = [m[case] for m in mine], [t[case] for t in theirs]
        ratio = [x / y for x, y in zip(a, b)]
        print(f"{case:<16} {fmt(a):<30} {fmt(b):<30} {statistics.median(ratio):6.2f}x "
              f"[{min(ratio):.2f}-{max(ratio):.2f}]")
    for what in ("draw", "sample"):
        hi, lo = f"{what} {big:.0e}", f"{what} {10_000:.0e}"
        for side, rows in (("this", mine), (rev, theirs)):
            if hi in rows[0]:
                growth = [r[hi] / r[lo] for r in rows]
                print(f"{what} growth {big:.0e} / 1e+04, {side}: "
                      f"{statistics.median(growth):.2f}x [{min(growth):.2f}-{max(growth):.2f}]"
                      "   target <= 4x")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="10^6 steps instead of 10^7")
    ap.add_argument("--against", metavar="REV",
                    help="time the draw of this install against git revision REV, alternating")
    args = ap.parse_args(argv)
    big = 10 ** 6 if args.quick else 10 ** 7
    print(f"load average before: {os.getloadavg()}; shmbuf {shmbuf.__file__}; "
          f"select= {'yes' if _select() is not None else 'no (private draw path)'}")
    if args.against:
        against(args.against, big)
        print(f"load average after: {os.getloadavg()}")
        return
    bench_draw(big)
    bench_add()
    bench_w1_batch(20_000 if args.quick else 100_000)
    bench_cpprb(10 ** 6)
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    sys.exit(main())
