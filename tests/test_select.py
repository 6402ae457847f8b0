"""Sampling regimes (shmbuf.select): draws follow each selector's formula, bad input fails.

Every test buffer holds interleaved streams of finished episodes whose steps
record their global add number ``x`` (``helpers.select_workers.fill``), so
the exact probability of every start is computable from the contents; the
draws (fixed seeds) are compared with it by Pearson's chi-squared.  A draw
on a start of probability 0 (a window across an episode end) fails the fit.
"""
import multiprocessing

import numpy as np
import pytest
from helpers.procs import bounded_pool
from helpers.select_workers import SPEC, draw_starts, fill
from helpers.stats import chi2_pvalue

import shmbuf
from shmbuf.select import AgeBuckets, Mixture, Prioritized, Recency, Uniform

LENGTH = 6
P_MIN = 1e-3   # fixed seeds: a pass is reproducible, and a wrong formula fails far below this


@pytest.fixture
def filled(make_buffer):
    buf = make_buffer(SPEC, 8192, chunk_size=64, seed=3)
    return buf, fill(buf)


def uniform_probs(c, length=LENGTH):
    p = np.zeros(len(c.x))
    p[c.valid_starts(length)] = 1.0
    return p / p.sum()


def age_bucket_probs(c, weights, length=LENGTH):
    """The AgeBuckets formula written out: eligible episodes in end order, equal groups
    (the newest take the extra), a group by weight, an episode and a start uniformly."""
    eligible = [e for e in np.argsort(c.ep_end) if c.ep_len[e] >= length]
    g = len(weights)
    base, extra = divmod(len(eligible), g)
    sizes = [base + (i >= g - extra) for i in range(g)]
    w = np.array([wi if s else 0.0 for wi, s in zip(weights, sizes)], np.float64)
    w /= w.sum()
    p, at = np.zeros(len(c.x)), 0
    for gi, size in enumerate(sizes):
        for e in eligible[at:at + size]:
            starts = c.x[(c.ep == e) & (c.o <= c.ep_len[e] - length)]
            p[starts] = w[gi] / size / len(starts)
        at += size
    return p


def recency_probs(c, exponent, length=LENGTH):
    """(1 + age) ** -exponent over the valid starts; one process added every step, so a
    step's publish number is its x and its age is (steps written - 1 - x)."""
    p = np.zeros(len(c.x))
    v = c.valid_starts(length)
    p[v] = (1.0 + (len(c.x) - 1 - v)) ** -exponent
    return p / p.sum()


def fit(c, starts, probs) -> float:
    return chi2_pvalue(np.bincount(starts, minlength=len(c.x)), probs)


def test_uniform_is_uniform_steps(filled):
    buf, c = filled
    got = draw_starts(buf, Uniform(), 1, 200, 50, LENGTH)
    assert fit(c, got, uniform_probs(c)) > P_MIN
    # the same draws as uniform="steps" under the same seed
    same = buf.sample_sequences(50, LENGTH, rng=9, uniform="steps")["x"]
    assert (buf.sample_sequences(50, LENGTH, rng=9, select=Uniform())["x"] == same).all()


@pytest.mark.parametrize("weights", [(1 / 8, 1 / 8, 1 / 4, 1 / 2), (0.1, 0.1, 0.1, 0.7), (3, 0, 1)])
def test_age_buckets_follow_the_formula(filled, weights):
    buf, c = filled
    got = draw_starts(buf, AgeBuckets(weights), 2, 200, 50, LENGTH)
    assert fit(c, got, age_bucket_probs(c, weights)) > P_MIN
    assert fit(c, got, uniform_probs(c)) < P_MIN   # and the test can tell them apart


def test_one_age_bucket_is_uniform_episodes(filled):
    buf, c = filled
    got = draw_starts(buf, AgeBuckets([1]), 4, 200, 50, LENGTH)
    assert fit(c, got, age_bucket_probs(c, [1.0])) > P_MIN
    batch = buf.sample_sequences(8, LENGTH, uniform="episodes", select=AgeBuckets([2.0]))
    assert batch["x"].shape == (LENGTH, 8)


