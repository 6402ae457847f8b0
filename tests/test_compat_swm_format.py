"""shmbuf.compat.swm.ShmFormat: swm's writer contract and HDF5 reader conventions for shm://."""
import multiprocessing as mp
import os
import pickle

import numpy as np
import pytest
from helpers.procs import join_all, running

try:   # stable-worldmodel's data layer; some builds fail with more than ImportError
    import stable_worldmodel.data  # noqa: F401
except Exception as exc:  # e.g. RuntimeError from a torchvision built for CUDA torch
    pytest.skip(f"stable-worldmodel cannot be imported: {type(exc).__name__}: {exc}",
                allow_module_level=True)

import h5py
import torch
from helpers.swm_envs import make_world, world_class
from helpers.swm_workers import frame_episode, play_frames, tagged_episode, write_shm_dataset
from stable_worldmodel.data import convert, load_dataset
from stable_worldmodel.data.format import FORMATS, detect_format, get_format

import shmbuf
from shmbuf import Compress, cli
from shmbuf.compat.swm import (
    EPISODE_DATA_KEY,
    ReplayBuffer,
    ShmDataset,
    ShmFormat,
    ShmWriter,
)

SHM = "/dev/shm"


def hdf5_available() -> bool:
    return "hdf5" in FORMATS


needs_hdf5 = pytest.mark.skipif(not hdf5_available(), reason="swm's hdf5 format is not "
                                "registered (h5py or hdf5plugin missing)")


@pytest.fixture
def shm_name(request):
    """A test-session name for shm://; whatever is left under it is removed at teardown."""
    names = []

    def make(what="t"):
        name = f"shmbuf-test-swm{what}{len(names)}-{os.getpid()}"
        names.append(name)
        return name

    yield make
    for name in names:
        if os.path.exists(os.path.join(SHM, name)):
            shmbuf.segment.segment.unlink(name)


def _hdf5_writes_text() -> bool:
    """Whether this swm's HDF5 writer stores a text column (releases up to 0.1.1 cannot:
    h5py refuses numpy's unicode dtype there); the round trips use text where it can."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        try:
            with get_format("hdf5").open_writer(os.path.join(tmp, "probe.h5")) as w:
                w.write_episode({"x": [np.zeros(1, np.float32)] * 2, "lang": ["ab"] * 2})
        except TypeError:
            return False
    return True


TEXT = hdf5_available() and _hdf5_writes_text()


def swm_episode(n, seed, text=None):
    """An episode in swm's row convention: the reset row has NaN action and reward."""
    rng = np.random.default_rng(seed)
    action = rng.standard_normal((n, 2)).astype(np.float32)
    action[-1] = np.nan                     # collect shifts action one row earlier
    reward = rng.standard_normal(n)
    reward[0] = np.nan
    ep = {"pixels": list(rng.integers(0, 256, (n, 8, 8, 3), dtype=np.uint8)),
          "action": list(action), "reward": list(reward),
          "state": list(rng.standard_normal((n, 3))),
          "terminated": list(np.arange(n) == n - 1),
          "step_idx": list(np.arange(n, dtype=np.int64))}
    if TEXT if text is None else text:
        ep["lang"] = [f"push the T to goal {seed}"] * n
    return ep


def written(name) -> int:
    buf = shmbuf.attach(name)
    try:
        return buf.stats().steps_written
    finally:
        buf.close()


# -- registration and detection -------------------------------------------------------------
def test_registered_as_shmbuf_and_claims_only_shm_names(tmp_path):
    assert get_format("shmbuf") is ShmFormat and ShmFormat.supports_episode_data
    assert ShmFormat.detect("shm://pusht")
    assert detect_format("shm://pusht") is ShmFormat
    for other in ("pusht.h5", "shm:/pusht", "lerobot://x/y", tmp_path, "SHM://x", None):
        assert not ShmFormat.detect(other)


@pytest.mark.parametrize("path, match", [("shm://", "not a valid segment name"),
                                         ("shm://a/b", "not a valid segment name"),
                                         ("data.h5", "must be 'shm://NAME'")])
