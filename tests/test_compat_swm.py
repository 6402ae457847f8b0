"""shmbuf.compat.swm.ReplayBuffer: stable-worldmodel's contract, and sharing it across processes."""
import multiprocessing as mp
import os
import pickle
import threading

import numpy as np
import pytest
from helpers.procs import join_all, running
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

try:   # stable-worldmodel's data layer; some builds fail with more than ImportError
    import stable_worldmodel.data  # noqa: F401
except Exception as exc:  # e.g. RuntimeError from a torchvision built for CUDA torch
    pytest.skip(f"stable-worldmodel cannot be imported: {type(exc).__name__}: {exc}",
                allow_module_level=True)

import torch
from helpers.swm_workers import (
    frame_episode,
    play_frames,
    rb_len,
    tagged_episode,
    write_frame_episodes,
    write_tagged,
)

import shmbuf
from shmbuf import Compress, cli
from shmbuf.compat.swm import EPISODE_DATA_KEY, ReplayBuffer, ShmDataset, as_sampler
from shmbuf.select import AgeBuckets, Prioritized, Recency

SHM = "/dev/shm"


@pytest.fixture
def make():
    """ReplayBuffer(...) closed (so removed) at teardown."""
    made = []

    def build(*args, **kw):
        rb = ReplayBuffer(*args, **kw)
        made.append(rb)
        return rb

    yield build
    for rb in made:
        rb.close()


def episode(n, seed=0, pixels=True):
    rng = np.random.default_rng(seed)
    ep = {"action": rng.standard_normal((n, 2)).astype(np.float32),
          "reward": rng.standard_normal(n).astype(np.float32)}
    if pixels:
        ep["pixels"] = rng.integers(0, 256, (n, 8, 8, 3), dtype=np.uint8)
    return ep


def held_steps(rb) -> int:
    """Steps in the shared store (finished or not): what 'nothing written' checks."""
    buf = rb._table.attached("test")
    return 0 if buf is None else buf.stats().steps_written


# -- swm's contract -----------------------------------------------------------------------
def test_is_a_swm_dataset_and_starts_empty(make):
    from stable_worldmodel.data.dataset import Dataset

    rb = make(max_steps=10, history_len=2)
    assert isinstance(rb, Dataset)
    assert (len(rb), rb.num_episodes, rb.num_steps_stored, rb.column_names) == (0, 0, 0, [])
    assert rb.lengths.shape == (0,) and rb.offsets.shape == (0,)
    assert not os.path.exists(os.path.join(SHM, rb.name))   # made by the first episode


@pytest.mark.parametrize("kw", [{"max_steps": 0}, {"max_steps": 10, "history_len": 0},
                                {"max_steps": 10, "frameskip": -1}])
def test_sizes_must_be_positive(kw):
    with pytest.raises(ValueError, match="must be positive"):
        ReplayBuffer(**kw)


def test_per_step_lists_and_arrays_read_back_exactly(make):
    rb = make(max_steps=100, history_len=3)
    first = episode(6, seed=1)
    rb.write_episode(first)
    second = {k: list(v) for k, v in episode(5, seed=2).items()}   # World.collect's shape
    rb.write_episode(second)
    assert rb.column_names == ["action", "reward", "pixels"]
    np.testing.assert_array_equal(rb.lengths, [6, 5])
    assert rb.lengths.dtype == np.int32 and rb.offsets.dtype == np.int64
    np.testing.assert_array_equal(rb.offsets, [0, 6])
    assert len(rb) == rb.num_valid_ends() == (6 - 2) + (5 - 2)
    eps = list(rb.episodes())
    for got, want in zip(eps, [first, second]):
        for k in want:
            assert isinstance(got[k], list)
            np.testing.assert_array_equal(np.stack(got[k]), np.asarray(want[k]))
    last = rb[-1]
    np.testing.assert_array_equal(last["pixels"], np.asarray(second["pixels"])[2:5])


def test_frameskip_strides_observations_and_keeps_action_dense(make):
    rb = make(max_steps=100, history_len=3, frameskip=2)
    ep = episode(10)
    rb.write_episode(ep)
    assert len(rb) == 10 - 6 + 1
    item = rb[1]
    np.testing.assert_array_equal(item["pixels"], ep["pixels"][[1, 3, 5]])
    np.testing.assert_array_equal(item["reward"], ep["reward"][[1, 3, 5]])
    np.testing.assert_array_equal(item["action"], ep["action"][1:7].reshape(3, 4))
    batch = rb.sample(4)
    assert batch["pixels"].shape == (4, 3, 8, 8, 3) and batch["action"].shape == (4, 3, 4)


