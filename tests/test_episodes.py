"""The episode index: finished episodes listed and sampled per episode, in O(batch)."""
import multiprocessing as mp

import numpy as np
import pytest
from helpers.procs import join_all, running

import shmbuf

SPEC = {"obs": ((2,), np.int64), "done": ((), np.bool_)}  # obs = (episode id, step)


def write_episodes(w, lengths, first_id=0, cut=()):
    """Episode ``first_id + i`` of ``lengths[i]`` steps; the ones in ``cut`` end by end_episode."""
    for i, n in enumerate(lengths):
        ep = first_id + i
        for t in range(n):
            w.add(obs=np.array([ep, t]), done=(t == n - 1 and ep not in cut))
        if ep in cut:
            w.end_episode()


def check_windows(batch, time_major=True):
    obs = batch["obs"] if time_major else batch["obs"].swapaxes(0, 1)
    ep, t = obs[..., 0], obs[..., 1]
    assert (ep == ep[:1]).all(), "a window crossed an episode"
    assert (np.diff(t, axis=0) == 1).all(), "a window skipped or repeated a step"
    return ep[0]


def test_finished_episodes_are_listed_oldest_first(make_buffer):
    buf = make_buffer(SPEC, 1000, chunk_size=7)
    lengths = [3, 10, 1, 25, 8]
    with buf.writer() as w:
        write_episodes(w, lengths, cut={2})
        w.add(obs=np.array([99, 0]), done=False)   # open: not listed
        eps = buf.episodes()
    assert eps.length.tolist() == lengths
    assert eps.terminal.tolist() == [True, True, False, True, True]
    assert eps.index.tolist() == [0, 1, 2, 3, 4]
    assert buf.episodes(newest=2).length.tolist() == [25, 8]
    assert buf.stats().episodes == 4  # terminal ones, as before


def test_an_empty_cut_is_not_an_episode(make_buffer):
    buf = make_buffer(SPEC, 100)
    with buf.writer() as w:
        w.end_episode()
        write_episodes(w, [4])
        w.end_episode()
        w.end_episode()
    assert buf.episodes().length.tolist() == [4]


def test_episode_sampling_is_uniform_over_episodes_not_steps(make_buffer):
    buf = make_buffer(SPEC, 5000, chunk_size=16)
    lengths = [5, 200] * 10
    with buf.writer() as w:
        write_episodes(w, lengths)
    per_episode = np.bincount(check_windows(
        buf.sample_sequences(8000, 5, uniform="episodes", rng=1)), minlength=20)
    # 8000 draws over 20 episodes: 400 each; 5 sigma is about 100.
    assert per_episode.min() > 300 and per_episode.max() < 500, per_episode
    per_step = np.bincount(check_windows(buf.sample_sequences(8000, 5, rng=1)), minlength=20)
    assert per_step[0::2].sum() * 20 < per_step[1::2].sum()  # long episodes dominate


def test_start_is_uniform_within_the_episode(make_buffer):
    buf = make_buffer(SPEC, 1000, chunk_size=8)
    with buf.writer() as w:
        write_episodes(w, [40])
    starts = buf.sample_sequences(7200, 5, uniform="episodes", rng=2)["obs"][0, :, 1]
    counts = np.bincount(starts, minlength=36)
    assert len(counts) == 36 and counts.min() > 120 and counts.max() < 280, counts


def test_newest_restricts_the_draw(make_buffer):
    buf = make_buffer(SPEC, 2000, chunk_size=10)
    with buf.writer() as w:
        write_episodes(w, [12] * 30)
    ids = check_windows(buf.sample_sequences(500, 12, uniform="episodes", newest=3, rng=0))
    assert set(ids.tolist()) == {27, 28, 29}


