"""Lifecycle of real segments: create, attach, close, unlink, corruption, processes.

Every test leaves /dev/shm as it found it (the autouse fixture in conftest
checks).  Children are forked or started with ``python -c``; each has a timeout
and is killed in ``finally`` if it is still there.
"""
import contextlib
import errno
import gc
import mmap
import os
import pickle
import secrets
import stat
import struct
import subprocess
import sys
import textwrap
import traceback
import weakref

import numpy as np
import posix_ipc
import pytest
from helpers.procs import wait_pid
from helpers.shm import own_entries
from helpers.workers import SPEC, step_for, verify_batch, write_steps

import shmbuf
from shmbuf.keyed import rings as keyed
from shmbuf.protocol import layout as L
from shmbuf.segment.segment import Segment

SHM = "/dev/shm"
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
CHILD_TIMEOUT = 60


def fresh_name(tag="t"):
    return f"shmbuf-test-{tag}-{os.getpid()}-{secrets.token_hex(5)}"


def exists(name):
    return os.path.exists(os.path.join(SHM, name))


@contextlib.contextmanager
def raw_map(name):
    """A read-write mapping of /dev/shm/NAME that bypasses shmbuf entirely."""
    fd = os.open(os.path.join(SHM, name), os.O_RDWR)
    try:
        mm = mmap.mmap(fd, 0)
    finally:
        os.close(fd)
    try:
        yield mm
    finally:
        mm.close()


def run_forked(body, timeout=CHILD_TIMEOUT):
    """Run ``body()`` in a forked child that always leaves through os._exit; its exit code."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            body()
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    code = wait_pid(pid, timeout)   # killed and reaped if it hangs
    assert code is not None, f"forked child did not exit within {timeout} s"
    return code


def run_python(code, timeout=CHILD_TIMEOUT):
    """Run ``code`` in a fresh interpreter that can import tests/helpers/workers.py."""
    prelude = f"import sys; sys.path.insert(0, {TESTS_DIR!r})\n"
    proc = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"child failed ({proc.returncode}):\n{proc.stderr}"
    return proc.stdout


def write(buf, n, writer_id=0, episode_len=1000):
    write_steps(buf, writer_id, n, episode_len)


# -- create / attach / close / unlink ----------------------------------------------
def test_create_attach_close_unlink():
    name = fresh_name()
    buf = shmbuf.create(SPEC, 64, name=name)
    try:
        assert buf.name == name and buf.owner and exists(name)
        att = shmbuf.attach(name)
        assert not att.owner
        assert att.spec == buf.spec and att.capacity == buf.capacity == 64
        assert att.chunk_size == buf.chunk_size and att.done_key == buf.done_key == "done"
        att.close()
        assert exists(name), "an attacher's close unlinked the segment"
    finally:
        buf.close()
    assert not exists(name)


def test_generated_names_are_distinct_and_prefixed(make_buffer):
    a, b = make_buffer(capacity=16), make_buffer(capacity=16)
    assert a.name != b.name
    assert a.name.startswith("shmbuf-") and exists(a.name) and exists(b.name)


@pytest.mark.parametrize("who", ["owner", "attacher"])
def test_double_close_is_idempotent(make_buffer, who):
    owner = make_buffer(capacity=16)
    buf = owner if who == "owner" else shmbuf.attach(owner.name)
    buf.close()
    buf.close()
    assert exists(owner.name) == (who == "attacher")
    assert "closed" in repr(buf)


CLOSED_OPS = {
    "arrays": lambda b: b.arrays,
    "writer": lambda b: b.writer(),
    "sample_sequences": lambda b: b.sample_sequences(1, 1),
    "sample_steps": lambda b: b.sample_steps(1),
    "wait_ready": lambda b: b.wait_ready(1, timeout=0),
    "stats": lambda b: b.stats(),
}


@pytest.mark.parametrize("op", list(CLOSED_OPS.values()), ids=list(CLOSED_OPS))
@pytest.mark.parametrize("who", ["owner", "attacher"])
def test_operations_after_close_raise(make_buffer, who, op):
    owner = make_buffer(capacity=16)
    write(owner, 4)
    buf = owner if who == "owner" else shmbuf.attach(owner.name)
    buf.close()
    with pytest.raises(shmbuf.BufferClosedError, match="closed") as info:
        op(buf)
    assert buf.name in str(info.value)
    assert isinstance(info.value, ValueError)  # like I/O on a closed file


def test_writer_after_buffer_close_raises(make_buffer):
    buf = make_buffer(capacity=16)
    w = buf.writer()
    w.add(**step_for(0, 0, 0, 0, False))
    buf.close()
    with pytest.raises(shmbuf.BufferClosedError):
        w.add(**step_for(0, 1, 0, 1, False))
    w.close()
    w.close()


def test_closed_writer_raises_and_double_close_is_fine(make_buffer):
    buf = make_buffer(capacity=16)
    w = buf.writer()
    w.close()
    w.close()
    with pytest.raises(shmbuf.BufferClosedError, match="writer"):
        w.add(**step_for(0, 0, 0, 0, False))
    assert buf.stats().writers == 0


VIEWS_AFTER_CLOSE = """
    import gc
    import numpy as np
    import shmbuf
    from helpers.workers import SPEC, write_steps
    buf = shmbuf.{how}(SPEC, 16)
    write_steps(buf, 0, 3)
    reward = buf.arrays["reward"]
    expect = reward.copy()
    {drop}
    gc.collect()
    assert (reward == expect).all()  # a dangling view segfaults here instead
    reward[0] = 1.0
    print("ok")