def test_transform_applies_to_items_not_to_sample(make):
    rb = make(max_steps=50, history_len=2,
              transform=lambda clip: {k: torch.as_tensor(v) for k, v in clip.items()})
    rb.write_episode(episode(5))
    assert all(isinstance(v, torch.Tensor) for v in rb[0].values())
    assert all(isinstance(v, np.ndarray) for v in rb.sample(2).values())


def test_whole_oldest_episodes_are_evicted_first(make):
    rb = make(max_steps=50)
    eps = [episode(30, 0), episode(15, 1), episode(20, 2)]
    for ep in eps:
        rb.write_episode(ep)
    assert (rb.num_episodes, rb.num_steps_stored) == (2, 35)
    np.testing.assert_array_equal(rb[0]["pixels"][0], eps[1]["pixels"][0])
    np.testing.assert_array_equal(rb[len(rb) - 1]["pixels"][0], eps[2]["pixels"][-1])


def test_flat_clip_order_is_oldest_episode_first(make):
    rb = make(max_steps=200, history_len=4)
    eps = [episode(n, seed=n) for n in (6, 9, 5)]
    for ep in eps:
        rb.write_episode(ep)
    expect = [(e, s) for e, ep in enumerate(eps) for s in range(len(ep["reward"]) - 3)]
    assert len(rb) == len(expect)
    for i, (e, s) in enumerate(expect):
        np.testing.assert_array_equal(rb[i]["reward"], eps[e]["reward"][s:s + 4])


# -- bad input: a clear error and nothing written --------------------------------------
def _bad_episodes():
    ok = episode(4)
    extra = dict(ok, extra=np.zeros((4, 2), np.float32))
    missing = {k: v for k, v in ok.items() if k != "reward"}
    shape = dict(ok, action=np.zeros((4, 3), np.float32))
    lossy = dict(ok, reward=np.zeros(4, np.float64))
    ragged = dict(ok, reward=np.zeros(3, np.float32))
    return [
        ({"action": 42}, ValueError, "scalar"),
        (ragged, ValueError, "has length 3, expected 4"),
        (episode(30), ValueError, "exceeds max_steps=20"),
        (extra, ValueError, r"schema mismatch.*extra=\['extra'\]"),
        (missing, ValueError, r"schema mismatch.*missing=\['reward'\]"),
        (shape, ValueError, r"'action' per-step shape \(3,\) mismatches expected \(2,\)"),
        (lossy, ValueError, "'reward' has dtype float64"),
        (dict(ok, note=np.array([object()] * 4)), TypeError, "Python objects"),
        (dict(ok, **{EPISODE_DATA_KEY: {"f": lambda: 0}}), TypeError, "episode data holds"),
    ]


@pytest.mark.parametrize("bad, exc, match", _bad_episodes())
def test_bad_episode_is_refused_and_nothing_is_written(make, bad, exc, match):
    rb = make(max_steps=20)
    rb.write_episode(episode(4))
    before = held_steps(rb)
    with pytest.raises(exc, match=match):
        rb.write_episode(bad)
    assert held_steps(rb) == before and rb.num_episodes == 1


def test_empty_and_zero_length_episodes_are_ignored(make):
    rb = make(max_steps=10)
    rb.write_episode({})
    rb.write_episode({"action": np.zeros((0, 2), np.float32)})
    assert rb.num_episodes == 0 and not os.path.exists(os.path.join(SHM, rb.name))


def test_text_columns_round_trip_and_a_longer_text_is_refused(make):
    rb = make(max_steps=100)
    rb.write_episode({"action": np.zeros((3, 2), np.float32), "lang": ["push the T"] * 3})
    rb.write_episode({"action": np.zeros((2, 2), np.float32), "lang": ["go", "stop"]})
    assert [list(ep["lang"]) for ep in rb.episodes()] == [["push the T"] * 3, ["go", "stop"]]
    before = held_steps(rb)
    with pytest.raises(ValueError, match="'lang' has a value of 70 characters; it holds at most"):
        rb.write_episode({"action": np.zeros((1, 2), np.float32), "lang": ["x" * 70]})
    assert held_steps(rb) == before