def test_bad_shm_paths_are_refused(path, match):
    with pytest.raises(ValueError, match=match):
        ShmFormat.open_writer(path)
    with pytest.raises(ValueError, match=match):
        ShmFormat.open_reader(path)


def test_a_missing_name_and_a_foreign_segment_are_clear_errors(shm_name):
    name = shm_name()
    with pytest.raises(FileNotFoundError, match=name):
        load_dataset(f"shm://{name}")
    spec = {"obs": ((2,), np.float32), "done": ((), np.bool_)}
    with shmbuf.create(spec, 64, name=name) as buf:
        before = buf.stats().steps_written
        with pytest.raises(ValueError, match="is not a stable-worldmodel buffer"):
            load_dataset(f"shm://{name}")
        for mode in ("append", "overwrite"):
            with pytest.raises(ValueError, match="is not a stable-worldmodel buffer"), \
                    ShmFormat.open_writer(f"shm://{name}", mode=mode) as w:
                w.write_episode(tagged_episode(0, 0, 3))
        assert buf.stats().steps_written == before and os.path.exists(os.path.join(SHM, name))


# -- the writer contract --------------------------------------------------------------------
def test_writing_outside_with_is_refused(shm_name):
    w = ShmFormat.open_writer(f"shm://{shm_name()}")
    with pytest.raises(RuntimeError, match="outside of a `with` block"):
        w.write_episode(tagged_episode(0, 0, 3))
    with pytest.raises(ValueError, match="write mode must be one of"):
        ShmFormat.open_writer(f"shm://{shm_name()}", mode="truncate")


def test_modes_append_overwrite_error(shm_name):
    path = f"shm://{shm_name()}"
    with ShmFormat.open_writer(path, mode="error") as w:
        w.write_episode(tagged_episode(0, 0, 5))
    with ShmFormat.open_writer(path) as w:                      # append is the default
        w.write_episode(tagged_episode(0, 1, 7))
    assert load_dataset(path).lengths.tolist() == [5, 7]
    with pytest.raises(FileExistsError, match="already exists"), \
            ShmFormat.open_writer(path, mode="error"):
        pass
    assert load_dataset(path).lengths.tolist() == [5, 7]
    with ShmFormat.open_writer(path, mode="overwrite") as w:
        w.write_episode(tagged_episode(0, 2, 4))
    assert load_dataset(path).lengths.tolist() == [4]


def test_schema_drift_is_refused_before_writing(shm_name):
    path = f"shm://{shm_name()}"
    with ShmFormat.open_writer(path) as w:
        w.write_episode(tagged_episode(0, 0, 5))
    name = path[len("shm://"):]
    before = written(name)
    drifted = [dict(tagged_episode(0, 1, 5), extra=np.zeros((5, 2))),
               {k: v for k, v in tagged_episode(0, 1, 5).items() if k != "t"},
               dict(tagged_episode(0, 1, 5), pixels=np.zeros((5, 4, 4, 1), np.uint8)),
               dict(tagged_episode(0, 1, 5), who=np.zeros(5, np.float64))]
    for ep in drifted:
        with pytest.raises(ValueError, match="schema mismatch|per-step shape|dtype float64"), \
                ShmFormat.open_writer(path) as w:
            w.write_episode(ep)
    assert written(name) == before and load_dataset(path).lengths.tolist() == [5]


def test_the_writer_is_reentrant_and_applies_its_mode_once(shm_name):
    path = f"shm://{shm_name()}"
    w = ShmFormat.open_writer(path, mode="overwrite")
    for ep in range(3):
        with w as again:
            assert again is w
            with w:                                             # nested too
                w.write_episode(tagged_episode(0, ep, 4))
    assert load_dataset(path).lengths.tolist() == [4, 4, 4]