"""


@pytest.mark.slow
@pytest.mark.parametrize("drop", ["buf.close()", "del buf"], ids=["closed", "dropped"])
def test_views_outlive_the_buffer(drop):
    """close() says views stay valid; a child checks, so a crash cannot take pytest down."""
    code = VIEWS_AFTER_CLOSE.format(how="create", drop=drop)
    prelude = f"import sys; sys.path.insert(0, {TESTS_DIR!r})\n"
    proc = subprocess.run([sys.executable, "-X", "faulthandler", "-c",
                           prelude + textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=CHILD_TIMEOUT)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", (
        f"reading buf.arrays after {drop!r} failed with exit code {proc.returncode} "
        f"(-11: SIGSEGV, the mapping was unmapped under a live view):\n{proc.stderr[-2000:]}")


def test_with_block_unlinks_for_the_owner_only():
    name = fresh_name()
    with shmbuf.create(SPEC, 16, name=name) as owner:
        with shmbuf.attach(name) as att:
            assert not att.owner
        assert exists(name), "leaving an attacher's with block unlinked the segment"
        with pytest.raises(shmbuf.BufferClosedError):
            att.stats()
        owner.stats()
    assert not exists(name)
    with pytest.raises(shmbuf.BufferClosedError):
        owner.stats()


def test_with_block_unlinks_on_exception():
    name = fresh_name()
    with pytest.raises(KeyError):
        with shmbuf.create(SPEC, 16, name=name):
            raise KeyError("boom")
    assert not exists(name)


def test_attacher_unlink_raises_permission_error(make_buffer):
    owner = make_buffer(capacity=16)
    with shmbuf.attach(owner.name) as att:
        with pytest.raises(PermissionError, match=owner.name):
            att.unlink()
    assert exists(owner.name)


def test_owner_unlink_keeps_mapping_usable(make_buffer):
    buf = make_buffer(capacity=16)
    buf.unlink()
    assert not exists(buf.name)
    buf.unlink()  # already gone: still fine
    write(buf, 5)
    assert buf.stats().live_steps == 5
    with pytest.raises(shmbuf.SegmentNotFoundError):
        shmbuf.attach(buf.name)


def test_keep_leaves_the_segment_after_close_and_exit_until_rm():
    name = fresh_name("keep")
    try:
        buf = shmbuf.create(SPEC, 16, name=name)
        write(buf, 5)
        buf.keep()
        assert not buf.owner
        buf.close()
        del buf
        gc.collect()
        assert exists(name)                              # close and the finalizer left it
        with shmbuf.attach(name) as att:
            assert att.stats().live_steps == 5 and att.stats().owner_pid == os.getpid()

        def child():                                     # its creator exits: still there
            b = shmbuf.create(SPEC, 16, name=name + "-c")
            write(b, 3)
            b.keep()
        assert run_forked(child) == 0
        assert exists(name + "-c")
        with shmbuf.attach(name + "-c") as att:
            assert att.stats().live_steps == 3 and not att.stats().owner_alive
        out = run_python(f"""
            from shmbuf import cli
            print(cli.main(["rm", {name!r}]), cli.main(["rm", {name + "-c"!r}]))
        """)
        assert out.split()[-2:] == ["1", "0"]            # a live creator needs --force
        assert exists(name) and not exists(name + "-c")
    finally:
        for n in (name, name + "-c"):
            if exists(n):
                shmbuf.segment.segment.unlink(n)


def test_keep_on_an_attached_handle_changes_nothing(make_buffer):
    owner = make_buffer(capacity=16)
    with shmbuf.attach(owner.name) as att:
        att.keep()
    owner.close()
    assert not exists(owner.name)


def test_attach_after_unlink_raises_not_found():
    name = fresh_name()
    shmbuf.create(SPEC, 16, name=name).close()
    with pytest.raises(shmbuf.SegmentNotFoundError) as info:
        shmbuf.attach(name)
    assert isinstance(info.value, FileNotFoundError)
    assert info.value.errno == errno.ENOENT
    assert name in str(info.value)
    with pytest.raises(FileNotFoundError):
        shmbuf.attach(name)


def test_create_existing_name_raises_exists(make_buffer):
    first = make_buffer(capacity=16)
    write(first, 3)
    with pytest.raises(shmbuf.SegmentExistsError) as info:
        shmbuf.create(SPEC, 16, name=first.name)
    assert isinstance(info.value, FileExistsError)
    assert info.value.errno == errno.EEXIST
    assert first.name in str(info.value)
    assert exists(first.name) and first.stats().live_steps == 3  # the first is untouched


def test_segment_mode_is_0600(make_buffer):
    buf = make_buffer(capacity=16)
    assert stat.S_IMODE(os.stat(os.path.join(SHM, buf.name)).st_mode) == 0o600


BAD_NAMES = ["a/b", "/leading", "trailing/", "a\0b", "\0", "x" * 201, "", ".hidden",
             "-dash", "with space", "caf\u00e9"]


@pytest.mark.parametrize("name", BAD_NAMES)
@pytest.mark.parametrize("call", ["create", "attach"])
def test_bad_names_rejected_before_any_syscall(name, call):
    before = own_entries()
    with pytest.raises(ValueError, match="name") as info:
        if call == "create":
            shmbuf.create(SPEC, 16, name=name).close()
        else:
            shmbuf.attach(name).close()
    assert not isinstance(info.value, OSError)  # not an answer from the kernel
    assert own_entries() == before


@pytest.mark.parametrize("call", ["create", "attach"])
def test_non_str_name_is_a_type_error(call):
    with pytest.raises(TypeError, match="name"):
        if call == "create":
            shmbuf.create(SPEC, 16, name=b"bytes").close()
        else:
            shmbuf.attach(42).close()


def test_longest_name_is_accepted():
    name = fresh_name()
    name += "x" * (200 - len(name))
    with shmbuf.create(SPEC, 16, name=name) as buf:
        with shmbuf.attach(name) as att:
            assert att.name == buf.name == name


# -- segments that are not (or no longer) shmbuf buffers ----------------------------
def _poke_header(name, field, value):
    off, fmt = L.HEADER_FIELDS[field]
    with raw_map(name) as mm:
        struct.pack_into(fmt, mm, off, value)


def test_wrong_magic_raises_corrupt(make_buffer):
    buf = make_buffer(capacity=16)
    with raw_map(buf.name) as mm:
        mm[0:8] = b"NOTSHMBF"
    with pytest.raises(shmbuf.CorruptSegmentError, match="magic") as info:
        shmbuf.attach(buf.name)
    assert buf.name in str(info.value)
    assert not isinstance(info.value, shmbuf.LayoutVersionError)
    assert isinstance(info.value, ValueError)


def test_wrong_version_raises_layout_version_error(make_buffer):
    buf = make_buffer(capacity=16)
    newer = L.LAYOUT_VERSION + 1
    _poke_header(buf.name, "version", newer)
    with pytest.raises(shmbuf.LayoutVersionError) as info:
        shmbuf.attach(buf.name)
    msg = str(info.value)
    assert repr(buf.name) in msg
    assert f"version {newer}" in msg and f"version {L.LAYOUT_VERSION}" in msg
    assert isinstance(info.value, shmbuf.CorruptSegmentError)


def test_corrupt_header_field_raises_corrupt(make_buffer):
    buf = make_buffer(capacity=16)
    _poke_header(buf.name, "capacity", 17)
    with pytest.raises(shmbuf.CorruptSegmentError, match=buf.name):
        shmbuf.attach(buf.name)


@pytest.mark.parametrize("size, content", [(0, b""), (64, b"hello"), (8192, b"\xff" * 8192)])
def test_foreign_segment_raises_corrupt(size, content):
    name = fresh_name("foreign")
    shm = posix_ipc.SharedMemory("/" + name, posix_ipc.O_CREX, mode=0o600, size=size)
    try:
        if content:
            with raw_map(name) as mm:
                mm[:len(content)] = content
        with pytest.raises(shmbuf.CorruptSegmentError, match=name):
            shmbuf.attach(name)
        assert exists(name), "attach removed a segment that is not shmbuf's"
    finally:
        shm.close_fd()
        posix_ipc.unlink_shared_memory("/" + name)


@pytest.mark.parametrize("size", [0, 8, L.COLUMN_TABLE - 1, L.COLUMN_TABLE + 100, 3 * L.PAGE])
def test_truncated_segment_raises_corrupt(make_buffer, size):
    buf = make_buffer(capacity=64)
    # Nothing below touches the owner's memory past the new end (that would SIGBUS);
    # closing it only unmaps and unlinks.
    os.truncate(os.path.join(SHM, buf.name), size)
    with pytest.raises(shmbuf.CorruptSegmentError, match=buf.name):
        shmbuf.attach(buf.name)


def test_too_small_dev_shm_raises_shared_memory_full():
    st = os.statvfs(SHM)
    shm_size = st.f_blocks * st.f_frsize
    if not shm_size:
        pytest.skip("/dev/shm has no size limit")
    # Ask for more than the whole of /dev/shm, not merely more than is free: tmpfs
    # refuses that at once, while a request in between fills memory before failing.
    row = 1 << 20
    capacity = 2 * shm_size // row + 1
    spec = {"obs": ((row,), np.uint8), "done": ((), np.bool_)}
    assert L.plan(spec, capacity).total_bytes > shm_size  # plan() accepts it
    name = fresh_name("full")
    before = own_entries()
    with pytest.raises(shmbuf.SharedMemoryFullError) as info:
        shmbuf.create(spec, capacity, name=name)
    assert isinstance(info.value, OSError)
    assert info.value.errno in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM)
    assert "--shm-size" in str(info.value) and name in str(info.value)
    assert own_entries() == before


# -- pickling ------------------------------------------------------------------
@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_pickle_sends_only_the_name(make_buffer, protocol):
    owner = make_buffer(capacity=64)
    write(owner, 10)
    payload = pickle.dumps(owner, protocol=protocol)
    assert len(payload) < 200 + len(owner.name)
    assert owner.name.encode() in payload
    att = pickle.loads(payload)
    try:
        assert not att.owner and att.name == owner.name
        for k, v in owner.arrays.items():
            np.testing.assert_array_equal(att.arrays[k], v)
        assert att.stats() == owner.stats()
        assert len(pickle.dumps(att, protocol=protocol)) == len(payload)
    finally:
        att.close()
    assert exists(owner.name)


def test_writer_cannot_be_pickled(make_buffer):
    buf = make_buffer(capacity=16)
    with buf.writer() as w:
        with pytest.raises(TypeError, match="buf.writer"):
            pickle.dumps(w)


# -- other processes ---------------------------------------------------------------
ATTACH_AND_WRITE = """
    import shmbuf
    from helpers.workers import write_steps
    buf = shmbuf.attach({name!r})
    write_steps(buf, 7, {n}, episode_len=25)
    {close}
