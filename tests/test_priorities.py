"""Shared priorities: ids, update_priorities, the prioritized draw, checkpoints, kills."""
import multiprocessing as mp
import os
import signal

import numpy as np
import pytest
import torch
from helpers.priority_workers import draw_starts, update_forever, update_rounds
from helpers.procs import running
from helpers.stats import chi2_pvalue

import shmbuf
from shmbuf._errors import NotEnoughDataError
from shmbuf.protocol.layout import TREE_EXPONENTS
from shmbuf.sampling import prioritized as _prioritized
from shmbuf.select import Prioritized

SPEC = {"x": ((), np.float32), "done": ((), np.bool_)}
EPISODE = 37   # steps per episode: windows may not cross its ends
P_MIN = 1e-3   # fixed seeds: a pass is reproducible, and a near miss of the score fails below it


def filled(capacity=1024, steps=900, chunk_size=64, **kw):
    buf = shmbuf.create(SPEC, capacity, chunk_size=chunk_size, priorities=True, seed=1, **kw)
    with buf.writer() as w:
        for i in range(steps):
            w.add(x=np.float32(i), done=np.bool_(i % EPISODE == EPISODE - 1))
    return buf


def all_ids(buf):
    return buf.port.step_ids(buf.committed_rows())


def scores(buf, length, exponent, maxfrac, dreamer_order=False, default=None):
    """Every valid start (as its step's x, ascending) and its score, computed here.

    Independent of the library's window finder: the test buffers hold steps
    x = 0, 1, ... from one writer, in episodes of EPISODE steps, so a window
    is valid where its steps are all held and in one episode.  Priorities are
    read through the public ``priorities_of``.  ``dreamer_order``: DreamerV3's
    score (each step's priority raised to the exponent, then mixed) instead
    of shmbuf's (the mix raised to the exponent).  ``default``: the priority of a
    step never set (None: what ``priorities_of`` reads, the largest ever set).
    """
    rows = buf.committed_rows()
    x = buf.arrays["x"][rows].astype(np.int64)
    held = np.zeros(int(x.max()) + 1, bool)
    held[x] = True
    p = np.zeros(len(held))
    p[x] = buf.priorities_of(buf.port.step_ids(rows))
    if default is not None:
        p[x[~buf._ring.priorities.values(rows)[1]]] = default
    first = np.arange(len(held) - length + 1)
    window = first[:, None] + np.arange(length)
    valid = held[window].all(1) & (first // EPISODE == (first + length - 1) // EPISODE)
    w = p[window[valid]]
    if dreamer_order:
        score = maxfrac * (w ** exponent).max(1) + (1 - maxfrac) * (w ** exponent).mean(1)
    else:
        score = (maxfrac * w.max(1) + (1 - maxfrac) * w.mean(1)) ** exponent
    return first[valid], score


def draws(buf, calls, n, length, exponent, maxfrac, seed):
    """The first steps (x) of ``calls * n`` windows sampled with select=Prioritized."""
    sel = Prioritized(exponent=exponent, maxfrac=maxfrac)
    return np.concatenate([buf.sample_sequences(n, length, select=sel, rng=seed + i)["x"][0]
                           for i in range(calls)])


def law(buf, length, exponent, maxfrac, dreamer_order=False, default=None) -> np.ndarray:
    """P(start x) for every x up to the last valid start, under a score."""
    starts, score = scores(buf, length, exponent, maxfrac, dreamer_order, default)
    probs = np.zeros(int(starts.max()) + 1)
    probs[starts] = score
    return probs / probs.sum()


def fit(drawn, probs, against=None, groups=6) -> float:
    """Pearson's chi-squared p-value of the drawn starts under ``probs``.

    Start by start; or, given another law ``against``, over ``groups`` groups
    of starts of equal mass under ``probs`` ordered by ``against / probs``:
    the grouping that shows best whether the draws lean towards ``against``
    (it depends on the two laws only, never on the draws).
    """
    drawn = drawn.astype(np.int64)
    if drawn.max() >= len(probs):
        return 0.0
    counts = np.bincount(drawn, minlength=len(probs))
    if against is None:
        return chi2_pvalue(counts, probs)
    on = np.flatnonzero(probs > 0)
    order = on[np.argsort(against[on] / probs[on], kind="stable")]
    mass = np.cumsum(probs[order]) - probs[order] / 2
    group = np.minimum((mass * groups).astype(np.int64), groups - 1)
    observed = np.bincount(group, weights=counts[order], minlength=groups)
    expected = np.bincount(group, weights=probs[order], minlength=groups)
    return 0.0 if counts[probs == 0].any() else chi2_pvalue(observed, expected)


def check_follows(buf, drawn, length, exponent, maxfrac):
    """The draws fit shmbuf's score and none of its near misses: maxfrac off by 0.1 either
    way (0.1 / exponent under an exponent below 1, which flattens the difference), the
    exponent off by 0.1, and (for an exponent other than 1, where they differ) DreamerV3's
    order of operations."""
    starts, _ = scores(buf, length, exponent, maxfrac)
    assert np.isin(drawn, starts).all(), "drew a start that cannot begin a window"
    truth = law(buf, length, exponent, maxfrac)
    assert fit(drawn, truth) > P_MIN
    step = max(0.1, 0.1 / exponent)
    misses = [(exponent, m, False) for m in (maxfrac - step, maxfrac + step) if 0 <= m <= 1]
    misses += [(exponent - 0.1, maxfrac, False), (exponent + 0.1, maxfrac, False)]
    if exponent != 1.0:
        misses.append((exponent, maxfrac, True))
    for e, m, dreamer in misses:
        other = law(buf, length, e, m, dreamer)[:len(truth)]
        assert fit(drawn, truth, against=other) > P_MIN, (e, m, dreamer)
        assert fit(drawn, other, against=truth) < P_MIN, (e, m, dreamer)


def set_random(buf, seed=0, frac=1.0):
    """Random priorities on a fraction of the held steps (the rest keep the default).

    Episodes alternate between two kinds of equal total score: flat ones
    (every step about 11) and spiky ones (20 on every 8th step, 0.01
    between), times a factor per episode (e^-1 to e^1) and a little jitter
    per step.  A window of 8 or more steps in a spiky episode has a max about
    8 times its mean, one in a flat episode a max about equal to it, so the
    share of max and mean (maxfrac), the exponent and the order of the two
    each move mass between the kinds by an amount that 40,000 draws show.
    """
    rng = np.random.default_rng(seed)
    rows = buf.committed_rows()
    ids = buf.port.step_ids(rows)
    x = buf.arrays["x"][rows].astype(np.int64)
    episode = x // EPISODE
    spiky = np.where(x % 8 == 0, 20.0, 0.01)
    value = np.where(episode % 2 == 0, 11.0, spiky) \
        * np.exp(rng.uniform(-1, 1, int(episode.max()) + 1))[episode] \
        * rng.lognormal(0, 0.1, len(rows))
    some = rng.random(len(ids)) < frac
    buf.update_priorities(ids[some], value[some].astype(np.float32))


# -- ids and update_priorities ------------------------------------------------------------
def test_ids_name_the_sampled_steps_in_the_batch_layout():
    with filled() as buf:
        for time_major in (True, False):
            batch = buf.sample_sequences(6, 5, ids=True, time_major=time_major, rng=3)
            assert batch["ids"].dtype == np.int64 and batch["ids"].shape == batch["x"].shape
            rows = buf.committed_rows()
            by_id = dict(zip(all_ids(buf).tolist(), buf.arrays["x"][rows].tolist()))
            assert [by_id[i] for i in batch["ids"].ravel()] == batch["x"].ravel().tolist()
        out = {"x": np.empty((5, 6), np.float32), "done": np.empty((5, 6), bool),
               "ids": np.empty((5, 6), np.int64)}
        assert buf.sample_sequences(6, 5, ids=True, out=out)["ids"] is out["ids"]
        assert (buf.priorities_of(out["ids"]) == 1.0).all()


def test_default_is_the_largest_ever_and_stale_ids_never_come_back():
    with filled(capacity=256, steps=200, chunk_size=16) as buf:
        ids = all_ids(buf)
        assert (buf.priorities_of(ids) == 1.0).all()           # before any update: 1.0
        assert buf.update_priorities(ids[:3], np.array([0.5, 0.25, 0.125])) == 3
        assert (buf.priorities_of(ids[3:]) == 0.5).all()       # the largest ever set
        assert buf.update_priorities(ids[:1], np.float32([0.0]).repeat(1)) == 1
        assert buf.priorities_of(ids[:2]).tolist() == [0.0, 0.25]
        with buf.writer() as w:                                # recycle every chunk
            for i in range(400):
                w.add(x=np.float32(i), done=np.bool_(False))
        assert np.isnan(buf.priorities_of(ids)).all()
        assert buf.update_priorities(ids, np.ones(len(ids), np.float32)) == 0
        new = all_ids(buf)
        assert not np.isin(new, ids).any() and new.min() > ids.max()
        assert (buf.priorities_of(new) == 0.5).all()           # fresh steps: largest ever


def test_priorities_are_shared_with_attached_processes():
    with filled() as buf:
        other = shmbuf.attach(buf.name)
        try:
            ids = all_ids(buf)[:10]
            assert other.update_priorities(ids, np.arange(10, dtype=np.float64)) == 10
            assert buf.priorities_of(ids).tolist() == list(range(10))
        finally:
            other.close()


def test_bad_input_is_refused_and_nothing_is_written():
    with shmbuf.create(SPEC, 256, chunk_size=16) as plain:
        plain.writer().add(x=np.float32(0), done=np.bool_(False))
        for call in (lambda: plain.sample_sequences(1, 1, ids=True),
                     lambda: plain.update_priorities(np.zeros(1, np.int64), np.ones(1)),
                     lambda: plain.sample_sequences(1, 1, select=Prioritized())):
            with pytest.raises(ValueError, match="priorities=True"):
                call()
    with filled() as buf:
        ids = all_ids(buf)[:4]
        before = buf.priorities_of(all_ids(buf))
        with pytest.raises(TypeError, match="int64"):
            buf.update_priorities(ids.astype(np.int32), np.ones(4))
        with pytest.raises(TypeError, match="floats"):
            buf.update_priorities(ids, np.ones(4, np.int64))
        with pytest.raises(ValueError, match=r"shape \(3,\).*\(4,\)"):
            buf.update_priorities(ids, np.ones(3))
        for bad, at in ((np.nan, 2), (np.inf, 1), (-1.0, 3), (1e39, 0)):
            vals = np.ones(4)
            vals[at] = bad
            with pytest.raises(ValueError, match=rf"priorities\[{at}\] is .*nothing was updated"):
                buf.update_priorities(ids, vals)
        with pytest.raises(ValueError, match=r"ids\[1\] is -5"):
            buf.update_priorities(np.array([ids[0], -5]), np.ones(2))
        with pytest.raises(TypeError, match="ids must be True or False"):
            buf.sample_sequences(2, 2, ids=1)
        assert np.array_equal(buf.priorities_of(all_ids(buf)), before)
        assert buf._ring.priorities.largest_set() is None
        with pytest.raises(TypeError, match="priorities must be True or False"):
            shmbuf.create(SPEC, 64, priorities=1)


def test_torch_tensors_update_like_arrays():
    with filled() as buf:
        batch = buf.sample_sequences(4, 3, ids=True)
        ids = torch.from_numpy(batch["ids"])
        assert buf.update_priorities(ids, torch.full(ids.shape, 2.0)) == ids.numel()
        assert (buf.priorities_of(batch["ids"]) == 2.0).all()


# -- the draw -------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("exponent,maxfrac", [(0.8, 0.5), (0.6, 0.5), (1.0, 1.0), (2.0, 0.0),
                                              (0.3, 0.5)])