def test_mixture_follows_its_fractions(filled):
    buf, c = filled
    ages = (0.0, 0.0, 0.0, 1.0)
    mix = Mixture([(0.3, Uniform()), (0.7, AgeBuckets(ages))])
    got = draw_starts(buf, mix, 5, 200, 50, LENGTH)
    want = 0.3 * uniform_probs(c) + 0.7 * age_bucket_probs(c, ages)
    assert fit(c, got, want) > P_MIN
    assert fit(c, got, age_bucket_probs(c, ages)) < P_MIN


@pytest.mark.parametrize("exponent", [1.0, 0.5, 2.0])
def test_recency_follows_the_formula(filled, exponent):
    buf, c = filled
    got = draw_starts(buf, Recency(exponent), 6, 200, 50, LENGTH)
    assert fit(c, got, recency_probs(c, exponent)) > P_MIN
    assert fit(c, got, uniform_probs(c)) < P_MIN


def test_recency_zero_is_uniform(filled):
    buf, c = filled
    assert fit(c, draw_starts(buf, Recency(0.0), 7, 200, 50, LENGTH), uniform_probs(c)) > P_MIN


@pytest.mark.parametrize("n_envs, exponent, length", [(8, 1.0, 12), (3, 2.0, 40)])
def test_recency_over_interleaved_streams_after_recycling(make_buffer, n_envs, exponent,
                                                          length):
    """add_batch numbers env e's step i as i * n_envs + e; once chunks were recycled the
    draw still follows the formula over the starts held now."""
    buf = make_buffer(SPEC, 2048, chunk_size=32)
    with buf.writer() as w:
        for i in range(700):
            x = i * n_envs + np.arange(n_envs)
            w.add_batch(x=x, ep=np.zeros(n_envs, np.int64), o=np.zeros(n_envs, np.int64),
                        done=np.zeros(n_envs, bool))
    assert buf.stats().oldest_step > 0, "chunks should have been recycled"
    held = np.zeros(700 * n_envs, bool)
    held[buf.arrays["x"][buf.committed_rows()]] = True
    x = np.arange(len(held))
    # a start is valid when its stream holds it and the next length - 1 steps
    ahead = x + (length - 1) * n_envs
    valid = held & (ahead < len(held)) & held[np.minimum(ahead, len(held) - 1)]
    probs = np.where(valid, (1.0 + (len(held) - 1 - x)) ** -exponent, 0.0)
    got = draw_starts(buf, Recency(exponent), 8, 200, 50, length)
    assert chi2_pvalue(np.bincount(got, minlength=len(x))[::-1], probs[::-1]) > P_MIN


def test_recency_after_the_streams_grew_between_draws(make_buffer):
    """The envelope is kept between draws; starts it left out (too few rows after them
    yet) take part once their stream grows, and windows across an episode start never."""
    n_envs, length, rng = 3, 12, np.random.default_rng(5)
    buf = make_buffer(SPEC, 4096, chunk_size=16)
    ends = [np.cumsum(rng.integers(5, 40, 40)) for _ in range(n_envs)]   # episode ends
    w = buf.writer()

    def write(first, last):
        for i in range(first, last):
            done = np.array([i in e for e in ends])
            w.add_batch(x=i * n_envs + np.arange(n_envs), ep=np.zeros(n_envs, np.int64),
                        o=np.zeros(n_envs, np.int64), done=done)

    write(0, 200)
    buf.sample_sequences(50, length, select=Recency(1.0), rng=0)      # the envelope is made
    write(200, 230)
    got = draw_starts(buf, Recency(1.0), 10, 200, 50, length)
    steps = 230
    x = np.arange(steps * n_envs)
    pos, env = x // n_envs, x % n_envs
    episode = np.stack([np.searchsorted(e, np.arange(steps)) for e in ends])  # (env, pos)
    last = np.minimum(pos + length - 1, steps - 1)
    valid = (pos + length - 1 < steps) & (episode[env, pos] == episode[env, last])
    probs = np.where(valid, 1.0 / (len(x) - x), 0.0)
    assert chi2_pvalue(np.bincount(got, minlength=len(x))[::-1], probs[::-1]) > P_MIN
    w.close()


