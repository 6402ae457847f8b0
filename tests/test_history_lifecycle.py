"""HistoryBuffer and keyed rings stop, crash and restart like the step store.

The owner's close marks the segment closed, so workers stop with
BufferClosedError; a closed segment cannot be attached; after a SIGKILL,
``attach(name, own=True)`` takes the buffer over; SIGTERM unlinks it.
Owners, workers and adopters are real processes; every wait has a timeout.
Rival adopters, SIGTERM and ``handle_signals=False`` with a HistoryBuffer
owner are parametrized cases of test_adopt.py and test_signals.py.
"""
import json
import multiprocessing as mp
import os
import pickle

import numpy as np
import pytest
import torch
from helpers.history_workers import (
    SPEC,
    attach_until_closed,
    check_entries,
    check_saved,
    dead_owner_history,
    until_closed,
)
from helpers.keyed_workers import history_info, history_worker
from helpers.procs import join_all, reap
from helpers.shm import exists as shm_exists
from helpers.shm import own_entries
from helpers.stop_workers import TIMEOUT, Script

import shmbuf
from shmbuf import cli
from shmbuf.compat.history import HistoryBuffer
from shmbuf.disk import keyed_save as _keyed_save
from shmbuf.keyed import rings as keyed
from shmbuf.params import ParamBlock
from shmbuf.posix.wait import poll
from shmbuf.protocol import header as _header
from shmbuf.protocol.layout import CLOSED_OWNER
from shmbuf.segment.segment import _mark_closed
from shmbuf.segment.segment import unlink as unlink_segment

OTHER_PID = 1  # a closer that is not this process (init never closes anything of ours)


def closed_by_another_process(segment_holder) -> None:
    """Set the closed mark as an owner in another process would (the name stays)."""
    assert _header.mark_closed(segment_holder._segment.mmap, CLOSED_OWNER, OTHER_PID)


def receive(conn, timeout: float = TIMEOUT):
    assert conn.poll(timeout), f"no report from the child within {timeout} s"
    return conn.recv()


# -- the closed mark -------------------------------------------------------------------------
def test_every_call_of_keyed_rings_checks_the_closed_mark():
    with keyed.create({"x": ((), np.int64)}, n_keys=2, max_len=3) as rings:
        rings.append([0], {"x": np.array([7])})
        other = keyed.attach(rings.name)
        try:
            closed_by_another_process(rings)
            for call in (lambda r: r.append([1], {"x": np.array([1])}),
                         lambda r: r.read(None, lambda n: np.zeros((len(n), 1), np.int64)),
                         lambda r: r.bounds(), lambda r: r.bounds_of(0), lambda r: r.counts(),
                         lambda r: r.lengths(), lambda r: r.reset([0]), lambda r: r.snapshot()):
                for handle in (rings, other):
                    with pytest.raises(shmbuf.BufferClosedError,
                                       match=f"closed by its owner \\(pid {OTHER_PID}\\)"):
                        call(handle)
        finally:
            other.close()


def test_the_process_that_closed_keeps_its_mapping():
    buf = HistoryBuffer(2, 4, spec=SPEC)
    buf.append(history_info([0, 1], 1))
    buf.unlink()  # marks it closed in this process: this process carries on
    buf.append(history_info([0, 1], 2))
    assert buf.get(1)["step"].tolist() == [[2], [2]]
    buf.close()


def test_attach_refuses_a_closed_segment_and_lazy_handles_learn_it():
    buf = HistoryBuffer(2, 4)
    early = pickle.loads(pickle.dumps(buf))  # attaches lazily, once the segment is sized
    try:
        buf.append(history_info([0, 1], 1))
        _mark_closed(buf.name, CLOSED_OWNER)  # closed, its name not removed yet
        for attach in (HistoryBuffer.attach, shmbuf.attach, keyed.attach,
                       keyed.attach_if_published, lambda n: HistoryBuffer.attach(n, own=True),
                       lambda n: pickle.loads(pickle.dumps(buf))):
            with pytest.raises(shmbuf.BufferClosedError, match="closed by its owner"):
                attach(buf.name)
        with pytest.raises(shmbuf.BufferClosedError, match="closed by its owner"):
            early.get(1)
    finally:
        early.close()
        buf.close()
    assert not shm_exists(buf.name)


