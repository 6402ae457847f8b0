"""The CLI: ls, info, rm, gc (dead owners only) and top, through real subprocesses."""
import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import posix_ipc
import pytest
from helpers.procs import join_all, running

import shmbuf

SPEC = {"obs": ((2,), np.uint8), "done": ((), np.bool_)}


def cli(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "shmbuf", *args], capture_output=True,
                          text=True, timeout=timeout)


def _orphan(name: str) -> None:
    """Make buffer ``name`` and SIGKILL its owner, so its segment outlives it."""
    code = (f"import shmbuf, numpy as np, sys; b = shmbuf.create({{'x': ((2,), np.uint8)}}, 64, "
            f"done_key=None, name={name!r}); print('ready', flush=True); sys.stdin.read()")
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    with running([child]):
        assert child.stdout.readline().strip() == "ready"
        child.send_signal(signal.SIGKILL)
        join_all([child], 30, expect=-signal.SIGKILL)


def _remove(name: str) -> None:
    try:
        posix_ipc.unlink_shared_memory("/" + name)
    except posix_ipc.ExistentialError:
        pass


@pytest.fixture
def orphan():
    """A buffer whose owner was SIGKILLed, so its segment outlived it."""
    name = f"shmbuf-test-cli-orphan-{os.getpid()}"
    try:
        _orphan(name)
        yield name
    finally:
        _remove(name)


@pytest.mark.slow
def test_gc_removes_only_segments_of_dead_owners(orphan, make_buffer):
    alive = make_buffer(SPEC, 64)
    foreign = posix_ipc.SharedMemory(f"/shmbuf-test-cli-foreign-{os.getpid()}",
                                     posix_ipc.O_CREX, size=4096)
    # Only what this test made: gc without names would act on every user's buffers.
    ours = (orphan, alive.name, foreign.name.lstrip("/"))
    try:
        dry = cli("gc", "--dry-run", *ours)
        assert dry.returncode == 0
        assert f"would remove {orphan}" in dry.stdout
        assert alive.name not in dry.stdout and "foreign" not in dry.stdout
        assert os.path.exists(f"/dev/shm/{orphan}")
        real = cli("gc", *ours)
        assert real.returncode == 0 and f"removed {orphan}" in real.stdout
        assert not os.path.exists(f"/dev/shm/{orphan}")
        assert os.path.exists(f"/dev/shm/{alive.name}")
        assert os.path.exists(f"/dev/shm{foreign.name}")
    finally:
        foreign.close_fd()
        foreign.unlink()


@pytest.mark.slow
def test_ls_info_top_rm(make_buffer):
    buf = make_buffer(SPEC, 100)
    with buf.writer() as w:
        for _ in range(30):
            w.add(obs=[1, 2], done=False)
        ls = cli("ls")
        assert ls.returncode == 0
        row = next(line for line in ls.stdout.splitlines() if line.startswith(buf.name))
        assert row.split()[5:7] == ["100", "30"] and "alive" in row
        info = cli("info", buf.name)
        assert info.returncode == 0
        assert "live steps   30" in info.stdout and "obs" in info.stdout
        top = cli("top", buf.name, "--iterations", "2", "--interval", "0", "--plain")
        assert top.returncode == 0 and "fill 30/100" in top.stdout
        assert "steps/s" in top.stdout  # the writer's slot is listed with its rate
    other = shmbuf.create(SPEC, 10, name=f"shmbuf-test-cli-rm-{os.getpid()}")
    try:
        refused = cli("rm", other.name)
        assert refused.returncode == 1 and os.path.exists(f"/dev/shm/{other.name}")
        assert f"owned by a live process, pid {os.getpid()}" in refused.stderr
        assert "--force" in refused.stderr
        rm = cli("rm", "--force", other.name)
        assert rm.returncode == 0 and not os.path.exists(f"/dev/shm/{other.name}")
        with pytest.raises(shmbuf.BufferClosedError, match="'shmbuf rm'"):
            other.writer().add(obs=[1, 2], done=False)  # its owner learns who removed it
    finally:
        other.close()


