"""``shmbuf.compat.embodied``: DreamerV3's replay contract, shared across processes.

Items are checked against a reference model of upstream's definition: every
``length`` consecutive steps of one worker form an item, the newest
``capacity`` items are live.
"""
import contextlib
import multiprocessing as mp
import os
import pickle
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest
from helpers import embodied_workers as workers
from helpers.procs import join_all, running
from helpers.shm import exists as shm_exists
from helpers.stats import chi2_pvalue
from helpers.stop_workers import Script

import shmbuf
from shmbuf import BufferClosedError, NoFreeWriterSlotError
from shmbuf.compat import _embodied_chunks as chunks
from shmbuf.compat import embodied
from shmbuf.compat.embodied import Fifo, Mixture, Prioritized, Recency, Replay, Uniform

TIMEOUT = 60


@pytest.fixture
def make():
    made = []

    def make(*args, **kw):
        r = Replay(*args, **kw)
        made.append(r)
        return r

    yield make
    for r in made:
        r.close()


def fill(replay, steps: int, workers: int = 1):
    for t in range(steps):
        for w in range(workers):
            replay.add({"step": np.int64(t), "worker": np.int64(w), "is_first": t == 0}, w)


def live_items(steps: int, workers: int, length: int, capacity: int) -> list:
    """Reference: the (worker, first step) of the live items, oldest first (round robin)."""
    order = [(w, t - length + 1) for t in range(steps) for w in range(workers)
             if t >= length - 1]
    return order[-capacity:]


