"""A shard's weight in a global batch: its count of valid window starts (no cluster needed)."""
import numpy as np
import pytest

from shmbuf.ray._count import PROBES, weight

SPEC = {"x": ((), np.int64), "done": ((), np.bool_)}


def _fill(buf, episodes):
    with buf.writer() as w:
        for n in episodes:
            for t in range(n):
                w.add(x=t, done=t == n - 1)


def _exact(episodes, length):
    return sum(max(0, n - length + 1) for n in episodes)


@pytest.mark.parametrize("length", [1, 10, 60])
def test_small_shards_are_counted_exactly(make_buffer, length):
    episodes = [50, 80, 20, 75]                       # 225 rows: enumerated, not probed
    buf = make_buffer(SPEC, 1_000, chunk_size=16)
    _fill(buf, episodes)
    assert weight(buf, length, 0, "steps", np.random.default_rng(0)) == _exact(episodes, length)


def test_large_shards_are_estimated_within_a_few_standard_errors(make_buffer):
    rng = np.random.default_rng(1)
    episodes = list(rng.integers(20, 200, 300))       # ~33k rows: probed
    buf = make_buffer(SPEC, 40_000, chunk_size=256)
    _fill(buf, episodes)
    exact = _exact(episodes, 50)
    p = exact / sum(episodes)
    assert sum(episodes) > PROBES
    got = [weight(buf, 50, 0, "steps", np.random.default_rng(s)) for s in range(5)]
    sigma = exact * np.sqrt((1 - p) / (p * PROBES))   # the module doc's standard error
    assert all(abs(g - exact) < 5 * sigma for g in got), (got, exact, sigma)


def test_an_empty_shard_counts_zero(make_buffer):
    assert weight(make_buffer(SPEC, 100), 5, 0, "steps", np.random.default_rng(0)) == 0
