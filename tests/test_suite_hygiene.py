"""The suite's own leak check (tests/conftest.py) removes only what this session made.

Users run the tests beside training, and a training run keeps its data in
/dev/shm too (PyTorch's shared tensors, other shmbuf buffers).  A test
session that meets a new entry it did not name must report it and leave it
alone.  Each case runs a small pytest session in a child process, with this
suite's conftest.py, on a test that makes an entry and leaves it.
"""
import os
import shutil
import subprocess
import sys

import pytest

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def _session(tmp_path, body: str) -> subprocess.CompletedProcess:
    # This suite's conftest.py and the helpers it imports, beside a test of our own.
    shutil.copy(os.path.join(TESTS_DIR, "conftest.py"), tmp_path / "conftest.py")
    shutil.copytree(os.path.join(TESTS_DIR, "helpers"), tmp_path / "helpers",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "test_inner.py").write_text(body)
    env = dict(os.environ)
    env.pop("SHMBUF_NAME_TAG", None)  # the child session tags its own names
    env.pop("PYTEST_ADDOPTS", None)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W",
         "default", str(tmp_path / "test_inner.py")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.slow
def test_a_foreign_entry_survives_and_is_reported(tmp_path):
    # Not a shmbuf name, like a tensor PyTorch shares beside a training run.
    name = f"torch_foreign_{os.getpid()}_leakcheck"
    path = f"/dev/shm/{name}"
    try:
        run = _session(tmp_path, f"def test_foreign():\n"
                                 f"    open({path!r}, 'wb').write(b'not ours')\n")
        assert os.path.exists(path), (
            f"the leak check removed {name}, which the session did not make:\n{run.stdout}")
        assert run.returncode == 0, run.stdout + run.stderr
        assert name in run.stdout and "left alone" in run.stdout, run.stdout
    finally:
        if os.path.exists(path):
            os.unlink(path)


@pytest.mark.slow
def test_another_sessions_segment_survives(tmp_path):
    # A shmbuf segment named by another test session (another pid): not this one's.
    name = f"shmbuf-test-foreign-{os.getpid()}"
    path = f"/dev/shm/{name}"
    try:
        run = _session(tmp_path, f"def test_foreign():\n"
                                 f"    open({path!r}, 'wb').write(b'not ours')\n")
        assert os.path.exists(path), run.stdout
        assert run.returncode == 0, run.stdout + run.stderr
    finally:
        if os.path.exists(path):
            os.unlink(path)


@pytest.mark.slow
def test_its_own_leak_is_removed_and_fails_the_test(tmp_path):
    named = tmp_path / "name"
    run = _session(tmp_path, "import os\n"
                             "def test_leaks():\n"
                             "    name = f'shmbuf-test-leak-{os.getpid()}'\n"
                             f"    open({str(named)!r}, 'w').write(name)\n"
                             "    open('/dev/shm/' + name, 'wb').write(b'ours')\n")
    name = named.read_text()
    try:
        assert run.returncode == 1, run.stdout + run.stderr
        assert "left shared-memory segments behind" in run.stdout and name in run.stdout
        assert not os.path.exists(f"/dev/shm/{name}")
    finally:
        if os.path.exists(f"/dev/shm/{name}"):
            os.unlink(f"/dev/shm/{name}")


@pytest.mark.slow
def test_the_dataset_tests_that_need_no_jax_run_without_it(tmp_path):
    # A jax that cannot be imported, ahead of the real one on the path.
    (tmp_path / "jax.py").write_text(
        "raise ModuleNotFoundError('No module named jax', name='jax')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(tmp_path)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    env.pop("SHMBUF_NAME_TAG", None)
    env.pop("PYTEST_ADDOPTS", None)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
         os.path.join(TESTS_DIR, "test_datasets.py")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False)
    if "No module named 'minari'" in run.stdout or "No module named 'h5py'" in run.stdout:
        pytest.skip("the datasets extra is not installed")
    summary = run.stdout.strip().splitlines()[-1]
    assert run.returncode == 0, run.stdout + run.stderr
    passed = int(summary.split(" passed")[0].split()[-1]) if " passed" in summary else 0
    assert passed >= 8, run.stdout          # the HDF5, CLI and import-graph tests
    assert "minari[create] (jax)" in run.stdout, run.stdout   # -rs names why the rest skip
