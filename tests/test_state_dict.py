"""Buffer.state_dict / load_state_dict: plain tensors, weights_only loading, episode and
stream structure kept, whole chunks while writers run, one copy of memory at most."""
import subprocess
import sys

import numpy as np
import pytest
import torch
from helpers.trainer_workers import Writers
from helpers.workers import SPEC, episode_steps, obs_for, verify_batch

import shmbuf


def _fill(buf, writers=2, steps=700, episode_len=37, cut_every=0):
    ws = [buf.writer() for _ in range(writers)]
    gens = [episode_steps(i, steps, episode_len) for i in range(writers)]
    for k in range(steps):
        for w, g in zip(ws, gens):
            w.add(**next(g))
            if cut_every and k % cut_every == cut_every - 1:
                w.end_episode()
    for w in ws:
        w.close()


def _plain(value):
    """True if ``value`` holds only tensors, str, int, float, bool, None, lists and dicts."""
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    return isinstance(value, (torch.Tensor, str, int, float, bool, type(None)))


def _episodes(buf):
    return [(e["action"][0, :2].tolist(), len(e["reward"])) for e in buf.iter_episodes()]


def test_round_trip_through_torch_save_weights_only(make_buffer, tmp_path):
    buf = make_buffer(SPEC, 2000, chunk_size=16)
    _fill(buf, cut_every=50)
    sd = buf.state_dict()
    assert _plain(sd) and sd["columns"]["obs"].shape == (1400, 3, 8, 8)
    torch.save(sd, tmp_path / "replay.pt")
    loaded = torch.load(tmp_path / "replay.pt", weights_only=True)
    other = make_buffer(SPEC, 2000, chunk_size=16)
    other.load_state_dict(loaded)
    assert len(other) == len(buf) == 1400
    assert _episodes(other) == _episodes(buf)      # the same episodes, cuts included
    for _ in range(20):   # windows after loading never cross an old boundary
        verify_batch(other.sample_sequences(16, 30))


def test_the_tensors_own_exactly_their_rows(make_buffer):
    buf = make_buffer(SPEC, 2000)
    _fill(buf, writers=1, steps=300)
    sd = buf.state_dict()
    for t in list(sd["columns"].values()) + [sd["stream"], sd["episode"]]:
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size()


def test_a_checkpoint_larger_than_the_target_keeps_its_newest_steps(make_buffer):
    buf = make_buffer(SPEC, 2000, chunk_size=8)
    _fill(buf, writers=1, steps=1200)
    small = make_buffer(SPEC, 400, chunk_size=8)
    small.load_state_dict(buf.state_dict())
    assert 0 < len(small) <= 400
    verify_batch(small.sample_sequences(8, 20))


def test_a_column_torch_lacks_travels_as_bytes(make_buffer, tmp_path):
    spec = {"word": ((2,), "<U5"), "big": ((), ">i4"), "done": ((), np.bool_)}
    buf = make_buffer(spec, 100)
    with buf.writer() as w:
        for i in range(30):
            w.add(word=np.array([f"a{i}", "b"]), big=i, done=i % 10 == 9)
    torch.save(buf.state_dict(), tmp_path / "s.pt")
    other = make_buffer(spec, 100)
    other.load_state_dict(torch.load(tmp_path / "s.pt", weights_only=True))
    got = [(e["word"][:, 0].tolist(), e["big"].tolist()) for e in other.iter_episodes()]
    assert got == [([f"a{i}" for i in range(k, k + 10)], list(range(k, k + 10)))
                   for k in (0, 10, 20)]


def test_bad_states_change_nothing(make_buffer):
    buf = make_buffer(SPEC, 1000)
    _fill(buf, writers=1, steps=100)
    before = len(buf)
    with pytest.raises(ValueError, match="format"):
        buf.load_state_dict({"columns": {}})
    with pytest.raises(ValueError, match="format"):
        buf.load_state_dict([1, 2])
    other = make_buffer({"x": ((), np.int64), "done": ((), np.bool_)}, 100)
    with pytest.raises(ValueError, match="schema"):
        buf.load_state_dict(other.state_dict())
    sd = buf.state_dict()
    del sd["episode"]
    with pytest.raises(ValueError, match="episode"):
        buf.load_state_dict(sd)
    assert len(buf) == before
    buf.close()
    with pytest.raises(shmbuf.BufferClosedError):
        buf.state_dict()


