"""Every public import path keeps working: users' code and other libraries use them."""
import importlib
import subprocess
import sys

import pytest

import shmbuf

# (module, names it exports): the paths users import from, pinned.
PUBLIC = {
    "shmbuf": shmbuf.__all__,
    "shmbuf.select": ["Selector", "Uniform", "Recency", "AgeBuckets", "Prioritized", "Mixture"],
    "shmbuf.params": ["ParamBlock"],
    "shmbuf.compat.dreamer": ["ReplayBuffer"],
    "shmbuf.compat.planet": ["Memory", "Episode", "SampleTooLargeError"],
    "shmbuf.compat.iris": ["IRISReplayBuffer", "IRISOnPolicyBuffer", "OnPolicyBufferFullError"],
    "shmbuf.compat.diamond": ["ReplayBuffer"],
    "shmbuf.compat.history": ["HistoryBuffer", "SchemaPendingError"],
    "shmbuf.diamond": ["ReplayBuffer", "SequenceDataset"],
    "shmbuf.gym": ["RecordEpisodes", "RecordVectorEpisodes", "UnsupportedSpaceError", "spec_for",
                   "run_actor"],
    "shmbuf.datasets": ["from_minari", "to_minari", "from_swm_hdf5", "to_swm_hdf5",
                        "CapacityWarning", "DatasetFormatError"],
    "shmbuf.ray": ["create", "connect", "ShardedBuffer", "ShardLostError", "ShardStats",
                   "ShardEntry", "ShardedBufferNotFoundError", "LocalWriter", "ShippingWriter",
                   "ReplayBuffer"],
    "shmbuf.ray.dreamer": ["ReplayBuffer"],
    "shmbuf.cli": ["main"],
}


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_public_names_import_from_their_paths(module):
    mod = importlib.import_module(module)
    missing = [n for n in PUBLIC[module] if not hasattr(mod, n)]
    assert missing == [], f"{module} lacks {missing}"


def test_the_facade_modules_export_the_classes_the_root_does():
    from shmbuf.compat import diamond, dreamer, history, iris, planet

    assert shmbuf.ReplayBuffer is dreamer.ReplayBuffer
    assert shmbuf.DiamondReplayBuffer is diamond.ReplayBuffer
    assert shmbuf.HistoryBuffer is history.HistoryBuffer
    assert shmbuf.Memory is planet.Memory and shmbuf.IRISReplayBuffer is iris.IRISReplayBuffer


def test_python_m_shmbuf_runs_the_command_line():
    got = subprocess.run([sys.executable, "-m", "shmbuf", "--help"], capture_output=True,
                         text=True, timeout=60)
    assert got.returncode == 0 and "usage" in got.stdout.lower()