# -- sampling ---------------------------------------------------------------------------
def test_sample_shapes_errors_and_the_step_counter(make):
    rb = make(max_steps=200, history_len=4)
    with pytest.raises(RuntimeError, match="no clips of history_len=4"):
        rb.sample(2)
    for s in range(3):
        rb.write_episode(episode(20, seed=s))
    out = rb.sample(8, history_len=5)
    assert {k: v.shape for k, v in out.items()} == {
        "action": (8, 5, 2), "reward": (8, 5), "pixels": (8, 5, 8, 8, 3)}
    for bad in (0, -1):
        with pytest.raises(ValueError, match="batch_size must be positive"):
            rb.sample(bad)
        with pytest.raises(ValueError, match="history_len must be positive"):
            rb.sample(2, history_len=bad)
    seen = []

    def sampler(step, buffer, batch_size, history_len):
        seen.append((step, buffer is rb, history_len))
        return np.zeros(batch_size, np.int64)

    rb.sampler = sampler
    rb.sample(2)
    rb.sample(2, step=42)
    rb.sample(2, history_len=3)
    assert seen == [(2, True, 4), (42, True, 4), (3, True, 3)]   # steps 0, 1: the samples above


@pytest.mark.parametrize("result, exc, match", [
    (lambda b: np.zeros(b + 1, np.int64), ValueError, "returned shape"),
    (lambda b: np.zeros((b, 1), np.int64), ValueError, "returned shape"),
    (lambda b: np.full(b, 10**9, np.int64), IndexError, r"out of range \[0, 68\)"),
    (lambda b: np.full(b, -1, np.int64), IndexError, "out of range"),
    (lambda b: np.zeros(b, np.float32), ValueError, "integer clip indices"),
])
def test_a_bad_sampler_result_is_a_clear_error(make, result, exc, match):
    rb = make(max_steps=200, history_len=4, sampler=lambda s, buf, b, h: result(b))
    for s in range(4):
        rb.write_episode(episode(20, seed=s))
    with pytest.raises(exc, match=match):
        rb.sample(4)


def test_the_sampler_and_the_read_see_the_same_episodes(make):
    """Episodes that end (and evict older ones) while the sampler runs, as a collector's
    would, leave its clip indices meaning what they meant when it counted them."""
    rb = make(max_steps=100)
    for e in range(3):
        rb.write_episode(tagged_episode(0, e, 30))

    def sampler(step, buffer, batch_size, history_len):
        n = buffer.num_valid_ends(history_len)
        if step == 0:
            rb.write_episode(tagged_episode(1, 0, 15))   # evicts the oldest episode
        return np.full(batch_size, n - 1)

    rb.sampler = sampler
    batch = rb.sample(2, step=0)
    np.testing.assert_array_equal(batch["ep"], [[2], [2]])   # the last clip it counted
    np.testing.assert_array_equal(batch["t"], [[29], [29]])
    np.testing.assert_array_equal(rb.sample(1, step=1)["who"], [[1]])   # the newest now


def test_only_clips_recycled_while_read_are_drawn_again(make):
    rb = make(max_steps=100)
    for e in range(3):
        rb.write_episode(tagged_episode(0, e, 30))
    sizes = []

    def sampler(step, buffer, batch_size, history_len):
        sizes.append(batch_size)
        n = buffer.num_valid_ends(history_len)
        if len(sizes) == 1:
            rb.write_episode(tagged_episode(1, 0, 15))   # recycles episode 0's first rows
            return np.array([0, n - 1])                 # episode 0's first clip, episode 2's last
        return np.array([n - 1])                        # now: the newest episode's last clip

    rb.sampler = sampler
    batch = rb.sample(2)
    assert sizes == [2, 1]                      # the one recycled clip was drawn again
    np.testing.assert_array_equal(batch["who"], [[1], [0]])
    np.testing.assert_array_equal(batch["t"], [[14], [29]])
    np.testing.assert_array_equal(rb.last_ids.shape, (2, 1))


def test_recency_sampler_prefers_the_newest_steps(make):
    rb = make(max_steps=400, history_len=2, sampler=as_sampler(Recency(exponent=8.0)))
    for s in range(10):
        rb.write_episode(episode(20, seed=s, pixels=False))
    flat = np.concatenate([rb.sampler(0, rb, 64, 2) for _ in range(4)])
    assert flat.min() >= 0 and flat.max() < rb.num_valid_ends(2)
    newest = rb.num_valid_ends(2) - 19                          # the last episode's clips
    assert (flat >= newest).mean() > 0.9