def test_tail_rows_may_follow_the_episode_end(make_buffer):
    buf = make_buffer(SPEC, 1000, chunk_size=6)
    with buf.writer() as w:
        write_episodes(w, [4, 4, 4])
    batch = buf.sample_sequences(300, 5, tail=1, uniform="episodes", rng=0)
    obs = batch["obs"]
    assert (obs[:4, :, 0] == obs[:1, :, 0]).all()
    # only episodes with a successor in the stream can give a tail row
    assert set(obs[0, :, 0].tolist()) == {0, 1}
    assert (obs[4, :, 1] == 0).all() and (obs[4, :, 0] == obs[0, :, 0] + 1).all()


def test_vectorised_writers_log_one_episode_per_env_stream(make_buffer):
    buf = make_buffer(SPEC, 4000, chunk_size=5)
    n = 4
    with buf.writer() as w:
        for t in range(60):
            ids = np.array([e * 1000 + t // (e + 3) for e in range(n)])
            steps = np.array([t % (e + 3) for e in range(n)])
            done = np.array([t % (e + 3) == e + 2 for e in range(n)])
            w.add_batch(obs=np.stack([ids, steps], 1), done=done)
        w.end_episode(env=0)   # its open episode is empty: 60 % 3 == 0
    eps = buf.episodes()
    expected = sum(60 // (e + 3) for e in range(n))
    assert len(eps) == expected
    for e in range(n):
        assert (eps.length[eps.stream == eps.stream.min() + e] == e + 3).all()
    check_windows(buf.sample_sequences(1000, 3, uniform="episodes", rng=0))


def test_recycled_episodes_leave_the_index(make_buffer):
    buf = make_buffer(SPEC, 64, chunk_size=8)
    with buf.writer() as w:
        write_episodes(w, [8] * 40)
        eps = buf.episodes()
    assert 0 < len(eps) < 40 and eps.index[-1] == 39
    assert eps.length.sum() <= 64
    ids = check_windows(buf.sample_sequences(400, 8, uniform="episodes", rng=0))
    assert set(ids.tolist()) == set(eps.index.tolist())


def test_a_small_index_keeps_the_newest_episodes(make_buffer):
    buf = make_buffer(SPEC, 1000, chunk_size=10, episode_slots=4)
    with buf.writer() as w:
        write_episodes(w, [5] * 10)
    assert buf.episodes().index.tolist() == [6, 7, 8, 9]
    ids = check_windows(buf.sample_sequences(200, 5, uniform="episodes", rng=0))
    assert set(ids.tolist()) == {6, 7, 8, 9}


def test_time_major_false_and_out(make_buffer):
    buf = make_buffer(SPEC, 500, chunk_size=4)
    with buf.writer() as w:
        write_episodes(w, [9, 9])
    out = {"obs": np.empty((16, 6, 2), np.int64), "done": np.empty((16, 6), np.bool_)}
    got = buf.sample_sequences(16, 6, time_major=False, out=out, uniform="episodes", rng=0)
    assert got["obs"] is out["obs"]
    check_windows(got, time_major=False)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"uniform": "episode"}, ValueError, "uniform must be one of"),
    ({"newest": 3}, ValueError, "newest= applies to uniform='episodes'"),
    ({"uniform": "episodes", "newest": 0}, ValueError, "newest must be at least 1"),
    ({"uniform": "episodes", "newest": 1.5}, TypeError, "newest must be an int"),
])
def test_bad_arguments_name_themselves(make_buffer, kwargs, error, match):
    buf = make_buffer(SPEC, 100)
    with buf.writer() as w:
        write_episodes(w, [5])
    with pytest.raises(error, match=match):
        buf.sample_sequences(2, 2, **kwargs)


def test_no_finished_episode_yet_is_not_enough_data(make_buffer):
    buf = make_buffer(SPEC, 100)
    with buf.writer() as w:
        w.add(obs=np.array([0, 0]), done=False)
        with pytest.raises(shmbuf.NotEnoughDataError, match="no episode has finished yet"):
            buf.sample_sequences(2, 1, uniform="episodes")
        write_episodes(w, [3, 7], first_id=1)
        with pytest.raises(shmbuf.NotEnoughDataError, match="the longest held has 7"):
            buf.sample_sequences(2, 8, uniform="episodes")