def test_prioritized_draws_follow_the_score(exponent, maxfrac):
    with filled() as buf:
        set_random(buf)
        check_follows(buf, draws(buf, 40, 2000, 8, exponent, maxfrac, 7), 8, exponent, maxfrac)
        assert buf._ring.priorities.stale_nodes() == (0, 0)


@pytest.mark.parametrize("tree", [-1, 0, 1])
def test_acceptance_stops_at_enough_with_the_picks_scoring_every_window_makes(tree):
    # The draw's acceptance scores windows in order and stops once it has `need`: what it
    # picks is what scoring them all (score_ratio) and keeping the first `need` picks.
    with filled() as buf:
        set_random(buf, frac=0.7)
        finder = buf.port.finder
        pri = finder.ring.priorities
        rng = np.random.default_rng(3)
        w = finder.locate(rng.integers(0, 900, 400), 8, 0, 400)
        top = pri.largest()
        _, ratio = pri.score_ratio(w.rows, 0.8, 0.5, top, tree)
        for need in (0, 1, 5, 40, 400):
            u = rng.random(len(w.rows))
            every = np.flatnonzero(u < ratio)
            picked, scored = pri.accept(w.rows, u, need, 0.8, 0.5, top, tree)
            assert picked.tolist() == every[:need].tolist()
            # Stopped right after the last pick it needed, else it scored them all.
            assert scored == (every[need - 1] + 1 if 0 < need <= len(every)
                              else 0 if need == 0 else len(w.rows))
        with pytest.raises(ValueError, match="accept: arguments do not fit"):
            pri.accept(w.rows, u[:-1], 5, 0.8, 0.5, top, tree)
        for bad in (buf.capacity, -1, 1 << 50):   # refused, and never read
            rows = np.full((40, 8), bad)
            with pytest.raises(ValueError, match="accept: row out of range"):
                pri.accept(rows, u[:40], 1, 0.8, 0.5, top, tree)
            with pytest.raises(ValueError, match="score_ratio: row out of range"):
                pri.score_ratio(rows, 0.8, 0.5, top, tree)