@pytest.mark.slow
def test_gc_with_names_looks_at_those_buffers_only(orphan):
    other = f"shmbuf-test-cli-orphan2-{os.getpid()}"
    try:
        _orphan(other)
        got = cli("gc", other, f"shmbuf-test-cli-absent-{os.getpid()}")
        assert got.returncode == 0 and f"removed {other}" in got.stdout
        assert not os.path.exists(f"/dev/shm/{other}")
        assert os.path.exists(f"/dev/shm/{orphan}") and orphan not in got.stdout
    finally:
        _remove(other)


@pytest.mark.slow
def test_gc_keeps_a_dead_owners_buffer_while_writers_use_it(orphan):
    buf = shmbuf.attach(orphan)
    try:
        with buf.writer() as w:
            w.add(x=[1, 2])
            kept = cli("gc", orphan)
            assert kept.returncode == 0 and f"kept {orphan}" in kept.stdout
            assert "own=True" in kept.stdout and os.path.exists(f"/dev/shm/{orphan}")
        gone = cli("gc", orphan)  # the writer closed: nobody uses it now
        assert f"removed {orphan}" in gone.stdout and not os.path.exists(f"/dev/shm/{orphan}")
    finally:
        buf.close()


@pytest.mark.slow
def test_rm_removes_a_dead_owners_buffer_without_force(orphan):
    rm = cli("rm", orphan)
    assert rm.returncode == 0 and not os.path.exists(f"/dev/shm/{orphan}")


@pytest.mark.slow
def _ls_row(name: str) -> dict:
    """``shmbuf ls``'s row for ``name`` by the header's labels (a size is two words)."""
    lines = cli("ls").stdout.splitlines()
    assert lines[0].split()[:6] == ["NAME", "IN", "/DEV/SHM", "MAX", "SIZE", "CAPACITY"]
    words = next(line for line in lines if line.startswith(name + " ")).split()
    return {"IN /DEV/SHM": " ".join(words[1:3]), "MAX SIZE": " ".join(words[3:5]),
            "CAPACITY": words[5], "FILL": words[6]}


def _human(n: int) -> str:
    from shmbuf.cli import _human
    return _human(n)


def test_ls_and_info_show_what_a_buffer_holds_in_dev_shm_and_its_largest_size(make_buffer):
    buf = make_buffer({"frame": ((64, 64, 3), np.uint8), "done": ((), np.bool_)}, 100_000)
    with buf.writer() as w:
        w.extend(frame=np.ones((300, 64, 64, 3), np.uint8), done=np.zeros(300, bool))
        st = os.stat(f"/dev/shm/{buf.name}")
        held, size = st.st_blocks * 512, st.st_size
        assert 300 * 64 * 64 * 3 <= held < size / 100    # sparse: a page per written row
        row = _ls_row(buf.name)
        assert row["IN /DEV/SHM"] == _human(held) and row["MAX SIZE"] == _human(size)
        assert (row["CAPACITY"], row["FILL"]) == ("100000", "300")
        info = cli("info", buf.name).stdout
        assert f"in /dev/shm  {_human(held)} (the pages it holds now)" in info
        assert f"max size     {_human(size)} (every chunk written and raw)" in info


def test_ls_flags_a_shmbuf_named_entry_that_is_not_a_buffer():
    name = f"shmbuf-test-cli-garbage-{os.getpid()}"
    garbage = posix_ipc.SharedMemory("/" + name, posix_ipc.O_CREX, size=8192)
    try:
        os.write(garbage.fd, b"not a header" * 100)
        ls = cli("ls")
        assert ls.returncode == 0
        row = next(line for line in ls.stdout.splitlines() if line.startswith(name))
        assert "NOT A SHMBUF BUFFER" in row and f"rm --force {name}" in row
        refused = cli("rm", name)
        assert refused.returncode == 1 and "not a shmbuf buffer" in refused.stderr
        assert os.path.exists(f"/dev/shm/{name}")
        assert cli("gc", name).returncode == 0 and os.path.exists(f"/dev/shm/{name}")
        assert cli("rm", "--force", name).returncode == 0
        assert not os.path.exists(f"/dev/shm/{name}")
    finally:
        garbage.close_fd()
        try:
            garbage.unlink()
        except posix_ipc.ExistentialError:
            pass


