"""Actor processes: a versioned parameter block, and run_actor recording from spawned children."""
import multiprocessing as mp
import os
import pickle

import gymnasium as gym
import numpy as np
import pytest
from helpers.gym_actors import actor_until_stopped, cartpole_actor, read_versions
from helpers.procs import running

import shmbuf
from shmbuf.gym import run_actor, spec_for
from shmbuf.params import ParamBlock

TEMPLATE = {"w": np.zeros((4,), np.float32), "table": np.zeros((3, 5), np.int64),
            "scale": np.zeros((), np.float64)}


@pytest.fixture
def block():
    b = ParamBlock.create(TEMPLATE)
    yield b
    b.close()


def test_publish_and_read_round_trip(block):
    assert block.version() == 0 and block.read() == (0, None)
    assert block.read_newer(0) is None
    assert block.publish({"w": np.arange(4.0), "table": np.ones((3, 5), np.int8),
                          "scale": 2.5}) == 1
    version, params = block.read()
    assert version == 1 and params.keys() == TEMPLATE.keys()
    assert params["w"].dtype == np.float32 and params["w"].tolist() == [0, 1, 2, 3]
    assert params["table"].dtype == np.int64 and params["table"].sum() == 15
    assert params["scale"].shape == () and params["scale"] == 2.5
    params["w"][:] = 9  # a private copy
    assert block.read()[1]["w"].tolist() == [0, 1, 2, 3]
    assert block.read_newer(1) is None and block.read_newer(0)[0] == 1


def test_bad_publishes_change_nothing(block):
    block.publish({k: np.zeros_like(v) for k, v in TEMPLATE.items()})
    with pytest.raises(KeyError, match="names"):
        block.publish({"w": np.zeros(4)})
    with pytest.raises(ValueError, match="shape"):
        block.publish({**TEMPLATE, "w": np.zeros(5)})
    with pytest.raises(TypeError):
        block.publish({**TEMPLATE, "table": np.full((3, 5), 0.5)})
    assert block.version() == 1
    with pytest.raises(ValueError):
        ParamBlock.create({})


@pytest.mark.slow
def test_torch_state_dicts_round_trip():
    torch = pytest.importorskip("torch")
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8))
    with ParamBlock.create(model.state_dict()) as block:
        block.publish(model.state_dict())
        copy = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8))
        copy.load_state_dict({k: torch.from_numpy(v) for k, v in block.read()[1].items()})
        for k, v in model.state_dict().items():
            assert torch.equal(copy.state_dict()[k], v)


def test_attach_by_name_and_pickle_never_unlink(block):
    block.publish({k: np.ones_like(v) for k, v in TEMPLATE.items()})
    other = pickle.loads(pickle.dumps(block))
    assert not other.owner and other.read()[0] == 1
    other.close()
    again = ParamBlock.attach(block.name)
    assert again.version() == 1
    again.close()
    with shmbuf.create({"x": ((), np.int8)}, 16, done_key=None) as buf:
        with pytest.raises(shmbuf.CorruptSegmentError):
            ParamBlock.attach(buf.name)
    with pytest.raises(shmbuf.WaitTimeoutError, match="version 1"):
        block.wait_version(2, timeout=0.01)


@pytest.mark.slow
def test_a_restarted_trainer_adopts_the_block_and_actors_read_on():
    from helpers.adopters import dead_owner_param_block
    from helpers.shm import exists as shm_exists

    from shmbuf.segment import segment as _segment

    name = dead_owner_param_block()
    try:
        actor = ParamBlock.attach(name)            # attached before the restart
        assert actor.read()[0] == 1
        with pytest.raises(shmbuf.CorruptSegmentError, match="not made by a HistoryBuffer"):
            shmbuf.HistoryBuffer.attach(name, own=True)   # the wrong class adopts nothing
        block = shmbuf.attach(name, own=True)      # shmbuf.attach knows parameter blocks
        assert isinstance(block, ParamBlock) and block.owner
        version, params = block.read()
        assert version == 1 and (params["w"] == 7).all()
        assert block.publish({"w": np.full(3, 8, np.float32)}) == 2
        assert actor.read()[0] == 2 and (actor.read()[1]["w"] == 8).all()
        with pytest.raises(shmbuf.OwnerAliveError, match=f"owned by pid {os.getpid()}"):
            ParamBlock.attach(name, own=True)
        actor.close()
        block.close()                              # the adopter unlinks
        assert not shm_exists(name)
    finally:
        if shm_exists(name):
            _segment.unlink(name)