@pytest.mark.slow
def test_repeated_world_collect_into_one_writer(tmp_path, shm_name):
    world_cls, why = world_class()
    if world_cls is None:
        pytest.skip(f"swm's World cannot be imported here: {why}")
    path = f"shm://{shm_name()}"
    world = make_world(num_envs=2, steps=5)
    try:
        w = ShmFormat.open_writer(path)
        world.collect(writer=w, episodes=2, seed=0, progress=False)
        world.collect(writer=w, episodes=2, seed=1, progress=False)
        world.collect(path, episodes=1, seed=2, format="shmbuf", progress=False)
        # The same collect through swm's own HDF5 format: its row convention (how many
        # rows a 5-step episode has, which of them carry NaN) is the reference.
        world.collect(str(tmp_path / "ref.h5"), episodes=1, seed=2, format="hdf5",
                      progress=False)
    finally:
        world.close()
    ds = load_dataset(path, num_steps=2)
    ref = load_dataset(str(tmp_path / "ref.h5"), num_steps=2)
    assert ds.lengths.tolist() == [int(ref.lengths[0])] * 5
    ep, want = ds.load_episode(0), ref.load_episode(0)
    for col in ("reward", "action"):
        assert torch.isnan(ep[col]).tolist() == torch.isnan(want[col]).tolist(), col
    assert ep["pixels"].shape == want["pixels"].shape
    assert ep["pixels"].shape[1:] == (3, 16, 16)


# -- reading: HDF5's conventions, and the round trip ---------------------------------------
@needs_hdf5
def test_round_trip_through_convert_is_bit_identical(tmp_path, shm_name):
    src, back = tmp_path / "data.h5", tmp_path / "back.h5"
    with get_format("hdf5").open_writer(src) as w:
        for seed, n in enumerate((6, 9, 4)):
            w.write_episode(swm_episode(n, seed))
    path = f"shm://{shm_name()}"
    convert(str(src), path, dest_format="shmbuf", progress=False)
    convert(path, str(back), dest_format="hdf5", progress=False)
    with h5py.File(src, "r") as a, h5py.File(back, "r") as b:
        assert sorted(a.keys()) == sorted(b.keys())
        for key in a:
            assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape, key
            if h5py.check_string_dtype(a[key].dtype):
                assert list(a[key].asstr()[:]) == list(b[key].asstr()[:])
            else:
                assert a[key][:].tobytes() == b[key][:].tobytes(), key   # NaN rows included


@needs_hdf5
def test_reader_follows_the_hdf5_readers_output(tmp_path, shm_name):
    src = tmp_path / "data.h5"
    with get_format("hdf5").open_writer(src) as w:
        for seed, n in enumerate((12, 9, 15)):
            w.write_episode(swm_episode(n, seed))
    path = f"shm://{shm_name()}"
    convert(str(src), path, dest_format="shmbuf", progress=False)
    kw = {"num_steps": 3, "frameskip": 2}
    h5, shm = load_dataset(str(src), **kw), load_dataset(path, **kw)
    assert isinstance(shm, ShmDataset)
    assert len(h5) == len(shm) and h5.lengths.tolist() == shm.lengths.tolist()
    assert h5.offsets.tolist() == shm.offsets.tolist()

    def same(x, y):
        assert type(x) is type(y)
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and x.shape == y.shape
            assert x.numpy().tobytes() == y.numpy().tobytes()
        else:
            assert x == y

    for i in range(len(h5)):
        a, b = h5[i], shm[i]
        assert a.keys() == b.keys()
        for k in a:
            same(a[k], b[k])
    for a, b in zip(h5.load_chunk(np.array([0, 2]), np.array([1, 3]), np.array([7, 13])),
                    shm.load_chunk(np.array([0, 2]), np.array([1, 3]), np.array([7, 13]))):
        for k in a:
            same(a[k], b[k])
    for col in ("pixels", "action", "reward", "step_idx"):
        assert h5.get_col_data(col).tobytes() == shm.get_col_data(col).tobytes()
        assert h5.get_dim(col) == shm.get_dim(col)
    rows = [0, 5, 20]
    for col in ("action", "state"):
        assert h5.get_row_data(rows)[col].tobytes() == shm.get_row_data(rows)[col].tobytes()


