"""The public surface: ``shmbuf.__all__`` is pinned, documented, and typed."""
from importlib import resources

import shmbuf

EXPORTS = [
    "Buffer", "BufferClosedError", "Compress", "CompressionStats", "CorruptSaveError",
    "CorruptSegmentError", "DiamondReplayBuffer", "Episode", "ForeignStepIdsError",
    "HistoryBuffer", "IRISOnPolicyBuffer", "IRISReplayBuffer", "LayoutVersionError", "Memory",
    "MemoryFullError", "NoFreeChunkError", "NoFreeWriterSlotError", "NotEnoughDataError",
    "OnPolicyBufferFullError", "OwnerAliveError", "RateLimit", "RateStats", "ReplayBuffer",
    "SampleRetryError",
    "SampleTooLargeError", "SaveExistsError", "Saver",
    "SchemaPendingError", "SegmentExistsError", "SegmentNotFoundError",
    "SegmentPermissionError", "SequenceDataset", "SharedMemoryFullError", "ShmbufError",
    "Stats", "WaitTimeoutError", "Writer", "WritersStoppedError", "attach", "create", "load",
]


def test_all_is_exactly_the_public_surface():
    assert sorted(set(shmbuf.__all__)) == EXPORTS
    assert len(shmbuf.__all__) == len(EXPORTS), "a name is listed twice in __all__"


def test_every_exported_name_resolves_and_has_a_docstring():
    for name in shmbuf.__all__:
        obj = getattr(shmbuf, name)  # AttributeError names the missing export
        doc = obj.__doc__  # a class's own docstring: __doc__ is not inherited
        assert isinstance(doc, str) and doc.strip(), f"shmbuf.{name} has no docstring"


def test_the_package_ships_the_py_typed_marker():
    marker = resources.files("shmbuf").joinpath("py.typed")
    assert marker.is_file(), "shmbuf/py.typed is missing from the installed package"
