"""Buffer.iter_episodes: whole episodes, oldest first, from the episode index; open ones on
request; consistent under concurrent writes (skipped or whole, never torn)."""
import numpy as np
import pytest
from helpers.trainer_workers import Writers
from helpers.workers import SPEC, episode_steps, verify_window

import shmbuf


def _check(ep):
    verify_window(ep["obs"], ep["action"], ep["reward"], ep["done"])
    assert ep["action"][0, 2] == 0, "an episode starts at its step 0"


def _ident(ep):
    return int(ep["action"][0, 0]), int(ep["action"][0, 1]), len(ep["reward"])


def test_finished_episodes_oldest_first_cuts_included(make_buffer):
    buf = make_buffer(SPEC, 4000, chunk_size=16)
    w0, w1 = buf.writer(), buf.writer()
    g0, g1 = episode_steps(0, 500, 40), episode_steps(1, 500, 70)
    for _k in range(500):
        w0.add(**next(g0))
        w1.add(**next(g1))
    w0.end_episode()   # cut after 20 steps of episode 12
    eps = list(buf.iter_episodes())
    for ep in eps:
        _check(ep)
    ends = [(40 * (e + 1), (0, e, 40)) for e in range(12)] + [(70 * (e + 1), (1, e, 70))
                                                               for e in range(7)]
    expected = [ident for _, ident in sorted(ends)] + [(0, 12, 20)]
    assert [_ident(ep) for ep in eps] == expected
    assert [_ident(ep) for ep in buf.iter_episodes(newest=3)] == expected[-3:]
    w0.close()
    w1.close()


def test_open_episodes_on_request(make_buffer):
    buf = make_buffer(SPEC, 4000, chunk_size=16)
    with buf.writer() as w0, buf.writer() as w1:
        for step in episode_steps(0, 130, 50):     # 2 finished, 30 steps open
            w0.add(**step)
        for step in episode_steps(1, 45, 1000):    # 45 steps open, across chunks
            w1.add(**step)
        finished = [_ident(e) for e in buf.iter_episodes()]
        every = list(buf.iter_episodes(include_open=True))
    assert finished == [(0, 0, 50), (0, 1, 50)]
    for ep in every:
        _check(ep)
    assert [_ident(e) for e in every] == finished + [(0, 2, 30), (1, 0, 45)]


@pytest.mark.parametrize("episode_len", [128, 129])
def test_open_episodes_of_writers_adding_in_turn(make_buffer, episode_len):
    """Two writers adding in turn, so each stream's chunks alternate with the other's in
    rows; an open episode that begins exactly at a chunk boundary (after a done at step
    127 with chunks of 64) or one step past it is found for both writers."""
    buf = make_buffer(SPEC, 4000, chunk_size=64)
    with buf.writer() as w0, buf.writer() as w1:
        for s0, s1 in zip(episode_steps(0, 200, episode_len), episode_steps(1, 200, episode_len)):
            w0.add(**s0)
            w1.add(**s1)
        every = list(buf.iter_episodes(include_open=True))
    for ep in every:
        _check(ep)
    opened = 200 - episode_len
    assert sorted(_ident(e) for e in every) == [(0, 0, episode_len), (0, 1, opened),
                                                (1, 0, episode_len), (1, 1, opened)]


def test_only_the_held_part_of_an_open_episode_and_no_recycled_finished_one(make_buffer):
    buf = make_buffer(SPEC, 256, chunk_size=16)
    with buf.writer() as w:
        for step in episode_steps(0, 100, 60):   # episode 0 finished, 40 steps open
            w.add(**step)
    with buf.writer() as w:
        for step in episode_steps(1, 300, 1000):   # recycles everything of writer 0
            w.add(**step)
        eps = list(buf.iter_episodes(include_open=True))
    assert len(eps) == 1 and eps[0]["action"][0, 0] == 1
    assert 0 < len(eps[0]["reward"]) <= 256   # the held tail of writer 1's open episode
    verify_window(eps[0]["obs"], eps[0]["action"], eps[0]["reward"], eps[0]["done"])


def test_recycling_between_episodes_skips_never_tears(make_buffer):
    buf = make_buffer(SPEC, 512, chunk_size=16)
    with buf.writer() as w:
        for step in episode_steps(0, 480, 20):
            w.add(**step)
        it = buf.iter_episodes()
        first = next(it)
        for step in episode_steps(1, 300, 20):   # recycles the oldest chunks meanwhile
            w.add(**step)
        rest = list(it)
    for ep in [first] + rest:
        _check(ep)
        assert len(ep["reward"]) == 20
    assert len(rest) < 23   # some were recycled and skipped
    assert all(_ident(ep)[0] == 0 for ep in rest)   # episodes ended later are not included


def test_bad_input_and_closing(make_buffer):
    buf = make_buffer(SPEC, 1000)
    with buf.writer() as w:
        for step in episode_steps(0, 100, 10):
            w.add(**step)
    with pytest.raises(ValueError, match="newest"):
        buf.iter_episodes(newest=0)
    with pytest.raises(TypeError, match="include_open"):
        buf.iter_episodes(include_open="yes")
    it = buf.iter_episodes()
    next(it)
    buf.close()
    with pytest.raises(shmbuf.BufferClosedError):
        next(it)
    with pytest.raises(shmbuf.BufferClosedError):
        buf.iter_episodes()


def test_read_episode_reads_one_entry_of_the_index(make_buffer):
    buf = make_buffer(SPEC, 512, chunk_size=16, episode_slots=8)
    with buf.writer() as w:
        for step in episode_steps(0, 200, 20):    # episodes 0..9; the index holds 8
            w.add(**step)
        eps = buf.episodes()
        assert eps.index.tolist() == list(range(2, 10))
        for i, ep in zip(eps.index.tolist(), buf.iter_episodes()):
            got = buf.read_episode(i)
            _check(got)
            assert _ident(got) == _ident(ep) == (0, i, 20)
            assert all(np.array_equal(got[k], ep[k]) for k in ep)
        assert buf.read_episode(1) is None        # its index entry was reused
        assert buf.read_episode(10) is None       # not ended yet
        for step in episode_steps(1, 700, 1000):  # recycles the chunks of episodes 0..9
            w.add(**step)
        assert buf.read_episode(9) is None        # recycled: never returned torn
    with pytest.raises(ValueError, match="index"):
        buf.read_episode(-1)
    with pytest.raises(TypeError, match="index"):
        buf.read_episode(1.5)
    buf.close()
    with pytest.raises(shmbuf.BufferClosedError):
        buf.read_episode(2)


@pytest.mark.slow
def test_concurrent_writers_never_give_a_torn_episode(make_buffer):
    buf = make_buffer(SPEC, 1024, chunk_size=8)
    seen = 0
    with Writers(buf, 2, max_steps=10**7, episode_len=23):
        for _ in range(40):
            for ep in buf.iter_episodes(include_open=True):
                verify_window(ep["obs"], ep["action"], ep["reward"], ep["done"])
                seen += 1
    assert seen > 40