def test_age_buckets_sampler_draws_only_the_weighted_group(make):
    rb = make(max_steps=400, history_len=2, sampler=as_sampler(AgeBuckets([0, 0, 0, 1])))
    for s in range(8):
        rb.write_episode(episode(10, seed=s, pixels=False))
    flat = rb.sampler(0, rb, 128, 2)
    per_episode = 9
    assert (flat // per_episode >= 6).all()                      # the newest quarter: 6, 7


def test_prioritized_sampler_follows_priorities_pushed_from_another_process(make):
    rb = make(max_steps=400, history_len=2, sampler=as_sampler(Prioritized(exponent=1.0,
                                                                           maxfrac=0.0)))
    for s in range(5):
        rb.write_episode(episode(10, seed=s, pixels=False))
    # Every step gets priority 0 except the clips of episode 3, which get 1.
    everything = rb._view().rows
    ids = rb._table.buf.port.step_ids(everything)
    rb._table.buf.update_priorities(ids, np.zeros(len(ids), np.float32))
    other = pickle.loads(pickle.dumps(rb))
    target = np.arange(27, 36)                                  # episode 3's flat clips
    rb.sampler = lambda s, b, n, h: np.repeat(target, 2)[:n]
    rb.sample(18)
    other.update_priorities(rb.last_ids, np.ones(18, np.float32))
    rb.sampler = as_sampler(Prioritized(exponent=1.0, maxfrac=0.0))
    flat = rb.sampler(0, rb, 64, 2)
    assert np.isin(flat, target).all()
    other.close()


# -- episode data -------------------------------------------------------------------------
def test_episode_data_is_kept_evicted_and_cleared_with_its_episode(make):
    rb = make(max_steps=12)
    for tag in range(3):
        ep = episode(4, seed=tag)
        ep[EPISODE_DATA_KEY] = {"xml": f"<scene {tag}/>", "idx": tag, "arr": np.arange(3) * tag,
                                "blob": b"\x00\xff"}
        rb.write_episode(ep)
    rb.write_episode(episode(4, seed=9))                        # evicts episode 0
    assert rb.episode_column_names == ["xml", "idx", "arr", "blob"]
    data = rb.get_episode_data()
    assert data["idx"] == [1, 2, None] and data["xml"][0] == "<scene 1/>"
    np.testing.assert_array_equal(data["arr"][1], [0, 2, 4])
    assert data["blob"][0] == b"\x00\xff"
    assert rb.get_episode_data([2, 0])["idx"] == [None, 1]
    eps = list(rb.episodes())
    assert eps[0][EPISODE_DATA_KEY]["idx"] == 1 and EPISODE_DATA_KEY not in eps[2]
    assert EPISODE_DATA_KEY not in rb.column_names
    rb.clear()
    assert (rb.num_episodes, rb.episode_column_names, rb.get_episode_data()) == (0, [], {})


def tagged_steps(n, first):
    """An episode whose ``tag`` column numbers its steps from ``first`` (never 0)."""
    tag = np.arange(first, first + n, dtype=np.int64)
    return {"tag": tag, "obs": np.stack([tag, -tag], 1).astype(np.float32)}


def test_episode_data_of_any_size_fits_episodes_of_any_length(make):
    rb = make(max_steps=4000, history_len=1)
    first = tagged_steps(10, 1)
    first[EPISODE_DATA_KEY] = {"seed": 1}     # 16 bytes per step from here on
    rb.write_episode(first)
    sizes = {2: {"goal": "g" * 20},            # 34 bytes encoded: more than 2 steps' 32
             1: {"xml": "x" * 3000, "arr": np.arange(300, dtype=np.int64)},
             3: {"blob": bytes(range(256)) * 4}}
    start = 100
    for n, data in sizes.items():
        ep = tagged_steps(n, start)
        ep[EPISODE_DATA_KEY] = data
        rb.write_episode(ep)
        start += 100
    rb.write_episode(tagged_steps(4, 900))     # no data after a long one
    assert rb.lengths.tolist() == [10, 2, 1, 3, 4] and rb.num_steps_stored == 20
    copy = pickle.loads(pickle.dumps(rb))   # builds its own view
    for reader in (rb, copy):
        got = reader.get_episode_data()
        assert got["seed"] == [1, None, None, None, None]
        assert got["goal"][1] == "g" * 20 and got["xml"][2] == "x" * 3000
        np.testing.assert_array_equal(got["arr"][2], np.arange(300))
        assert got["blob"][3] == bytes(range(256)) * 4
        eps = list(reader.episodes())
        assert [len(e["tag"]) for e in eps] == [10, 2, 1, 3, 4]
        assert [e["tag"][0] for e in eps] == [1, 100, 200, 300, 900]
        # The rows that carry only data are never a step: every clip is a written one.
        tags = reader.sample(256)["tag"]
        assert (tags > 0).all() and len(reader) == 20
    ds = ShmDataset(rb.name)     # load_dataset("shm://...")'s reader
    assert ds.lengths.tolist() == [10, 2, 1, 3, 4]
    assert ds.get_episode_data([1])["goal"] == ["g" * 20]
    ds.close()
    copy.close()


def test_episode_data_rows_are_evicted_with_their_episode(make):
    rb = make(max_steps=256)
    start = 1
    for e in range(80):
        n = 1 + e % 5
        ep = tagged_steps(n, start)
        ep[EPISODE_DATA_KEY] = {"first": start, "pad": "p" * (37 * e % 300)}
        rb.write_episode(ep)
        start += n
        # Read after every episode: the view is updated, evicted episodes dropped.
        eps = list(rb.episodes())
        for got in eps:   # each held episode with its own data, whole
            assert got[EPISODE_DATA_KEY]["first"] == got["tag"][0]
            assert np.array_equal(got["tag"], got["tag"][0] + np.arange(len(got["tag"])))
    assert 0 < len(eps) < 60 and eps[-1]["tag"][0] == start - 5
    assert rb._view().data_rows     # some episodes here needed rows of their own


def test_episode_data_too_large_for_max_steps_is_refused(make):
    rb = make(max_steps=20)
    ep = episode(4)
    ep[EPISODE_DATA_KEY] = {"xml": "x"}
    rb.write_episode(ep)
    before = held_steps(rb)
    big = episode(2)
    big[EPISODE_DATA_KEY] = {"xml": "x" * 500}
    with pytest.raises(ValueError, match="exceed max_steps=20"):
        rb.write_episode(big)
    assert held_steps(rb) == before and rb.num_episodes == 1


# -- sharing -----------------------------------------------------------------------------
def test_clear_and_writes_are_seen_through_a_pickled_copy(make):
    rb = make(max_steps=100, history_len=2)
    rb.write_episode(episode(5))
    other = pickle.loads(pickle.dumps(rb))
    assert len(pickle.dumps(rb)) < 1000
    assert other.name == rb.name and other.num_episodes == 1
    other.write_episode(episode(6, seed=1))
    assert rb.num_episodes == 2
    rb.clear()
    assert other.num_episodes == 0 and len(other) == 0
    other.write_episode(episode(3, seed=2))
    assert rb.lengths.tolist() == [3]
    other.close()
    assert rb.num_episodes == 1                  # only the constructing process removes it


@pytest.mark.slow
def test_dataloader_workers_read_the_same_memory(make):
    rb = make(max_steps=400, history_len=2)
    eps = [episode(10, seed=s) for s in range(3)]
    for ep in eps:
        rb.write_episode(ep)
    loader = torch.utils.data.DataLoader(rb, batch_size=6, num_workers=2, timeout=60)
    got = torch.cat([b["reward"] for b in loader])
    want = torch.stack([torch.as_tensor(rb[i]["reward"]) for i in range(len(rb))])
    assert torch.equal(got, want)
    # Spawned workers (the buffer pickled to its name) started before these writes see
    # them: they read the same memory, not a copy.
    lens = torch.utils.data.DataLoader(_Lens(rb), batch_size=None, num_workers=2,
                                       persistent_workers=True, timeout=60,
                                       multiprocessing_context="spawn")
    it = iter(lens)
    assert next(it)[1] == len(rb)
    for s in range(3):
        rb.write_episode(episode(10, seed=10 + s))
    # Items already prefetched carry the old length; every worker then reports the new one.
    updated = set()
    for worker, n in it:
        if int(n) == len(rb):
            updated.add(int(worker))
        if updated == {0, 1}:
            break
    assert updated == {0, 1}
    del it


class _Lens(torch.utils.data.IterableDataset):
    """Endless (worker id, len(rb)) pairs: 200 per worker at most."""

    def __init__(self, rb):
        self.rb = rb

    def __iter__(self):
        worker = torch.utils.data.get_worker_info().id
        for _ in range(200):
            yield worker, rb_len(self.rb)


@pytest.mark.slow
def test_several_collector_processes_write_whole_episodes(make):
    rb = make(max_steps=10_000, history_len=3)
    ctx = mp.get_context("fork")   # spawned children (pickled by name) are tested below
    procs = [ctx.Process(target=write_tagged, args=(rb, w, 6, 25)) for w in range(3)]
    with running(procs):
        join_all(procs, 120)
    assert rb.num_episodes == 18 and rb.num_steps_stored == 18 * 25
    seen = set()
    for ep in rb.episodes():
        who, e = int(ep["who"][0]), int(ep["ep"][0])
        want = tagged_episode(who, e, 25)
        for k in want:
            np.testing.assert_array_equal(np.stack(ep[k]), want[k])
        seen.add((who, e))
    assert seen == {(w, e) for w in range(3) for e in range(6)}
    per_writer = {w: [e for who, e in
                      ((int(x["who"][0]), int(x["ep"][0])) for x in rb.episodes()) if who == w]
                  for w in range(3)}
    assert all(v == sorted(v) for v in per_writer.values())   # each writer's order is kept


@pytest.mark.slow
def test_a_buffer_first_written_by_a_child_lives_until_its_constructor_closes_it(capsys):
    rb = ReplayBuffer(max_steps=1000)
    try:
        ctx = mp.get_context("spawn")
        with running([ctx.Process(target=write_tagged, args=(rb, 1, 2, 10))]) as procs:
            join_all(procs, 120)
        assert rb.num_episodes == 2                # the child exited; the data stayed
        assert os.path.exists(os.path.join(SHM, rb.name))
        # The constructing process adopted it: gc leaves it alone, rm asks for --force.
        look = shmbuf.attach(rb.name)
        assert look.stats().owner_pid == os.getpid() and look.stats().owner_alive
        look.close()
        assert cli.main(["gc", "--dry-run"]) == 0
        assert rb.name not in capsys.readouterr().out
        rb.write_episode(tagged_episode(0, 0, 10))  # and writes on through a new writer
        assert rb.num_episodes == 3
    finally:
        rb.close()
    assert not os.path.exists(os.path.join(SHM, rb.name))
    rb.close()                                     # idempotent


# -- against swm's own class ------------------------------------------------------------------
@pytest.mark.slow
@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.one_of(st.integers(1, 30), st.just("clear"), st.just("check")),
                    min_size=1, max_size=25),
       history_len=st.integers(1, 3), frameskip=st.integers(1, 2))
