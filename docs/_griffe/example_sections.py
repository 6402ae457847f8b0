"""A griffe extension for the API reference: render the docstrings' ``Example:`` sections as code.

shmbuf's docstrings title their doctest section ``Example:`` (the house style);
griffe's Google parser reads only ``Examples:`` as an examples section and would
render the singular title as an admonition of plain text.  This extension
retitles the section before the docstring is parsed, so the ``>>>`` lines come
out as highlighted code.  It changes the rendered page only, never the code.
"""
import re

import griffe

_TITLE = re.compile(r"^(\s*)Example:\s*$", re.MULTILINE)


class ExampleSections(griffe.Extension):
    """Retitle ``Example:`` to ``Examples:`` in every docstring griffe loads."""

    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _TITLE.sub(r"\1Examples:", obj.docstring.value)
