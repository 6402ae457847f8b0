"""TorchRL's replay buffer parts, in shared memory: ``LazyShmStorage``, ``ShmWriter``, samplers.

``ReplayBuffer(storage=LazyShmStorage(n), writer=ShmWriter(), sampler=SliceSampler(...))``
keeps TorchRL's API while every process writes its own lock-free stream and
samples the same memory.  See the "TorchRL" guide.  Needs the ``torchrl``
extra: ``pip install 'shmbuf[torchrl]'``.
"""
from __future__ import annotations

try:
    import tensordict as _tensordict  # noqa: F401
    import torchrl as _torchrl  # noqa: F401
except ImportError as exc:   # the core never imports them: only this package does
    raise ImportError(f"shmbuf.compat.torchrl needs torchrl and tensordict ({exc}); install "
                      "them with: pip install 'shmbuf[torchrl]'") from exc

from ._samplers import PrioritizedSliceSampler, SliceSampler
from ._storage import LazyShmStorage, attach
from ._writer import ShmWriter

__all__ = ["LazyShmStorage", "ShmWriter", "SliceSampler", "PrioritizedSliceSampler", "attach"]