@pytest.mark.slow
def test_reads_are_never_torn_while_the_trainer_publishes(block):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=read_versions, args=(block, 3000, out))
    with running([proc], timeout=30):
        for version in range(1, 100_000):
            block.publish({k: np.full_like(v, version) for k, v in TEMPLATE.items()})
            if not proc.is_alive() or (version > 2000 and not out.empty()):
                break
        torn, seen = out.get(timeout=60)
    assert proc.exitcode == 0
    assert torn == 0 and seen > 1


@pytest.mark.slow
def test_spawned_actors_record_with_the_newest_weights():
    ctx = mp.get_context("spawn")
    env = gym.make("CartPole-v1")
    with shmbuf.create(spec_for(env), capacity=20_000, seed=0) as buf, \
            ParamBlock.create({"w": np.zeros(4, np.float32)}) as block:
        stop, out = ctx.Event(), ctx.Queue()
        procs = [ctx.Process(target=cartpole_actor, args=(buf, block, stop, seed, out))
                 for seed in range(2)]
        with running(procs, timeout=30):
            block.publish({"w": np.zeros(4, np.float32)})        # always push left
            buf.wait_ready(min_steps=200, timeout=60)
            # A policy that balances: push towards the side the pole leans to.
            block.publish({"w": np.array([0.0, 0.0, 1.0, 0.5], np.float32)})
            shmbuf_wait(lambda: balanced_streams(buf) == 2)
            stop.set()
            results = [out.get(timeout=60) for _ in procs]
        assert [p.exitcode for p in procs] == [0, 0]
        assert all(r["version"] == 2 for r in results)
        assert buf.stats().writers == 0


@pytest.mark.slow
def test_actors_end_when_the_trainer_stops_the_writers():
    """Actors without steps= or stop=, held back by the rate limit while the trainer
    samples: stop_writers ends them (the README's pattern), each with its counts."""
    ctx = mp.get_context("spawn")
    env = gym.make("CartPole-v1")
    limit = shmbuf.RateLimit(4.0, min_steps=64, writer_timeout=300.0)
    with shmbuf.create(spec_for(env), capacity=20_000, seed=0, rate_limit=limit) as buf:
        out = ctx.Queue()
        procs = [ctx.Process(target=actor_until_stopped, args=(buf, seed, out))
                 for seed in range(2)]
        with running(procs, timeout=30):
            for _ in range(20):
                buf.sample_sequences(4, 8, timeout=60)
            buf.stop_writers()
            results = [out.get(timeout=60) for _ in procs]
        assert [p.exitcode for p in procs] == [0, 0]
        # An actor that started late may have waited from its first row on: 0 steps.
        assert all(r["stopped"] for r in results) and sum(r["steps"] for r in results) > 0, \
            results
        assert buf.stats().writers == 0


def balanced_streams(buf) -> int:
    """Streams with two episodes that lasted all 500 steps (501 rows): the new weights balance."""
    eps = buf.episodes()
    streams, counts = np.unique(eps.stream[eps.length == 501], return_counts=True)
    return int((counts >= 2).sum())


def shmbuf_wait(condition, timeout=60.0):
    import time
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_run_actor_in_process_with_a_vector_env():
    with shmbuf.create(spec_for(gym.make("CartPole-v1")), capacity=4096) as buf:
        got = run_actor(lambda: gym.make_vec("CartPole-v1", num_envs=2), buf,
                        lambda obs, w: np.zeros(len(obs), np.int64), steps=100, seed=0)
        assert got["steps"] == 100 and got["episodes"] >= 8 and got["version"] == 0
        assert len(buf) == 2 + 200 and buf.stats().writers == 0