@pytest.mark.slow
def test_top_prints_rates_from_the_first_frame_without_escapes_when_piped(make_buffer):
    buf = make_buffer(SPEC, 1000)
    with buf.writer() as w:
        for t in range(50):
            w.add(obs=[1, 2], done=t % 10 == 9)
    buf.sample_sequences(8, 5)
    top = cli("top", buf.name, "--iterations", "1", "--interval", "0")  # stdout is a pipe
    assert top.returncode == 0
    assert "\x1b[" not in top.stdout
    assert "ingest" in top.stdout and "steps/s" in top.stdout
    assert "sampled" in top.stdout and "rows/s" in top.stdout and "episodes" in top.stdout
    assert "evicted" in top.stdout and "alive" in top.stdout
    assert "totals: written 50  evicted 0  episodes 5  sampled rows 40" in top.stdout


@pytest.mark.slow
def test_ls_info_and_top_agree_on_a_history_buffer_and_show_its_keys():
    hb = shmbuf.HistoryBuffer(n_envs=2, max_len=5, spec={"pixels": ((1, 2), np.uint8),
                                                         "action": ((1, 3), np.float32)})
    try:
        for _ in range(3):
            hb.append({"pixels": np.zeros((2, 1, 2), np.uint8),
                       "action": np.zeros((2, 1, 3), np.float32)})
        row = next(line for line in cli("ls").stdout.splitlines() if line.startswith(hb.name))
        assert row.split()[6] == "6"   # 3 entries for each of 2 envs
        top = cli("top", hb.name, "--iterations", "1", "--interval", "0")
        assert "fill 6/" in top.stdout
        info = cli("info", hb.name)
        assert info.returncode == 0 and "live entries 6" in info.stdout
        assert "pixels" in info.stdout and "action" in info.stdout
        assert "k0" not in info.stdout
    finally:
        hb.close()


@pytest.mark.slow
@pytest.mark.parametrize("args", [("info", "shmbuf-test-cli-missing"),
                                  ("rm", "shmbuf-test-cli-missing"),
                                  ("top", "shmbuf-test-cli-missing")])
def test_missing_name_exits_1_with_a_message(args):
    got = cli(*args)
    assert got.returncode == 1
    assert "no shared-memory segment named 'shmbuf-test-cli-missing'" in got.stderr


@pytest.mark.slow
def test_usage_errors_exit_2_and_every_command_has_help():
    assert cli().returncode == 2
    assert cli("frobnicate").returncode == 2
    for command in ("ls", "info", "rm", "gc", "top"):
        got = cli(command, "--help")
        assert got.returncode == 0 and "usage: shmbuf" in got.stdout


@pytest.mark.slow
def test_console_script_is_installed():
    script = shutil.which("shmbuf")
    assert script is not None, "pip install -e . should install the shmbuf console script"
    got = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=60)
    assert got.returncode == 0 and "usage: shmbuf" in got.stdout


@pytest.mark.slow
def test_a_reader_that_leaves_early_gets_no_traceback(make_buffer):
    buf = make_buffer(SPEC, 64)
    # ``shmbuf info NAME | head``: the reader has gone before the first write.
    child = subprocess.Popen([sys.executable, "-m", "shmbuf", "info", buf.name],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    child.stdout.close()
    with running([child]):
        err = child.stderr.read().decode()
        join_all([child], 60, expect=141)
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