@pytest.mark.slow
def test_windows_longer_than_a_block_walk_back_across_chunks():
    # 16-row chunks and blocks, windows of 24: proposals step back over a chunk's link.
    with filled(capacity=512, steps=500, chunk_size=16) as buf:
        set_random(buf, seed=2)
        check_follows(buf, draws(buf, 10, 2000, 24, 0.8, 0.5, 8), 24, 0.8, 0.5)


@pytest.mark.slow
def test_prioritized_draws_spread_over_processes_follow_the_score():
    with filled() as buf:
        set_random(buf, seed=4)
        ctx = mp.get_context("spawn")
        procs, conns = [], []
        with running(procs, timeout=30):
            for seed in range(3):
                mine, theirs = ctx.Pipe()
                procs.append(ctx.Process(target=draw_starts, args=(
                    buf.name, 100 + seed, 8, 2000, 8, 0.8, 0.5, theirs)))
                procs[-1].start()
                conns.append(mine)
            drawn = []
            for c in conns:
                assert c.poll(120), "a drawing child did not answer"
                drawn.append(c.recv())
            check_follows(buf, np.concatenate(drawn), 8, 0.8, 0.5)


@pytest.mark.slow
@pytest.mark.parametrize("exponent,default", [(0.8, 2.0), (0.3, 0.5), (1.0, 2000.0), (0.8, 0.0)])
def test_a_default_priority_scores_the_steps_never_set(exponent, default):
    # Half the steps are set (largest about 54); the rest count as `default`, below the
    # largest, far above it (the bound of every proposal rises to it) or 0; exponent 0.3
    # proposes uniformly.
    with filled() as buf:
        set_random(buf, seed=6, frac=0.5)
        sel = Prioritized(exponent=exponent, maxfrac=0.5, default=default)
        drawn = np.concatenate([buf.sample_sequences(2000, 8, select=sel, rng=20 + i)["x"][0]
                                for i in range(20)])
        truth = law(buf, 8, exponent, 0.5, default=default)
        assert fit(drawn, truth) > P_MIN
        running = law(buf, 8, exponent, 0.5)   # today's rule: fresh steps are the largest
        assert fit(drawn, running) < P_MIN
        _, score = scores(buf, 8, exponent, 0.5, default=default)
        got = _prioritized.total(buf, 8, 0, exponent, 0.5, np.random.default_rng(0),
                                 default=default)
        assert got == pytest.approx(score.sum(), rel=1e-9)


