"""The CLI: ls, info, rm, gc (dead owners only) and top, through real subprocesses."""
import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import posix_ipc
import pytest

import shmbuf

SPEC = {"obs": ((2,), np.uint8), "done": ((), np.bool_)}


def cli(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "shmbuf", *args], capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture
def orphan():
    """A buffer whose owner was SIGKILLed, so its segment outlived it."""
    name = f"shmbuf-test-cli-orphan-{os.getpid()}"
    code = (f"import shmbuf, numpy as np, sys; b = shmbuf.create({{'x': ((2,), np.uint8)}}, 64, "
            f"name={name!r}); print('ready', flush=True); sys.stdin.read()")
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=30)
    yield name
    try:
        posix_ipc.unlink_shared_memory("/" + name)
    except posix_ipc.ExistentialError:
        pass


@pytest.mark.slow
def test_gc_removes_only_segments_of_dead_owners(orphan, make_buffer):
    alive = make_buffer(SPEC, 64)
    foreign = posix_ipc.SharedMemory(f"/shmbuf-test-cli-foreign-{os.getpid()}",
                                     posix_ipc.O_CREX, size=4096)
    try:
        dry = cli("gc", "--dry-run")
        assert dry.returncode == 0
        assert f"would remove {orphan}" in dry.stdout
        assert alive.name not in dry.stdout and "foreign" not in dry.stdout
        assert os.path.exists(f"/dev/shm/{orphan}")
        real = cli("gc")
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
        assert row.split()[3:5] == ["100", "30"] and "alive" in row
        info = cli("info", buf.name)
        assert info.returncode == 0
        assert "live steps   30" in info.stdout and "obs" in info.stdout
        top = cli("top", buf.name, "--iterations", "2", "--interval", "0", "--plain")
        assert top.returncode == 0 and "fill 30/100" in top.stdout
        assert "steps/s" in top.stdout  # the writer's slot is listed with its rate
    other = shmbuf.create(SPEC, 10, name=f"shmbuf-test-cli-rm-{os.getpid()}")
    try:
        rm = cli("rm", other.name)
        assert rm.returncode == 0 and not os.path.exists(f"/dev/shm/{other.name}")
        assert other.stats().capacity == 10  # the mapping outlives the name
    finally:
        other.close()


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