def draw_counts(replay, draws: int, batch: int = 50) -> dict:
    counts: dict = {}
    for _ in range(draws // batch):
        data = replay.sample(batch)
        for w, s in zip(data["worker"][:, 0].tolist(), data["step"][:, 0].tolist()):
            counts[(w, s)] = counts.get((w, s), 0) + 1
    return counts


# -- upstream's behaviours ------------------------------------------------------------
def test_keys_and_shapes(make):
    r = make(5, 10)
    for _ in range(12):
        r.add({"image": np.zeros((8, 8, 3), np.uint8), "action": np.zeros(4, np.float32),
               "log/debug": 1.0})
    data = r.sample(3)
    assert set(data) == {"image", "action", "stepid"}
    assert data["image"].shape == (3, 5, 8, 8, 3) and data["image"].dtype == np.uint8
    assert data["action"].shape == (3, 5, 4)
    assert data["stepid"].shape == (3, 5, 20) and data["stepid"].dtype == np.uint8
    # A stepid is the store's step id (its buffer's tag in it), then 12 zero bytes.
    ids = data["stepid"][..., :8].copy().view(np.int64)[..., 0]
    assert (ids >> 47 == r.buffer.port.id_tag).all() and not data["stepid"][..., 8:].any()


@pytest.mark.parametrize("length,workers,capacity",
                         [(1, 1, 1), (2, 1, 2), (5, 1, 10), (1, 2, 2), (5, 3, 15), (2, 7, 20)])
def test_len_counts_items_as_upstream(make, length, workers, capacity):
    r = make(length, capacity)
    for t in range(20):
        for w in range(workers):
            r.add({"step": t}, w)
        assert len(r) == min(workers * max(0, t + 2 - length), capacity)


@pytest.mark.parametrize("length,workers,capacity,chunksize",
                         [(2, 1, 2, 128), (5, 3, 15, 128), (7, 2, 27, 4), (3, 2, 40, 2)])
def test_samples_are_live_items_across_chunks(make, length, workers, capacity, chunksize):
    r = make(length, capacity, chunksize=chunksize)
    fill(r, 30, workers)
    live = set(live_items(30, workers, length, capacity))
    for _ in range(20):
        data = r.sample(8)
        assert (data["step"] - data["step"][:, :1] == np.arange(length)).all()
        assert (data["worker"] == data["worker"][:, :1]).all()
        for w, s in zip(data["worker"][:, 0].tolist(), data["step"][:, 0].tolist()):
            assert (w, s) in live


def test_items_cross_episodes_and_annotation(make):
    r = make(4, 100)
    flags = [(t % 3 == 0, t % 3 == 2) for t in range(12)]   # episodes of 3 steps
    for t, (first, last) in enumerate(flags):
        r.add({"step": t, "is_first": first, "is_last": last})
    data = r.sample(64)
    for steps, first, last in zip(data["step"], data["is_first"], data["is_last"]):
        want_first = np.array([flags[t][0] for t in steps])
        want_first[0] = True
        assert (first == want_first).all()
        want_last = np.array([flags[t][1] for t in steps])
        want_last[:-1] |= want_first[1:]
        assert (last == want_last).all()


@pytest.mark.parametrize("last_dtype", [np.bool_, np.uint8])
def test_is_last_is_set_before_every_later_is_first_of_an_item(make, last_dtype):
    # No step is stored with is_last: the item's own is_last marks the step before
    # each is_first after its first step, as upstream's (and the flags stored stay).
    r = make(4, 100)
    firsts = [t % 3 == 0 for t in range(12)]
    for t, first in enumerate(firsts):
        r.add({"step": t, "is_first": first, "is_last": last_dtype(t == 7)})
    data, again = r.sample(64), r.sample(64)
    for batch in (data, again):
        assert batch["is_last"].dtype == np.dtype(last_dtype)
        for steps, first, last in zip(batch["step"], batch["is_first"], batch["is_last"]):
            want_first = np.array([firsts[t] for t in steps])
            want_first[0] = True
            assert (first == want_first).all()
            want_last = np.array([t == 7 for t in steps])
            want_last[:-1] |= want_first[1:]
            assert (last.astype(bool) == want_last).all(), (steps, last)


def test_stats_keys_and_reset_on_read(make):
    r = make(3, 50)
    fill(r, 10)
    r.sample(4)
    s = r.stats()
    assert set(s) == {"items", "chunks", "streams", "ram_gb", "inserts", "samples", "updates",
                      "replay_ratio"}
    assert (s["items"], s["inserts"], s["samples"]) == (8, 8, 4)
    assert s["replay_ratio"] == 3 * 4 / 8
    s = r.stats()
    assert (s["inserts"], s["samples"], s["updates"]) == (0, 0, 0)
    assert np.isnan(s["replay_ratio"])


def test_online_serves_each_new_item_first(make):
    r = make(2, 100, online=True)
    fill(r, 7)   # items are queued at stream positions 2, 4, 6 (upstream's rule)
    data = r.sample(3)
    assert data["step"][:, 0].tolist() == [1, 3, 5]
    assert r.sample(200)["step"].shape == (200, 2)   # then the selector's draws


# -- selectors' distributions against upstream's definitions -------------------------
def test_uniform_distribution(make):
    r = make(3, 20, selector=Uniform(seed=1))
    fill(r, 10, workers=2)
    live = live_items(10, 2, 3, 20)
    counts = draw_counts(r, 4000)
    assert set(counts) <= set(live)
    assert chi2_pvalue([counts.get(i, 0) for i in live], np.ones(len(live))) > 1e-4


@pytest.mark.parametrize("items", [12, 40])   # stretched over fewer items than ages, or not
def test_recency_distribution(make, items):
    uprobs = 1.0 / np.arange(1, 21)
    r = make(2, 100, selector=Recency(uprobs, seed=2))
    fill(r, items + 1)
    live = live_items(items + 1, 1, 2, 100)   # oldest first: age = len - 1 - index
    probs = np.zeros(len(live))
    for a, p in enumerate(uprobs / uprobs.sum()):
        age = a * items // len(uprobs) if items < len(uprobs) else a
        probs[len(live) - 1 - age] += p
    counts = draw_counts(r, 4000)
    assert chi2_pvalue([counts.get(i, 0) for i in live], probs) > 1e-4


@pytest.mark.parametrize("exponent,maxfrac", [(1.0, 0.0), (0.5, 0.3)])
def test_prioritized_distribution(make, exponent, maxfrac):
    r = make(3, 100, selector=Prioritized(exponent=exponent, maxfrac=maxfrac, seed=3))
    fill(r, 12)
    prio = np.arange(12, dtype=np.float64) % 4 + 0.5
    data = r.sample(64)
    steps = data["step"]
    r.update({"stepid": data["stepid"], "priority": prio[steps]})
    seen = set(steps[:, 0].tolist())
    live = live_items(12, 1, 3, 100)
    score = []
    for _, s in live:
        p = prio[s:s + 3] ** exponent
        score.append(maxfrac * p.max() + (1 - maxfrac) * p.mean() if s in seen or any(
            t in steps for t in range(s, s + 3)) else np.nan)
    assert not np.isnan(score).any(), "every step got a priority from the 64 draws"
    counts = draw_counts(r, 4000)
    assert chi2_pvalue([counts.get(i, 0) for i in live], score) > 1e-4


@pytest.mark.parametrize("exponent,maxfrac", [(1.0, 0.0), (0.5, 0.3)])
def test_prioritized_never_updated_steps_count_as_initial(make, exponent, maxfrac):
    # Steps 0..5 get priorities (one far above `initial`); steps 6..11 never do, so
    # upstream gives them `initial`, not the largest priority set.
    initial = 2.0
    r = make(3, 100, selector=Prioritized(exponent=exponent, initial=initial,
                                          maxfrac=maxfrac, seed=5))
    fill(r, 12)
    prio = np.array([0.5, 1.0, 8.0, 0.25, 3.0, 1.5] + [initial] * 6)
    data = r.sample(64)
    early = data["step"][:, 0] <= 3   # items wholly within steps 0..5
    assert set(data["step"][early].ravel().tolist()) == set(range(6))
    r.update({"stepid": data["stepid"][early], "priority": prio[data["step"][early]]})
    live = live_items(12, 1, 3, 100)
    score = []
    for _, s in live:
        p = prio[s:s + 3] ** exponent
        score.append(maxfrac * p.max() + (1 - maxfrac) * p.mean())
    counts = draw_counts(r, 4000)
    assert chi2_pvalue([counts.get(i, 0) for i in live], score) > 1e-4


@pytest.mark.parametrize("maxfrac", [0.0, 0.5])
def test_prioritized_initial_inf_draws_new_items_first(make, maxfrac):
    # DreamerV3's config: initial=inf.  While items hold a never-updated step, upstream
    # draws uniformly among them; once every step has a priority, by the finite scores.
    r = make(3, 100, selector=Prioritized(exponent=0.8, initial=float("inf"),
                                          maxfrac=maxfrac, seed=6))
    fill(r, 12)
    prio = np.array([0.5, 1.0, 8.0, 0.25, 3.0, 1.5, 2.0, 0.75, 4.0, 1.0, 0.5, 6.0])
    data = r.sample(64)
    early = data["step"][:, 0] <= 3   # items wholly within steps 0..5
    r.update({"stepid": data["stepid"][early], "priority": prio[data["step"][early]]})
    live = live_items(12, 1, 3, 100)
    fresh = [float(s + 2 >= 6) for _, s in live]   # an item holding a step of 6..11
    counts = draw_counts(r, 2000)
    assert set(counts) <= {i for i, f in zip(live, fresh) if f}
    assert chi2_pvalue([counts.get(i, 0) for i in live if fresh[live.index(i)]],
                       [f for f in fresh if f]) > 1e-4
    every = r.sample(200)    # steps 6..11 get their priorities too: finite scores now
    r.update({"stepid": every["stepid"], "priority": prio[every["step"]]})
    score = []
    for _, s in live:
        p = prio[s:s + 3] ** 0.8
        score.append(maxfrac * p.max() + (1 - maxfrac) * p.mean())
    counts = draw_counts(r, 4000)
    assert chi2_pvalue([counts.get(i, 0) for i in live], score) > 1e-4


def test_prioritized_initial_refuses_nan_and_names_inf():
    with pytest.raises(ValueError, match=r"initial must be a finite number in .* or inf"):
        Prioritized(initial=float("nan"))
    with pytest.raises(ValueError, match="initial must be > 0 or inf"):
        Prioritized(initial=0.0)


def test_mixture_distribution(make):
    uprobs = np.array([1.0, 0.0, 0.0, 0.0])   # always the newest item
    mix = Mixture({"u": Uniform(), "r": Recency(uprobs)}, {"u": 0.5, "r": 0.5}, seed=4)
    r = make(2, 100, selector=mix)
    fill(r, 9)
    live = live_items(9, 1, 2, 100)
    probs = np.full(len(live), 0.5 / len(live))
    probs[-1] += 0.5
    counts = draw_counts(r, 4000)
    assert chi2_pvalue([counts.get(i, 0) for i in live], probs) > 1e-4


def test_fifo_serves_the_oldest_live_item(make):
    r = make(2, 5, selector=Fifo())
    fill(r, 10)
    assert r.sample(4)["step"][:, 0].tolist() == [4] * 4


def test_prioritized_zero_on_sample(make):
    r = make(1, 100, selector=Prioritized(zero_on_sample=True))
    fill(r, 4)
    ids = r._ids(r.sample(1)["stepid"])
    assert r.buffer.priorities_of(ids).tolist() == [[0.0]]
    assert len(draw_counts(r, 20, batch=1)) >= 1   # all zero at last: uniform, as upstream


# -- update: priorities and replay context -------------------------------------------
def test_update_writes_context_into_the_named_steps_only(make):
    r = make(4, 100, spec={"step": ((), np.int64), "deter": ((3,), np.float32)})
    for t in range(20):
        r.add({"step": t, "deter": np.zeros(3, np.float32)})
    data = r.sample(5)
    r.update({"stepid": data["stepid"], "deter": np.full((5, 2, 3), 7, np.float32)})
    written = {int(s) for s in data["step"][:, :2].ravel()}
    assert r.stats()["updates"] == 20
    for _ in range(20):
        d = r.sample(16)
        hit = np.isin(d["step"], list(written))
        assert (d["deter"][hit] == 7).all() and (d["deter"][~hit] == 0).all()


def test_update_skips_evicted_steps(make):
    r = make(2, 4, chunksize=2, streams=1, spec={"step": ((), np.int64),
                                                  "ctx": ((), np.float32)})
    for t in range(6):
        r.add({"step": t, "ctx": 0.0})
    old = r.sample(8)
    for t in range(6, 200):   # every chunk of the first steps is recycled
        r.add({"step": t, "ctx": 0.0})
    r.update({"stepid": old["stepid"], "ctx": np.ones((8, 2), np.float32),
              "priority": np.ones((8, 2))})
    assert not (r.sample(64)["ctx"] != 0).any()


# -- bad inputs: a clear error, nothing written ----------------------------------------
def test_schema_errors_write_nothing(make):
    r = make(2, 10)
    r.add({"step": 0, "image": np.zeros((2, 2), np.uint8)})
    with pytest.raises(KeyError, match="unknown \\['extra'\\]"):
        r.add({"step": 1, "image": np.zeros((2, 2), np.uint8), "extra": 1})
    with pytest.raises(ValueError, match="'image'.*shape"):
        r.add({"step": 1, "image": np.zeros((3, 2), np.uint8)})
    with pytest.raises(TypeError, match="'image'"):
        r.add({"step": 1, "image": np.full((2, 2), 0.5)})
    r.add({"step": 1, "image": np.zeros((2, 2), np.uint8)})
    assert len(r) == 1 and r.sample(1)["step"].tolist() == [[0, 1]]


def test_update_errors_write_nothing(make):
    r = make(2, 10, selector=Prioritized(), spec={"step": ((), np.int64),
                                                  "ctx": ((), np.float32)})
    for t in range(6):
        r.add({"step": t, "ctx": 0.0})
    data = r.sample(3)
    sid = data["stepid"]
    bad = [
        ({"stepid": sid[0]}, ValueError, "stepid must be"),
        ({"stepid": sid.astype(np.int32)}, ValueError, "uint8"),
        ({"stepid": sid, "priority": np.full((3, 2), -1.0)}, ValueError, "-1.0"),
        ({"stepid": sid, "priority": np.full((3, 2), np.nan)}, ValueError, "nan"),
        ({"stepid": sid, "priority": np.ones((3, 2)), "ctx": np.ones((3, 2)),
          "nope": np.ones((3, 2))}, KeyError, "'nope'"),
        ({"stepid": sid, "ctx": np.ones((3, 5))}, ValueError, "ctx"),
        ({"priority": np.ones((3, 2))}, KeyError, "stepid"),
    ]
    for data, exc, match in bad:
        with pytest.raises(exc, match=match):
            r.update(data)
    assert not (r.sample(32)["ctx"] != 0).any()
    assert r.stats()["updates"] == 0


def test_constructor_errors():
    with pytest.raises(ValueError, match="length \\(5\\) must be <= capacity \\(4\\)"):
        Replay(5, 4)
    with pytest.raises(ValueError, match="sum to 1"):
        Mixture({"a": Uniform(), "b": Uniform()}, {"a": 0.5, "b": 0.6})
    with pytest.raises(ValueError, match="same names"):
        Mixture({"a": Uniform()}, {"b": 1.0})
    with pytest.raises(TypeError, match="selector must be"):
        Replay(2, 10, selector=object())
    with pytest.raises(ValueError, match="uprobs\\[1\\] is nan"):
        Recency([1.0, float("nan")])
    with pytest.raises(ValueError, match="maxfrac"):
        Prioritized(maxfrac=1.5)


# -- upstream's chunk directory --------------------------------------------------------
@pytest.mark.parametrize("length,capacity,chunksize,workers",
                         [(3, 10, 5, 1), (5, 100, 12, 1), (3, 30, 5, 3), (1, 1, 1, 1)])
def test_save_writes_upstream_chunks(make, tmp_path, length, capacity, chunksize, workers):
    r = make(length, capacity, directory=tmp_path, chunksize=chunksize)
    fill(r, 30, workers)
    r.save()
    names = [chunks.parse(f) for f in os.listdir(tmp_path)]
    assert all(n is not None for n in names)
    stored = min(capacity // workers + length - 1, 30)
    total = -(-30 // chunksize)
    kept = total - (30 - stored) // chunksize
    assert len(names) == kept * workers
    assert sum(n.length for n in names) == (30 - ((30 - stored) // chunksize) * chunksize) * workers
    for n in names:
        with np.load(tmp_path / n.file) as data:
            assert data["step"].shape == (n.length,)
            assert data["stepid"].shape == (n.length, 20)
    again = make(length, capacity, directory=tmp_path, chunksize=chunksize)
    again.load()
    assert len(again) == len(r)
    saved = sum(n.length for n in names) // workers   # the newest steps of each worker
    want = {(w, t) for w in range(workers) for t in range(30 - saved, 31 - length)}
    for _ in range(5):
        d = again.sample(16)
        assert (d["step"] - d["step"][:, :1] == np.arange(length)).all()
        assert {(w, s) for w, s in zip(d["worker"][:, 0].tolist(),
                                       d["step"][:, 0].tolist())} <= want


def test_save_continues_a_grown_chunk_in_a_new_file(make, tmp_path):
    r = make(2, 100, directory=tmp_path, chunksize=8)
    fill(r, 5)
    r.save()
    fill_more = [r.add({"step": np.int64(t), "worker": np.int64(0), "is_first": False})
                 for t in range(5, 12)]
    assert len(fill_more) == 7
    r.save()
    names = sorted((chunks.parse(f) for f in os.listdir(tmp_path)), key=lambda n: n.file)
    assert [n.length for n in names] == [5, 3, 4]
    assert names[0].succ == names[1].uuid and names[1].succ == names[2].uuid
    again = make(2, 100, directory=tmp_path)
    again.load()
    assert len(again) == 11


def test_load_reads_an_upstream_directory(make, tmp_path):
    """Files written as DreamerV3 writes them (names, stepid, debug ids) load as streams."""
    for stream, lengths in ((1, (4, 4, 2)), (2, (3,))):
        uuids = [str(100 * stream + i) for i in range(len(lengths))] + ["0"]
        step = 0
        for i, n in enumerate(lengths):
            data = {"step": np.arange(step, step + n), "worker": np.full(n, stream),
                    "stepid": chunks.stepids(uuids[i], n)}
            step += n
            name = chunks.file_name(f"20240101T0000{stream}{i}F000000", uuids[i],
                                    uuids[i + 1], n)
            np.savez_compressed(tmp_path / name, **data)
    (tmp_path / "20240101T000099F000000-x-0-3.npz").write_bytes(b"not a zip")
    r = make(3, 100)
    r.load(directory=tmp_path)
    assert len(r) == (10 - 2) + (3 - 2)
    for _ in range(5):
        d = r.sample(16)
        assert (d["step"] - d["step"][:, :1] == np.arange(3)).all()
        assert (d["worker"] == d["worker"][:, :1]).all()


def test_load_amount_takes_the_newest_chunks(make, tmp_path):
    r = make(2, 100, directory=tmp_path, chunksize=4)
    fill(r, 16)
    r.save()
    again = make(2, 100)
    again.load(directory=tmp_path, amount=3)
    assert len(again) == 3   # the newest chunk's 4 steps make 3 items: enough
    assert set(again.sample(32)["step"][:, 0].tolist()) == {12, 13, 14}


# -- shared across processes -------------------------------------------------------------
def _run(ctx, target, args, n: int = 1) -> list:
    queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=args(i, queue)) for i in range(n)]
    with running(procs):
        got = [queue.get(timeout=TIMEOUT) for _ in procs]
        join_all(procs, TIMEOUT, expect=None)
        return got


@pytest.mark.slow
@pytest.mark.parametrize("method", ["spawn", "fork", "forkserver"])
def test_actor_processes_add_directly(make, method):
    r = make(4, 1000, spec={"step": ((), np.int64), "worker": ((), np.int64),
                            "is_first": ((), bool)})
    got = _run(mp.get_context(method), workers.add_steps,
               lambda i, q: (r, i, 30, q), n=3)
    assert sorted(got) == [("ok", 0), ("ok", 1), ("ok", 2)]
    assert len(r) == 3 * 27
    data = r.sample(64)
    assert (data["step"] - data["step"][:, :1] == np.arange(4)).all()
    assert set(data["worker"][:, 0].tolist()) <= {0, 1, 2}


@pytest.mark.slow
def test_first_add_in_a_child_fixes_the_schema(make):
    r = make(3, 100)   # no spec: nothing exists until the first add
    ctx = mp.get_context("spawn")
    assert _run(ctx, workers.add_steps, lambda i, q: (r, 5, 10, q)) == [("ok", 5)]
    assert len(r) == 8
    (status, message), = _run(ctx, workers.add_other_shape, lambda i, q: (r, q))
    assert status == "error" and "ValueError" in message and "'step'" in message
    with pytest.raises(ValueError, match="'step'.*shape"):
        r.add({"step": np.zeros(3, np.int64), "worker": np.int64(0), "is_first": False})
    assert len(r) == 8


@pytest.mark.slow
def test_second_process_samples_the_same_items(make):
    r = make(3, 100)
    fill(r, 10, workers=2)
    (status, seen), = _run(mp.get_context("spawn"), workers.sample_steps,
                           lambda i, q: (r, 20, q))
    assert status == "ok"
    live = set(live_items(10, 2, 3, 100))
    assert {(w, s[0]) for w, s in seen} <= live
    assert all(s == list(range(s[0], s[0] + 3)) for _, s in seen)


def test_pickles_to_its_name(make):
    r = make(2, 10, selector=Recency(np.ones(4)))
    fill(r, 5)
    blob = pickle.dumps(r)
    assert len(blob) < 2000 and r.shm_name.encode() in blob
    other = pickle.loads(blob)
    try:
        assert len(other) == len(r) == 4
        assert isinstance(other.selector, Recency)
    finally:
        other.close()
    assert embodied.Replay is Replay


@pytest.mark.slow
def test_sigterm_removes_a_segment_an_actor_created():
    """The constructing process answers for the segment, even when an actor made it."""
    owner = Script("""
        import json, multiprocessing as mp, sys
        from shmbuf.compat.embodied import Replay
        from helpers.embodied_workers import add_steps
        if __name__ == "__main__":
            ctx = mp.get_context("spawn")
            r, q = Replay(3, 100), ctx.Queue()
            p = ctx.Process(target=add_steps, args=(r, 0, 10, q))
            p.start()
            status = q.get(timeout=60)[0]
            p.join(60)
            print(json.dumps({"name": r.shm_name, "status": status, "len": len(r)}), flush=True)
            sys.stdin.readline()
    """, stdin=subprocess.PIPE)
    try:
        info = owner.json()
        assert (info["status"], info["len"]) == ("ok", 8)
        assert shm_exists(info["name"])
        owner.signal(signal.SIGTERM)
        assert owner.wait() == -signal.SIGTERM
        assert not shm_exists(info["name"])
    finally:
        owner.close()


def test_attach_by_name(make):
    r = make(2, 10, spec={"step": ((), np.int64)})
    for t in range(5):
        r.add({"step": t})
    plain = shmbuf.attach(r.shm_name)   # the registry knows the facade
    try:
        assert isinstance(plain, Replay) and len(plain) == 4
    finally:
        plain.close()
    other = Replay.attach(r.shm_name)
    try:
        assert len(other) == 4 and other.length == 2 and other.capacity == 10
        assert (np.diff(other.sample(8)["step"], axis=1) == 1).all()
        other.add({"step": 100}, worker=9)   # its own stream
        assert len(r) == 4
    finally:
        other.close()


@pytest.mark.slow
def test_sigkilled_actors_leave_consistent_items_and_their_slots(make):
    r = make(4, 2000, streams=2, spec={"step": ((), np.int64), "worker": ((), np.int64),
                                       "is_first": ((), bool)})
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=workers.add_forever, args=(r, w, queue)) for w in range(2)]
    with running(procs):
        assert sorted(queue.get(timeout=TIMEOUT)[1] for _ in procs) == [0, 1]
        for p in procs:   # the actors die mid-add: what the test is about
            p.kill()
        join_all(procs, TIMEOUT, expect=-signal.SIGKILL)
        for _ in range(20):
            data = r.sample(16)
            assert (data["step"] - data["step"][:, :1] == np.arange(4)).all()
            assert (data["worker"] == data["worker"][:, :1]).all()
        # The dead actors' writer slots are free again: two new actors add.
        got = _run(ctx, workers.add_steps, lambda i, q: (r, 10 + i, 6, q), n=2)
        assert sorted(got) == [("ok", 10), ("ok", 11)]


@pytest.mark.slow
def test_actors_racing_to_the_first_add_share_one_schema(make):
    r = make(4, 1000)   # no spec: the first add in any of them makes the store
    got = _run(mp.get_context("fork"), workers.add_steps, lambda i, q: (r, i, 20, q), n=3)
    assert sorted(got) == [("ok", 0), ("ok", 1), ("ok", 2)]
    assert len(r) == 3 * 17
    assert set(r.sample(64)["worker"][:, 0].tolist()) <= {0, 1, 2}


@pytest.mark.slow
def test_online_queue_takes_items_other_processes_add(make):
    r = make(2, 100, online=True)
    assert _run(mp.get_context("fork"), workers.add_steps, lambda i, q: (r, 3, 7, q)) == \
        [("ok", 3)]
    assert r.stats()["inserts"] == 6   # counted by the constructing handle too
    assert r.sample(3)["step"][:, 0].tolist() == [1, 3, 5]
    assert r.sample(50, mode="report")["step"].shape == (50, 2)   # report: no queue


@pytest.mark.slow
def test_dataloader_workers_sample_the_replay(make):
    """Forked workers (spawned ones take seconds to import torch; pickling is covered
    by the spawned actors above)."""
    import torch
    from helpers.embodied_dataset import Batches
    from torch.utils.data import DataLoader

    r = make(3, 100)
    fill(r, 20)
    loader = DataLoader(Batches(r, 3), batch_size=None, num_workers=2,
                        multiprocessing_context="fork", timeout=TIMEOUT)
    got = [batch for batch in loader]
    assert len(got) == 6 and all(isinstance(b, torch.Tensor) for b in got)
    for b in got:
        assert (b - b[:, :1] == torch.arange(3)).all() and int(b.min()) >= 0


def test_no_store_is_made_once_the_constructing_process_ended():
    code = ("import pickle, sys; from shmbuf.compat.embodied import Replay; "
            "sys.stdout.buffer.write(pickle.dumps(Replay(2, 10)))")
    blob = subprocess.run([sys.executable, "-c", code], capture_output=True, check=True,
                          timeout=TIMEOUT).stdout
    orphan = pickle.loads(blob)
    try:
        with pytest.raises(BufferClosedError, match="has ended"):
            orphan.add({"step": 0})
        assert not shm_exists(orphan.shm_name)
    finally:
        orphan.close()


def test_more_workers_than_streams_is_a_clear_error(make):
    r = make(2, 10, streams=2)
    r.add({"step": 0}, worker="a")
    r.add({"step": 0}, worker="b")
    with pytest.raises(NoFreeWriterSlotError, match="streams=2|2 workers"):
        r.add({"step": 0}, worker="c")
    assert r.stats()["streams"] == 2


def test_a_stopped_buffer_refuses_adds_and_counts_no_item(make):
    r = make(2, 100)
    fill(r, 5)
    held, steps = len(r), r.buffer.stats().steps_written
    r.buffer.stop_writers()
    for _ in range(3):
        with pytest.raises(shmbuf.WritersStoppedError):
            r.add({"step": np.int64(9), "worker": np.int64(0), "is_first": False})
    assert len(r) == held and r.buffer.stats().steps_written == steps
    r.buffer.resume_writers()
    r.add({"step": np.int64(9), "worker": np.int64(0), "is_first": False})
    assert len(r) == held + 1


def test_save_of_compressed_chunks_writes_the_frames_a_raw_replay_writes(make, tmp_path):
    """Chunks compressed in shared memory are decoded into the upstream files (through the
    store's packed read at each chunk's seq now), byte for byte what a raw replay saves."""
    saved = []
    for i, compress in enumerate((None, shmbuf.Compress(["image"], hot_steps=8))):
        directory = tmp_path / str(i)
        r = make(4, 200, directory=directory, chunksize=16, compress=compress)
        for t in range(120):
            image = np.full((16, 16, 3), t % 251, np.uint8)
            image[0, 0, 0] = 7
            r.add({"image": image, "step": np.int64(t), "is_first": t == 0}, 0)
        if compress is not None:
            assert r.buffer.compact() > 0
            assert r.buffer.stats().compression.compressed_chunks > 0
        r.save()
        frames = {}
        for f in os.listdir(directory):
            with np.load(directory / f) as data:
                frames.update(zip(data["step"].tolist(), data["image"].copy()))
        saved.append(frames)
    raw, packed = saved
    assert sorted(raw) == sorted(packed) == list(range(120))
    assert all((raw[s] == packed[s]).all() for s in raw)


class _Lines:
    """A stdout that keeps what is printed and sets ``ready`` at the ``wanted``-th line."""

    def __init__(self, wanted: int):
        self.lines: list[str] = []
        self.wanted = wanted
        self.ready = threading.Event()

    def write(self, text: str) -> int:
        self.lines.extend(line for line in text.splitlines() if line)
        if len(self.lines) >= self.wanted:
            self.ready.set()
        return len(text)

    def flush(self) -> None:
        pass


def test_an_empty_sample_says_what_it_waits_for_then_repeats(make, monkeypatch):
    monkeypatch.setattr(embodied, "WAIT_NOTICE_FIRST", 0.05)   # 5 s as shipped
    monkeypatch.setattr(embodied, "WAIT_NOTICE_EVERY", 0.05)   # 60 s as shipped
    r = make(3, 100, name="actors")
    out = _Lines(wanted=2)

    def add_after_two_notices():
        out.ready.wait(TIMEOUT)      # the steps come either way: sample() never hangs
        fill(r, 3)

    adder = threading.Thread(target=add_after_two_notices)
    with contextlib.redirect_stdout(out):
        adder.start()
        try:
            data = r.sample(2)
        finally:
            adder.join(TIMEOUT)
    assert out.ready.is_set() and not adder.is_alive()
    assert data["step"].tolist() == [[0, 1, 2], [0, 1, 2]]
    first, second = out.lines[:2]
    assert first.startswith("Replay buffer actors is empty, waited ")
    assert "its first item, 3 consecutive steps" in first and "no step was added" in first
    assert second.startswith("Replay buffer actors is empty, waited ")
    quiet = _Lines(wanted=1)
    with contextlib.redirect_stdout(quiet):
        r.sample(2)                  # items held: no word
    assert quiet.lines == []