def test_mixture_with_recency(filled):
    buf, c = filled
    mix = Mixture([(0.25, AgeBuckets([0, 1])), (0.75, Recency(1.0))])
    got = draw_starts(buf, mix, 9, 200, 50, LENGTH)
    want = 0.25 * age_bucket_probs(c, [0, 1]) + 0.75 * recency_probs(c, 1.0)
    assert fit(c, got, want) > P_MIN


def test_every_window_stays_in_one_episode(filled):
    buf, _ = filled
    for sel in (Uniform(), AgeBuckets([1, 2, 3]), Recency(3.0),
                Mixture([(0.5, Recency()), (0.5, AgeBuckets([1, 1]))])):
        b = buf.sample_sequences(64, LENGTH, select=sel, time_major=False, rng=0)
        assert (b["ep"] == b["ep"][:, :1]).all()
        assert (np.diff(b["o"], axis=1) == 1).all() and (np.diff(b["x"], axis=1) > 0).all()


@pytest.mark.slow
def test_draws_spread_over_processes_follow_the_formulas(filled):
    """Spawned children attach by pickle and draw; together they follow each formula."""
    buf, c = filled
    ages = (1 / 8, 1 / 8, 1 / 4, 1 / 2)
    cases = {"uniform": (Uniform(), uniform_probs(c)),
             "ages": (AgeBuckets(ages), age_bucket_probs(c, ages)),
             "recency": (Recency(1.0), recency_probs(c, 1.0)),
             "mixture": (Mixture([(0.5, Uniform()), (0.3, AgeBuckets(ages)), (0.2, Recency())]),
                         0.5 * uniform_probs(c) + 0.3 * age_bucket_probs(c, ages)
                         + 0.2 * recency_probs(c, 1.0))}
    ctx = multiprocessing.get_context("spawn")
    with bounded_pool(ctx, 2) as pool:
        jobs = {k: [pool.apply_async(draw_starts, (buf, sel, 100 + i, 100, 50, LENGTH))
                    for i in range(2)] for k, (sel, _) in cases.items()}
        got = {k: np.concatenate([j.get(timeout=120) for j in js]) for k, js in jobs.items()}
    for k, (_, probs) in cases.items():
        assert fit(c, got[k], probs) > P_MIN, k


def _loader_starts(dataset, batches: int, workers: int) -> np.ndarray:
    from torch.utils.data import DataLoader

    loader = DataLoader(dataset, batch_size=None, num_workers=workers)
    return np.concatenate([b["x"][0].numpy().copy() for _, b in zip(range(batches), loader)])


@pytest.mark.slow
def test_dataset_and_prefetch_draw_by_their_selector(filled):
    """Not only valid starts (a uniform draw lands on those too): the selector's law,
    through DataLoader workers and through the prefetch thread."""
    buf, c = filled
    ages = (0.0, 0.0, 1.0, 3.0)
    mix = Mixture([(0.3, Uniform()), (0.7, AgeBuckets(ages))])
    want_mix = 0.3 * uniform_probs(c) + 0.7 * age_bucket_probs(c, ages)
    got = _loader_starts(buf.dataset(50, LENGTH, select=mix, seed=11), 160, workers=2)
    assert fit(c, got, want_mix) > P_MIN
    assert fit(c, got, uniform_probs(c)) < P_MIN
    got = _loader_starts(buf.dataset(50, LENGTH, select=Recency(1.0), seed=12), 160, workers=0)
    assert fit(c, got, recency_probs(c, 1.0)) > P_MIN
    assert fit(c, got, uniform_probs(c)) < P_MIN
    with buf.prefetch(50, LENGTH, device="cpu", select=AgeBuckets(ages), rng=13) as batches:
        # A batch lives until the next is taken (the slots are reused): copy it.
        got = np.concatenate([next(batches)["x"][0].numpy().copy() for _ in range(160)])
    assert fit(c, got, age_bucket_probs(c, ages)) > P_MIN
    assert fit(c, got, uniform_probs(c)) < P_MIN


