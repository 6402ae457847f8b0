"""Which class opens a buffer: one table from a kind name to the class that made it.

Every buffer records the name of the class that made it: a step store's
JSON metadata carries ``{"facade": NAME}`` (none for ``shmbuf.create``'s
plain ``Buffer``), and keyed rings carry it in their user metadata.  Each
class registers itself here when its module is imported (``@register``), so
``shmbuf.attach`` and ``shmbuf.load`` find it without naming it: the core
never imports ``compat/``.  The package root imports every class that can
make a buffer, so after ``import shmbuf`` the table is complete.

A registered class opens an attached segment with the classmethod
``_open_segment(segment, layout, owner, *, seed, own, handle_signals)``.
"""
from __future__ import annotations

import importlib

_CLASSES: dict[str, type] = {}
# Classes in modules that import optional packages (torch, torchrl): their
# module is imported at the first lookup, so ``import shmbuf`` stays light.
_LAZY: dict[str, str] = {}


def register(cls: type, name: str | None = None) -> type:
    """Class decorator: buffers recorded as made by ``name`` open as ``cls``.

    ``name`` defaults to ``cls.FACADE``.
    """
    _CLASSES[name if name is not None else cls.FACADE] = cls  # type: ignore[attr-defined]
    return cls


def register_lazy(name: str, module: str) -> None:
    """Buffers recorded as made by ``name`` open as a class that ``module`` registers;
    the module is imported at the first lookup of ``name``."""
    _LAZY[name] = module


def class_for(name: str) -> type | None:
    """The class registered under ``name``, or None (also when the module that registers
    it cannot be imported here: its optional dependencies are missing)."""
    if name not in _CLASSES and name in _LAZY:
        try:
            importlib.import_module(_LAZY[name])
        except ImportError:
            return None
    return _CLASSES.get(name)