def _episode_writer(buf, first_id, count, length):
    with buf.writer() as w:
        write_episodes(w, [length] * count, first_id=first_id)


@pytest.mark.slow
def test_episodes_from_spawned_writers_are_whole_and_sampled_untorn(make_buffer):
    buf = make_buffer(SPEC, 20_000, chunk_size=16)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_episode_writer, args=(buf, 1000 * i, 100, 37))
             for i in range(2)]
    with running(procs):
        join_all(procs, 60)
    eps = buf.episodes()
    assert len(eps) == 200 and (eps.length == 37).all() and eps.terminal.all()
    ids = check_windows(buf.sample_sequences(4000, 37, uniform="episodes", rng=0))
    assert len(set(ids.tolist())) == 200


def test_not_enough_data_says_when_waiting_cannot_help(make_buffer):
    buf = make_buffer(SPEC, 2000, chunk_size=50)
    with buf.writer() as w:
        write_episodes(w, [300, 300])
        with pytest.raises(shmbuf.NotEnoughDataError) as err:
            buf.sample_sequences(2, 400)
        assert "longest of its 2 finished episodes has 300 steps" in str(err.value)
        assert "Waiting helps only if episodes get longer" in str(err.value)
        assert "fits in the buffer yet" not in str(err.value)


def test_not_enough_data_says_wait_while_the_buffer_fills(make_buffer):
    buf = make_buffer(SPEC, 2000, chunk_size=50)
    with buf.writer() as w:
        write_episodes(w, [3])
        w.add(obs=np.array([1, 0]), done=False)
        with pytest.raises(shmbuf.NotEnoughDataError, match="fits in the buffer yet.*"
                           r"the longest finished episode has 3\).*wait_ready"):
            buf.sample_sequences(2, 10)


def test_count_valid_starts_is_exact_while_small_and_close_when_large(make_buffer):
    buf = make_buffer(SPEC, 20_000, chunk_size=64)
    with buf.writer() as w:
        write_episodes(w, [30] * 10)                   # 300 rows: exact
        assert buf.count_valid_starts(10) == 10 * 21
        assert buf.count_valid_starts(10, tail=1) == 10 * 22 - 1   # the last has no successor
        write_episodes(w, [100] * 100, first_id=10)    # 10,300 rows: estimated
    exact = 10 * 21 + 100 * 91
    got = [buf.count_valid_starts(10, rng=s) for s in range(5)]
    assert all(abs(g - exact) < 0.05 * exact for g in got), (got, exact)
    with pytest.raises(ValueError, match="tail must be"):
        buf.count_valid_starts(10, tail=10)


def _brute_episodes(buf, length, tail=0, newest=None):
    """Finished episodes still held and long enough, read back one by one."""
    eps = buf.episodes(newest=newest)
    return sum(1 for i, n in zip(eps.index, eps.length)
               if n >= length - tail and buf.read_episode(int(i)) is not None)


def test_count_episodes_is_exact_while_the_index_is_small(make_buffer):
    buf = make_buffer(SPEC, 160, chunk_size=8)
    lengths = [3, 12, 7, 25, 2, 15, 9, 30, 4, 18] * 3
    with buf.writer() as w:
        write_episodes(w, lengths)
    eps = buf.episodes()
    assert eps.index[0] > 0, "the small capacity must have recycled the first episodes"
    assert buf.read_episode(0) is None
    for length in (1, 4, 9, 16, 26, 31):
        assert buf.count_episodes(length) == _brute_episodes(buf, length), length
    assert buf.count_episodes(31) == 0
    assert buf.count_episodes(10, tail=2) == _brute_episodes(buf, 10, tail=2)
    assert buf.count_episodes(5, newest=3) == _brute_episodes(buf, 5, newest=3) == 2
    check_windows(buf.sample_sequences(200, 9, uniform="episodes", rng=0))


