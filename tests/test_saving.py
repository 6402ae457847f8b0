"""Saving to disk and loading back: format, consistency under writers, incremental, bad input."""
import json
import os
import shutil
import signal
import tracemalloc

import numpy as np
import pytest
from helpers.stop_workers import Script
from helpers.workers import SPEC, obs_for, step_for, verify_batch

import shmbuf
from shmbuf.disk import saved as _saved


def fill(buf, streams=3, steps=150, cut_every=None, episode_len=20):
    """Encoded steps in ``streams`` writers; terminal every ``episode_len``, cuts if asked."""
    for wid in range(streams):
        with buf.writer() as w:
            for pos in range(steps):
                t = pos % episode_len
                w.add(**step_for(wid, pos, pos // episode_len, t, t == episode_len - 1))
                if cut_every and pos % cut_every == cut_every - 1 and t != episode_len - 1:
                    w.end_episode()


def by_stream(state):
    """{stream id: (positions, episode numbers)} of a snapshot or a loaded save."""
    out = {}
    for sid in np.unique(state["stream"]):
        rows = np.flatnonzero(state["stream"] == sid)
        out[int(sid)] = (state["columns"]["action"][rows, 3], np.asarray(state["episode"])[rows])
    return out


def check_rows(columns):
    """Every saved row is a whole step: its obs and checksum match its (writer, position)."""
    action, obs = np.asarray(columns["action"]), np.asarray(columns["obs"])
    for i in range(len(action)):
        expect = obs_for(int(action[i, 0]), int(action[i, 3]))
        assert (obs[i] == expect).all(), f"torn row {i}"
        assert float(int(expect.sum()) % 65521) == action[i, 4]


def test_round_trip_keeps_steps_streams_and_episodes(make_buffer, tmp_path):
    buf = make_buffer(SPEC, 1000, chunk_size=16)
    fill(buf, cut_every=7)
    with buf.writer() as w:  # a vectorised env: one stream per row
        for pos in range(40):
            steps = [step_for(10 + e, pos, pos // 9, pos % 9, pos % 9 == 8) for e in range(2)]
            w.add_batch(**{k: np.stack([s[k] for s in steps]) for k in steps[0]})
    path = tmp_path / "save"
    assert buf.save(path) == len(buf) == 530
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["format"] == "shmbuf-save" and manifest["rows"] == 530
    assert manifest["spec"]["obs"] == {"shape": [3, 8, 8], "dtype": "|u1"}
    for name, (shape, dtype) in SPEC.items():  # numpy alone reads every column, mapped
        arr = np.load(path / f"{name}.npy", mmap_mode="r")
        assert isinstance(arr, np.memmap) and arr.shape == (530,) + shape and arr.dtype == dtype
    assert np.load(path / "_stream.npy").dtype == np.int64
    check_rows({k: np.load(path / f"{k}.npy") for k in ("obs", "action")})
    with shmbuf.load(path) as back:
        assert (back.capacity, back.chunk_size, back.spec) == (1000, 16, buf.spec)
        original, loaded = buf.snapshot(), back.snapshot()
        a, b = by_stream(original), by_stream(loaded)
        assert sorted(len(p) for p, _ in a.values()) == sorted(len(p) for p, _ in b.values())
        assert sorted(tuple(p) for p, _ in a.values()) == sorted(tuple(p) for p, _ in b.values())
        for column in SPEC:
            assert np.array_equal(np.sort(original["columns"][column], axis=0),
                                  np.sort(loaded["columns"][column], axis=0))
        ea, eb = buf.episodes(), back.episodes()
        assert sorted(zip(ea.length, ea.terminal)) == sorted(zip(eb.length, eb.terminal))
        verify_batch(back.sample_sequences(16, 5))


def test_load_options(make_buffer, tmp_path):
    buf = make_buffer(SPEC, 1000, chunk_size=16)
    fill(buf, streams=2, steps=200)
    buf.save(tmp_path / "s")
    name = f"shmbuf-test-load-{os.getpid()}"
    with shmbuf.load(tmp_path / "s", name=name, capacity=128) as small:
        assert small.name == name and small.capacity == 128
        held = small.snapshot()["columns"]["action"]
        assert 0 < len(held) <= 128
        assert held[:, 3].min() >= 200 - 128  # the newest steps are kept
        verify_batch(small.sample_sequences(4, 4))


def test_an_empty_buffer_saves_and_loads(make_buffer, tmp_path):
    buf = make_buffer(SPEC, 64)
    assert buf.save(tmp_path / "e") == 0
    assert np.load(tmp_path / "e" / "obs.npy").shape == (0, 3, 8, 8)
    with shmbuf.load(tmp_path / "e") as back:
        assert len(back) == 0


@pytest.mark.slow
def test_saves_while_writers_run_hold_whole_steps_and_unbroken_streams(make_buffer, tmp_path):
    buf = make_buffer(SPEC, 256, chunk_size=4)  # recycled all the time
    writer = Script(f"""
        import shmbuf
        from helpers.stop_workers import write_forever
        print("writing", flush=True)
        write_forever(shmbuf.attach({buf.name!r}), 7, episode_len=13)
    """)
    try:
        assert writer.line() == "writing"
        buf.wait_ready(128, timeout=60)
        for i in range(20):
            path = tmp_path / f"s{i}"
            buf.save(path)
            manifest, state = _saved.open_save(path)
            check_rows(state["columns"])
            for positions, _ in by_stream(state).values():  # a gap starts a new stream id
                assert (np.diff(positions) == 1).all()
            with shmbuf.load(path) as back:
                if len(back) >= 8:
                    verify_batch(back.sample_sequences(8, 3))
    finally:
        writer.close()


def test_save_holds_at_most_one_chunk_of_extra_memory(make_buffer, tmp_path):
    buf = make_buffer(SPEC, 20_000, chunk_size=500)
    fill(buf, streams=4, steps=5000)
    chunk_bytes = 500 * sum(int(np.prod(s)) * np.dtype(d).itemsize for s, d in SPEC.values())
    tracemalloc.start()
    try:
        buf.save(tmp_path / "m")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    total = os.path.getsize(tmp_path / "m" / "obs.npy")
    assert total > 3_000_000
    # Steps are written straight from the mapping; besides them, a save reads the
    # episode index (metadata, 64 bytes an episode slot) to record where episodes end.
    index_bytes = 2 * buf._layout.episode_slots * 64
    assert peak < chunk_bytes + index_bytes, (peak, chunk_bytes, index_bytes)


def test_incremental_save_appends_sealed_chunks(make_buffer, tmp_path):
    buf = make_buffer(SPEC, 1000, chunk_size=10)
    path = tmp_path / "inc"
    saver = buf.save(path, follow=True, interval=3600)  # flushed by hand here
    assert isinstance(saver, shmbuf.Saver)
    w = buf.writer()
    for pos in range(25):
        w.add(**step_for(0, pos, 0, pos, False))
    assert saver.flush() == 20  # two sealed chunks; the open one (5 steps) waits
    assert np.load(path / "obs.npy", mmap_mode="r").shape[0] == 20
    snapshot = tmp_path / "after-reboot"  # what a reboot right now would leave
    shutil.copytree(path, snapshot)
    for pos in range(25, 32):
        w.add(**step_for(0, pos, 0, pos, False))
    assert saver.flush() == 10
    saver.close()  # the open chunk too
    assert saver.rows == 32
    _, state = _saved.open_save(path)
    assert state["columns"]["action"][:, 3].tolist() == list(range(32))
    _, early = _saved.open_save(snapshot)
    assert early["columns"]["action"][:, 3].tolist() == list(range(20))
    with shmbuf.load(snapshot) as back:
        verify_batch(back.sample_sequences(4, 5))
    w.close()


def test_buffer_close_stops_its_saver(make_buffer, tmp_path):
    buf = make_buffer(SPEC, 1000, chunk_size=10)
    saver = buf.save(tmp_path / "c", follow=True, interval=3600)
    fill(buf, streams=1, steps=15)
    buf.close()
    assert saver.closed and saver.rows == 15
    with pytest.raises(shmbuf.BufferClosedError):
        saver.flush()


@pytest.mark.slow
def test_a_killed_process_loses_at_most_the_open_chunks(tmp_path):
    path = tmp_path / "k"
    trainer = Script(f"""
        import shmbuf
        from helpers.workers import SPEC, step_for
        buf = shmbuf.create(SPEC, 4000, chunk_size=16, handle_signals=False)
        saver = buf.save({str(path)!r}, follow=True, interval=3600)
        w = buf.writer()
        for pos in range(1000):
            w.add(**step_for(0, pos, pos // 50, pos % 50, pos % 50 == 49))
            if pos % 100 == 99:
                saver.flush()
                print(saver.rows, flush=True)
        print(buf.name, flush=True)
        import time; time.sleep(600)
    """)
    name = None
    try:
        rows = [int(trainer.line()) for _ in range(10)]
        name = trainer.line()
        trainer.signal(signal.SIGKILL)
        trainer.wait()
        manifest, state = _saved.open_save(path)
        assert manifest["rows"] == rows[-1] == 992  # 62 sealed chunks; the open one is lost
        assert state["columns"]["action"][:, 3].tolist() == list(range(992))
        with shmbuf.load(path) as back:
            assert len(back) == 992
            verify_batch(back.sample_sequences(8, 10))
    finally:
        trainer.close()
        if name:
            shmbuf.attach(name, own=True).close()


# -- bad input ----------------------------------------------------------------------
@pytest.fixture
def saved(make_buffer, tmp_path):
    buf = make_buffer(SPEC, 100, chunk_size=10)
    fill(buf, streams=1, steps=30)
    buf.save(tmp_path / "ok")
    return buf, tmp_path / "ok"


def test_an_existing_path_needs_overwrite(saved, tmp_path):
    buf, path = saved
    with pytest.raises(shmbuf.SaveExistsError, match="overwrite=True") as info:
        buf.save(path)
    assert isinstance(info.value, FileExistsError)
    assert buf.save(path, overwrite=True) == 30  # a save is replaced
    (tmp_path / "file").write_text("x")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    for other in ("file", "mine"):
        with pytest.raises(shmbuf.SaveExistsError, match="only a"):
            buf.save(tmp_path / other, overwrite=True)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def _corrupt(path, how):
    if how == "truncated column":
        with open(path / "obs.npy", "r+b") as f:
            f.truncate(os.path.getsize(path / "obs.npy") - 100)
    elif how == "missing column":
        os.unlink(path / "reward.npy")
    elif how == "no manifest":
        os.unlink(path / "manifest.json")
    elif how == "manifest not json":
        (path / "manifest.json").write_bytes(b"\x00{{{")
    elif how == "more rows than saved":
        m = json.loads((path / "manifest.json").read_text())
        m["rows"] = 10_000
        (path / "manifest.json").write_text(json.dumps(m))
    elif how == "schema changed":
        m = json.loads((path / "manifest.json").read_text())
        m["spec"]["obs"]["dtype"] = "<f4"
        (path / "manifest.json").write_text(json.dumps(m))
    elif how == "bad schema":
        m = json.loads((path / "manifest.json").read_text())
        m["spec"]["obs"] = {"shape": "big"}
        (path / "manifest.json").write_text(json.dumps(m))
    elif how == "garbage npy header":
        with open(path / "action.npy", "r+b") as f:
            f.write(b"\x93NUMPY\x01\x00\xff\x00{'descr': <<<")
    elif how == "newer format":
        m = json.loads((path / "manifest.json").read_text())
        m["version"] = 99
        (path / "manifest.json").write_text(json.dumps(m))
    elif how == "negative rows":
        m = json.loads((path / "manifest.json").read_text())
        m["rows"] = -1
        (path / "manifest.json").write_text(json.dumps(m))


@pytest.mark.parametrize("how, says", [
    ("truncated column", "obs.npy is truncated"),
    ("missing column", "reward.npy is missing"),
    ("no manifest", "has no manifest.json"),
    ("manifest not json", "not readable JSON"),
    ("more rows than saved", "truncated"),
    ("schema changed", "schema does not match"),
    ("bad schema", "schema is invalid"),
    ("garbage npy header", "action.npy is not a readable .npy"),
    ("newer format", "version 99"),
    ("negative rows", "'rows' is -1"),
])
def test_a_damaged_save_is_a_clear_error_and_creates_nothing(saved, how, says):
    _, path = saved
    _corrupt(path, how)
    before = _our_segments()
    with pytest.raises(shmbuf.CorruptSaveError, match=says) as info:
        shmbuf.load(path)
    assert isinstance(info.value, ValueError) and str(path) in str(info.value)
    assert _our_segments() <= before


def _our_segments():
    """This test session's segments (load names them with its tag; others' runs come and go)."""
    mine = "shmbuf-" + os.environ["SHMBUF_NAME_TAG"]
    return {n for n in os.listdir("/dev/shm") if n.startswith(mine)}


def test_loading_nothing(tmp_path):
    with pytest.raises(FileNotFoundError):
        shmbuf.load(tmp_path / "nope")


def test_saving_a_closed_buffer(make_buffer, tmp_path):
    buf = make_buffer(SPEC, 16)
    buf.close()
    with pytest.raises(shmbuf.BufferClosedError):
        buf.save(tmp_path / "x")
    assert not (tmp_path / "x").exists()


# -- the seed facades ---------------------------------------------------------------
def test_a_facade_saves_and_loads_as_itself(tmp_path):
    from shmbuf import Memory, ReplayBuffer

    with ReplayBuffer(200, (3, 8, 8), 6, seq_len=4, batch_size=8, seed=0) as rb:
        for t in range(60):
            rb.add({"image": np.full((3, 8, 8), t, np.uint8)}, np.full(6, t, np.float32),
                   float(t), t % 15 == 14)
        rb.save(tmp_path / "rb")
        with ReplayBuffer.load(tmp_path / "rb") as back:
            assert isinstance(back, ReplayBuffer) and back.owner and len(back.buffer) == 60
            obs, act, rew, term = back.sample()
            assert obs.shape == (4, 8, 3, 8, 8)
            assert (act[..., 0] == rew).all()  # rows stay whole
        with shmbuf.load(tmp_path / "rb") as back:
            assert isinstance(back, ReplayBuffer)
        with pytest.raises(shmbuf.CorruptSaveError, match="saved by torchwm.dreamer.ReplayBuffer"):
            Memory.load(tmp_path / "rb")
        with pytest.raises(ValueError, match="keeps its own capacity"):
            shmbuf.load(tmp_path / "rb", capacity=10)


def test_many_streams_load_back(make_buffer, tmp_path):
    buf = make_buffer(SPEC, 4000, chunk_size=4, max_writers=4)
    with buf.writer() as w:  # 200 env streams from one writer, interleaved in the save
        for pos in range(6):
            steps = [step_for(e, pos, 0, pos, False) for e in range(200)]
            w.add_batch(**{k: np.stack([s[k] for s in steps]) for k in steps[0]})
    buf.save(tmp_path / "many")
    with shmbuf.load(tmp_path / "many") as back:
        assert len(back) == 1200
        verify_batch(back.sample_sequences(16, 6))


@pytest.mark.parametrize("follow", [False, True])
def test_a_cut_last_episode_stays_finished_and_episodes_end_in_order(make_buffer, tmp_path,
                                                                    follow):
    buf = make_buffer(SPEC, 1000, chunk_size=8)
    path = tmp_path / "cut"
    saver = buf.save(path, follow=True, interval=3600) if follow else None
    writers = [buf.writer() for _ in range(2)]
    for pos in range(30):  # two streams, episodes ending interleaved
        for wid, w in enumerate(writers):
            w.add(**step_for(wid, pos, 0, pos, pos == 12 + wid))
        if saver is not None and pos % 10 == 9:
            saver.flush()
    writers[0].end_episode()  # the last episode of stream 0 is finished by a cut
    if saver is None:
        buf.save(path)
    else:
        saver.close()
    before = buf.episodes()
    with shmbuf.load(path) as back:
        after = back.episodes()
        assert list(zip(after.length, after.terminal)) == list(zip(before.length,
                                                                   before.terminal))
        assert len(after) == 3 and not after.terminal[-1]  # the cut one too
    for w in writers:
        w.close()


@pytest.mark.parametrize("capacity", [10, 1, 30])
def test_a_capacity_below_a_saved_chunk_keeps_the_newest_steps(make_buffer, tmp_path, capacity):
    # Saved chunks of 14 steps; the new buffer holds fewer than one of them.
    spec = {"x": ((), np.int64), "done": ((), np.bool_)}
    buf = make_buffer(spec, 64 * 14, chunk_size=14)
    with buf.writer() as w:
        w.extend(x=np.arange(100), done=np.arange(100) % 30 == 29)
    buf.save(tmp_path / "s")
    loaded = shmbuf.load(tmp_path / "s", capacity=capacity)
    restored = make_buffer(spec, capacity)
    restored.load_state_dict(buf.state_dict())   # the same rule for checkpoints
    try:
        for small in (loaded, restored):
            assert len(small) == capacity
            held = set(small.sample_steps(200, rng=0)["x"].tolist())
            assert held == set(range(100 - capacity, 100))
            windows = small.sample_sequences(50, min(capacity, 5), rng=0)["x"]
            assert (np.diff(windows, axis=0) == 1).all()   # in order, never past an end
    finally:
        loaded.close()