def test_same_episodes_and_clips_as_swms_buffer(make, ops, history_len, frameskip):
    """One writer and max_steps < 128 (chunks of one step): swm's eviction rule exactly."""
    from stable_worldmodel.data import ReplayBuffer as SwmReplayBuffer

    ours = make(max_steps=40, history_len=history_len, frameskip=frameskip)
    theirs = SwmReplayBuffer(max_steps=40, history_len=history_len, frameskip=frameskip)
    for k, op in enumerate(ops):
        if op == "clear":
            ours.clear()
            theirs.clear()
        elif op != "check":
            ep = episode(op, seed=k, pixels=False)
            ours.write_episode(ep)
            theirs.write_episode(ep)
        assert ours.lengths.tolist() == theirs.lengths.tolist()
        assert ours.offsets.tolist() == theirs.offsets.tolist()
        assert len(ours) == len(theirs) and ours.num_steps_stored == theirs.num_steps_stored
        for i in range(len(ours)):
            a, b = ours[i], theirs[i]
            assert all(np.array_equal(a[c], b[c]) for c in b)


# -- compressed cold chunks ---------------------------------------------------------------
# Frames: Breakout played by a random policy (ale-py), or a rendered Breakout-like scene
# where ale-py is missing; a step's ``tag`` names its frame and action, so every batch is
# also checked against the ground truth.
FRAMES = 600