@pytest.mark.slow
def test_dataset_and_prefetch_take_select(filled):
    buf, c = filled
    mix = Mixture([(0.5, Uniform()), (0.5, AgeBuckets([1, 3]))])
    item = next(iter(buf.dataset(16, LENGTH, select=mix, seed=1)))
    assert tuple(item["x"].shape) == (LENGTH, 16)
    assert np.isin(item["x"][0].numpy(), c.valid_starts(LENGTH)).all()
    with buf.prefetch(16, LENGTH, device="cpu", select=AgeBuckets([1, 3]), rng=2) as batches:
        x = next(batches)["x"]
        assert np.isin(x[0].numpy(), c.valid_starts(LENGTH)).all()
    with pytest.raises(ValueError, match="disagree"):
        buf.dataset(16, LENGTH, select=AgeBuckets([1, 3]), uniform="steps")
    with pytest.raises(ValueError, match="disagree"):
        buf.prefetch(16, LENGTH, device="cpu", select=Recency(), uniform="episodes")


# -- bad input ------------------------------------------------------------------------
@pytest.mark.parametrize("make, err, words", [
    (lambda: AgeBuckets([]), ValueError, "weights.*empty"),
    (lambda: AgeBuckets([0.5, -0.1]), ValueError, r"weights\[1\].*>= 0.*-0.1"),
    (lambda: AgeBuckets([0, 0]), ValueError, "not all be 0"),
    (lambda: AgeBuckets([float("nan")]), ValueError, r"weights\[0\].*finite"),
    (lambda: AgeBuckets(0.5), TypeError, "weights must be a sequence"),
    (lambda: AgeBuckets(["a"]), TypeError, r"weights\[0\].*real number.*'a'"),
    (lambda: Mixture([(0.5, Uniform()), (0.6, Recency())]), ValueError,
     r"sum to 1.*\[0.5, 0.6\].*1.1"),
    (lambda: Mixture([(-0.5, Uniform()), (1.5, Recency())]), ValueError,
     r"components\[0\].*>= 0.*-0.5"),
    (lambda: Mixture([]), ValueError, "non-empty"),
    (lambda: Mixture([(1.0, "uniform")]), TypeError, r"components\[0\].*'uniform'.*expected"),
    (lambda: Mixture([(1.0, Mixture([(1.0, Uniform())]))]), TypeError, "cannot nest"),
    (lambda: Mixture([Uniform()]), TypeError, r"\(fraction, selector\) pair"),
    (lambda: Recency(-1), ValueError, "exponent.*>= 0.*-1"),
    (lambda: Recency(True), TypeError, "exponent.*real number"),
    (lambda: Prioritized(exponent=float("inf")), ValueError, "exponent.*finite.*inf"),
    (lambda: Prioritized(maxfrac=1.5), ValueError, "maxfrac.*between 0.0 and 1.0.*1.5"),
    (lambda: Prioritized(default=-0.5), ValueError, "default.*finite.*>= 0.0.*-0.5"),
    (lambda: Prioritized(default="1"), TypeError, "default.*real number.*'1'"),
])
def test_bad_selectors_name_the_argument(make, err, words):
    with pytest.raises(err, match=words):
        make()


def test_fractions_within_tolerance_are_accepted():
    mix = Mixture([(0.1, Uniform()), (0.2, Recency()), (0.7 + 5e-7, AgeBuckets([1]))])
    assert mix.fractions[2] == pytest.approx(0.7)
    assert mix.selectors == (Uniform(), Recency(), AgeBuckets((1.0,)))


