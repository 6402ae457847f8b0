"""HistoryBuffer: the stable-worldmodel contract, the fixed bugs, and sharing it."""
import collections
import multiprocessing as mp
import os
import pickle

import numpy as np
import pytest
import torch
from helpers.keyed_workers import history_info, history_worker, pixels_for
from helpers.procs import join_all, running
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shmbuf
from shmbuf.compat._strided import AgeTables, block_ages, contiguous_window, frame_ages
from shmbuf.compat.history import HistoryBuffer, SchemaPendingError
from shmbuf.keyed import rings as keyed

SHM = "/dev/shm"


@pytest.fixture
def make():
    """HistoryBuffer(...) that is closed (and so unlinked) at teardown."""
    made = []

    def build(*args, **kw):
        buf = HistoryBuffer(*args, **kw)
        made.append(buf)
        return buf

    yield build
    for buf in made:
        buf.close()


def steps_info(n_envs, t, env_ids=None):
    """Encoded step ``t``: action = [env, t], step = t, pixels = pattern(env, t)."""
    envs = np.arange(n_envs) if env_ids is None else np.asarray(env_ids)
    return history_info(envs, t)


# -- the documented example, typed out with only the import changed -------------------
def test_docs_example():
    import numpy as np

    from shmbuf.compat.history import HistoryBuffer

    # 2 envs, hold up to 5 env steps, return history at frameskip-2 cadence
    buf = HistoryBuffer(n_envs=2, max_len=5, action_block=2, block_keys=('action',))

    for t in range(5):
        buf.append({
            'pixels': np.full((2, 1, 64, 64, 3), t, dtype=np.uint8),  # (n_envs, T, H, W, C)
            'action': np.full((2, 1, 2), t, dtype=np.float32),        # (n_envs, T, D)
        })

    out = buf.get(3)
    # out['pixels'].shape == (2, 3, 64, 64, 3)   # strided frames: t=0, t=2, t=4
    # out['action'].shape == (2, 2, 4)           # blocks between them:
    #                                            #   [a_1,a_2] (leaving t=0) and
    #                                            #   [a_3,a_4] (leaving t=2)

    buf.reset(env_ids=[0])  # clear env 0 only (e.g. on episode reset)

    assert out['pixels'].shape == (2, 3, 64, 64, 3) and out['pixels'].dtype == np.uint8
    assert out['action'].shape == (2, 2, 4) and out['action'].dtype == np.float32
    for e in range(2):
        for j, t in enumerate([0, 2, 4]):
            assert (out['pixels'][e, j] == t).all()
        assert out['action'][e].tolist() == [[1, 1, 2, 2], [3, 3, 4, 4]]
    assert buf.get(3) is None                       # env 0 is empty now
    assert buf.get(3, env_ids=[1])['pixels'][0, :, 0, 0, 0].tolist() == [0, 2, 4]
    assert buf.num_strided() == [0, 3] and len(buf) == 0