def test_count_episodes_estimates_when_the_index_holds_more_than_probes(make_buffer):
    buf = make_buffer(SPEC, 20_000, chunk_size=64)
    with buf.writer() as w:
        write_episodes(w, [5, 20] * 250)              # 500 episodes, half of 10 steps or more
    held, exact, probes = 500, _brute_episodes(buf, 10), 64
    assert exact == 250 and len(buf.episodes()) == held
    assert buf.count_episodes(10, probes=held) == exact   # at the limit: still exact
    # held * Binomial(probes, p) / probes: 6 sigma is held * 6 * sqrt(p (1 - p) / probes)
    band = held * 6 * np.sqrt(0.5 * 0.5 / probes)
    got = [buf.count_episodes(10, probes=probes, rng=s) for s in range(5)]
    assert all(abs(g - exact) < band for g in got), (got, exact, band)
    assert len(set(got)) > 1, "the estimate should vary with the seed"
    assert buf.count_episodes(21, probes=probes, rng=0) == 0


@pytest.mark.parametrize("kwargs, error, match", [
    ({"length": 0}, ValueError, "length must be between 1 and 100, got 0"),
    ({"length": 101}, ValueError, "length must be between 1 and 100, got 101"),
    ({"length": 2.0}, TypeError, "length must be an int"),
    ({"length": 5, "tail": 5}, ValueError, "tail must be between 0 and 4, got 5"),
    ({"length": 5, "newest": 0}, ValueError, "newest must be at least 1, got 0"),
    ({"length": 5, "probes": 0}, ValueError, "probes must be between 1 and"),
    ({"length": 5, "probes": True}, TypeError, "probes must be an int"),
])
def test_count_episodes_bad_arguments_name_themselves(make_buffer, kwargs, error, match):
    buf = make_buffer(SPEC, 100)
    with pytest.raises(error, match=match):
        buf.count_episodes(**kwargs)


def test_done_key_must_name_a_column_and_only_none_means_no_episodes(make_buffer):
    # A terminal flag under another name used to be ignored: no episode ever ended.
    spec = {"x": ((), np.int64), "terminal": ((), np.bool_)}
    for done_key in ({}, {"done_key": "done"}, {"done_key": "term"}):
        with pytest.raises(ValueError) as err:
            shmbuf.create(spec, 64, **done_key)
        msg = str(err.value)
        assert f"done_key {done_key.get('done_key', 'done')!r} is not a column" in msg
        assert "['terminal', 'x']" in msg and "done_key=None" in msg
    named = make_buffer(spec, 64, done_key="terminal")
    plain = make_buffer(spec, 64, done_key=None)
    for buf in (named, plain):
        with buf.writer() as w:
            w.extend(x=np.arange(8), terminal=np.arange(8) % 4 == 3)
    assert named.done_key == "terminal" and named.episodes().length.tolist() == [4, 4]
    windows = named.sample_sequences(64, 2, rng=0)["x"]
    assert not ((windows[0] % 4 == 3) & (windows[1] % 4 == 0)).any()   # never across an end
    assert plain.done_key is None and len(plain.episodes()) == 0


@pytest.mark.parametrize("uniform", ["steps", "episodes"])
def test_no_window_is_drawn_from_an_episode_shorter_than_it(make_buffer, uniform):
    # Episodes of 1..6 steps, ended by a terminal or cut, in two streams.
    spec = {"ep": ((), np.int64), "eplen": ((), np.int64), "done": ((), np.bool_)}
    buf = make_buffer(spec, 512, chunk_size=5)
    rng = np.random.default_rng(3)
    writers = [buf.writer(), buf.writer()]
    for ep in range(60):
        n, w = int(rng.integers(1, 7)), writers[ep % 2]
        terminal = bool(rng.integers(2))
        for t in range(n):
            w.add(ep=ep, eplen=n, done=terminal and t == n - 1)
        if not terminal:
            w.end_episode()
    for length in (1, 2, 4, 6):
        batch = buf.sample_sequences(300, length, uniform=uniform, rng=length)
        assert (batch["ep"] == batch["ep"][0]).all()          # one episode per window
        assert (batch["eplen"] >= length).all()               # never a shorter one
    for w in writers:
        w.close()