def test_a_lazy_handle_whose_owner_closed_before_sizing_gets_buffer_closed():
    buf = HistoryBuffer(2, 4)
    early = pickle.loads(pickle.dumps(buf))
    buf.close()  # never sized: only the name was taken, and now it is gone
    try:
        for call in (lambda: early.get(1), lambda: early.append(history_info([0, 1], 1)),
                     lambda: early.reset()):
            with pytest.raises(shmbuf.BufferClosedError, match="closed by its owner"):
                call()
    finally:
        early.close()


def test_a_parameter_block_reader_learns_that_the_trainer_closed():
    with ParamBlock.create({"w": np.zeros(3, np.float32)}) as block:
        block.publish({"w": np.ones(3, np.float32)})
        actor = ParamBlock.attach(block.name)
        try:
            closed_by_another_process(block._rings)
            with pytest.raises(shmbuf.BufferClosedError, match="closed by its owner"):
                actor.wait_version(2, timeout=TIMEOUT)
            with pytest.raises(shmbuf.BufferClosedError):
                actor.read()
        finally:
            actor.close()


@pytest.mark.slow
@pytest.mark.parametrize("op", ["append", "get"])
def test_a_worker_stops_with_buffer_closed_when_the_owner_closes(op):
    ctx = mp.get_context("spawn")
    buf = HistoryBuffer(4, 8, action_block=1, spec=SPEC)
    buf.append(history_info(np.arange(4), 0))  # something to get
    name = buf.name
    report, child_end = ctx.Pipe()
    worker = ctx.Process(target=until_closed, args=(buf, [1, 3], child_end, op))
    try:
        worker.start()
        assert receive(report) == "running"
        buf.close()  # marks it closed, then unlinks it
        kind, calls, message = receive(report)
        assert kind == "closed", message
        assert "closed by its owner" in message and f"pid {os.getpid()}" in message
        assert repr(name) in message
        join_all([worker], TIMEOUT)
        assert not shm_exists(name)
    finally:
        buf.close()
        reap([worker])


# -- adoption ----------------------------------------------------------------------------------
def remove(name: str) -> None:
    if shm_exists(name):
        unlink_segment(name)


def test_a_live_owner_is_never_replaced():
    with HistoryBuffer(2, 4, spec=SPEC) as buf:
        for adopt in (lambda: HistoryBuffer.attach(buf.name, own=True),
                      lambda: shmbuf.attach(buf.name, own=True),
                      lambda: keyed.attach(buf.name, own=True)):
            with pytest.raises(shmbuf.OwnerAliveError,
                               match=f"owned by pid {os.getpid()}, which is alive"):
                adopt()
        assert shm_exists(buf.name) and buf.owner
        buf.append(history_info([0, 1], 1))


def test_adopting_another_kind_of_keyed_rings_leaves_them_alone():
    with ParamBlock.create({"w": np.zeros(2, np.float32)}) as block:
        with pytest.raises(shmbuf.CorruptSegmentError, match="not made by a HistoryBuffer"):
            HistoryBuffer.attach(block.name, own=True)
        assert shm_exists(block.name) and block.owner


@pytest.mark.slow
def test_the_adopter_keeps_the_data_and_the_workers_keep_appending():
    name = dead_owner_history()
    ctx = mp.get_context("spawn")
    report, child_end = ctx.Pipe()
    worker = ctx.Process(target=attach_until_closed, args=(name, [2, 3], child_end))
    buf = None
    try:
        worker.start()
        assert receive(report) == "running"  # attached before the adoption
        buf = HistoryBuffer.attach(name, own=True)
        assert buf.owner and (buf.n_envs, buf.max_len) == (4, 8)
        out = buf.get(5, [0])
        assert out["step"].tolist() == [[1, 2, 3, 4, 5]]  # the dead owner's entries
        check_entries(out, [0])
        seen = int(buf.get(1, [2])["step"][0, 0])
        poll(lambda: True if buf.get(1, [2])["step"][0, 0] > seen + 50 else None, TIMEOUT,
             lambda: AssertionError("the worker stopped appending after the adoption"))
        check_entries(buf.get(8, [2, 3]), [2, 3])
        buf.append(history_info([0], 6), env_ids=[0])  # the adopter appends too
        buf.close()  # the adopter unlinks, and the worker learns it
        assert not shm_exists(name)
        kind, _, message = receive(report)
        assert kind == "closed" and f"closed by its owner (pid {os.getpid()})" in message
        join_all([worker], TIMEOUT)
    finally:
        if buf is not None:
            buf.close()
        reap([worker])
        remove(name)