# -- strided frames, blocks and warm-up ------------------------------------------------
def expected_steps(L, n, ab):
    """Steps (0..L-1) of the strided frames, oldest strided entry repeated in warm-up."""
    k = min(n, (L - 1) // ab + 1)
    real = [L - 1 - off * ab for off in reversed(range(k))]
    return [real[0]] * (n - k) + real


@pytest.mark.parametrize("L, n, ab", [
    (1, 3, 2), (2, 3, 2), (3, 3, 2), (4, 3, 2), (5, 3, 2), (9, 3, 2),
    (4, 4, 3), (6, 2, 4), (1, 1, 1), (3, 5, 1), (7, 3, 3),
])
def test_frames_blocks_and_warm_up_contents(make, L, n, ab):
    buf = make(n_envs=2, max_len=10, action_block=ab, block_keys=("action",))
    for t in range(L):
        buf.append(steps_info(2, t))
    out = buf.get(n)
    want = expected_steps(L, n, ab)
    assert out["step"].tolist() == [want, want]
    assert out["pixels"].shape == (2, n * 1, 4, 4, 3)
    for e in range(2):
        assert (out["pixels"][e] == pixels_for([e] * n, want)[:, 0]).all()
    if n == 1:
        assert "action" not in out
        return
    assert out["action"].shape == (2, n - 1, ab * 2)
    for i in range(n - 1):
        lo, hi = want[i], want[i + 1]
        block = out["action"][1, i]
        if hi == lo:   # padding: a zero block
            assert (block == 0).all()
        else:          # the ab entries after frame i up to and including frame i+1
            assert hi - lo == ab
            assert block.tolist() == [v for t in range(lo + 1, hi + 1) for v in (1.0, t)]


def test_padding_repeats_the_oldest_strided_entry_not_the_oldest_entry(make):
    buf = make(n_envs=1, max_len=10, action_block=2, block_keys=("action",))
    for t in range(4):   # (L - 1) % ab == 1: entry 0 is older than every strided frame
        buf.append(steps_info(1, t))
    out = buf.get(3)
    assert out["step"].tolist() == [[1, 1, 3]]
    assert out["action"].tolist() == [[[0, 0, 0, 0], [0, 2, 0, 3]]]
    assert buf.num_strided() == [2]


def test_padding_never_ends_when_max_len_is_too_short(make):
    buf = make(n_envs=1, max_len=3, action_block=2, block_keys=("action",))
    for t in range(20):
        buf.append(steps_info(1, t))
    out = buf.get(3)
    assert out["step"].tolist() == [[17, 17, 19]]
    assert out["action"][0, 0].tolist() == [0, 0, 0, 0]
    assert buf.num_strided() == [2] and len(buf) == 3


def test_age_math():
    lengths = np.array([1, 4, 5, 100])
    assert frame_ages(3, 2, lengths).tolist() == [[0, 0, 0], [2, 2, 0], [4, 2, 0], [4, 2, 0]]
    assert block_ages(3, 2, lengths).tolist() == [[-1, -1, -1, -1], [-1, -1, 1, 0],
                                                  [3, 2, 1, 0], [3, 2, 1, 0]]
    for n, ab in [(1, 1), (3, 2), (5, 3), (8, 4)]:
        tables = AgeTables(ab)
        lengths = np.arange(0, 40)
        ages = tables.lookup(n, lengths.copy())
        frames, blocks = ages[:, :n], ages[:, n:]
        assert np.array_equal(frames[1:], frame_ages(n, ab, lengths[1:]))
        assert np.array_equal(blocks[1:], block_ages(n, ab, lengths[1:]))
        assert (frames[0] < 0).all() and (blocks[0] < 0).all()   # empty: nothing to read
    assert contiguous_window(3, 2, start=0, count=5, ring_len=9) == (0, 4)
    assert contiguous_window(3, 2, start=1, count=5, ring_len=9) is None    # needs padding
    assert contiguous_window(3, 2, start=4, count=11, ring_len=9) is None   # wraps: 1 < 4
    assert contiguous_window(1, 5, start=8, count=10, ring_len=9) == (0, 0)


def test_per_step_scalars_and_time_dims(make):
    buf = make(n_envs=2, max_len=8, action_block=1, block_keys=("act",))
    for t in range(3):
        buf.append({"r": np.array([t, 10 + t], np.float64),
                    "obs": np.full((2, 2, 3), t, np.int16),             # T = 2
                    "act": np.full((2, 2, 3), t, np.float32)})
    out = buf.get(2)
    assert out["r"].shape == (2, 2) and out["r"].tolist() == [[1, 2], [11, 12]]
    assert out["obs"].shape == (2, 4, 3) and out["obs"][:, :, 0].tolist() == [[1, 1, 2, 2]] * 2
    assert out["act"].shape == (2, 1, 6) and out["act"].dtype == np.float32
    assert out["act"][0, 0].tolist() == [2.0] * 6


def test_nan_is_zeroed_in_blocks_only(make):
    buf = make(n_envs=1, max_len=8, action_block=2, block_keys=("action",))
    values = [np.nan, 1.0, np.inf, -np.inf, np.nan]
    for v in values:
        buf.append({"action": np.array([[[v]]], np.float32), "raw": np.array([[v]])})
    out = buf.get(3)
    assert out["action"].tolist() == [[[1.0, np.inf], [-np.inf, 0.0]]]
    raw = out["raw"][0]
    assert np.isnan(raw[0]) and raw[1] == np.inf and np.isnan(raw[2])


def test_get_returns_none_or_empty(make):
    buf = make(n_envs=2, max_len=4, action_block=1, block_keys=("action",))
    assert buf.get(2) is None and buf.get(2, []) is None      # nothing appended yet
    buf.append(steps_info(2, 0))
    assert buf.get(0) is None and buf.get(-3) is None
    with pytest.raises(TypeError, match="n must be an int"):
        buf.get(1.5)
    only_blocks = make(n_envs=1, max_len=4, action_block=1, block_keys=("action",))
    only_blocks.append({"action": np.zeros((1, 1, 2), np.float32)})
    assert only_blocks.get(1) == {}


def test_empty_env_ids_give_empty_arrays(make):
    buf = make(n_envs=2, max_len=4, action_block=2, block_keys=("action",))
    buf.append(steps_info(2, 0))
    out = buf.get(3, env_ids=[])
    assert {k: v.shape for k, v in out.items()} == {
        "pixels": (0, 3, 4, 4, 3), "step": (0, 3), "action": (0, 2, 4)}
    assert out["action"].dtype == np.float32
    assert buf.num_strided([]) == []
    buf.reset([])
    buf.append({k: v[:0] for k, v in steps_info(2, 1).items()}, env_ids=[])
    assert len(buf) == 1


def test_env_ids_order_duplicates_and_negatives(make):
    buf = make(n_envs=3, max_len=4, action_block=1, block_keys=("action",))
    for t in range(2):
        buf.append(steps_info(3, t))
    out = buf.get(2, env_ids=[2, 0, 2, -1])
    assert out["action"][:, 0, 0].tolist() == [2, 0, 2, 2]
    assert out["pixels"].shape[0] == 4
    assert buf.num_strided([2, 2]) == [2, 2]
    with pytest.raises(IndexError, match="out of range"):
        buf.get(2, env_ids=[3])
    with pytest.raises(TypeError, match="env_ids"):
        buf.get(2, env_ids=[0.5])


def test_reset_one_env_and_retention_per_env(make):
    buf = make(n_envs=2, max_len=3, action_block=1)
    buf.append(steps_info(2, 0))
    for t in range(1, 30):   # env 0 runs far ahead; env 1 keeps its single entry
        buf.append(steps_info(1, t), env_ids=[0])
    assert buf.get(2)["step"].tolist() == [[28, 29], [0, 0]]
    buf.reset(env_ids=[0])
    assert buf.get(2) is None and buf.num_strided() == [0, 1] and len(buf) == 0
    buf.append(steps_info(1, 50), env_ids=[0])
    assert buf.get(2)["step"].tolist() == [[50, 50], [0, 0]]
    buf.reset()
    assert buf.num_strided() == [0, 0]


def test_appends_for_some_envs(make):
    buf = make(n_envs=4, max_len=4, action_block=1)
    buf.append(steps_info(4, 0))
    buf.append(steps_info(2, 1, env_ids=[3, 1]), env_ids=[3, 1])
    out = buf.get(2)
    assert out["step"].tolist() == [[0, 0], [0, 1], [0, 0], [0, 1]]
    assert (out["pixels"][3, 1] == pixels_for([3], [1])[0, 0]).all()


# -- inputs ----------------------------------------------------------------------------------
def test_torch_in_torch_out_numpy_in_numpy_out(make):
    buf = make(n_envs=2, max_len=5, action_block=2, block_keys=("action", "grip"))
    for t in range(2):
        buf.append({"pixels": torch.full((2, 1, 3, 3), t, dtype=torch.uint8),
                    "action": torch.full((2, 1, 2), t, dtype=torch.float64),
                    "grip": np.full((2,), t, np.int8),
                    "step": np.full((2,), t, np.int32)})
    out = buf.get(3)
    assert isinstance(out["pixels"], torch.Tensor) and out["pixels"].dtype == torch.uint8
    assert isinstance(out["action"], torch.Tensor) and out["action"].dtype == torch.float64
    assert out["action"].shape == (2, 2, 4)
    assert out["action"][0, 0].tolist() == [0, 0, 0, 0]               # a zero block, in torch
    assert isinstance(out["grip"], np.ndarray) and out["grip"].dtype == np.int8
    assert out["grip"][0].tolist() == [[0, 0], [0, 0]]
    assert isinstance(out["step"], np.ndarray) and out["step"].dtype == np.int32


def test_torch_dtypes_in_spec(make):
    buf = make(2, 3, spec={"obs": ((4,), torch.float16), "idx": ((), np.int64)})
    buf.append({"obs": np.ones((2, 4), np.float16), "idx": np.arange(2)})
    out = buf.get(1)
    assert out["obs"].dtype == torch.float16 and isinstance(out["idx"], np.ndarray)
    with pytest.raises(TypeError, match="bfloat16"):
        HistoryBuffer(2, 3, spec={"x": ((1,), torch.bfloat16)})


def test_strings_and_python_scalars_are_broadcast(make):
    buf = make(n_envs=2, max_len=4, action_block=1)
    for t in range(2):
        buf.append({"task": f"push-{t}", "eps": 0.5 * t, "flag": bool(t), "k": t,
                    "f32": np.float32(t), "obs": np.zeros((2, 1), np.uint8)})
    out = buf.get(2)
    assert out["task"].tolist() == [["push-0", "push-1"]] * 2
    assert out["task"].dtype == np.dtype("<U6")   # the value's own width, as upstream's stack
    assert out["eps"].tolist() == [[0.0, 0.5]] * 2 and out["eps"].dtype == np.float64
    assert out["flag"].tolist() == [[False, True]] * 2 and out["flag"].dtype == np.bool_
    assert out["k"].dtype == np.int64 and out["f32"].dtype == np.float32
    buf.append({"task": "x" * 32, "eps": 1, "flag": 1, "k": np.array([5, 6]), "f32": 1.0,
                "obs": np.zeros((2, 1), np.uint8)})
    assert buf.get(1)["k"].tolist() == [[5], [6]]
    assert buf.get(2)["task"].dtype == np.dtype("<U32")   # a later, longer string: wider
    before = buf.get(2)
    for bad, err in [({"task": "y" * 33}, "fixed width"), ({"k": 1.5}, "losing"),
                     ({"task": ["a", "b"]}, "list"), ({"k": None}, "NoneType"),
                     ({"eps": "text"}, "losing")]:
        info = {"task": "t", "eps": 0.0, "flag": False, "k": 0, "f32": 0.0,
                "obs": np.zeros((2, 1), np.uint8), **bad}
        with pytest.raises(TypeError, match=err):
            buf.append(info)
    after = buf.get(2)
    assert all(np.array_equal(before[k], after[k]) for k in before)


def test_string_arrays_get_headroom_and_come_back_at_their_own_width(make):
    buf = make(n_envs=2, max_len=3)
    buf.append({"name": np.array(["ab", "c"]), "raw": np.array([b"xy", b"z"])})
    out = buf.get(2)
    assert out["name"].dtype == np.dtype("<U2") and out["raw"].dtype == np.dtype("S2")
    assert out["name"].tolist() == [["ab", "ab"], ["c", "c"]]
    buf.append({"name": np.array(["a" * 32, "d"]), "raw": np.array([b"", b""])})
    out = buf.get(2)   # the shared column is 32 wide: a longer value than the first fits
    assert out["name"].dtype == np.dtype("<U32") and out["raw"].tolist() == [[b"xy", b""],
                                                                           [b"z", b""]]
    with pytest.raises(TypeError, match="does not fit"):   # a fixed column cannot grow
        buf.append({"name": np.array(["a" * 33, "d"]), "raw": np.array([b"", b""])})
    assert buf.get(0) is None and buf.get(1, env_ids=[])["name"].dtype == np.dtype("<U1")


def test_unsupported_first_values(make):
    buf = make(n_envs=2, max_len=4)
    with pytest.raises(TypeError, match="list"):
        buf.append({"x": [1, 2]})
    with pytest.raises(ValueError, match="leading env dim of 2"):
        buf.append({"x": np.zeros((3, 1))})
    with pytest.raises(ValueError, match="leading env dim"):
        buf.append({"x": np.float64(1.0), "y": np.array(1.0)})
    with pytest.raises(TypeError, match="object"):
        buf.append({"x": np.array([None, None])})
    # The constructor holds the name; no failed append sized the segment or fixed a schema.
    assert buf.get(1) is None and os.path.getsize(os.path.join(SHM, buf.name)) == 0


def test_mutating_the_callers_arrays_after_append_does_not_leak(make):
    buf = make(n_envs=2, max_len=4, action_block=1, block_keys=("action",))
    obs, act = np.zeros((2, 1, 3), np.float32), torch.zeros((2, 1, 2))
    buf.append({"obs": obs, "action": act})
    buf.append({"obs": obs, "action": act})
    obs += 7
    act += 7
    out = buf.get(2)
    assert (out["obs"] == 0).all() and (out["action"] == 0).all()
    out["obs"] += 1   # the result is a copy too
    assert (buf.get(2)["obs"] == 0).all()


@pytest.mark.parametrize("bad, error, match", [
    ({"pix": np.zeros((2, 1, 3)) + 0.5}, TypeError, "pix"),                   # lossy cast
    ({"action": np.zeros((3, 1, 2), np.float32)}, ValueError, "action"),    # leading dim
    ({"action": np.zeros((2, 2, 2), np.float32)}, ValueError, "action"),    # shape
    ({"extra": np.zeros(2)}, KeyError, "unknown keys \\['extra'\\]"),
    ({"action": None}, TypeError, "NoneType"),
])
def test_a_bad_append_writes_nothing(make, bad, error, match):
    buf = make(n_envs=2, max_len=4, action_block=1, block_keys=("action",))
    good = {"obs": np.ones((2, 1, 3), np.float32), "pix": np.ones((2, 1, 3), np.uint8),
            "action": np.ones((2, 1, 2), np.float32)}
    buf.append(good)
    before = buf.get(3)
    with pytest.raises(error, match=match):
        buf.append({**good, **bad})
    assert buf.num_strided() == [1, 1]
    after = buf.get(3)
    assert all(np.array_equal(before[k], after[k]) for k in before)


def test_keys_are_fixed(make):
    buf = make(n_envs=2, max_len=4)
    buf.append({"a": np.zeros(2), "b": np.zeros(2)})
    with pytest.raises(KeyError, match="missing keys \\['b'\\]"):
        buf.append({"a": np.zeros(2)})
    with pytest.raises(ValueError, match="distinct"):
        buf.append({"a": np.zeros(2), "b": np.zeros(2)}, env_ids=[1, 1])
    with pytest.raises(IndexError):
        buf.append({"a": np.zeros(1), "b": np.zeros(1)}, env_ids=[2])
    with pytest.raises(ValueError, match="leading env dim of 1|expected shape \\(1,\\)"):
        buf.append({"a": np.zeros(2), "b": np.zeros(2)}, env_ids=[1])
    assert len(buf) == 1


def test_many_long_key_names_are_kept(make):
    # Past the header's 1 KiB of metadata: the key names get a room of their own.
    buf = make(n_envs=1, max_len=2)
    info = {f"observation/camera_{i:02d}/{'x' * 40}": np.full(1, i) for i in range(20)}
    buf.append(info)
    got = buf.get(1)
    assert set(got) == set(info)
    assert all(np.array_equal(np.asarray(got[k]).reshape(-1)[-1:], v) for k, v in info.items())


def test_spec_declares_keys_up_front(make):
    buf = make(2, 3, 1, ("act.x",), spec={"pix/0": ((1, 2), np.uint8), "act.x": (1, "f4")})
    assert os.path.exists(os.path.join(SHM, buf.name))
    with pytest.raises(KeyError, match="missing"):
        buf.append({"pix/0": np.zeros((2, 1, 2), np.uint8)})
    buf.append({"pix/0": np.ones((2, 1, 2), np.uint8), "act.x": np.ones((2, 1), np.float32)})
    buf.append({"pix/0": np.ones((2, 1, 2), np.uint8), "act.x": np.ones((2, 1), np.float32)})
    assert set(buf.get(2)) == {"pix/0", "act.x"}


def test_constructor_validates_and_exposes_attributes(make):
    for kwargs, match in [({"n_envs": 0}, "n_envs"), ({"max_len": -1}, "max_len"),
                          ({"action_block": 0}, "action_block")]:
        with pytest.raises(ValueError, match=match):
            HistoryBuffer(**{"n_envs": 1, "max_len": 1, **kwargs})
    with pytest.raises(TypeError, match="did you mean"):
        HistoryBuffer(1, 1, 1, "action")
    buf = make(3, 7, 2, ["action", "grip"], seed=4)
    assert (buf.n_envs, buf.max_len, buf.action_block) == (3, 7, 2)
    assert buf.block_keys == frozenset({"action", "grip"})
    assert isinstance(buf.rng, np.random.Generator)
    assert buf.rng.integers(1 << 30) == np.random.default_rng(4).integers(1 << 30)
    assert len(buf) == 0 and buf.num_strided() == [0, 0, 0]
    with pytest.raises(shmbuf.SegmentExistsError):
        with shmbuf.create({"x": ((), np.float32)}, 16, done_key=None) as store:
            HistoryBuffer(1, 1, name=store.name)


# -- against a reference model ----------------------------------------------------------
class DequeHistory:
    """The documented semantics, one deque per env: the reference for get()."""

    def __init__(self, n_envs, max_len, action_block, block_keys):
        self.ab, self.block_keys = action_block, frozenset(block_keys)
        self.envs = [collections.deque(maxlen=max_len) for _ in range(n_envs)]

    def append(self, info, env_ids=None):
        ids = range(len(self.envs)) if env_ids is None else env_ids
        for row, e in enumerate(ids):
            self.envs[e].append({k: np.array(v[row]) for k, v in info.items()})

    def reset(self, env_ids=None):
        for e in range(len(self.envs)) if env_ids is None else env_ids:
            self.envs[e].clear()

    def get(self, n, env_ids=None):
        envs = self.envs if env_ids is None else [self.envs[e] for e in env_ids]
        if n <= 0 or any(len(d) == 0 for d in envs):
            return None
        out = {}
        for key in envs[0][-1]:
            if key in self.block_keys and n == 1:
                continue
            rows = [self._blocks(d, key, n) if key in self.block_keys else self._frames(d, key, n)
                    for d in envs]
            out[key] = np.stack(rows)
        return out

    def _frames(self, d, key, n):
        k = min(n, (len(d) - 1) // self.ab + 1)
        frames = [d[-1 - off * self.ab][key] for off in reversed(range(k))]
        frames = [frames[0]] * (n - k) + frames
        return np.concatenate(frames) if frames[0].ndim else np.stack(frames)

    def _blocks(self, d, key, n):
        ab = self.ab
        k = min(n, (len(d) - 1) // ab + 1)
        blocks = []
        for i in range(k - 1):
            start = (k - 2 - i) * ab
            raw = np.concatenate([d[-1 - off][key].reshape(-1)
                                  for off in reversed(range(start, start + ab))])
            blocks.append(np.where(np.isnan(raw), 0, raw).astype(raw.dtype))
        zero = np.zeros(ab * d[-1][key].size, d[-1][key].dtype)
        return np.stack([zero] * (n - 1 - len(blocks)) + blocks)


def ref_info(n_rows, serial, envs, nan_every):
    envs = np.asarray(envs)
    s = serial + np.arange(n_rows)
    act = np.stack([s, envs], axis=1).astype(np.float32)[:, None, :]
    act[s % nan_every == 0, 0, 1] = np.nan
    return {"obs": np.stack([envs, s], axis=1).astype(np.int32),
            "act": act, "r": s + 0.5}


@st.composite
def history_ops(draw):
    n_envs = draw(st.integers(1, 4))
    envs = st.integers(0, n_envs - 1)
    some = st.one_of(st.none(), st.lists(envs, min_size=1, max_size=n_envs, unique=True))
    op = st.one_of(
        st.tuples(st.just("append"), some),
        st.tuples(st.just("append"), some),
        st.tuples(st.just("reset"), some),
        st.tuples(st.just("get"), st.integers(-1, 5),
                  st.one_of(st.none(), st.lists(envs, min_size=1, max_size=5))))
    return n_envs, draw(st.lists(op, max_size=30))


@pytest.mark.slow
@settings(max_examples=80, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(ops=history_ops(), max_len=st.integers(1, 7), ab=st.integers(1, 3),
       act_is_block=st.booleans(), nan_every=st.integers(2, 5))
def test_get_matches_a_deque_reference(ops, max_len, ab, act_is_block, nan_every):
    n_envs, ops = ops
    block_keys = ("act",) if act_is_block else ()
    ref = DequeHistory(n_envs, max_len, ab, block_keys)
    serial = 0
    with HistoryBuffer(n_envs, max_len, ab, block_keys) as buf:
        for op in ops:
            if op[0] == "append":
                ids = op[1]
                rows = n_envs if ids is None else len(ids)
                info = ref_info(rows, serial, range(n_envs) if ids is None else ids, nan_every)
                serial += rows
                buf.append(info, env_ids=ids)
                ref.append(info, ids)
            elif op[0] == "reset":
                buf.reset(op[1])
                ref.reset(op[1])
            else:
                got, want = buf.get(op[1], op[2]), ref.get(op[1], op[2])
                if want is None:
                    assert got is None
                    continue
                assert got.keys() == want.keys()
                for key in want:
                    assert got[key].dtype == want[key].dtype
                    np.testing.assert_array_equal(got[key], want[key])
        assert buf.num_strided() == [(len(d) - 1) // ab + 1 if d else 0 for d in ref.envs]
        assert len(buf) == min(len(d) for d in ref.envs)


# -- the zero-copy variant ------------------------------------------------------------------
def test_get_view_is_a_live_window_when_contiguous(make):
    buf = make(n_envs=2, max_len=5, action_block=2, block_keys=("action",))
    ring = buf.max_len + buf.SPARE                       # 9 slots per env
    for t in range(ring):
        buf.append(steps_info(2, t))
    view = buf.get_view(3, 1)
    copy = buf.get(3, [1])
    assert view.keys() == copy.keys()
    columns = {s.key: s.column for s in buf._schema}
    for k in view:
        assert np.array_equal(view[k], copy[k][0])
        assert np.shares_memory(view[k], buf._rings.views[columns[k]])
    assert np.array_equal(buf.get_view(3, -1)["pixels"], view["pixels"])
    with pytest.raises(IndexError):
        buf.get_view(3, 2)
    frames = view["pixels"].copy()
    for t in range(ring, ring + buf.SPARE):              # intact for SPARE more appends
        buf.append(steps_info(2, t), env_ids=None)
        assert np.array_equal(view["pixels"], frames)
    assert buf.get_view(3, 1) is None                    # the window now wraps the ring


def test_get_view_is_none_where_no_view_exists(make):
    buf = make(n_envs=1, max_len=6, action_block=2)
    buf.append({"obs": np.zeros((1, 2, 3))})
    assert buf.get_view(2, 0) is None                    # warm-up needs padding
    buf.append({"obs": np.zeros((1, 2, 3))})
    buf.append({"obs": np.zeros((1, 2, 3))})
    assert buf.get_view(2, 0) is None                    # T=2 frames at stride 2
    assert buf.get_view(0, 0) is None
    one = make(n_envs=1, max_len=6, action_block=1, block_keys=("a",))
    for t in range(3):
        one.append({"obs": torch.full((1, 2, 3), t), "a": np.array([[np.nan]])})
    view = one.get_view(2, 0)
    assert isinstance(view["obs"], torch.Tensor) and view["obs"].shape == (4, 3)
    assert view["obs"][:, 0].tolist() == [1, 1, 2, 2]
    assert np.isnan(view["a"]).all()                     # raw: NaN is not zeroed in views


# -- lifecycle and sharing ----------------------------------------------------------------
def test_lifecycle_and_attach():
    with HistoryBuffer(2, 4, 1, ("action",)) as buf:
        assert buf.owner and "no schema yet" in repr(buf)
        buf.append(steps_info(2, 0))
        other = HistoryBuffer.attach(buf.name)
        assert not other.owner and other.block_keys == {"action"} and other.n_envs == 2
        other.append(steps_info(1, 1, env_ids=[1]), env_ids=[1])
        assert buf.get(2)["step"].tolist() == [[0, 0], [0, 1]]
        with pytest.raises(PermissionError):
            other.unlink()
        other.close()
        other.close()
        with pytest.raises(shmbuf.BufferClosedError):
            other.get(1)
        assert os.path.exists(os.path.join(SHM, buf.name))
        name = buf.name
    assert not os.path.exists(os.path.join(SHM, name))
    with pytest.raises(shmbuf.BufferClosedError):
        buf.append(steps_info(2, 0))
    with pytest.raises(shmbuf.SegmentNotFoundError):
        HistoryBuffer.attach(name)


def test_attach_refuses_other_segments():
    with keyed.create({"x": ((), np.float32)}, 2, 2) as rings:
        with pytest.raises(shmbuf.CorruptSegmentError, match="HistoryBuffer"):
            HistoryBuffer.attach(rings.name)


def test_unlink_and_drop(make):
    buf = make(1, 2)
    buf.unlink()   # nothing created yet: a no-op
    buf.append({"x": np.zeros(1)})
    buf.unlink()
    assert not os.path.exists(os.path.join(SHM, buf.name))
    assert buf.get(1)["x"].tolist() == [[0.0]]
    dropped = HistoryBuffer(1, 2)
    dropped.append({"x": np.zeros(1)})
    name = dropped.name
    del dropped
    assert not os.path.exists(os.path.join(SHM, name))


def test_a_handle_pickled_before_the_first_append_attaches_lazily(make):
    buf = make(n_envs=2, max_len=4, action_block=1)
    early = pickle.loads(pickle.dumps(buf))
    try:
        assert not early.owner and early.get(1) is None and len(early) == 0
        with pytest.raises(SchemaPendingError, match="spec="):
            early.append(steps_info(2, 0))
        buf.append(steps_info(2, 0))                         # the constructor creates it
        early.append(steps_info(1, 1, env_ids=[1]), env_ids=[1])
        assert early.get(2)["step"].tolist() == [[0, 0], [0, 1]]
        assert buf.get(2)["step"].tolist() == [[0, 0], [0, 1]]
        late = pickle.loads(pickle.dumps(buf))               # after: attaches at once
        assert late.num_strided() == [1, 2]
        late.close()
    finally:
        early.close()
    assert os.path.exists(os.path.join(SHM, buf.name))
    buf.close()
    with pytest.raises(shmbuf.SegmentNotFoundError):
        pickle.loads(pickle.dumps(buf))


# -- checkpoints ----------------------------------------------------------------------------
def fill_for_checkpoint(buf, steps):
    for t in range(steps):
        info = steps_info(3, t)
        info["task"] = f"t{t}"
        buf.append(info)
    buf.reset([1])
    buf.append({**steps_info(1, 100, env_ids=[1]), "task": "late"}, env_ids=[1])


def test_checkpoint_round_trip(make, tmp_path):
    src = make(3, 6, 2, ("action",))
    fill_for_checkpoint(src, 9)
    path = tmp_path / "history.pt"
    torch.save(src.state_dict(), path)
    state = torch.load(path, weights_only=True)
    assert state["lengths"].tolist() == [6, 1, 6]
    dst = make(3, 4, 2, ("action",))                        # smaller: keeps the newest 4
    dst.load_state_dict(state)
    assert dst.num_strided() == [2, 1, 2] and len(dst) == 1
    want = src.get(2)
    got = dst.get(2)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])
    assert got["task"].tolist()[1] == ["late", "late"]
    assert dst.get(3)["step"].tolist()[0] == [6, 6, 8]      # kept 5..8, in order
    same = make(3, 6, 2, ("action",))
    same.load_state_dict(state)
    for k, v in src.get(3).items():
        np.testing.assert_array_equal(same.get(3)[k], v)


def test_checkpoint_of_torch_keys_and_of_an_empty_buffer(make, tmp_path):
    src = make(2, 3)
    assert make(2, 3).state_dict()["entries"] == {}
    src.append({"obs": torch.arange(4, dtype=torch.float16).reshape(2, 2)})
    torch.save(src.state_dict(), tmp_path / "t.pt")
    dst = make(2, 3)
    dst.load_state_dict(torch.load(tmp_path / "t.pt", weights_only=True))
    out = dst.get(1)["obs"]
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float16
    assert out.tolist() == [[0.0, 1.0], [2.0, 3.0]]


def test_checkpoint_mismatches_are_rejected(make):
    src = make(2, 3)
    src.append({"obs": np.zeros((2, 3), np.float32)})
    state = src.state_dict()
    for other, match in [(make(3, 3), "n_envs=2"),
                         (make(2, 3, spec={"obs": ((3,), np.float64)}), "schema"),
                         (make(2, 3, spec={"img": ((3,), np.float32)}), "schema")]:
        with pytest.raises(ValueError, match=match):
            other.load_state_dict(state)
    with pytest.raises(ValueError, match="format"):
        src.load_state_dict({**state, "format": "nope"})
    with pytest.raises(ValueError, match="lengths"):
        src.load_state_dict({**state, "lengths": torch.tensor([5, 5])})
    assert src.num_strided() == [1, 1]


# -- several processes -------------------------------------------------------------------------
def check_history(out, envs, n, ab, newest_seen) -> None:
    """Frames are whole entries at stride ab (oldest strided repeated); blocks match."""
    before = dict(newest_seen)
    for row, env in enumerate(envs):
        steps = out["step"][row]
        diffs = np.diff(steps)
        assert set(diffs.tolist()) <= {0, ab}, f"env {env}: steps {steps.tolist()}"
        assert (np.sort(diffs) == diffs).all(), f"padding after real frames: {steps.tolist()}"
        assert (out["pixels"][row] == pixels_for([env] * n, steps)[:, 0]).all(), "torn frame"
        for i in range(n - 1):
            block = out["action"][row, i].reshape(ab, 2)
            if diffs[i] == 0:
                assert (block == 0).all()
            else:
                ts = np.arange(steps[i] + 1, steps[i + 1] + 1)
                assert block.tolist() == [[env, t] for t in ts.tolist()]
        assert steps[-1] >= before.get(env, 0), "history went back in time"
        newest_seen[env] = max(newest_seen.get(env, 0), int(steps[-1]))


@pytest.mark.slow
def test_spawned_workers_append_their_envs_while_the_planner_gets():
    ctx = mp.get_context("spawn")
    n_envs, n, ab = 4, 3, 2
    owned = [[0, 2], [3, 1]]
    buf = HistoryBuffer(n_envs, max_len=6, action_block=ab, block_keys=("action",))
    go_r, go_w = ctx.Pipe(duplex=False)
    stop_r, stop_w = ctx.Pipe(duplex=False)
    ready_r, ready_w = ctx.Pipe(duplex=False)
    procs = [ctx.Process(target=history_worker, args=(buf, envs, go_r, stop_r, ready_w, 100_000))
             for envs in owned]       # pickled before the segment exists: they attach lazily
    newest, ok, lapped = {}, 0, 0
    try:
        with running(procs):
            buf.append(history_info(np.arange(n_envs), 0))   # creates the segment
            go_w.send(True)
            for _ in procs:
                assert ready_r.poll(60), "a worker never started"
                ready_r.recv()
            for i in range(300):
                envs = [3, 0, 1, 2] if i % 2 else None
                try:
                    out = buf.get(n, envs)
                except shmbuf.SampleRetryError:
                    lapped += 1
                    continue
                check_history(out, list(range(n_envs)) if envs is None else envs, n, ab, newest)
                ok += 1
            stop_w.send(True)
            join_all(procs, 60)
        assert os.path.exists(os.path.join(SHM, buf.name))  # workers never unlink
        final = buf.get(n)
        check_history(final, range(n_envs), n, ab, newest)
        assert (final["step"][:, -1] > 0).all()
        print(f"planner gets: {ok} verified, {lapped} lapped every retry")
    finally:
        stop_w.send(True)
        buf.close()