"""


@pytest.mark.slow
@pytest.mark.parametrize("close", ["buf.close()", "pass"], ids=["closes", "just exits"])
def test_attacher_process_writes_exits_and_owner_still_reads(make_buffer, close):
    owner = make_buffer(capacity=256, chunk_size=16)
    run_python(ATTACH_AND_WRITE.format(name=owner.name, n=100, close=close))
    assert exists(owner.name), "an attacher's exit unlinked the owner's segment"
    stats = owner.stats()
    assert (stats.steps_written, stats.live_steps, stats.writers) == (100, 100, 0)
    batch = owner.sample_sequences(16, 10, rng=0)
    assert verify_batch(batch) == 16
    assert (batch["action"][..., 0] == 7).all()
    with shmbuf.attach(owner.name) as again:  # and others can still attach
        assert again.stats().steps_written == 100


@pytest.mark.slow
def test_owner_process_exit_unlinks():
    """CPython-style: a ``python -c`` owner that never closes still cleans up at exit."""
    name = fresh_name("exit")
    out = run_python(f"""
        import shmbuf
        from helpers.workers import SPEC
        buf = shmbuf.create(SPEC, 64, name={name!r})
        print(buf.stats().owner_alive)
    """)
    assert out.strip() == "True"
    assert not exists(name), "the owner process exited and its segment leaked"


def test_owner_dropped_without_close_unlinks():
    box = [shmbuf.create(SPEC, 16, name=fresh_name())]
    name = box[0].name
    assert exists(name)
    box.clear()
    gc.collect()
    assert not exists(name)


def test_a_held_port_keeps_no_dropped_owner_alive():
    """``Buffer.port`` holds the buffer's methods weakly: an owner dropped while a facade
    (or anyone) keeps its port unlinks at once, without waiting for a gc pass."""
    was = gc.isenabled()
    gc.disable()   # "at once": by reference count alone
    try:
        box = [shmbuf.create(SPEC, 16, name=fresh_name())]
        name, port = box[0].name, box[0].port
        box.clear()
        assert not exists(name), "the port kept its dropped owner (and the segment) alive"
        with pytest.raises(ReferenceError, match="dropped"):
            port.writer()
    finally:
        if was:
            gc.enable()


def test_attacher_dropped_without_close_does_not_unlink(make_buffer):
    owner = make_buffer(capacity=16)
    box = [shmbuf.attach(owner.name)]
    ref = weakref.ref(box[0])
    box.clear()
    gc.collect()
    assert ref() is None
    assert exists(owner.name)
    assert owner.stats().owner_alive


def test_forked_child_dropping_inherited_owner_does_not_unlink():
    box = [shmbuf.create(SPEC, 64, name=fresh_name("fork"))]
    name = box[0].name
    ref = weakref.ref(box[0])
    try:
        def child():
            box.clear()  # the last reference: the finalizer runs here, in the child
            if ref() is not None:
                gc.collect()
            assert ref() is None
        assert run_forked(child) == 0
        assert exists(name), "a forked child unlinked its parent's buffer"
        assert box[0].stats().owner_alive
    finally:
        box.clear()
    assert ref() is None and not exists(name)


def test_forked_child_that_closes_and_writes_does_not_unlink(make_buffer):
    buf = make_buffer(capacity=64, chunk_size=8)

    def child():
        write(buf, 20, writer_id=3)
        buf.close()
    assert run_forked(child) == 0
    assert exists(buf.name)
    stats = buf.stats()
    assert (stats.steps_written, stats.live_steps, stats.writers) == (20, 20, 0)
    assert verify_batch(buf.sample_sequences(4, 8, rng=1)) == 4


# -- stats() ----------------------------------------------------------------------
def test_stats_after_known_writes(make_buffer):
    buf = make_buffer(capacity=64, chunk_size=4)
    s = buf.stats()
    assert (s.name, s.capacity, s.chunk_size, s.n_chunks) == (buf.name, 64, 4, 16)
    assert (s.steps_written, s.live_steps, s.writers, s.streams, s.samples) == (0, 0, 0, 0, 0)
    assert s.owner_pid == os.getpid() and s.owner_alive

    w = buf.writer()
    assert buf.stats().writers == 1
    for step in (step_for(0, p, p // 5, p % 5, p % 5 == 4) for p in range(10)):
        w.add(**step)
    s = buf.stats()
    assert (s.steps_written, s.live_steps, s.episodes) == (10, 10, 2)
    assert (s.oldest_step, s.newest_step, s.chunks_in_use) == (0, 9, 3)
    assert (s.writers, s.streams, s.samples) == (1, 1, 0)

    buf.sample_sequences(2, 3, rng=0)
    buf.sample_steps(5, rng=0)
    assert buf.stats().samples == 2

    w.close()
    s = buf.stats()
    assert (s.steps_written, s.live_steps, s.episodes, s.writers) == (10, 10, 2, 0)

    with buf.writer() as w2:
        w2.add_batch(obs=np.zeros((3, 3, 8, 8), np.uint8), action=np.zeros((3, 6), np.float32),
                     reward=np.zeros(3, np.float32), done=np.array([True, False, False]))
        s = buf.stats()
        assert (s.steps_written, s.live_steps, s.episodes) == (13, 13, 3)
        assert (s.writers, s.streams) == (1, 4)

    with shmbuf.attach(buf.name) as att:
        assert att.stats() == buf.stats()


def test_stats_after_eviction(make_buffer):
    buf = make_buffer(capacity=64, chunk_size=4)
    write(buf, 203, writer_id=1)
    s = buf.stats()
    assert s.steps_written == 203 and s.newest_step == 202
    assert s.capacity - s.chunk_size < s.live_steps <= s.capacity
    assert s.oldest_step == s.steps_written - s.live_steps
    assert s.chunks_in_use <= s.n_chunks
    batch = buf.sample_sequences(32, 4, rng=0)
    verify_batch(batch)
    assert batch["reward"].min() >= s.oldest_step  # reward is the position in the stream
    assert batch["reward"].max() <= s.newest_step


# -- zero-copy views ----------------------------------------------------------------
def test_arrays_are_zero_copy_views(make_buffer):
    buf = make_buffer(capacity=64, chunk_size=4)
    arrays = buf.arrays
    assert set(arrays) == set(SPEC)
    for k, (shape, dtype) in SPEC.items():
        assert arrays[k].shape == (64,) + shape and arrays[k].dtype == dtype
        assert np.shares_memory(arrays[k], buf.arrays[k])
    with buf.writer() as w:
        w.add(**step_for(5, 123, 0, 0, False))
    rows = np.flatnonzero(arrays["reward"] == 123)  # seen through views taken before
    assert len(rows) == 1
    np.testing.assert_array_equal(arrays["action"][rows[0]],
                                  step_for(5, 123, 0, 0, False)["action"])
    with shmbuf.attach(buf.name) as att:
        assert att.arrays["reward"][rows[0]] == 123
        att.arrays["reward"][rows[0]] = -1.5  # and a write from the other side shows here
    assert arrays["reward"][rows[0]] == -1.5


@pytest.mark.slow  # the first torch import takes seconds
def test_tensors_share_memory_with_arrays(make_buffer):
    torch = pytest.importorskip("torch")
    buf = make_buffer(capacity=64, chunk_size=4)
    tensors = buf.tensors
    for k, (shape, _dtype) in SPEC.items():
        assert tuple(tensors[k].shape) == (64,) + shape
        assert tensors[k].data_ptr() == buf.arrays[k].ctypes.data
    with buf.writer() as w:
        w.add(**step_for(2, 77, 0, 0, True))
    row = int(np.flatnonzero(buf.arrays["reward"] == 77)[0])
    assert tensors["reward"][row].item() == 77 and bool(tensors["done"][row])
    tensors["reward"][row] = 0.25
    assert buf.arrays["reward"][row] == 0.25
    assert isinstance(tensors["obs"], torch.Tensor) and tensors["obs"].dtype == torch.uint8
    buf.close()
    with pytest.raises(shmbuf.BufferClosedError):
        _ = buf.tensors


# -- one lifecycle for every kind: store, keyed rings, facades, HistoryBuffer ---------------

FRAME = (1, 2, 2)


def _history(sized=True):
    buf = shmbuf.HistoryBuffer(2, 3)
    if sized:
        buf.append({"x": np.zeros(2, np.float32)})
    return buf


def _dreamer():
    rb = shmbuf.ReplayBuffer(16, FRAME, 1, seq_len=2, batch_size=2)
    rb.add({"image": np.zeros(FRAME, np.uint8)}, np.zeros(1), 0.0, 0.0)
    return rb


def _memory():
    return shmbuf.Memory(2, steps_per_episode=4, obs_shape=(2,), action_size=1)


# factory, an operation that needs the object open
KINDS = {
    "store": (lambda: shmbuf.create(SPEC, 16), lambda b: b.stats()),
    "keyed rings": (lambda: keyed.create({"x": ((), np.float32)}, 2, 2), lambda r: r.lengths()),
    "HistoryBuffer": (_history, lambda h: h.get(1)),
    "HistoryBuffer, not sized yet": (lambda: _history(sized=False), lambda h: h.get(1)),
    "Dreamer ReplayBuffer": (_dreamer, lambda rb: rb.steps),
    "IRISReplayBuffer": (lambda: shmbuf.IRISReplayBuffer(16, FRAME, 1, seq_len=2),
                         lambda rb: len(rb)),
    "PlaNet Memory": (_memory, lambda m: len(m)),
}
KIND_IDS = list(KINDS)


@pytest.fixture(params=KIND_IDS)
def kind(request):
    return KINDS[request.param]


def test_every_kind_shares_the_lifecycle_base():
    from shmbuf.segment.lifecycle import Shared

    for factory, _ in KINDS.values():
        obj = factory()
        try:
            assert isinstance(obj, Shared) and obj.owner and exists(obj.name)
        finally:
            obj.close()
        assert not exists(obj.name)


def test_double_close_then_every_use_raises_closed_naming_the_object(kind):
    factory, use = kind
    obj = factory()
    name = obj.name
    obj.close()
    obj.close()
    assert obj.closed and not exists(name) and obj.name == name
    with pytest.raises(shmbuf.BufferClosedError, match="closed") as info:
        use(obj)
    assert repr(name) in str(info.value)
    assert "closed" in repr(obj)


def test_with_block_closes_and_the_owner_unlinks(kind):
    factory, use = kind
    with factory() as obj:
        use(obj)
    assert obj.closed and not exists(obj.name)


def test_pickling_sends_the_name_and_the_copy_never_unlinks(kind):
    factory, use = kind
    obj = factory()
    try:
        payload = pickle.dumps(obj)
        assert obj.name.encode() in payload and len(payload) < 400 + len(obj.name)
        copy = pickle.loads(payload)
        try:
            assert type(copy) is type(obj) and copy.name == obj.name and not copy.owner
            use(copy)
            with pytest.raises(PermissionError, match=obj.name):
                copy.unlink()
        finally:
            copy.close()
        assert exists(obj.name), "closing an unpickled copy unlinked the segment"
        use(obj)
    finally:
        obj.close()


def test_a_forked_childs_finalizer_and_close_never_unlink(kind):
    factory, use = kind
    box = [factory()]
    obj = box[0]
    ref = weakref.ref(obj)
    del obj

    def child():
        inherited = box[0]
        assert not inherited.owner
        with pytest.raises(PermissionError):
            inherited.unlink()
        del inherited
        box.clear()   # the last reference in the child: the finalizers run here
        gc.collect()
        assert ref() is None
    try:
        assert run_forked(child) == 0
        assert exists(box[0].name), "a forked child unlinked its parent's segment"
        assert box[0].owner
        use(box[0])
    finally:
        name = box[0].name
        box.clear()
        gc.collect()
    assert ref() is None and not exists(name), "the owner's finalizer did not unlink"


def test_owner_unlink_then_close_is_quiet(kind):
    factory, use = kind
    obj = factory()
    obj.unlink()
    obj.unlink()
    assert not exists(obj.name)
    use(obj)
    obj.close()


# -- HistoryBuffer takes its name at construction --------------------------------------
def test_history_buffer_name_taken_raises_from_the_real_create():
    with shmbuf.create(SPEC, 16) as store:
        with pytest.raises(shmbuf.SegmentExistsError) as info:
            shmbuf.HistoryBuffer(1, 1, name=store.name)
        assert info.value.errno == errno.EEXIST and store.name in str(info.value)
        assert store.stats().steps_written == 0   # untouched
    with shmbuf.HistoryBuffer(1, 1) as held:      # and the reverse: the constructor holds it
        assert exists(held.name) and os.path.getsize(os.path.join(SHM, held.name)) == 0
        for make in (lambda: shmbuf.create(SPEC, 16, name=held.name),
                     lambda: shmbuf.HistoryBuffer(1, 1, name=held.name),
                     lambda: keyed.create({"x": ((), np.float32)}, 1, 1, name=held.name)):
            with pytest.raises(shmbuf.SegmentExistsError):
                make()
        held.append({"x": np.ones(1, np.float32)})   # the first append sizes the held name
        assert held.get(1)["x"].tolist() == [[1.0]]


def test_history_buffer_constructor_never_stats_the_name(monkeypatch):
    def no_exists_check(path):
        raise AssertionError(f"os.path.exists({path!r}) races with other creators")
    monkeypatch.setattr(os.path, "exists", no_exists_check)
    buf = shmbuf.HistoryBuffer(1, 1)
    monkeypatch.undo()
    buf.close()


def test_an_attacher_that_comes_before_the_first_append_waits_for_it(monkeypatch):
    buf = shmbuf.HistoryBuffer(2, 3, action_block=1)
    try:
        real = Segment.published
        waited = []

        def published(segment):
            ready = real(segment)
            if not ready and not waited:   # the attacher is waiting: the owner appends now
                waited.append(segment.name)
                buf.append({"x": np.arange(2, dtype=np.float32)})
            return ready
        monkeypatch.setattr(Segment, "published", published)
        early = shmbuf.HistoryBuffer.attach(buf.name)
        monkeypatch.undo()
        try:
            assert waited == [buf.name]
            assert not early.owner and early.get(1)["x"].tolist() == [[0.0], [1.0]]
        finally:
            early.close()
    finally:
        buf.close()


def test_shmbuf_attach_maps_the_segment_and_reads_its_header_once(monkeypatch):
    made = [shmbuf.create(SPEC, 16), _history(), _dreamer()]
    calls = {"attach": 0, "header": 0}
    real_attach, real_header = Segment.attach.__func__, Segment.header

    def attach(cls, name):
        calls["attach"] += 1
        return real_attach(cls, name)

    def header(self, *args, **kwargs):
        calls["header"] += 1
        return real_header(self, *args, **kwargs)
    try:
        for obj in made:
            monkeypatch.setattr(Segment, "attach", classmethod(attach))
            monkeypatch.setattr(Segment, "header", header)
            calls.update(attach=0, header=0)
            other = shmbuf.attach(obj.name)
            monkeypatch.undo()
            try:
                assert type(other) is type(obj)
                assert calls == {"attach": 1, "header": 1}, (type(obj).__name__, calls)
            finally:
                other.close()
    finally:
        for obj in made:
            obj.close()


def test_long_metadata_is_kept_whole_and_attachers_read_it(make_buffer):
    # A Box space's bounds for a 64x64x3 image: far past the header's 1 KiB.
    meta = {"bounds": list(range(30_000)), "note": "x" * 5000}
    buf = make_buffer(SPEC, 64, meta=meta)
    other = shmbuf.attach(buf.name)
    try:
        assert other.meta == meta and buf.meta == meta
        write_steps(buf, 0, 64, 8)   # the room lies between the index and the rows
        again = shmbuf.attach(buf.name)
        assert again.meta == meta
        again.close()
        verify_batch(other.sample_sequences(8, 4))
    finally:
        other.close()


def test_metadata_past_the_limit_is_refused_before_anything_is_made():
    from shmbuf.protocol.layout import META_LIMIT

    name = f"shmbuf-test-bigmeta-{os.getpid()}"
    with pytest.raises(ValueError, match=f"at most {META_LIMIT} bytes of metadata"):
        shmbuf.create(SPEC, 16, name=name, meta={"blob": "y" * (META_LIMIT + 1)})
    assert not os.path.exists(f"/dev/shm/{name}")