def test_bad_select_arguments_fail_at_the_door(filled):
    buf, _ = filled
    before = buf.stats().samples
    for kwargs, err, words in [
            (dict(select="recency"), TypeError, "select must be a selector.*'recency'"),
            (dict(select=Uniform(), uniform="episodes"), ValueError, "disagree"),
            (dict(select=AgeBuckets([1, 2]), uniform="episodes"), ValueError, "disagree"),
            (dict(select=Recency(), uniform="steps"), ValueError, "disagree"),
            (dict(select=AgeBuckets([1]), newest=3), ValueError, "newest= applies"),
            (dict(uniform="newest"), ValueError, "uniform must be one of"),
            (dict(select=Prioritized()), ValueError, "priorities=True"),
            (dict(select=Mixture([(0.5, Uniform()), (0.5, Prioritized())])), ValueError,
             "priorities=True")]:
        with pytest.raises(err, match=words):
            buf.sample_sequences(4, LENGTH, **kwargs)
        with pytest.raises(err, match=words):
            buf.dataset(4, LENGTH, **kwargs)
    assert buf.stats().samples == before


def test_age_buckets_say_when_no_episode_is_long_enough(filled):
    buf, c = filled
    with pytest.raises(shmbuf.NotEnoughDataError, match="finished episode"):
        buf.sample_sequences(4, int(c.ep_len.max()) + 1, select=AgeBuckets([1, 1]))


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(shmbuf.Buffer, "update_priorities"),
                    reason="needs create(..., priorities=True) (issue 19's priorities)")
def test_prefetched_and_loader_batches_carry_ids(make_buffer):
    """ids=True through prefetch, a DataLoader worker (the handoff regions) and the
    dataset in this process: int64 ids of the batch's layout that update_priorities takes."""
    import torch
    from torch.utils.data import DataLoader

    buf = make_buffer(SPEC, 8192, chunk_size=64, seed=3, priorities=True)
    fill(buf)
    mix = Mixture([(0.5, Uniform()), (0.5, Prioritized())])
    lead = (LENGTH, 16)

    def check(ids, value):
        assert ids.dtype == torch.int64 and tuple(ids.shape) == lead
        ids = ids.numpy()
        assert buf.update_priorities(ids, np.full(lead, value)) == ids.size
        assert (buf.priorities_of(ids) == value).all()

    with buf.prefetch(16, LENGTH, device="cpu", select=mix, ids=True, rng=1) as batches:
        check(next(batches)["ids"], 2.0)
    loader = DataLoader(buf.dataset(16, LENGTH, select=mix, ids=True, seed=2),
                        batch_size=None, num_workers=1)
    check(next(iter(loader))["ids"], 3.0)
    check(next(iter(buf.dataset(16, LENGTH, ids=True, seed=4)))["ids"], 4.0)
    plain = make_buffer(SPEC, 1024)
    for make in (lambda: plain.dataset(4, LENGTH, ids=True),
                 lambda: plain.prefetch(4, LENGTH, device="cpu", ids=True)):
        with pytest.raises(ValueError, match="ids=True.*priorities=True"):
            make()
    with pytest.raises(TypeError, match="ids must be True or False"):
        buf.dataset(4, LENGTH, ids="yes")


def test_an_episode_logged_but_not_yet_published_is_read_later_not_lost(filled):
    # Per-episode draws keep the index entries they read.  An entry whose writer has
    # taken its index but not yet published it must be read again by a later draw:
    # skipping it for good lost episodes under concurrent writers, until a draw found
    # none left while the index held long ones.  The pending state is made here by
    # giving the newest entry's seq its value from before the publish, for one read.
    from shmbuf.protocol.words import _E_SEQ

    buf, _ = filled
    finder, ring = buf._finder, buf._ring
    newest = ring.episodes_logged() - 1
    word = ring.episode_table[newest % ring.layout.episode_slots, _E_SEQ:_E_SEQ + 1]
    published = word.copy()
    word.view(np.int64)[0] = 2 * newest + 1   # the writer is still writing its body
    try:
        seen = finder.held_episodes(1, 0).index
    finally:
        word[...] = published
    assert newest not in seen
    assert newest in finder.held_episodes(1, 0).index   # read again once published