@pytest.mark.slow
def test_shmbuf_attach_adopts_a_history_buffer_and_gc_spares_it(capsys):
    name = dead_owner_history()
    try:
        with shmbuf.attach(name, own=True, handle_signals=False) as buf:
            assert isinstance(buf, HistoryBuffer) and buf.owner and len(buf) == 0
            assert buf.num_strided([0]) == [5]
            assert cli.main(["gc", name]) == 0
            assert shm_exists(name)  # its creator is dead, but its owner now is alive
            assert cli.main(["info", name]) == 0
            assert f"pid {os.getpid()} alive adopted" in capsys.readouterr().out
        assert not shm_exists(name)
    finally:
        remove(name)


# -- SIGTERM (a script owner's death by SIGTERM: test_signals.py, test_adopt.py) ----------------
def test_owners_install_the_handler_until_the_last_closes():
    # In a fresh interpreter, where SIGTERM has its default action whatever handler an
    # earlier test left in this one (ray.init installs Ray's).
    script = Script("""
        import signal
        import numpy as np
        from shmbuf import HistoryBuffer
        from shmbuf.params import ParamBlock
        from shmbuf.posix import signals as _signals
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        history = HistoryBuffer(2, 4)  # owns its name before it has a schema
        assert _signals.installed()
        block = ParamBlock.create({"w": np.zeros(2, np.float32)})
        history.close()
        assert _signals.installed()
        block.close()
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        with HistoryBuffer(2, 4, handle_signals=False), \\
                ParamBlock.create({"w": np.zeros(1)}, handle_signals=False):
            assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        print("checked", flush=True)
    """)
    try:
        assert script.line() == "checked"
        assert script.wait() == 0, script.stderr()
    finally:
        script.close()


def test_handle_signals_is_checked_before_anything_is_created():
    before = own_entries()
    for make in (lambda: HistoryBuffer(2, 4, handle_signals="yes"),
                 lambda: ParamBlock.create({"w": np.zeros(1)}, handle_signals=1),
                 lambda: keyed.attach("shmbuf-test-none", own=True, handle_signals="no")):
        with pytest.raises(TypeError, match="handle_signals must be None, True or False"):
            make()
    assert own_entries() <= before


# -- save and load -------------------------------------------------------------------------------
def fill(buf, env_steps: dict) -> None:
    """Append steps 1..n to each env (``{env: n}``), one env at a time, with every key."""
    for env, n in env_steps.items():
        for t in range(1, n + 1):
            info = history_info([env], t)
            info["task"] = f"e{env}t{t}"
            info["value"] = torch.full((1,), t / 2)
            buf.append(info, env_ids=[env])


def history_with_every_kind_of_env() -> HistoryBuffer:
    """Env 0 partly filled, env 1 wrapped round its ring, env 2 reset, env 3 empty."""
    buf = HistoryBuffer(4, 5, action_block=2, block_keys=("action",),
                         spec={**SPEC, "task": ((), "U8"), "value": ((), torch.float32)})
    fill(buf, {0: 3, 1: 12, 2: 4})
    buf.reset([2])
    fill(buf, {2: 2})
    return buf


def contents(buf: HistoryBuffer):
    lengths, entries = buf._rings.snapshot()
    return lengths.tolist(), {k: v.tolist() for k, v in entries.items()}


def our_segments():
    """This test session's generated segments (others' sessions come and go)."""
    mine = "shmbuf-" + os.environ["SHMBUF_NAME_TAG"]
    return {n for n in os.listdir("/dev/shm") if n.startswith(mine)}


def test_save_and_load_round_trip(tmp_path):
    path = tmp_path / "history"
    with history_with_every_kind_of_env() as buf:
        assert buf.save(path) == 3 + 5 + 2
        assert sorted(os.listdir(path)) == ["_lengths.npy", "k0.npy", "k1.npy", "k2.npy",
                                            "k3.npy", "k4.npy", "manifest.json"]
        for load in (HistoryBuffer.load, shmbuf.load):
            with load(path) as loaded:
                assert isinstance(loaded, HistoryBuffer) and loaded.owner
                assert loaded.name != buf.name and contents(loaded) == contents(buf)
                assert (loaded.n_envs, loaded.max_len, loaded.action_block,
                        loaded.block_keys) == (4, 5, 2, {"action"})
                mine, theirs = buf.get(3, [1, 0, 2]), loaded.get(3, [1, 0, 2])
                assert isinstance(theirs["value"], torch.Tensor)
                assert {k: v.tolist() for k, v in mine.items()} == \
                    {k: v.tolist() for k, v in theirs.items()}
                assert loaded.num_strided() == [2, 3, 1, 0]
                loaded.append({**history_info([3], 1), "task": "new", "value": torch.ones(1)},
                              env_ids=[3])
                assert loaded.num_strided() == [2, 3, 1, 1]


