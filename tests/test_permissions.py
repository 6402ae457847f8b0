"""Segments are mode 0600: another user cannot attach."""
import os
import select
import stat

import pytest
from helpers.procs import wait_pid

import shmbuf


def test_segment_mode_is_0600(make_buffer):
    buf = make_buffer()
    mode = stat.S_IMODE(os.stat(f"/dev/shm/{buf.name}").st_mode)
    assert mode == 0o600


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping privileges needs root")
def test_other_user_cannot_attach(make_buffer):
    buf = make_buffer()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: become 'nobody', then try to attach
        code = 3
        try:
            os.close(read_end)
            os.setgid(65534)
            os.setuid(65534)
            try:
                shmbuf.attach(buf.name)
                code = 1
            except shmbuf.SegmentPermissionError as exc:
                code = 0 if isinstance(exc, PermissionError) and buf.name in str(exc) else 2
        finally:
            os.write(write_end, bytes([code]))
            os._exit(0)
    try:
        os.close(write_end)
        ready, _, _ = select.select([read_end], [], [], 30)
        got = os.read(read_end, 1) if ready else b"timeout"
    finally:
        os.close(read_end)
        code = wait_pid(pid, 30)
    assert code == 0, f"child exit code {code} (None: still running after 30 s, killed)"
    assert got == bytes([0]), f"child attach result code {got!r} (1: attached, 2: wrong error)"


def test_import_refuses_a_platform_without_dev_shm(tmp_path):
    from shmbuf.segment.segment import check_platform

    check_platform("linux", "/dev/shm")
    with pytest.raises(ImportError, match="needs Linux.*'darwin'"):
        check_platform("darwin", "/dev/shm")
    with pytest.raises(ImportError, match=f"without {tmp_path / 'no'}.*--shm-size"):
        check_platform("linux", str(tmp_path / "no"))
