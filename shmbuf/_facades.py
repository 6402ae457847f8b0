"""The registry of seed facades, kept in the core so that the core never imports them.

A buffer made by a facade records the facade's name in its JSON metadata
(``{"facade": "dreamer", ...}``).  Each facade class registers itself here
when its module is imported (``@register``); ``shmbuf.attach`` and
``shmbuf.load`` ask ``facade_for`` which class to wrap a buffer in.  The
package root imports every facade, so after ``import shmbuf`` the registry
is complete; a name nobody registered yields the plain ``Buffer``.
"""
from __future__ import annotations

_REGISTRY: dict[str, type] = {}


def register(cls: type) -> type:
    """Class decorator: ``shmbuf.attach`` and ``shmbuf.load`` return ``cls`` for its buffers.

    ``cls.FACADE`` is the name the facade writes into its buffers' metadata.
    """
    _REGISTRY[cls.FACADE] = cls  # type: ignore[attr-defined]  # every facade class has FACADE
    return cls


def facade_for(buffer):
    """The registered class that made ``buffer`` (a ``Buffer``), or None for a plain store."""
    facade = buffer.meta.get("facade")
    return None if facade is None else _REGISTRY.get(facade)