def test_a_save_is_plain_npy_files(tmp_path):
    path = tmp_path / "history"
    with history_with_every_kind_of_env() as buf:
        buf.save(path)
        lengths, entries = buf._rings.snapshot()
    assert np.load(path / "_lengths.npy").tolist() == [3, 5, 2, 0]
    for column, expected in entries.items():
        mapped = np.load(path / f"{column}.npy", mmap_mode="r")
        assert isinstance(mapped, np.memmap) and (mapped == expected).all()
    steps = np.load(path / "k1.npy")  # "step", the second key
    assert steps.tolist() == [1, 2, 3, 8, 9, 10, 11, 12, 1, 2]  # env 1 kept its newest 5
    assert np.load(path / "k3.npy")[:3].tolist() == ["e0t1", "e0t2", "e0t3"]


def test_save_copies_a_bounded_group_of_envs_at_a_time(tmp_path, monkeypatch):
    calls, snapshot = [], keyed.KeyedRings.snapshot

    def spy(rings, keys=None):
        calls.append(keys.tolist())
        return snapshot(rings, keys)

    monkeypatch.setattr(keyed.KeyedRings, "snapshot", spy)
    with HistoryBuffer(5, 4, spec={"x": ((10,), np.float64)}) as buf:  # 80 bytes an entry
        monkeypatch.setattr(_keyed_save, "GROUP_BYTES", 2 * 4 * 80)  # two envs' entries
        for t in range(6):
            buf.append({"x": np.full((5, 10), t, np.float64)})
        assert buf.save(tmp_path / "history") == 20
        assert calls == [[0, 1], [2, 3], [4]]
        monkeypatch.undo()
        with HistoryBuffer.load(tmp_path / "history") as loaded:
            assert contents(loaded) == contents(buf)


@pytest.mark.slow
def test_saves_while_a_worker_appends_hold_whole_consecutive_entries(tmp_path):
    ctx = mp.get_context("spawn")
    buf = HistoryBuffer(4, 64, spec=SPEC)
    buf.append(history_info(np.arange(4), 0))
    go_r, go_w = ctx.Pipe(duplex=False)
    stop_r, stop_w = ctx.Pipe(duplex=False)
    ready_r, ready_w = ctx.Pipe(duplex=False)
    worker = ctx.Process(target=history_worker, args=(buf, [0, 1, 2, 3], go_r, stop_r,
                                                      ready_w, 10_000_000))
    try:
        worker.start()
        go_w.send(True)
        assert receive(ready_r) == 10
        newest = []
        for i in range(6):
            path = tmp_path / f"save{i}"
            buf.save(path)
            lengths = np.load(path / "_lengths.npy")
            entries = {s.key: np.load(path / f"{s.column}.npy", mmap_mode="r")
                       for s in buf._schema}
            check_saved(lengths, entries, range(4))
            newest.append(int(entries["step"][lengths[0] - 1]))
            with HistoryBuffer.load(path) as loaded:
                check_entries(loaded.get(64), range(4))
        assert newest == sorted(newest) and newest[-1] > newest[0]  # saved while it appended
        stop_w.send(True)
        join_all([worker], TIMEOUT)
    finally:
        stop_w.send(True)
        reap([worker])
        buf.close()


def test_an_existing_path_needs_overwrite(tmp_path):
    path = tmp_path / "history"
    with HistoryBuffer(2, 3, spec=SPEC) as buf:
        buf.append(history_info([0, 1], 1))
        buf.save(path)
        buf.append(history_info([0, 1], 2))
        with pytest.raises(shmbuf.SaveExistsError, match="overwrite=True"):
            buf.save(path)
        assert buf.save(path, overwrite=True) == 4
        (tmp_path / "mine").mkdir()
        (tmp_path / "mine" / "notes.txt").write_text("keep me")
        with pytest.raises(shmbuf.SaveExistsError, match="only a"):
            buf.save(tmp_path / "mine", overwrite=True)
    with HistoryBuffer.load(path) as loaded:
        assert loaded.get(2)["step"].tolist() == [[1, 2], [1, 2]]
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_nothing_to_save_and_no_capacity_to_change(tmp_path):
    with HistoryBuffer(2, 3) as buf:
        with pytest.raises(ValueError, match="no schema yet"):
            buf.save(tmp_path / "empty")
        buf.append({"x": np.zeros(2)})
        buf.reset()
        assert buf.save(tmp_path / "reset") == 0
    with pytest.raises(ValueError, match="capacity=None"):
        shmbuf.load(tmp_path / "reset", capacity=10)
    with shmbuf.load(tmp_path / "reset") as loaded:
        assert loaded.num_strided() == [0, 0] and loaded.get(1) is None