def test_episode_data_and_text_survive_the_format(shm_name):
    path = f"shm://{shm_name()}"
    rb = ReplayBuffer(max_steps=100)
    try:
        for tag in range(2):
            ep = swm_episode(4, tag, text=True)   # shmbuf keeps text whatever swm version
            ep[EPISODE_DATA_KEY] = {"model_xml": f"<scene {tag}/>", "idx": tag}
            rb.write_episode(ep)
        rb.dump(path, format="shmbuf")
    finally:
        rb.close()
    ds = load_dataset(path)
    assert ds.episode_column_names == ["model_xml", "idx"]
    assert ds.get_episode_data()["model_xml"] == ["<scene 0/>", "<scene 1/>"]
    assert ds.load_episode(1)["lang"] == "push the T to goal 1"


@pytest.mark.slow
def test_a_compressing_table_is_compacted_by_its_writer_and_reads_like_a_raw_one(shm_name):
    pytest.importorskip("zstandard", reason="compress= needs the compress extra's codec")
    frames = play_frames(400)   # Breakout (ale-py), or a rendered Breakout-like scene
    eps = [frame_episode(frames, e * 100, 100) for e in range(8)]
    raw, packed = f"shm://{shm_name('raw')}", f"shm://{shm_name('packed')}"
    with ShmFormat.open_writer(raw, max_steps=2048) as w:
        w.write_episodes(eps)
    # As convert(..., dest_format="shmbuf", compress=...) and dump(..., compress=...) pass it.
    with ShmFormat.open_writer(packed, max_steps=2048,
                               compress=Compress("pixels", hot_steps=0)) as w:
        w.write_episodes(eps)
    look = shmbuf.attach(packed[len("shm://"):])
    try:   # no process owns the table now: its writer compacted it before letting go
        st = look.stats().compression
        assert st.compressed_chunks > 0 and st.cold_raw_chunks == 0
        assert st.raw_bytes > 10 * st.stored_bytes
    finally:
        look.close()
    a, b = load_dataset(raw, num_steps=3), load_dataset(packed, num_steps=3)
    try:
        assert len(a) == len(b) == 8 * 98
        for i in range(0, len(a), 5):
            x, y = a[i], b[i]
            assert all(torch.equal(x[k], y[k]) for k in x)
        for col in ("pixels", "action", "tag"):
            assert np.array_equal(a.get_col_data(col), b.get_col_data(col))
        assert np.array_equal(b.get_col_data("pixels"), frames[b.get_col_data("tag") % 400])
        rows = np.array([[3, 150], [799, 0]])
        x, y = a.get_row_data(rows), b.get_row_data(rows)
        assert all(np.array_equal(x[k], y[k]) for k in x)
    finally:
        a.close()
        b.close()


def test_bad_compress_for_the_writer_is_refused(shm_name):
    path = f"shm://{shm_name()}"
    with pytest.raises(TypeError, match="ShmWriter: compress must be True, False, None or a "
                       "shmbuf.Compress, got 'pixels'"):
        ShmFormat.open_writer(path, compress="pixels")
    with pytest.raises(ValueError, match=r"ShmWriter: compress: hot_steps must be at most "
                       r"max_steps \(10\), got 11"):
        ShmFormat.open_writer(path, max_steps=10, compress=Compress("pixels", hot_steps=11))
    assert not os.path.exists(os.path.join(SHM, path[len("shm://"):]))


# -- sharing: pickles to the name, outlives its writer, removable -----------------------
@pytest.mark.slow
def test_dataloader_workers_share_the_dataset(shm_name):
    path = f"shm://{shm_name()}"
    with ShmFormat.open_writer(path) as w:
        for ep in range(4):
            w.write_episode(tagged_episode(1, ep, 10))
    ds = load_dataset(path, num_steps=2)
    blob = pickle.dumps(ds)
    assert len(blob) < 2000                                     # the name, not the data
    again = pickle.loads(blob)
    assert torch.equal(again[7]["pixels"], ds[7]["pixels"])
    loader = torch.utils.data.DataLoader(ds, batch_size=5, num_workers=2, timeout=60,
                                         multiprocessing_context="spawn")
    got = torch.cat([b["t"] for b in loader])
    assert torch.equal(got, torch.stack([ds[i]["t"] for i in range(len(ds))]))