@pytest.fixture(scope="module")
def frames():
    return play_frames(FRAMES)


@pytest.fixture
def zstd():
    pytest.importorskip("zstandard", reason="compress= needs the compress extra's codec")


def seeded(step, buffer, batch_size, history_len):
    """A sampler whose draw depends only on ``step`` (and the clip count): two buffers
    holding the same episodes draw the same clips."""
    n = buffer.num_valid_ends(history_len)
    return np.random.default_rng(step).integers(0, n, size=batch_size)


def check_clips(frames, batch, frameskip=1):
    """A sampled batch against the ground truth its ``tag`` names."""
    tag = batch["tag"]
    assert (np.diff(tag, axis=1) == frameskip).all()
    assert np.array_equal(batch["pixels"], frames[tag % len(frames)])
    dense = tag[:, :1] + np.arange(batch["action"].shape[1] * frameskip)
    want = np.stack([dense, -dense], -1).astype(np.float32)
    assert np.array_equal(batch["action"], want.reshape(batch["action"].shape))


def compression(rb):
    return rb._table.attached("test").stats().compression


@pytest.mark.slow
def test_a_compressing_buffer_reads_bit_identical_to_a_raw_one(make, frames, zstd):
    raw = make(4096, history_len=3, frameskip=2, sampler=seeded)
    packed = make(4096, history_len=3, frameskip=2, sampler=seeded,
                  compress=Compress("pixels", hot_steps=0))
    for e in range(12):
        ep = frame_episode(frames, e * 150, 150)
        ep[EPISODE_DATA_KEY] = {"score": float(e)}
        raw.write_episode(ep)
        packed.write_episode(ep)
    packed.compact(timeout=60)   # what the owner's thread has not compressed yet
    assert raw.compact() == 0
    buf = packed._table.attached("test")
    st = buf.stats().compression
    assert st.compressed_chunks >= 20 and st.cold_raw_chunks == 0
    assert st.raw_bytes > 10 * st.stored_bytes
    # Their raw pages are given back: the column's own view reads zeros there (every
    # frame has pixels), so only the packed read returns the frames.
    view = packed._view()
    lost = np.take(buf.port.views["c0"], view.rows, axis=0).reshape(len(view.rows), -1)
    assert (lost.max(axis=1) == 0).sum() >= 20 * buf.chunk_size
    for step in range(6):
        a, b = raw.sample(64, step=step), packed.sample(64, step=step)
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
        check_clips(frames, b, frameskip=2)
    for i in range(0, len(packed), 7):
        a, b = raw[i], packed[i]
        assert all(np.array_equal(a[k], b[k]) for k in a)
    for a, b in zip(raw.episodes(), packed.episodes(), strict=True):
        assert a.keys() == b.keys()
        assert all(np.array_equal(np.stack(a[k]), np.stack(b[k])) for k in a
                   if k != EPISODE_DATA_KEY)
        assert a[EPISODE_DATA_KEY] == b[EPISODE_DATA_KEY]
    assert packed.get_episode_data() == raw.get_episode_data()
    packed.sampler = as_sampler(Recency())      # a selector's draw, read the same way
    for _ in range(3):
        check_clips(frames, packed.sample(64), frameskip=2)
    packed.sampler = seeded
    for rb in (raw, packed):        # a clear() mark, read among compressed chunks
        rb.clear()
        rb.write_episode(frame_episode(frames, 5000, 40))
    assert packed.lengths.tolist() == raw.lengths.tolist() == [40]
    a, b = raw.sample(16, step=9), packed.sample(16, step=9)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    check_clips(frames, b, frameskip=2)