def _tamper(path, how):
    manifest = json.loads((path / "manifest.json").read_text())
    if how == "truncated column":
        with open(path / "k0.npy", "r+b") as f:
            f.truncate(os.path.getsize(path / "k0.npy") - 10)
    elif how == "missing lengths":
        os.unlink(path / "_lengths.npy")
    elif how == "lengths off":
        np.save(path / "_lengths.npy", np.array([1, 1], np.int64))
    elif how == "too long":
        np.save(path / "_lengths.npy", np.array([9, -5], np.int64))
    elif how == "manifest not json":
        (path / "manifest.json").write_text("{")
    else:
        if how == "rows":
            manifest["rows"] = 99
        elif how == "n_keys":
            manifest["n_keys"] = "4"
        elif how == "dtype":
            manifest["spec"]["k1"]["dtype"] = "<f8"
        elif how == "params":
            manifest["meta"]["params"]["action_block"] = 0
        elif how == "n_envs":
            manifest["meta"]["params"]["n_envs"] = 3
        elif how == "keys":
            manifest["meta"]["keys"] = manifest["meta"]["keys"][:1]
        elif how == "meta":
            manifest["meta"] = ["HistoryBuffer"]
        (path / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("how, says", [
    ("truncated column", "k0.npy is truncated"),
    ("missing lengths", "_lengths.npy is missing"),
    ("lengths off", "adding up to the manifest's 4 rows"),
    ("too long", "0 to 3 entries"),
    ("manifest not json", "not readable JSON"),
    ("rows", "adding up to the manifest's 99 rows"),
    ("n_keys", "'n_keys' is '4'"),
    ("dtype", "schema does not match"),
    ("params", "action_block must be"),
    ("n_envs", "do not fit 2 keys"),
    ("keys", "do not name the columns"),
    ("meta", "not by a HistoryBuffer"),
])
def test_a_damaged_save_is_a_clear_error_and_creates_nothing(tmp_path, how, says):
    path = tmp_path / "history"
    with HistoryBuffer(2, 3, spec=SPEC) as buf:
        for t in (1, 2):
            buf.append(history_info([0, 1], t))
        buf.save(path)
    _tamper(path, how)
    before = our_segments()
    for load in (HistoryBuffer.load, shmbuf.load):
        with pytest.raises(shmbuf.CorruptSaveError, match=says) as info:
            load(path)
        assert str(path) in str(info.value)
    assert our_segments() <= before


def test_each_class_refuses_the_others_save_naming_who_made_it(tmp_path, make_buffer):
    with HistoryBuffer(2, 3, spec=SPEC) as buf:
        buf.append(history_info([0, 1], 1))
        buf.save(tmp_path / "history")
    make_buffer({"x": ((), np.float32)}, 16, done_key=None).save(tmp_path / "store")
    rb = shmbuf.ReplayBuffer(16, (3, 8, 8), 6, seq_len=2, batch_size=2)
    try:
        rb.add({"image": np.zeros((3, 8, 8), np.uint8)}, np.zeros(6), 0.0, False)
        rb.save(tmp_path / "replay")
    finally:
        rb.close()
    before = our_segments()
    for path, made_by in (("store", "a plain shmbuf Buffer"),
                          ("replay", "torchwm.dreamer.ReplayBuffer")):
        with pytest.raises(shmbuf.CorruptSaveError,
                           match=f"saved by {made_by}, not by a HistoryBuffer"):
            HistoryBuffer.load(tmp_path / path)
    with pytest.raises(shmbuf.CorruptSaveError, match="saved by HistoryBuffer .kind 'keyed'"):
        shmbuf.ReplayBuffer.load(tmp_path / "history")
    with pytest.raises(FileNotFoundError):
        HistoryBuffer.load(tmp_path / "nothing")
    assert our_segments() <= before
