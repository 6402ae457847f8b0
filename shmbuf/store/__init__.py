"""The step store: ``create``, ``attach`` and ``Buffer``, built on every layer below."""
from .buffer import Buffer, Stats, attach, create

__all__ = ["Buffer", "Stats", "attach", "create"]
