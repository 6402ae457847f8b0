"""The store's one door upward: no layer outside ``shmbuf/store/`` reads a buffer's insides.

A ``Buffer``'s private attributes and methods (every ``_name`` its classes in
``shmbuf/store/`` define, and ``_parts``) are read only by the store itself.
Every other layer asks ``Buffer.port`` (``writing.port.StorePort``) by name.
Like ``test_imports``, the rule is read from the source with ``ast``: an
attribute chain ``x._ring`` whose ``x`` is not ``self`` or ``cls`` outside
``store/`` fails, whatever ``x`` is (a name, an attribute, a call).  The names
that the generic ``segment.lifecycle.Shared`` base gives every shared object
(``_check_open``, ``_closed_mark``, ...) are not the store's, and stay allowed.
"""
import ast
import os

import shmbuf

PKG_DIR = os.path.dirname(shmbuf.__file__)
STORE_DIR = os.path.join(PKG_DIR, "store")
SHARED_BASE = os.path.join(PKG_DIR, "segment", "lifecycle.py")
GONE = {"_parts", "_draw"}   # the old door, and the selector hook now named ``draw``


def _private_names(paths) -> set[str]:
    """The ``_names`` (not dunders) the classes of ``paths`` define or set on ``self``."""
    found = set()
    for path in paths:
        with open(path) as fh:
            tree = ast.parse(fh.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        found.add(item.name)
                    elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                        found.add(item.target.id)
                    elif isinstance(item, ast.Assign):
                        found.update(t.id for t in item.targets if isinstance(t, ast.Name))
            elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                  and isinstance(node.value, ast.Name) and node.value.id == "self"):
                found.add(node.attr)
    return {n for n in found if n.startswith("_") and not n.startswith("__")}


def store_insides() -> set[str]:
    """The private names that belong to the store and no lower layer."""
    store = [os.path.join(STORE_DIR, f) for f in os.listdir(STORE_DIR) if f.endswith(".py")]
    return (_private_names(store) - _private_names([SHARED_BASE])) | GONE


def reaches(source: str, path: str, forbidden: set[str]) -> list[str]:
    """``path:line: chain`` of each read of a ``forbidden`` attribute of another object."""
    found = []
    for node in ast.walk(ast.parse(source, path)):
        if isinstance(node, ast.Attribute) and node.attr in forbidden:
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            found.append((node.lineno, ast.unparse(node)))
    return [f"{os.path.relpath(path, PKG_DIR)}:{line}: {chain}" for line, chain in sorted(found)]


def test_the_rule_knows_the_stores_insides():
    insides = store_insides()
    # The store's working parts and its checks are insides; the generic lifecycle is not.
    assert {"_ring", "_views", "_finder", "_layout", "_port", "_sample_args",
            "_parts"} <= insides
    assert not {"_check_open", "_closed_mark", "_release"} & insides


def test_the_rule_catches_a_reach():
    """Planted reaches are found, in every form a chain can take; self's own are not."""
    planted = ("def f(buf, self):\n"
               "    a = buf._ring.live_chunks()\n"
               "    b = buf.port.ring\n"
               "    c = self._ring\n"
               "    d = get()._views['obs']\n"
               "    e = self.buffer._parts.finder\n")
    found = reaches(planted, os.path.join(PKG_DIR, "compat", "x.py"), store_insides())
    assert [f.split(": ")[1] for f in found] == ["buf._ring", "get()._views",
                                                "self.buffer._parts"]


def test_nothing_outside_the_store_reads_a_buffers_insides():
    insides = store_insides()
    found = []
    for root, _, files in os.walk(PKG_DIR):
        if os.path.commonpath([root, STORE_DIR]) == STORE_DIR:
            continue
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(root, f)
                with open(path) as fh:
                    found += reaches(fh.read(), path, insides)
    assert not found, ("layers outside shmbuf/store/ read a buffer's insides; ask its "
                       "StorePort (Buffer.port) instead:\n  " + "\n  ".join(found))