def test_total_is_the_sum_of_scores_and_zero_scores_are_never_drawn():
    with filled() as buf:
        set_random(buf, seed=5)
        _, score = scores(buf, 8, 0.8, 0.5)
        got = _prioritized.total(buf, 8, 0, 0.8, 0.5, np.random.default_rng(0))
        assert got == pytest.approx(score.sum(), rel=1e-9)
        est = _prioritized.total(buf, 8, 0, 0.8, 0.5, np.random.default_rng(0), probes=512)
        assert est == pytest.approx(score.sum(), rel=0.1)
        buf.update_priorities(all_ids(buf), np.zeros(len(buf), np.float32))
        with pytest.raises(NotEnoughDataError, match="positive priority score"):
            buf.sample_sequences(5, 8, select=Prioritized())


# -- checkpoints and adoption ---------------------------------------------------------------
def _table(buf):
    rows = buf.committed_rows()
    x = buf.arrays["x"][rows]
    value, explicit = buf._ring.priorities.values(rows)
    order = np.argsort(x)
    return x[order], value[order], explicit[order]


@pytest.mark.parametrize("how", ["snapshot", "state_dict", "save"])
def test_checkpoints_keep_priorities(how, tmp_path):
    with filled() as buf:
        set_random(buf, seed=6, frac=0.3)
        if how == "save":
            buf.save(tmp_path / "s")
            back = shmbuf.load(tmp_path / "s")
        else:
            back = shmbuf.create(SPEC, 1024, chunk_size=64, priorities=True)
            if how == "snapshot":
                back.restore(buf.snapshot())
            else:
                torch.save(buf.state_dict(), tmp_path / "s.pt")
                back.load_state_dict(torch.load(tmp_path / "s.pt", weights_only=True))
        with back:
            for a, b in zip(_table(buf), _table(back)):
                assert np.array_equal(a, b)
            assert back._ring.priorities.largest() == buf._ring.priorities.largest()
            assert back._ring.priorities.stale_nodes() == (0, 0)


