"""shmbuf.ray on a real ``ray.cluster_utils.Cluster``: three nodes on this host, loopback only.

One cluster serves the whole module (starting one costs seconds).  Nodes
``n0`` (head, where this driver runs) and ``n1`` advertise the ``shard``
resource; ``n2`` has no shard, so its writers must ship blocks.  One agent
actor per worker node runs the writers there.  On this host every node
shares one ``/dev/shm``; the tests check that nothing relies on it (a
process maps only its own node's segment, read from ``/proc/self/maps``).

Every Ray process started here carries ``SHMBUF_RAY_TEST_TAG`` in its
environment; the module's teardown waits for all of them to be gone.
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from helpers.procs import reap

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # driver resolves loopback
TAG = f"shmbuf-ray-test-{os.getpid()}"        # in the environment of every node and worker

import ray  # noqa: E402
from ray._private import ray_constants  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

# Set before ray was first imported, or the driver would resolve this host's interface
# address and dial it (the nodes listen on 127.0.0.1 only): refuse to run instead.
assert not ray_constants.ENABLE_RAY_CLUSTER, (
    "ray was imported before RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 was set; the driver would "
    "not stay on loopback")

import shmbuf  # noqa: E402
import shmbuf.ray as sray  # noqa: E402
from shmbuf.select import AgeBuckets, Mixture, Prioritized, Recency, Uniform  # noqa: E402

pytestmark = pytest.mark.slow
T = 60                      # seconds: the bound on every ray.get in these tests
NS = f"shmbuf-test-{os.getpid()}"
SPEC = {"wid": ((), np.int32), "step": ((), np.int64), "obs": ((3, 8, 8), np.uint8),
        "done": ((), np.bool_)}
EPISODE = 50
NODE_ARGS = dict(node_ip_address="127.0.0.1", num_cpus=1, object_store_memory=100 << 20)
HEAD_ARGS = dict(NODE_ARGS, include_dashboard=False, _system_config={
    "health_check_initial_delay_ms": 0, "health_check_period_ms": 300,
    "health_check_failure_threshold": 3})

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import us


# -- processes and sockets of this module's cluster -------------------------------------------
@contextlib.contextmanager
def tagged():
    """Tag the processes started inside (nodes), and only them: not other tests' children."""
    os.environ["SHMBUF_RAY_TEST_TAG"] = TAG
    try:
        yield
    finally:
        del os.environ["SHMBUF_RAY_TEST_TAG"]


def tagged_pids() -> list[int]:
    """Live Ray processes whose environment carries this module's tag (root may read any).

    Only the cluster's processes carry it: the fixture sets it while it starts the
    nodes (raylets pass their environment on to the workers they start later).
    """
    needle = f"SHMBUF_RAY_TEST_TAG={TAG}\0".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{entry}/stat") as f:
                zombie = f.read().rsplit(")", 1)[1].split()[0] == "Z"
        except OSError:
            continue
        if needle in env and b"ray" in cmdline and not zombie:
            found.append(int(entry))
    return found