def test_compress_true_packs_the_frame_columns_only(make, zstd):
    rb = make(100, compress=True)
    assert rb.compact() == 0               # no segment yet
    rb.write_episode(episode(10))          # action, reward (float32) and pixels (uint8)
    st = compression(rb)
    assert st is not None and st.columns == ("c2",)
    flat = make(100, compress=True)
    flat.write_episode(episode(10, pixels=False))
    assert compression(flat) is None       # no frames: nothing to compress


@pytest.mark.parametrize("compress, exc, match", [
    ("pixels", TypeError, "ReplayBuffer: compress must be True, False, None or a "
                          "shmbuf.Compress, got 'pixels'"),
    (Compress("pixels", hot_steps=101), ValueError,
     r"ReplayBuffer: compress: hot_steps must be at most max_steps \(100\), got 101"),
])
def test_bad_compress_is_refused_at_construction(compress, exc, match):
    with pytest.raises(exc, match=match):
        ReplayBuffer(100, compress=compress)


def test_compress_naming_an_unknown_column_is_refused_at_the_first_episode(make, zstd):
    rb = make(100, compress=Compress(["pixels", "rgb"]))
    with pytest.raises(ValueError, match="compress: columns names 'rgb', which is not a column "
                       r"of the episodes; their columns are \['action', 'pixels', 'reward'\]"):
        rb.write_episode(episode(5))
    assert not os.path.exists(os.path.join(SHM, rb.name)) and rb.num_episodes == 0