@pytest.mark.slow
def test_a_checkpoint_taken_while_writers_run_is_whole(make_buffer):
    buf = make_buffer(SPEC, 3000, chunk_size=16)
    with Writers(buf, 2, max_steps=10**7, episode_len=37):
        states = [buf.state_dict() for _ in range(5)]
    for sd in states:
        action = sd["columns"]["action"].numpy()
        writer, pos = action[:, 0].astype(int), action[:, 3].astype(int)
        for i in range(len(pos)):   # every step whole
            assert (sd["columns"]["obs"][i].numpy() == obs_for(writer[i], pos[i])).all()
        stream = sd["stream"].numpy()
        for s in np.unique(stream):   # a stream's steps are consecutive: no hole is joined
            mine = pos[stream == s]
            assert (np.diff(mine) == 1).all() and len(set(writer[stream == s])) == 1
        fresh = make_buffer(SPEC, 3000, chunk_size=16)
        fresh.load_state_dict(sd)
        verify_batch(fresh.sample_sequences(32, 20))
        fresh.close()


@pytest.mark.slow
def test_memory_is_one_copy_of_the_live_steps():
    """Peak RSS grows by about the live bytes (the copy), not twice that."""
    code = """
import resource, numpy as np, shmbuf
spec = {"obs": ((3, 64, 64), np.uint8), "done": ((), np.bool_)}
with shmbuf.create(spec, 8192, chunk_size=64) as buf:
    with buf.writer() as w:
        frame = np.ones((3, 64, 64), np.uint8)
        for i in range(8192):
            w.add(obs=frame, done=i % 500 == 499)
    import torch
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    sd = buf.state_dict()
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print((after - before) * 1024 / (8192 * 3 * 64 * 64))
"""
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert got.returncode == 0, got.stderr
    assert float(got.stdout.strip()) < 1.25


def test_a_chunk_recycled_while_copied_is_left_out_and_splits_its_stream(make_buffer,
                                                                          monkeypatch):
    buf = make_buffer(SPEC, 2000, chunk_size=16)
    _fill(buf, writers=1, steps=200, episode_len=1000)   # one long open episode
    ring = buf._ring
    live = ring.live_chunks()
    victim = int(live.chunk[3])
    real = ring.unchanged
    monkeypatch.setattr(ring, "unchanged", lambda c, s: real(c, s) & (c != victim))
    sd = buf.state_dict()
    monkeypatch.undo()
    assert len(sd["stream"]) == 200 - 16
    for t in sd["columns"].values():   # the copy was shrunk in place to its rows
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
    stream = sd["stream"].numpy()
    assert len(set(stream[:48].tolist())) == 1 and len(set(stream[48:].tolist())) == 1
    assert stream[0] != stream[48]
    other = make_buffer(SPEC, 2000, chunk_size=16)
    other.load_state_dict(sd)
    for _ in range(10):   # no window joins the two sides of the hole
        verify_batch(other.sample_sequences(16, 20))


def test_stream_ids_split_a_stream_where_its_chunks_do_not_link():
    """The one rule state_dict and save both split streams by (``disk.checkpoint.StreamIds``)."""
    from shmbuf.disk.checkpoint import StreamIds

    ids = StreamIds(first_gap_id=100)
    assert ids.of(7, chunk=3, seq=10, next_chunk=5, next_seq=12) == 7   # a stream's first chunk
    assert ids.of(8, chunk=4, seq=11, next_chunk=-1, next_seq=0) == 8   # another stream
    assert ids.of(7, chunk=5, seq=12, next_chunk=9, next_seq=20) == 7   # linked: same stream
    assert ids.of(7, chunk=2, seq=30, next_chunk=-1, next_seq=0) == 100  # (9, 20) was lost
    assert ids.of(7, chunk=6, seq=31, next_chunk=-1, next_seq=0) == 101  # unlinked again
    assert ids.of(8, chunk=1, seq=32, next_chunk=-1, next_seq=0) == 102
