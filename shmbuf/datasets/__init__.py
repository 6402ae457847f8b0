"""Datasets in and out: Minari datasets and stable-worldmodel's HDF5 files.

Install with ``pip install -e '.[datasets]'`` (minari, h5py; tqdm for a
progress bar); the core (``import shmbuf``) never imports this module.

- ``from_minari`` / ``to_minari``: Minari's episodes (N + 1 observations,
  N actions) under ``shmbuf.gym``'s step convention, bit-identical both ways.
- ``from_swm_hdf5`` / ``to_swm_hdf5``: one dataset per column plus
  ``ep_len`` and ``ep_offset``, columns and rows as they are.

The importers create a new buffer that this process owns (closing it
unlinks it), copy in blocks of bounded size with ``Writer.extend``, and on
any error remove the buffer again.  To keep an imported buffer for other
processes, hold it open in one process: ``python -m shmbuf import ...``
does exactly that (see ``shmbuf.cli``).

Example:
    >>> from shmbuf.datasets import from_minari
    >>> buf = from_minari("cartpole/random-v0", name="cartpole")
    >>> loader = DataLoader(buf.dataset(64, 32), batch_size=None, num_workers=4)
"""
from __future__ import annotations

from ._common import BLOCK_BYTES, CapacityWarning, DatasetFormatError
from ._minari import from_minari, to_minari
from ._swm import from_swm_hdf5, to_swm_hdf5

__all__ = ["BLOCK_BYTES", "CapacityWarning", "DatasetFormatError", "from_minari",
           "from_swm_hdf5", "to_minari", "to_swm_hdf5"]