@pytest.mark.slow
def test_dataloader_workers_decode_cold_chunks(make, frames, zstd):
    raw = make(2048, history_len=3)
    packed = make(2048, history_len=3, compress=Compress("pixels", hot_steps=0))
    for e in range(8):
        raw.write_episode(frame_episode(frames, e * 100, 100))
        packed.write_episode(frame_episode(frames, e * 100, 100))
    packed.compact(timeout=60)
    assert compression(packed).compressed_chunks >= 20
    # Spawned workers attach by name: the compressed blocks are read from shared memory.
    loader = torch.utils.data.DataLoader(packed, batch_size=64, num_workers=2, timeout=60,
                                         multiprocessing_context="spawn")
    got = {k: torch.cat([b[k] for b in loader]) for k in ("pixels", "tag", "action")}
    want = [raw[i] for i in range(len(raw))]
    for k in got:
        assert torch.equal(got[k], torch.as_tensor(np.stack([w[k] for w in want])))
    check_clips(frames, {k: v.numpy() for k, v in got.items()})


@pytest.mark.slow
def test_compress_travels_to_a_spawned_collector_that_makes_the_segment(frames, zstd):
    """The settings pickle with the buffer: the segment the collector creates compresses,
    and compression goes on in the constructing process once it adopts the segment."""
    rb = ReplayBuffer(4096, history_len=2, compress=Compress("pixels", hot_steps=0))
    try:
        p = mp.get_context("spawn").Process(target=write_frame_episodes,
                                            args=(rb, frames, 0, 6, 100))
        with running([p]):
            join_all([p], 120)
        assert rb.num_episodes == 6                     # the collector exited: adopted now
        look = shmbuf.attach(rb.name)
        assert look.stats().owner_pid == os.getpid()
        look.close()
        for e in range(6, 12):                           # more chunks to compress, here
            rb.write_episode(frame_episode(frames, e * 100, 100))
        rb.compact(timeout=60)
        st = compression(rb)
        assert (st.columns, st.hot_steps, st.cold_raw_chunks) == (("c0",), 0, 0)
        assert st.compressed_chunks >= 1100 // rb._table.buf.chunk_size
        for step in range(4):
            check_clips(frames, rb.sample(64, step=step))
        assert [int(ep["tag"][0]) for ep in rb.episodes()] == list(range(0, 1200, 100))
    finally:
        rb.close()
    assert not os.path.exists(os.path.join(SHM, rb.name))


@pytest.mark.slow
def test_sampling_while_a_collector_writes_into_a_compressing_buffer(make, frames, zstd):
    """A collector process wraps the buffer six times over, into chunks packed before;
    a thread compacts all along, so the sampler races with the packing of the chunks it
    reads; every batch matches the ground truth.

    A writer this fast (no env to step) recycles the oldest episodes within a read: those
    clips are drawn again."""
    rb = make(4096, history_len=4, compress=Compress("pixels", hot_steps=256))
    rb.write_episode(frame_episode(frames, 0, 100))     # made here: this process compresses
    buf = rb._table.attached("test")
    stop, packed = threading.Event(), []

    def compacting():
        while not stop.is_set():
            packed.append(buf.compact(timeout=60))

    proc = mp.get_context("fork").Process(target=write_frame_episodes,
                                          args=(rb, frames, 100, 250, 100))
    packer = threading.Thread(target=compacting)
    batches = packed_seen = 0
    try:
        with running([proc]):
            packer.start()
            while proc.exitcode is None and batches < 20_000:
                packed_seen += compression(rb).compressed_chunks > 0
                check_clips(frames, rb.sample(32))
                batches += 1
            join_all([proc], 120)
    finally:
        stop.set()
        packer.join(timeout=60)
    assert not packer.is_alive() and sum(packed) > 0
    assert packed_seen > 0
    assert rb.num_steps_stored > 4096 // 2   # wrapped, and well filled
    rb.compact(timeout=60)
    assert compression(rb).compressed_chunks > 0
    for _ in range(20):
        check_clips(frames, rb.sample(64))
    newest = list(rb.episodes())[-1]
    assert newest["tag"][-1] == 100 + 250 * 100 - 1
