"""What a ``Buffer`` holds, declared once for the mixins that make it up.

``Buffer`` (store/buffer.py) sets these attributes; ``Reads`` and
``Checkpoints`` are written against them and hold no state of their own.
"""
from __future__ import annotations

from typing import Any, Callable

from ..protocol.layout import Layout
from ..protocol.ring import Ring
from ..protocol.stepids import StepIds
from ..sampling.rng import ProcessRandom
from ..sampling.windows import WindowFinder
from ..segment.pages import ChunkPages
from ..writing.port import StorePort
from ..writing.ratelimit import Limiter
from ..writing.writer import Writer


class BufferState:
    """The attributes of a ``Buffer`` that its mixins read (annotations only)."""

    _layout: Layout
    _ring: Ring
    _views: dict
    _finder: WindowFinder
    _limiter: Limiter | None
    _random: ProcessRandom
    _step_ids: StepIds
    _space: Any
    _pages: ChunkPages
    _port: StorePort
    _savers: set
    _check_open: Callable[..., None]
    _check_live: Callable[[], None]
    _writer: Callable[..., Writer]
    name: str
