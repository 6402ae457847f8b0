"""DIAMOND ReplayBuffer and SequenceDataset, from the documented contract.

Steps are encoded (helpers/diamond_workers.py): every sampled element is checked
against the step it came from, so a wrong frame, a next_obs that is not the
immediate next frame, a spliced or cross-episode window, or a truncated
continuous action cannot pass.
"""
import multiprocessing as mp
import os
import pickle

import numpy as np
import pytest
import torch
from helpers.diamond_workers import (
    CUT_FROM,
    OBS_SHAPE,
    A,
    C,
    H,
    W,
    add_steps,
    check_items,
    check_sequences,
    check_steps,
    frame,
    identities,
    step,
    write_worker,
)
from helpers.procs import join_all, running
from torch.utils.data import DataLoader, default_collate

import shmbuf
from shmbuf import BufferClosedError, CorruptSegmentError, NotEnoughDataError, SegmentNotFoundError
from shmbuf.diamond import ReplayBuffer, SequenceDataset

ITEM_KEYS = {"obs_seq", "action_seq", "actions", "rewards", "dones", "next_obs",
             "burn_in_obs", "burn_in_actions"}


@pytest.fixture
def make_rb():
    """A small encoded-step ReplayBuffer, closed (so unlinked) at teardown."""
    made = []

    def make(capacity=500, **kw):
        kw.setdefault("obs_shape", OBS_SHAPE)
        kw.setdefault("action_dim", A)
        kw.setdefault("seed", 0)
        rb = ReplayBuffer(capacity, **kw)
        made.append(rb)
        return rb

    yield make
    for rb in made:
        rb.close()


def epoch(loader) -> list:
    """Check every batch of one pass over ``loader``; their (B, T, 4) step ids."""
    return [check_items(batch) for batch in loader]


# -- the documentation's example ----------------------------------------------------