def wait_no_tagged(timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while True:
        left = tagged_pids()
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def tcp_sockets(pids: set[int], listening: bool) -> list[tuple[str, str, int]]:
    """``(local, peer, pid)`` of the listening (or the other) TCP sockets of ``pids``."""
    cmd = ["ss", "-Hltnp"] if listening else ["ss", "-Htnp"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout
    found = []
    for line in out.splitlines():
        fields = line.split()
        for pid in re.findall(r"pid=(\d+)", line):
            if int(pid) in pids:
                found.append((fields[3], fields[4], int(pid)))
    return found


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


def shm_maps() -> list[str]:
    """The shmbuf segments mapped into this process."""
    with open("/proc/self/maps") as f:
        return sorted({os.path.basename(line.split()[-1]) for line in f
                       if "/dev/shm/shmbuf-" in line})


@pytest.fixture(scope="module")
def cluster():
    """Head n0 (+ this driver) and workers n1 (shard) and n2 (no shard); torn down always."""
    c = Cluster(shutdown_at_exit=False)
    try:
        with tagged():
            c.add_node(resources={"n0": 100, "shard": 1}, **HEAD_ARGS)
            nodes = {"n0": c.head_node,
                     "n1": c.add_node(resources={"n1": 100, "shard": 1}, **NODE_ARGS),
                     "n2": c.add_node(resources={"n2": 100}, **NODE_ARGS)}
        c.wait_for_nodes(timeout=T)
        ray.init(address=c.address, namespace=NS, log_to_driver=False)
        ids = {k: n.node_id for k, n in nodes.items()}
        assert ray.get_runtime_context().get_node_id() == ids["n0"]
        agents = {k: Agent.options(resources={k: 1}).remote() for k in ("n1", "n2")}
        assert ray.get([a.node.remote() for a in agents.values()], timeout=T) == [
            ids["n1"], ids["n2"]]
        yield c, ids, agents
    finally:
        ray.shutdown()
        c.shutdown()
        left = wait_no_tagged(30)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        assert not left, f"Ray processes left behind after shutdown: {left}"


@ray.remote(num_cpus=0)
class Agent:
    """Runs test functions on its node and keeps their state (writers) between calls."""

    def __init__(self):
        self.state = {}

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def run(self, fn, *args):
        return fn(self.state, *args)


# -- what the agents run -------------------------------------------------------------------
def write_episodes(state, rb, wid: int, steps: int, cut_at: int | None = None,
                   max_inflight: int = 64 << 20, block_steps: int | None = None,
                   shard: str | None = None):
    """Write ``steps`` steps of writer ``wid`` (episodes of EPISODE); report what it did."""
    w = state.get(wid)
    if w is None:
        w = state[wid] = rb.writer(max_inflight_bytes=max_inflight, block_steps=block_steps,
                                   shard=shard)
        state[("step", wid)] = 0
    start = state[("step", wid)]
    for s in range(start, start + steps):
        w.add(wid=wid, step=s, obs=np.full((3, 8, 8), s % 251, np.uint8),
              done=(s % EPISODE == EPISODE - 1))
        if cut_at is not None and s == cut_at:
            w.end_episode()
    state[("step", wid)] = start + steps
    w.flush()
    return {"mode": w.mode, "node": w.node_id, "maps": shm_maps(),
            "max_inflight": getattr(w, "max_inflight_seen", 0),
            "blocks": getattr(w, "blocks_shipped", 0)}


def write_until_error(state, wid: int, timeout_s: float):
    """Keep writing with an existing writer until it fails or ``timeout_s`` passes.

    Returns the error that stopped it, or None at the deadline. A kill is asynchronous
    (``ray.kill`` returns before the process is gone), so a fixed number of steps could all
    land while the shard still lives; writing until a deadline cannot race it.
    """
    w = state[wid]
    deadline = time.monotonic() + timeout_s
    s = 0
    try:
        while time.monotonic() < deadline:
            for _ in range(256):
                w.add(wid=wid, step=s, obs=np.zeros((3, 8, 8), np.uint8), done=False)
                s += 1
            w.flush()
    except Exception as exc:
        state.pop(wid)
        return type(exc).__name__, str(exc), isinstance(exc, sray.ShardLostError)
    return None


def write_while_stopped(state, wid: int, steps: int):
    """Add ``steps`` steps and flush with writer ``wid`` of a stopped buffer: the error."""
    w = state[wid]
    try:
        for s in range(steps):
            w.add(wid=wid, step=10**6 + s, obs=np.zeros((3, 8, 8), np.uint8), done=False)
        w.flush()
    except Exception as exc:
        return type(exc).__name__, isinstance(exc, shmbuf.WritersStoppedError), str(exc)
    return None


def close_writer(state, wid: int):
    state.pop(wid).close()


def check_windows(batch: dict, length: int) -> None:
    """Every window: one writer, consecutive steps, no episode crossed, obs matches step."""
    wid, step, done = batch["wid"], batch["step"], batch["done"]
    assert (wid == wid[:1]).all(), "a window mixes writers"
    assert (np.diff(step, axis=0) == 1).all(), "a window skips or repeats a step"
    assert not done[:-1].any(), "a window continues past a terminal step"
    assert (batch["obs"] == (step % 251)[:, :, None, None, None]).all(), "torn rows"
    assert (step[0] // EPISODE == step[-1] // EPISODE).all(), "a window crosses an episode"


@pytest.fixture
def rb(cluster):
    made = sray.create(SPEC, 2_000, namespace=NS, node_resource="shard", seed=0, chunk_size=64)
    try:
        yield made
    finally:
        made.close()


# -- the tests -------------------------------------------------------------------------------
LOOPBACK = re.compile(r"^(127\.0\.0\.1|\[::ffff:127\.0\.0\.1\]|\[::1\]):(\d+|\*)$")


def test_every_ray_socket_is_on_loopback(cluster, rb):
    _, _, agents = cluster
    ray.get(agents["n1"].run.remote(write_episodes, rb, 1, 200), timeout=T)
    rb.sample_sequences(8, 10)                          # traffic between the nodes
    pids = set(tagged_pids()) | {os.getpid()}
    listening = tcp_sockets(pids, listening=True)
    owners = {_comm(pid) for _, _, pid in listening}
    assert {"gcs_server", "raylet"} <= owners, f"the check would prove nothing: {owners}"
    foreign = [(local, pid) for local, _, pid in listening if not LOOPBACK.match(local)]
    assert not foreign, f"Ray listens on a non-loopback address: {foreign}"
    connected = tcp_sockets(pids, listening=False)
    assert connected, "found no connection of the cluster: the check would prove nothing"
    foreign = [s for s in connected if not (LOOPBACK.match(s[0]) and LOOPBACK.match(s[1]))]
    assert not foreign, f"Ray talks to a non-loopback address: {foreign}"
    ray.get(agents["n1"].run.remote(close_writer, 1), timeout=T)


def test_one_shard_per_node_and_writers_use_shared_memory_only_on_their_own_node(cluster, rb):
    _, ids, agents = cluster
    shards = {s.node_id: s for s in rb.shards}
    assert set(shards) == {ids["n0"], ids["n1"]}          # n2 lacks the "shard" resource
    assert len({s.buffer for s in shards.values()}) == 2
    n1 = ray.get(agents["n1"].run.remote(write_episodes, rb, 1, 400), timeout=T)
    n2 = ray.get(agents["n2"].run.remote(write_episodes, rb, 2, 400, 120), timeout=T)
    here = rb.writer()
    for s in range(300):
        here.add(wid=0, step=s, obs=np.full((3, 8, 8), s % 251, np.uint8),
                 done=(s % EPISODE == EPISODE - 1))
    assert (here.mode, n1["mode"], n2["mode"]) == ("shm", "shm", "ship")
    # Each process maps its own node's segment only; n2, with no shard, maps none even
    # though the other nodes' segments are right there in this host's /dev/shm.
    assert n1["maps"] == [shards[ids["n1"]].buffer]
    assert n2["maps"] == [] and n2["node"] in shards and n2["blocks"] >= 400 // 64
    batch = rb.sample_sequences(64, 10)
    check_windows(batch, 10)
    assert set(np.unique(batch["wid"])) <= {0, 1, 2}
    mine = set(shm_maps()) & {s.buffer for s in shards.values()}   # other tests' aside
    assert mine == {shards[ids["n0"]].buffer}              # the driver read n1 over Ray
    stats = {s.node_id: s for s in rb.stats()}
    assert stats[n2["node"]].steps_received == 400 and stats[n2["node"]].remote_writers == 1
    assert sum(s.steps_received for s in stats.values()) == 400   # no RPC for n0's, n1's
    reply = ray.get(shards[ids["n1"]].actor.sample.remote(8, 10, 0, True, 0), timeout=T)
    assert not reply["obs"].flags.writeable       # read in place from the object store
    assert sum(s.steps_written for s in stats.values()) == 1100
    assert all(s.health == "ok" and s.ingest_steps_per_s > 0 for s in stats.values())
    assert stats[ids["n1"]].samples_per_s > 0                 # it served the global batch
    here.close()
    ray.get(agents["n2"].run.remote(close_writer, 2), timeout=T)
    ray.get(agents["n1"].run.remote(close_writer, 1), timeout=T)


def test_a_shipped_cut_ends_the_episode_there(cluster, rb):
    _, ids, agents = cluster
    got = ray.get(agents["n2"].run.remote(write_episodes, rb, 5, 200, 20, 64 << 20, None,
                                          ids["n0"]), timeout=T)
    assert (got["mode"], got["node"]) == ("ship", ids["n0"])
    local = next(s for s in rb.shards if s.node_id == ids["n0"])
    eps = rb._attached(local).episodes()
    assert [int(x) for x in eps.length] == [21, 29, 50, 50, 50]
    assert [bool(x) for x in eps.terminal] == [False, True, True, True, True]
    batch = rb.sample_sequences(200, 25)
    check_windows(batch, 25)
    assert not ((batch["step"][0] <= 20) & (batch["step"][-1] > 20)).any()
    ray.get(agents["n2"].run.remote(close_writer, 5), timeout=T)


def test_shares_follow_each_shards_valid_windows(cluster, rb):
    _, ids, agents = cluster
    # 600 steps on each shard, so weighting by steps held would give 1/2 each; by valid
    # starts of 10 it is 591 (one episode here, n0) against 50 * 3 (episodes of 12 on n1).
    here = rb.writer()
    for s in range(600):
        here.add(wid=0, step=s, obs=np.full((3, 8, 8), s % 251, np.uint8), done=False)
    assert ray.get(agents["n1"].run.remote(write_aligned_episodes, rb, 1, 50, 12),
                   timeout=T) == "shm"
    counts = np.zeros(2)
    for _ in range(40):
        batch = rb.sample_sequences(50, 10, rng=None)
        counts += [np.sum(batch["wid"][0] == 0), np.sum(batch["wid"][0] == 1)]
    p = 591 / (591 + 150)
    n = counts.sum()
    assert abs(counts[0] / n - p) < 4 * np.sqrt(p * (1 - p) / n), counts
    here.close()


def test_prioritized_shares_and_updates_go_to_the_shard_that_holds_the_step(cluster):
    _, ids, agents = cluster
    rb = sray.create(SPEC, 2_000, namespace=NS, node_resource="shard", seed=3, chunk_size=64,
                     priorities=True)
    here = None
    try:
        here = rb.writer()                   # n0: one episode of 600 steps
        for s in range(600):
            here.add(wid=0, step=s, obs=np.full((3, 8, 8), s % 251, np.uint8), done=False)
        here.flush()
        ray.get(agents["n1"].run.remote(write_one_episode, rb, 1, 600), timeout=T)
        batch = rb.sample_sequences(64, 10, select=Prioritized(), ids=True)
        assert (batch["step"][1:] - batch["step"][:-1] == 1).all()
        wid = batch["wid"][0]
        # Every step gets priority 1 + its writer's id * 8: n1's windows then score 9 ** 0.8
        # against 1 for n0's (the same number of windows), after the updates route right.
        assert rb.update_priorities(batch["ids"], 1.0 + 8.0 * batch["wid"]) == 640
        for s in rb.shards:
            buf = shmbuf.attach(s.buffer)
            try:
                mine = batch["ids"] >> 39 == sray._ids.tag_of(s.buffer)
                got = buf.priorities_of(sray._ids.for_shard(batch["ids"][mine] & ((1 << 39) - 1),
                                                            buf))
                assert got.size and (got == 1.0 + 8.0 * batch["wid"][mine]).all()
                every = buf.port.step_ids(buf.committed_rows())
                w = buf.arrays["wid"][buf.committed_rows()][0]
                buf.update_priorities(every, np.full(len(every), 1.0 + 8.0 * w))
            finally:
                buf.close()
        p = 9 ** 0.8 / (1 + 9 ** 0.8)
        n1 = sum(int(np.sum(rb.sample_sequences(64, 10, select=Prioritized(), rng=k)
                            ["wid"][0] == 1)) for k in range(10))
        assert abs(n1 / 640 - p) < 4 * np.sqrt(p * (1 - p) / 640), n1
        assert wid.size == 64
        with pytest.raises(ValueError, match=r"priorities\[0\] is nan"):
            rb.update_priorities(batch["ids"][0, :1], np.array([np.nan]))
    finally:
        if here is not None:
            here.close()
        ray.get(agents["n1"].run.remote(close_writer, 1), timeout=T)
        rb.close()


def write_one_episode(state, rb, wid, steps):
    w = state[wid] = rb.writer()
    for s in range(steps):
        w.add(wid=wid, step=s, obs=np.full((3, 8, 8), s % 251, np.uint8), done=False)
    return w.mode


def write_aligned_episodes(state, rb, wid: int, count: int, length: int) -> str:
    """``count`` finished episodes of ``length`` <= EPISODE steps, episode i's steps
    numbered from i * EPISODE (so ``check_windows`` sees each as one episode)."""
    with rb.writer() as w:
        for i in range(count):
            for t in range(length):
                s = i * EPISODE + t
                w.add(wid=wid, step=s, obs=np.full((3, 8, 8), s % 251, np.uint8),
                      done=t == length - 1)
        return w.mode


def test_episode_draws_are_uniform_over_the_episodes_of_all_shards(cluster, rb):
    _, _, agents = cluster
    # 600 steps on each shard: 30 episodes of 20 here (n0), 12 of 50 on n1.
    assert write_aligned_episodes({}, rb, 0, 30, 20) == "shm"
    assert ray.get(agents["n1"].run.remote(write_aligned_episodes, rb, 1, 12, 50),
                   timeout=T) == "shm"
    gen = np.random.default_rng(0)
    per_episode = {0: np.zeros(30), 1: np.zeros(12)}
    for _ in range(40):
        batch = rb.sample_sequences(256, 10, uniform="episodes", rng=gen)
        check_windows(batch, 10)
        for wid, counts in per_episode.items():
            mine = batch["wid"][0] == wid
            counts += np.bincount(batch["step"][0][mine] // EPISODE, minlength=len(counts))
    n = 40 * 256
    share, p = per_episode[0].sum() / n, 30 / 42         # by steps it would be 330 / 822
    assert abs(share - p) < 6 * np.sqrt(p * (1 - p) / n), (share, p)
    every = np.concatenate(list(per_episode.values()))   # n / 42 = 244 each, sigma 15.4
    q = 1 / 42
    assert np.abs(every - n * q).max() < 6 * np.sqrt(n * q * (1 - q)), every
    steps = rb.sample_sequences(2048, 10, rng=gen)
    assert np.mean(steps["wid"][0] == 0) < 0.5          # 330 / 822 = 0.40 of the starts
    with rb.prefetch(32, 10, device="cpu", rng=1, uniform="episodes") as it:
        for _ in range(3):
            check_windows({k: v.numpy() for k, v in next(it).items()}, 10)
    with pytest.raises(shmbuf.NotEnoughDataError, match="finished episode of at least 51"):
        rb.sample_sequences(8, 51, uniform="episodes")
    with pytest.raises(ValueError, match="newest=None only, got newest=3.*no global order"):
        rb.sample_sequences(8, 10, uniform="episodes", newest=3)
    with pytest.raises(ValueError, match="uniform must be one of .*got 'episode'"):
        rb.sample_sequences(8, 10, uniform="episode")
    with pytest.raises(ValueError, match="newest=None only"):
        rb.prefetch(8, 10, device="cpu", uniform="episodes", newest=3)
    # A Mixture is split by fraction, then each part over the shards by its own weights.
    mix = Mixture([(0.5, Uniform()), (0.5, AgeBuckets([1]))])
    share = np.mean([np.mean(rb.sample_sequences(256, 10, select=mix, rng=gen)["wid"][0] == 0)
                     for _ in range(20)])
    p = 0.5 * 330 / 822 + 0.5 * 30 / 42
    assert abs(share - p) < 6 * np.sqrt(p * (1 - p) / (20 * 256)), (share, p)
    with rb.prefetch(32, 10, device="cpu", rng=1, select=mix) as it:
        check_windows({k: v.numpy() for k, v in next(it).items()}, 10)
    with pytest.raises(ValueError, match="cannot sample select=Recency.*own shard's publish"):
        rb.sample_sequences(8, 10, select=Recency())
    with pytest.raises(ValueError, match="cannot sample select=AgeBuckets.*no global oldest"):
        rb.prefetch(8, 10, device="cpu", select=Mixture([(0.5, Uniform()),
                                                         (0.5, AgeBuckets([1, 3]))]))
    with pytest.raises(ValueError, match="disagree"):
        rb.sample_sequences(8, 10, select=Uniform(), uniform="episodes")


def test_shipping_is_bounded_in_flight(cluster, rb):
    _, _, agents = cluster
    block = 16 * sum(int(np.prod(s)) * np.dtype(d).itemsize for s, d in SPEC.values())
    got = ray.get(agents["n2"].run.remote(write_episodes, rb, 7, 1_000, None, 2 * block, 16),
                  timeout=T)
    assert got["mode"] == "ship" and got["blocks"] >= 1_000 // 16
    assert 0 < got["max_inflight"] <= 2 * block
    assert sum(s.steps_received for s in rb.stats()) == 1_000
    ray.get(agents["n2"].run.remote(close_writer, 7), timeout=T)


def test_an_idle_shipping_writer_frees_its_shard_slot_and_can_go_on(cluster):
    _, ids, agents = cluster
    rb = sray.create(SPEC, 2_000, namespace=NS, nodes=[ids["n0"]], chunk_size=64,
                     remote_idle_s=0.2)
    try:
        got = ray.get(agents["n2"].run.remote(write_episodes, rb, 8, 100), timeout=T)
        assert got["mode"] == "ship"
        deadline = time.monotonic() + T        # a writer that died would stay silent too
        while rb.stats()[0].remote_writers:
            assert time.monotonic() < deadline, "the idle remote writer kept its slot"
        assert rb.stats()[0].writers == 0
        ray.get(agents["n2"].run.remote(write_episodes, rb, 8, 100), timeout=T)   # goes on
        s = rb.stats()[0]
        assert s.steps_received == 200 and s.live_steps == 200
        check_windows(rb.sample_sequences(32, 10), 10)
        ray.get(agents["n2"].run.remote(close_writer, 8), timeout=T)
    finally:
        rb.close()


def test_each_shard_holds_the_rate_limit_on_its_own_steps(cluster):
    _, ids, _ = cluster
    limit = shmbuf.RateLimit(2, min_steps=16, block_writers=False)
    rb = sray.create(SPEC, 2_000, namespace=NS, nodes=[ids["n0"]], chunk_size=64,
                     rate_limit=limit)
    try:
        here = rb.writer()                  # this node's shard, through shared memory
        for s in range(100):
            here.add(wid=0, step=s, obs=np.full((3, 8, 8), s % 251, np.uint8),
                     done=(s % EPISODE == EPISODE - 1))
        check_windows(rb.sample_sequences(4, 8), 8)
        with shmbuf.attach(rb.stats()[0].buffer) as shard:
            assert shard.rate_limit == limit
            r = shard.stats().rate
            assert (r.inserted, r.replayed) == (100, 32)
        here.close()
    finally:
        rb.close()


def test_stop_writers_reaches_both_kinds_of_writer_on_every_shard(cluster, rb):
    _, _, agents = cluster
    writers = (("n1", 31), ("n2", 32))      # n1 writes in shared memory, n2 ships
    for node, wid in writers:
        ray.get(agents[node].run.remote(write_episodes, rb, wid, 100), timeout=T)
    before = sum(s.steps_written for s in rb.stats())
    rb.stop_writers()
    try:
        for node, wid in writers:
            got = ray.get(agents[node].run.remote(write_while_stopped, wid, 150), timeout=T)
            assert got is not None and got[:2] == ("WritersStoppedError", True), got
        assert sum(s.steps_written for s in rb.stats()) == before   # nothing went in
        assert all(s.writers_stopped for s in rb.stats())
    finally:
        rb.resume_writers()
    for node, wid in writers:       # the same writers go on, in their own mode
        got = ray.get(agents[node].run.remote(write_episodes, rb, wid, 100), timeout=T)
        assert got["mode"] == ("shm" if node == "n1" else "ship")
    assert sum(s.steps_written for s in rb.stats()) == before + 200
    assert not any(s.writers_stopped for s in rb.stats())
    batch = rb.sample_sequences(64, 10)
    assert (batch["step"] < 10**6).all(), "a refused step was written"
    check_windows(batch, 10)
    for node, wid in writers:
        ray.get(agents[node].run.remote(close_writer, wid), timeout=T)


def test_prefetch_yields_valid_batches_and_stops(cluster, rb):
    _, _, agents = cluster
    ray.get(agents["n1"].run.remote(write_episodes, rb, 1, 500), timeout=T)
    here = rb.writer()
    for s in range(500):
        here.add(wid=0, step=s, obs=np.full((3, 8, 8), s % 251, np.uint8),
                 done=(s % EPISODE == EPISODE - 1))
    with rb.prefetch(32, 8, depth=2, device="cpu") as it:
        seen = set()
        for _ in range(10):
            batch = {k: v.numpy() for k, v in next(it).items()}     # torch CPU tensors
            check_windows(batch, 8)
            seen |= set(np.unique(batch["wid"]).tolist())
    assert seen == {0, 1}
    assert it.closed and not it._thread.is_alive()
    with pytest.raises(StopIteration):
        next(it)
    here.close()
    ray.get(agents["n1"].run.remote(close_writer, 1), timeout=T)


def test_a_writer_for_a_node_without_a_shard_is_refused(cluster, rb):
    _, ids, _ = cluster
    with pytest.raises(sray.ShardLostError, match=ids["n2"]):
        rb.writer(shard=ids["n2"])


def test_pickled_handles_never_close_the_shards(cluster, rb):
    _, _, agents = cluster
    copy = ray.get(agents["n1"].run.remote(lambda state, r: r, rb), timeout=T)
    assert not copy.owner and {s.node_id for s in copy.shards} == {
        s.node_id for s in rb.shards}
    copy.close()
    assert all(s.health == "ok" for s in rb.stats())


def test_dreamer_facade_samples_across_shards(cluster):
    _, _, agents = cluster
    rb = sray.ReplayBuffer(500, (3, 8, 8), 2, seq_len=10, batch_size=16, namespace=NS,
                           node_resource="shard", seed=1)
    try:
        def fill(state, facade):
            for t in range(100):
                facade.add({"image": np.zeros((3, 8, 8), np.uint8)}, np.zeros(2),
                           1.0, t == 99)
            facade.flush()
            return facade._writer.mode

        assert ray.get(agents["n1"].run.remote(fill, rb), timeout=T) == "shm"
        assert ray.get(agents["n2"].run.remote(fill, rb), timeout=T) == "ship"
        obs, act, rew, term = rb.sample()
        assert obs.shape == (10, 16, 3, 8, 8) and obs.dtype == np.uint8
        assert act.shape == (10, 16, 2) and rew.shape == (10, 16) and term.dtype == np.float32
        assert not term[:-1].any()
    finally:
        rb.close()


def test_a_dead_node_is_dropped_and_its_writers_get_a_clear_error(cluster, rb, caplog):
    c, ids, agents = cluster
    with tagged():
        extra = c.add_node(resources={"n3": 100, "shard": 1}, **NODE_ARGS)
    try:
        assert rb.refresh()["added"] == [extra.node_id]
        assert rb.refresh() == {"added": [], "dropped": []}
        shard3 = next(s for s in rb.shards if s.node_id == extra.node_id)
        got = ray.get(agents["n2"].run.remote(write_episodes, rb, 9, 300, None, 64 << 20, 32,
                                              extra.node_id), timeout=T)
        assert got["mode"] == "ship" and got["node"] == extra.node_id
        here = rb.writer()
        for s in range(300):
            here.add(wid=0, step=s, obs=np.full((3, 8, 8), s % 251, np.uint8),
                     done=(s % EPISODE == EPISODE - 1))
        rb.sample_sequences(32, 10)                      # all three shards are counted
        c.remove_node(extra)
        with caplog.at_level(logging.WARNING, logger="shmbuf.ray"):
            for _ in range(5):                           # draws that hit n3 are redrawn
                check_windows(rb.sample_sequences(64, 10), 10)
        assert extra.node_id not in {s.node_id for s in rb.shards}   # the sampler dropped it
        stats = {s.node_id: s for s in rb.stats()}
        assert stats[extra.node_id].health == "lost", stats
        assert any("dropped the shard" in r.message for r in caplog.records)
        err = ray.get(agents["n2"].run.remote(write_until_error, 9, T / 2), timeout=T)
        assert err is not None and err[2], err            # a ShardLostError
        assert extra.node_id in err[1] and "rb.writer()" in err[1]
        here.close()
    finally:
        _remove_segment(getattr(locals().get("shard3"), "buffer", None))
        if extra in c.worker_nodes:
            c.remove_node(extra)


def test_a_dead_shard_actor_is_replaced_by_refresh(cluster, rb):
    _, ids, agents = cluster
    old = next(s for s in rb.shards if s.node_id == ids["n1"])
    try:
        got = ray.get(agents["n1"].run.remote(write_episodes, rb, 3, 100), timeout=T)
        assert got["mode"] == "shm"
        ray.kill(old.actor, no_restart=True)             # the actor dies, its node lives on
        err = ray.get(agents["n1"].run.remote(write_until_error, 3, T / 2), timeout=T)
        assert err is not None and err[0] in ("ShardLostError", "BufferClosedError"), err
        assert rb.refresh() == {"added": [ids["n1"]], "dropped": [ids["n1"]]}
        new = next(s for s in rb.shards if s.node_id == ids["n1"])
        assert new.buffer != old.buffer
        got = ray.get(agents["n1"].run.remote(write_episodes, rb, 4, 100), timeout=T)
        assert new.buffer in got["maps"]
        check_windows(rb.sample_sequences(16, 10), 10)
        ray.get(agents["n1"].run.remote(close_writer, 4), timeout=T)
        here = next(s for s in rb.shards if s.node_id == ids["n0"])
        rb.sample_sequences(4, 10)                       # attaches this node's shard
        ray.kill(here.actor, no_restart=True)            # the trainer's own node's shard
        deadline = time.monotonic() + T
        while ids["n0"] in {s.node_id for s in rb.shards}:   # noticed within a second
            assert time.monotonic() < deadline, "the dead local shard was never dropped"
            batch = rb.sample_sequences(16, 10)
        check_windows(batch, 10)
        assert set(np.unique(batch["wid"])) == {4}        # all from the new n1 shard
    finally:
        _remove_segment(old.buffer)
        _remove_segment(locals().get("here") and here.buffer)


def _remove_segment(name: str | None) -> None:
    """A dead node's /dev/shm dies with the machine; on this one host, unlink it by hand."""
    if name and os.path.exists(f"/dev/shm/{name}"):
        os.unlink(f"/dev/shm/{name}")


TRAINER = textwrap.dedent("""
    import sys, time, numpy as np, ray, shmbuf.ray as sray
    address, ns, name = sys.argv[1:4]
    ray.init(address=address, namespace=ns, log_to_driver=False)
    spec = {"wid": ((), np.int32), "step": ((), np.int64), "obs": ((3, 8, 8), np.uint8),
            "done": ((), np.bool_)}
    rb = sray.create(spec, 2_000, name=name, namespace=ns, node_resource="shard", chunk_size=64)
    w = rb.writer()
    for s in range(300):
        w.add(wid=0, step=s, obs=np.full((3, 8, 8), s % 251, np.uint8), done=(s % 50 == 49))
    w.flush()
    print("READY", flush=True)
    time.sleep(600)
""")


def test_a_restarted_trainer_reconnects_by_name(cluster):
    c, ids, _ = cluster
    name = f"trainer-{os.getpid()}"
    proc = subprocess.Popen([sys.executable, "-c", TRAINER, c.address, NS, name],
                            env=dict(os.environ, SHMBUF_RAY_TEST_TAG=TAG),
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    rb = None
    try:
        line = _read_line(proc, T)
        assert line == "READY", line
        proc.kill()                                       # the trainer dies, SIGKILL
        proc.wait(timeout=T)
        rb = sray.connect(name, namespace=NS, own=True)
        assert {s.node_id for s in rb.shards} == {ids["n0"], ids["n1"]}
        assert sum(s.live_steps for s in rb.stats()) == 300
        check_windows(rb.sample_sequences(32, 10), 10)
    finally:
        reap([proc])
        if rb is None:
            rb = sray.connect(name, namespace=NS, own=True)
        rb.close()
    with pytest.raises(sray.ShardedBufferNotFoundError):
        sray.connect(name, namespace=NS)


def _read_line(proc, timeout: float) -> str:
    """The child's first line, waited for with a bound (select on its pipe)."""
    import select

    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    return proc.stdout.readline().strip() if ready else "<timeout>"


def test_close_ends_every_shard_and_its_segment(cluster):
    rb = sray.create(SPEC, 1_000, namespace=NS, chunk_size=64)
    names = [s.buffer for s in rb.shards]
    assert len(names) == 3                                # every alive node
    assert all(os.path.exists(f"/dev/shm/{n}") for n in names)
    rb.close()
    rb.close()
    assert not any(os.path.exists(f"/dev/shm/{n}") for n in names)
    assert not [a for a in ray.util.list_named_actors(all_namespaces=True)
                if a["name"].startswith(rb.name + "/")]
    with pytest.raises(shmbuf.BufferClosedError):
        rb.sample_sequences(1, 1)