@pytest.mark.slow
def test_data_outlives_its_writer_and_rm_removes_it(shm_name, capsys):
    name = shm_name()
    ctx = mp.get_context("spawn")
    with running([ctx.Process(target=write_shm_dataset, args=(f"shm://{name}", 3, 8))]) as procs:
        join_all(procs, 120)
    ds = load_dataset(f"shm://{name}", num_steps=4)             # a later process reads it
    assert ds.lengths.tolist() == [8, 8, 8]
    ds.close()
    assert cli.main(["gc", "--dry-run"]) == 0                  # its writer is gone: gc may
    assert f"would remove {name}" in capsys.readouterr().out
    assert cli.main(["rm", name]) == 0
    assert not os.path.exists(os.path.join(SHM, name))


def test_a_table_kept_by_a_live_process_needs_rm_force(shm_name, capsys):
    name = shm_name()
    with ShmFormat.open_writer(f"shm://{name}") as w:
        w.write_episode(tagged_episode(0, 0, 4))
    assert os.path.exists(os.path.join(SHM, name))              # kept after the writer closed
    assert cli.main(["rm", name]) == 1                          # its creator (us) is alive
    assert "owned by a live process" in capsys.readouterr().err
    assert cli.main(["rm", "--force", name]) == 0
    assert not os.path.exists(os.path.join(SHM, name))


def test_shm_writer_capacity_evicts_oldest(shm_name):
    path = f"shm://{shm_name()}"
    with ShmWriter(path, max_steps=20) as w:
        for ep in range(4):
            w.write_episode(tagged_episode(0, ep, 8))
        with pytest.raises(ValueError, match="exceeds max_steps=20"):
            w.write_episode(tagged_episode(0, 9, 21))
    ds = load_dataset(path)
    assert ds.lengths.tolist() == [8, 8]
    assert ds.load_episode(0)["ep"].tolist() == [2] * 8


@needs_hdf5
def test_reader_options_match_the_hdf5_readers(tmp_path, shm_name):
    src = tmp_path / "data.h5"
    with get_format("hdf5").open_writer(src) as w:
        w.write_episode(swm_episode(6, 0))
    path = f"shm://{shm_name()}"
    convert(str(src), path, dest_format="shmbuf", progress=False)
    def kw():   # fresh lists: swm's HDF5 reader appends the merged key to the caller's list
        return {"keys_to_load": ["action", "state"], "keys_to_merge": {"both": ["action", "state"]}}

    h5, shm = load_dataset(str(src), **kw()), load_dataset(path, **kw())
    assert h5.column_names == shm.column_names == ["action", "state", "both"]
    assert h5.get_col_data("both").tobytes() == shm.get_col_data("both").tobytes()
    assert pickle.loads(pickle.dumps(shm)).column_names == shm.column_names
    with pytest.raises(KeyError, match="'nope' is not a column"):
        load_dataset(path, keys_to_load=["nope"])
    with pytest.raises(TypeError, match="unexpected keyword argument 'framskip'"):
        load_dataset(path, framskip=2)


def test_shmbuf_info_names_the_tables_columns(shm_name, capsys):
    name = shm_name()
    with ShmFormat.open_writer(f"shm://{name}") as w:
        w.write_episode({"observation.state": np.zeros((3, 2), np.float32),
                         "action": np.zeros((3, 2), np.float32)})
    assert cli.main(["info", name]) == 0
    out = capsys.readouterr().out
    assert "observation.state" in out and "action" in out and " c0 " not in out
    ds = load_dataset(f"shm://{name}")                # a name that is not an identifier
    assert ds.column_names == ["observation.state", "action"]


def test_a_live_replay_buffer_reads_as_a_dataset():
    rb = ReplayBuffer(max_steps=100)
    try:
        for ep in range(3):
            rb.write_episode(tagged_episode(2, ep, 5 + ep))
        rb.clear()
        rb.write_episode(tagged_episode(2, 7, 4))
        ds = load_dataset(f"shm://{rb.name}")
        assert ds.lengths.tolist() == rb.lengths.tolist() == [4]
        assert ds.load_episode(0)["ep"].tolist() == [7] * 4
    finally:
        rb.close()