# -- kills ------------------------------------------------------------------------------------
def bounds_hold(buf, set_only=False):
    """No leaf bounds a set priority of its block from below, and nothing is NaN or < 0.

    ``set_only``: look only at rows set explicitly (while others update: a row never
    set reads as the largest-ever priority, which may move between the two reads).
    Rows are read before the bounds, and a row is written only under a bound.
    """
    pri = buf._ring.priorities
    rows = buf.committed_rows()
    value, explicit = pri.values(rows)
    if set_only:
        rows, value = rows[explicit], value[explicit]
    assert np.isfinite(value).all() and (value >= 0).all()
    k, block = buf.chunk_size, pri.block
    leaf = (rows // k) * -(-k // block) + (rows % k) // block
    for tree, exponent in enumerate(TREE_EXPONENTS):
        bound = pri.leaf_bounds(tree)[leaf] * (1 + 1e-6)
        assert (bound >= value.astype(np.float64) ** exponent).all()


@pytest.mark.slow
def test_two_processes_updating_the_same_blocks_at_once_lose_nothing():
    """Two updaters at once (their calls overlap for tens of milliseconds) on every
    other step of the same two blocks: while they run and after each round every bound
    covers its set rows, and at the end each one's last values stand and the trees
    agree with the blocks unrepaired.  A raise lost to the other's is healed by the next
    raise, so such a race shows only if the parent looks in between."""
    rounds = 8
    with filled(capacity=256, steps=128, chunk_size=64) as buf:
        ids = all_ids(buf)
        halves = [ids[0::2], ids[1::2]]
        finals = [np.random.default_rng(i).uniform(0, 1000, len(h)).astype(np.float32)
                  for i, h in enumerate(halves)]
        ctx = mp.get_context("spawn")
        start = ctx.Barrier(3)
        procs, conns = [], []
        try:
            with running(procs, timeout=30):
                for i, (half, final) in enumerate(zip(halves, finals)):
                    mine, theirs = ctx.Pipe()
                    procs.append(ctx.Process(target=update_rounds, args=(
                        buf.name, half, 20 + i, rounds, final, start, theirs)))
                    procs[-1].start()
                    conns.append(mine)
                for r in range(rounds + 1):
                    if r < rounds:
                        start.wait(60)
                    while not all(c.poll(0) for c in conns):   # while they update
                        bounds_hold(buf, set_only=True)
                        assert all(p.is_alive() for p in procs), "an updater died"
                    for c in conns:
                        assert c.recv() == r
                    bounds_hold(buf)
        finally:
            start.abort()
        for half, final in zip(halves, finals):
            assert np.array_equal(buf.priorities_of(half), final)
        assert buf._ring.priorities.stale_nodes() == (0, 0)


@pytest.mark.slow
def test_sigkill_during_updates_leaves_priorities_usable():
    rng = np.random.default_rng(11)
    ctx = mp.get_context("spawn")
    with filled(capacity=4096, steps=4000, chunk_size=64) as buf, buf.writer() as w:
        step = 0
        for round_ in range(12):
            ids = all_ids(buf)
            mine, theirs = ctx.Pipe()
            p = ctx.Process(target=update_forever, args=(buf.name, ids, round_, theirs))
            with running([p], timeout=30):
                for _ in range(int(rng.integers(1, 4))):
                    assert mine.poll(60), "the updater did not start"
                    mine.recv_bytes()
                os.kill(p.pid, signal.SIGKILL)   # most likely in the middle of a call
            assert p.exitcode == -signal.SIGKILL
            bounds_hold(buf)
            batch = buf.sample_sequences(8, 4, ids=True)
            assert buf.update_priorities(batch["ids"], np.full(batch["ids"].shape, 0.5)) == 32
            buf.sample_sequences(50, 8, select=Prioritized(), rng=round_)
            for _ in range(300):   # writers keep recycling chunks between kills
                w.add(x=np.float32(step), done=np.bool_(step % EPISODE == EPISODE - 1))
                step += 1
        bounds_hold(buf)
        buf._ring.priorities.repair()
        assert buf._ring.priorities.stale_nodes() == (0, 0)


PRIORITY_OWNER = """
    import numpy as np, time, shmbuf
    buf = shmbuf.create({{"x": ((), np.float32)}}, 256, chunk_size=16, priorities=True,
                        done_key=None, name={name!r})
    w = buf.writer()
    for i in range(200):
        w.add(x=np.float32(i))
    ids = buf.sample_sequences(1, 200, ids=True)["ids"][:, 0]
    buf.update_priorities(ids, np.arange(200, dtype=np.float32) / 8)
    print(buf.name, flush=True)
    while True:
        time.sleep(1)
"""


@pytest.mark.slow
def test_an_adopter_keeps_the_priorities():
    from helpers.adopters import dead_owner

    name = dead_owner(PRIORITY_OWNER, "prio")
    with shmbuf.attach(name, own=True) as buf:
        rows = buf.committed_rows()
        x = buf.arrays["x"][rows]
        assert np.array_equal(buf._ring.priorities.values(rows)[0], x / 8)
        assert buf._ring.priorities.largest() == 199 / 8
        assert buf._ring.priorities.stale_nodes() == (0, 0)