@pytest.mark.slow
def test_docs_example(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    frames = np.random.default_rng(0).integers(0, 256, (101, 64, 64, 3), dtype=np.uint8)
    expect = torch.from_numpy(np.divide(np.moveaxis(frames, -1, 1), 255, dtype=np.float32))

    from shmbuf.diamond import ReplayBuffer, SequenceDataset

    buffer = ReplayBuffer(
        capacity=1000,          # the docs say 100000; small here
        obs_shape=(64, 64, 3),  # H, W, C (native format)
        action_dim=4,
    )
    try:
        for t in range(100):
            obs, next_obs = frames[t], frames[t + 1]
            action, reward, done = np.full(4, t + 0.5, np.float32), float(t), t % 50 == 49
            buffer.add(obs, action, reward, done, next_obs)
            # Expects HWC observations (converted internally to CHW for training)

        # Wrap in PyTorch Dataset
        dataset = SequenceDataset(
            replay_buffer=buffer,
            sequence_length=5,
            burn_in=4,
        )
        loader = torch.utils.data.DataLoader(dataset, batch_size=32, shuffle=True)

        seen = 0
        for batch in loader:
            # batch keys: obs_seq, action_seq, rewards, dones, next_obs
            n = len(batch["rewards"])
            assert batch["obs_seq"].shape == (n, 5, 3, 64, 64)
            assert batch["obs_seq"].dtype == torch.float32
            assert batch["action_seq"].shape == (n, 5, 4)
            assert batch["rewards"].shape == batch["dones"].shape == (n, 5)
            assert batch["next_obs"].shape == (n, 3, 64, 64)
            t = batch["rewards"].long()
            assert torch.equal(batch["obs_seq"], expect[t])
            assert torch.equal(batch["next_obs"], expect[t[:, -1] + 1])
            assert (batch["action_seq"] == batch["rewards"][..., None] + 0.5).all()
            seen += n
        assert seen == 100

        # Checkpointing
        before = buffer.state_dict()
        state = buffer.state_dict()
        torch.save(state, "buffer.pt")

        # Restore
        state = torch.load("buffer.pt", weights_only=True)
        buffer.load_state_dict(state)

        after = buffer.state_dict()
        assert len(buffer) == 100
        for key, column in before["columns"].items():
            assert torch.equal(after["columns"][key], column), key
    finally:
        buffer.close()


# -- sample ---------------------------------------------------------------------------


def test_sample_gives_chw_floats_and_the_stored_next_obs(make_rb):
    rb = make_rb()
    add_steps(rb, 0, 40)   # episodes of 5: eight terminal steps
    batch = rb.sample(512)
    assert set(batch) == {"obs", "next_obs", "actions", "rewards", "dones"}
    assert batch["obs"].shape == batch["next_obs"].shape == (512, C, H, W)
    assert batch["actions"].shape == (512, A) and batch["actions"].dtype == torch.float32
    assert batch["rewards"].shape == batch["dones"].shape == (512,)
    assert batch["dones"].dtype == torch.bool   # upstream's dtype
    assert all(v.device.type == "cpu" for v in batch.values())
    ident = identities(batch["actions"])
    check_steps(ident, batch["obs"], batch["next_obs"], batch["rewards"], batch["dones"])
    assert batch["dones"].sum() > 0, "no terminal step drawn: their next_obs went unchecked"
    assert ident[:, 3].max() == 39, "the newest step was never drawn"


@pytest.mark.slow   # the first op on "meta" imports torch's meta kernels
def test_samples_go_to_the_buffer_device(make_rb):
    rb = make_rb(device="meta")   # a device that every torch build has; shapes only
    add_steps(rb, 0, 10)
    assert rb.device == torch.device("meta")
    batch = rb.sample(4)
    seq = rb.sample_sequence(2, 3, burn_in=1)
    assert all(v.device.type == "meta" for v in [*batch.values(), *seq.values()])
    assert seq["obs"].shape == (2, 3, C, H, W) and seq["obs"].dtype == torch.float32
    with ReplayBuffer.attach(rb.name) as other:
        assert other.device == torch.device("meta")   # the creator's device is shared
    with ReplayBuffer.attach(rb.name, device="cpu") as other:
        assert other.sample(1)["obs"].device.type == "cpu"
    rb.device = "cpu"   # this handle only
    check_sequences(rb.sample_sequence(8, 3, burn_in=1))


# -- sample_sequence and burn_in ----------------------------------------------------------


def test_sample_sequence_windows_lie_in_one_episode_after_their_burn_in(make_rb):
    rb = make_rb()
    add_steps(rb, 1, 70)   # episodes of 7
    seq = rb.sample_sequence(256, 4, burn_in=2)
    assert seq["obs"].shape == seq["next_obs"].shape == (256, 4, C, H, W)
    assert seq["actions"].shape == (256, 4, A)
    assert seq["rewards"].shape == seq["dones"].shape == (256, 4)
    assert seq["burn_in_obs"].shape == (256, 2, C, H, W)
    assert seq["burn_in_actions"].shape == (256, 2, A)
    full = check_sequences(seq)
    assert set(full[:, 0, 2].tolist()) == {0, 1}   # a 6-step window in a 7-step episode
    assert seq["dones"][:, -1].any() and not seq["dones"][:, :-1].any()
    assert full[:, -1, 3].max() == 69, "the newest step was never drawn"


def test_burn_in_is_the_context_right_before_the_sequence(make_rb):
    rb = make_rb()
    add_steps(rb, 0, 50)   # episodes of 5
    seq = rb.sample_sequence(64, 2, burn_in=3)
    full = check_sequences(seq)
    assert (full[:, :, 2] == np.arange(5)).all()   # burn-in t = 0..2, sequence t = 3, 4
    assert (seq["dones"][:, -1] == 1).all()
    items = default_collate([SequenceDataset(rb, 2, 3)[i] for i in range(32)])
    assert (check_items(items)[:, :, 2] == np.arange(5)).all()
    bare = rb.sample_sequence(8, 5)
    assert bare["burn_in_obs"].shape == (8, 0, C, H, W)
    assert bare["burn_in_actions"].shape == (8, 0, A)
    with pytest.raises(NotEnoughDataError):
        rb.sample_sequence(1, 3, burn_in=3)   # 6 steps: longer than every episode


def test_windows_never_cross_streams_cuts_or_the_wrap_point(make_rb):
    rb = make_rb(capacity=64)   # chunks of 4 steps: the ring wraps many times
    handles = {0: rb, 1: ReplayBuffer.attach(rb.name, seed=1),
               CUT_FROM + 1: ReplayBuffer.attach(rb.name, seed=2)}   # ends episodes by cuts
    try:
        pos, seen = dict.fromkeys(handles, 0), set()
        for round_ in range(40):
            for w, handle in handles.items():   # each handle is a stream of its own
                pos[w] = add_steps(handle, w, 3 + w % 4, pos[w])
            if round_ >= 5:
                full = check_sequences(rb.sample_sequence(32, 3, burn_in=2))
                seen.update(full[:, 0, 0].tolist())
        assert seen == set(handles)
        assert rb.buffer.stats().steps_written > 3 * rb.capacity
        check_items(default_collate([SequenceDataset(rb, 3, 2)[i] for i in range(64)]))
    finally:
        for handle in handles.values():
            handle.close()


# -- actions and input checks ------------------------------------------------------------


def test_continuous_actions_are_kept_and_integer_buffers_refuse_floats(make_rb):
    rb = make_rb(action_dim=2)
    action = np.array([0.123456, -2.75], np.float32)
    rb.add(frame(0, 0, 0), action, 1.0, True, frame(0, 0, 1))
    assert torch.equal(rb.sample(3)["actions"], torch.from_numpy(np.tile(action, (3, 1))))

    discrete = make_rb(action_dim=1)   # float32 holds action indices exactly
    discrete.add(frame(0, 0, 0), 5, 0.0, False, frame(0, 0, 1))
    assert discrete.sample(2)["actions"].tolist() == [5.0, 5.0]   # (B,): upstream squeezes

    ints = make_rb(action_dim=1, action_dtype=torch.int64)
    assert ints.action_dtype == np.int64
    ints.add(frame(0, 0, 0), 3, 0.0, False, frame(0, 0, 1))
    with pytest.raises(TypeError, match=r"add\(action="):
        ints.add(frame(0, 0, 1), 2.5, 0.0, False, frame(0, 0, 2))
    assert len(ints) == 1
    out = ints.sample(3)["actions"]
    assert out.dtype == torch.int64 and out.tolist() == [3, 3, 3]


def test_action_dim_1_squeezes_the_action_axis_as_upstream(make_rb):
    rb = make_rb(action_dim=1)
    for t in range(12):   # episodes of 6 steps, action == t
        rb.add(frame(0, t // 6, t % 6), np.float32(t), float(t), t % 6 == 5,
               frame(0, t // 6, t % 6 + 1))
    batch = rb.sample(16)
    assert batch["actions"].shape == (16,) and batch["actions"].dtype == torch.float32
    assert torch.equal(batch["actions"], batch["rewards"])
    seq = rb.sample_sequence(8, 3, burn_in=2)
    assert seq["actions"].shape == (8, 3) and seq["burn_in_actions"].shape == (8, 2)
    assert torch.equal(seq["actions"], seq["rewards"])
    assert torch.equal(seq["burn_in_actions"] + 2, seq["actions"][:, :2])
    assert seq["dones"].shape == (8, 3) and seq["dones"].dtype == torch.bool
    item = SequenceDataset(rb, sequence_length=4, burn_in=1)[0]
    assert item["action_seq"].shape == item["actions"].shape == (4,)
    assert item["burn_in_actions"].shape == (1,) and item["dones"].dtype == torch.bool
    loader = DataLoader(SequenceDataset(rb, 4, 1), batch_size=5)
    assert next(iter(loader))["action_seq"].shape == (5, 4)   # (B, L)


def test_size_and_position_count_every_writers_steps(make_rb):
    rb = make_rb(capacity=64)
    assert (rb.size, rb.position) == (0, 0)
    add_steps(rb, 0, 10)
    other = ReplayBuffer.attach(rb.name)
    try:
        add_steps(other, 1, 5)
        assert (rb.size, rb.position) == (15, 15) and (other.size, other.position) == (15, 15)
        add_steps(rb, 0, 60, 10)    # 75 steps into 64 rows: the oldest chunks went
        assert rb.position == 75 % 64
        assert rb.size == len(rb) <= rb.capacity and rb.size == rb.buffer.stats().live_steps
    finally:
        other.close()


@pytest.mark.parametrize("bad, error, arg", [
    ({"obs": np.full(OBS_SHAPE, 0.5, np.float32)}, TypeError, "obs"),
    ({"obs": np.zeros((C, H, W), np.uint8)}, ValueError, "obs"),
    ({"next_obs": np.zeros((H, W), np.uint8)}, ValueError, "next_obs"),
    ({"next_obs": torch.full(OBS_SHAPE, 300)}, TypeError, "next_obs"),
    ({"action": np.zeros(A + 1, np.float32)}, ValueError, "action"),
    ({"reward": np.array([1.0, 2.0])}, ValueError, "reward"),
    ({"done": 0.5}, TypeError, "done"),
])
def test_bad_steps_are_refused_by_name_and_nothing_is_written(make_rb, bad, error, arg):
    rb = make_rb()
    add_steps(rb, 0, 3)
    good = dict(zip(["obs", "action", "reward", "done", "next_obs"], step(0, 3)))
    with pytest.raises(error, match=rf"add\({arg}="):
        rb.add(**{**good, **bad})
    assert len(rb) == 3
    rb.add(**good)   # the stream goes on as if the bad call never happened
    assert (check_sequences(rb.sample_sequence(4, 4))[:, :, 3] == np.arange(4)).all()


@pytest.mark.parametrize("kwargs, error, arg", [
    ({"capacity": 0}, ValueError, "capacity"),
    ({"obs_shape": (64, 64)}, ValueError, "obs_shape"),
    ({"obs_shape": (64, 0, 3)}, ValueError, "obs_shape"),
    ({"action_dim": 0}, ValueError, "action_dim"),
    ({"action_dim": 1.0}, TypeError, "action_dim"),
    ({"action_dtype": np.bool_}, TypeError, "action_dtype"),
    ({"action_dtype": "no-such-dtype"}, TypeError, "action_dtype"),
    ({"device": "nowhere"}, ValueError, "device"),
])
def test_bad_constructor_arguments_are_refused_by_name(kwargs, error, arg):
    with pytest.raises(error, match=arg):
        ReplayBuffer(**{"obs_shape": OBS_SHAPE, **kwargs})


def test_bad_sampling_arguments_are_refused_by_name(make_rb):
    rb = make_rb(capacity=32)
    add_steps(rb, 0, 10)
    for call, error, arg in [
        (lambda: rb.sample(0), ValueError, "batch_size"),
        (lambda: rb.sample_sequence(2, 0), ValueError, "sequence_length"),
        (lambda: rb.sample_sequence(2, 3, burn_in=-1), ValueError, "burn_in"),
        (lambda: rb.sample_sequence(2, 30, burn_in=3), NotEnoughDataError, "capacity 32"),
        (lambda: rb.is_ready(-1), ValueError, "^n must"),
        (lambda: SequenceDataset(rb, 0), ValueError, "sequence_length"),
        (lambda: SequenceDataset(rb, epoch_length=-1), ValueError, "epoch_length"),
        (lambda: SequenceDataset(object()), TypeError, "replay_buffer"),
        (lambda: SequenceDataset(rb, 3, 1)["0"], TypeError, "int"),
    ]:
        with pytest.raises(error, match=arg):
            call()


def test_a_dataset_longer_than_the_capacity_fails_at_getitem(make_rb):
    # Upstream builds it and fails at the first item; so does shmbuf, with a clear error.
    rb = make_rb(capacity=32)
    add_steps(rb, 0, 10)
    dataset = SequenceDataset(rb, sequence_length=30, burn_in=4)
    with pytest.raises(NotEnoughDataError, match="capacity 32"):
        dataset[0]


def test_too_little_data_raises(make_rb):
    rb = make_rb()
    dataset = SequenceDataset(rb, sequence_length=3, burn_in=2)
    assert len(rb) == len(dataset) == 0 and rb.is_ready(0) and not rb.is_ready(1)
    for draw in (lambda: rb.sample(1), lambda: rb.sample_sequence(1, 1), lambda: dataset[0]):
        with pytest.raises(NotEnoughDataError):
            draw()
    add_steps(rb, 0, 4)   # four steps of a five-step episode
    assert rb.is_ready(4) and not rb.is_ready(5)
    with pytest.raises(NotEnoughDataError):
        rb.sample_sequence(1, 3, burn_in=2)
    with pytest.raises(NotEnoughDataError):
        dataset[0]
    add_steps(rb, 0, 1, first_pos=4)   # the episode's terminal step: now 5 steps fit
    assert (check_sequences(rb.sample_sequence(8, 3, burn_in=2))[:, :, 3] == np.arange(5)).all()


# -- SequenceDataset ---------------------------------------------------------------------------


def test_dataset_items_hold_the_window_and_the_frame_right_after_it(make_rb):
    rb = make_rb()
    add_steps(rb, 1, 35)   # episodes of 7
    dataset = SequenceDataset(rb, sequence_length=3, burn_in=2, seed=0)
    assert len(dataset) == 35
    item = dataset[0]
    assert set(item) == ITEM_KEYS
    assert item["obs_seq"].shape == (3, C, H, W) and item["next_obs"].shape == (C, H, W)
    assert item["action_seq"].shape == (3, A) and item["actions"] is item["action_seq"]
    assert item["rewards"].shape == item["dones"].shape == (3,)
    assert item["burn_in_obs"].shape == (2, C, H, W) and item["burn_in_actions"].shape == (2, A)
    check_items(default_collate([dataset[i] for i in range(64)]))
    add_steps(rb, 1, 7, first_pos=35)
    assert len(dataset) == 42   # the epoch grows with the buffer
    assert len(SequenceDataset(rb, epoch_length=10)) == 10
    one, two = SequenceDataset(rb, 3, 2, seed=4), SequenceDataset(rb, 3, 2, seed=4)
    assert all(torch.equal(one[i]["rewards"], two[i]["rewards"]) for i in range(10))


def test_dataset_pickles_as_a_handle_to_the_live_buffer(make_rb):
    rb = make_rb()
    add_steps(rb, 0, 10)
    copy = pickle.loads(pickle.dumps(SequenceDataset(rb, 2, 1, seed=0)))
    try:
        assert copy.replay_buffer.name == rb.name and not copy.replay_buffer.buffer.owner
        add_steps(rb, 0, 10, first_pos=10)
        assert len(copy) == 20
        assert check_items(default_collate([copy[i] for i in range(64)]))[:, -1, 3].max() == 19
    finally:
        copy.replay_buffer.close()
    assert len(rb) == 20   # an attacher closing leaves the buffer alone


@pytest.mark.slow
@pytest.mark.parametrize("persistent", [False, True])
def test_loader_workers_see_steps_added_after_the_loader_started(make_rb, persistent):
    rb = make_rb(capacity=2000)
    add_steps(rb, 0, 60)
    loader = DataLoader(SequenceDataset(rb, sequence_length=3, burn_in=1), batch_size=32,
                        shuffle=True, num_workers=2, persistent_workers=persistent,
                        generator=torch.Generator().manual_seed(0))
    first = np.concatenate(epoch(loader))
    assert len(first) == 60 and set(first[:, 0, 0].tolist()) == {0}
    add_steps(rb, 1, 140)   # a second stream, written after the workers started
    second = np.concatenate(epoch(loader))
    assert len(second) == 200 and set(second[:, 0, 0].tolist()) == {0, 1}
    del loader


@pytest.mark.slow
def test_loader_workers_draw_apart_and_a_seeded_loader_repeats(make_rb):
    rb = make_rb(capacity=2000)
    add_steps(rb, 1, 300)

    def batches():
        # Seeded: every process's stream is a function of the seed and its place, and a
        # worker's place includes the loader's seed from torch's generator.
        loader = DataLoader(SequenceDataset(rb, sequence_length=2, burn_in=1, seed=5),
                            batch_size=32, shuffle=True, num_workers=2,
                            generator=torch.Generator().manual_seed(3))
        return [ids[:, 0, 3] for ids in epoch(loader)]

    run = batches()
    assert len({b.tobytes() for b in run}) == len(run), "two workers drew the same windows"
    assert all((a == b).all() for a, b in zip(run, batches(), strict=True))


@pytest.mark.slow
def test_spawned_loader_workers_attach_to_the_live_buffer(make_rb):
    rb = make_rb(capacity=2000)
    add_steps(rb, 0, 40)
    loader = DataLoader(SequenceDataset(rb, sequence_length=3, burn_in=1), batch_size=32,
                        shuffle=True, num_workers=1, persistent_workers=True,
                        multiprocessing_context="spawn",
                        generator=torch.Generator().manual_seed(0))
    assert {int(w) for ids in epoch(loader) for w in ids[:, 0, 0]} == {0}
    add_steps(rb, 1, 160)
    assert {int(w) for ids in epoch(loader) for w in ids[:, 0, 0]} == {0, 1}
    del loader


# -- processes, attach, lifecycle ----------------------------------------------------------


@pytest.mark.slow
def test_spawned_writers_add_through_the_pickled_buffer_while_the_trainer_samples(make_rb):
    ctx = mp.get_context("spawn")
    rb = make_rb(capacity=256)   # far below the 3000 steps written: wraps under the sampler
    ready, go, n_steps = ctx.Semaphore(0), ctx.Event(), 1500
    procs = [ctx.Process(target=write_worker, args=(rb, w, n_steps, ready, go)) for w in (0, 1)]

    def check_a_batch():
        check_sequences(rb.sample_sequence(16, 3, burn_in=1))
        batch = rb.sample(32)
        check_steps(identities(batch["actions"]), batch["obs"], batch["next_obs"],
                    batch["rewards"], batch["dones"])

    with running(procs):
        for _ in procs:
            assert ready.acquire(timeout=60), "a writer never got going"
        for _ in range(20):   # both writers are mid-stream, each with an open chunk
            check_a_batch()
        go.set()
        for _ in range(500):
            if not any(p.is_alive() for p in procs):
                break
            check_a_batch()
        join_all(procs, 60)
        assert rb.buffer.stats().steps_written == 2 * n_steps
        check_a_batch()


def test_attach_by_name_shares_the_buffer_and_its_parameters(make_rb):
    rb = make_rb(action_dtype=np.float64)
    add_steps(rb, 0, 10)
    with ReplayBuffer.attach(rb.name, seed=1) as other:
        assert other.name == rb.name and not other.buffer.owner
        assert (other.obs_shape, other.action_dim, other.capacity) == (OBS_SHAPE, A, 500)
        assert other.action_dtype == np.float64 and len(other) == 10
        add_steps(other, 1, 7)   # a stream of its own
        assert len(rb) == 17
        assert set(check_sequences(rb.sample_sequence(64, 5))[:, 0, 0].tolist()) == {0, 1}
        with pytest.raises(PermissionError):
            other.unlink()
    with pytest.raises(BufferClosedError):
        other.sample(1)
    assert len(rb) == 17
    clone = pickle.loads(pickle.dumps(rb))   # a handle: the same live memory
    try:
        assert clone.name == rb.name and not clone.buffer.owner and len(clone) == 17
    finally:
        clone.close()
    with pytest.raises(SegmentNotFoundError):
        ReplayBuffer.attach("shmbuf-diamond-missing")
    with shmbuf.create({"x": ((), np.float32)}, 16, done_key=None) as plain:
        with pytest.raises(CorruptSegmentError, match="ReplayBuffer"):
            ReplayBuffer.attach(plain.name)


def test_lifecycle_close_unlink_context_manager_and_drop(make_rb):
    rb = make_rb()
    add_steps(rb, 0, 3)
    rb.close()
    rb.close()
    assert not os.path.exists(f"/dev/shm/{rb.name}")
    for call in (lambda: rb.add(*step(0, 3)), lambda: rb.sample(1), lambda: len(rb),
                 lambda: rb.sample_sequence(1, 1), lambda: rb.state_dict()):
        with pytest.raises(BufferClosedError):
            call()
    with ReplayBuffer(16, OBS_SHAPE, A) as owned:
        name = owned.name
        owned.unlink()
        assert not os.path.exists(f"/dev/shm/{name}")
        add_steps(owned, 0, 2)   # the mapping outlives the name
        assert len(owned) == 2
    dropped = ReplayBuffer(16, OBS_SHAPE, A)
    name = dropped.name
    del dropped   # the last reference: CPython finalizes it here
    assert not os.path.exists(f"/dev/shm/{name}")


def test_checkpoint_round_trip_through_torch_save(make_rb, tmp_path):
    rb = make_rb()
    add_steps(rb, 0, 30)
    with ReplayBuffer.attach(rb.name) as other:
        add_steps(other, CUT_FROM + 1, 28)
    torch.save(rb.state_dict(), tmp_path / "buffer.pt")
    state = torch.load(tmp_path / "buffer.pt", weights_only=True)

    fresh = make_rb(capacity=400)
    fresh.load_state_dict(state)
    assert fresh.capacity == 400 and len(fresh) == 58

    def rows(buf):
        cols = buf.state_dict()["columns"]
        order = np.lexsort(cols["action"].numpy()[:, [3, 0]].T)
        return {k: v.numpy()[order] for k, v in cols.items()}

    assert all((rows(fresh)[k] == v).all() for k, v in rows(rb).items())
    check_sequences(fresh.sample_sequence(128, 4, burn_in=2))

    small = make_rb(capacity=32)   # keeps the newest steps
    small.load_state_dict(state)
    assert small.capacity == 32 and 0 < len(small) <= 32
    check_sequences(small.sample_sequence(64, 3, burn_in=1))

    add_steps(rb, 0, 7, first_pos=30)   # this process's own stream is mid-chunk
    rb.load_state_dict(state)
    assert len(rb) == 58, "steps of this process's open chunk survived the restore"
    add_steps(rb, 0, 5, first_pos=30)
    assert len(rb) == 63
    check_sequences(rb.sample_sequence(128, 4, burn_in=1))

    for mismatched in (make_rb(obs_shape=(H, W, 1)), make_rb(action_dtype=np.int64),
                       make_rb(action_dim=A + 1)):
        with pytest.raises(ValueError):
            mismatched.load_state_dict(state)
        assert len(mismatched) == 0


def test_seeded_buffers_draw_the_same(make_rb):
    a, b = make_rb(seed=7), make_rb(seed=7)
    for rb in (a, b):
        add_steps(rb, 0, 50)
    assert torch.equal(a.sample(64)["rewards"], b.sample(64)["rewards"])
    assert torch.equal(a.sample_sequence(16, 3, burn_in=1)["rewards"],
                       b.sample_sequence(16, 3, burn_in=1)["rewards"])


# -- age_weights: DIAMOND's episode weighting by age ---------------------------------------
def test_age_weights_draw_episodes_by_age_group(make_rb):
    from helpers.stats import chi2_pvalue

    weights = (0.1, 0.1, 0.1, 0.7)
    rb = make_rb(500, age_weights=weights)
    add_steps(rb, 3, 8 * 11, length=11)                  # 8 finished episodes of 11 steps
    assert rb.age_weights == weights
    twin = ReplayBuffer.attach(rb.name)
    assert twin.age_weights == weights
    twin.close()
    counts = np.zeros(8)
    for _ in range(10):
        episode = rb.sample_sequence(256, 5)["actions"][:, 0, 1].floor().long()
        counts += np.bincount(episode.numpy(), minlength=8)
    # 8 episodes in 4 groups of 2: an episode of group g has weights[g] / 2
    assert chi2_pvalue(counts, np.repeat(weights, 2) / 2) > 1e-3
    newest = make_rb(500, age_weights=(0, 0, 0, 1))
    add_steps(newest, 3, 8 * 11, length=11)
    items = SequenceDataset(newest, sequence_length=3, burn_in=2)
    assert {int(items[i]["action_seq"][0, 1]) for i in range(40)} <= {6, 7}
    assert rb.sample(8)["obs"].shape[0] == 8             # single transitions stay uniform


@pytest.mark.parametrize("age_weights, err, words", [
    ([], ValueError, r"age_weights=\[\].*empty"),
    ([1, float("nan")], ValueError, r"age_weights=.*weights\[1\].*finite"),
    (3, TypeError, "age_weights=3"),
])
def test_bad_age_weights_are_refused_by_name(age_weights, err, words):
    with pytest.raises(err, match=words):
        ReplayBuffer(100, obs_shape=OBS_SHAPE, action_dim=A, age_weights=age_weights)
