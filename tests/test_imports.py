"""The package's import graph: no cycle, and the core never reaches up into compat/.

Every import counts, those inside functions too (a lazy import is still a
dependency: it only moves the cycle to run time).  The graph is read from
the source with ``ast``, so the test needs no import side effects.
"""
import ast
import os

import shmbuf

PKG_DIR = os.path.dirname(shmbuf.__file__)


def _module_name(path: str) -> str:
    rel = os.path.relpath(path, os.path.dirname(PKG_DIR))[:-3].replace(os.sep, ".")
    return rel[:-len(".__init__")] if rel.endswith(".__init__") else rel


def _modules() -> dict[str, str | None]:
    """``{module: source path}``; C extensions (their ``.pyi`` stubs) map to None."""
    found: dict[str, str | None] = {}
    for root, _, files in os.walk(PKG_DIR):
        for f in files:
            path = os.path.join(root, f)
            if f.endswith(".py"):
                found[_module_name(path)] = path
            elif f.endswith(".pyi"):
                found.setdefault(_module_name(path[:-1]), None)
    return found


def _resolve(module: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    base = base if is_pkg else base[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _runtime_nodes(tree):
    """Every node but the bodies of ``if TYPE_CHECKING:`` (annotations only: never imported)."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING",
                                                                   "typing.TYPE_CHECKING"):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return [n for n in ast.walk(tree) if id(n) not in skip]


def import_graph(annotations: bool = False) -> dict[str, set[str]]:
    """``{module: modules of shmbuf it imports}``; ``from . import x`` counts as ``x``.
    ``annotations``: count the imports under ``if TYPE_CHECKING:`` too."""
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        if path is None:
            continue   # a C extension imports nothing of shmbuf
        is_pkg = path.endswith("__init__.py")
        with open(path) as fh:
            tree = ast.parse(fh.read(), path)
        for node in (ast.walk(tree) if annotations else _runtime_nodes(tree)):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(mod, is_pkg, node)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base
                           for a in node.names]
            for t in targets:
                if t in mods and t != mod:
                    graph[mod].add(t)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_the_package_has_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_cycle_even_through_annotations():
    # An annotation-only import is no run-time dependency, but it still says which
    # module knows which: the house's arrows run one way even there.
    cycle = find_cycle(import_graph(annotations=True))
    assert cycle is None, "import cycle (annotations counted): " + " -> ".join(cycle)


def test_the_core_never_imports_compat():
    # Facades register themselves with the core (shmbuf._registry); the core
    # never names them.  Outside compat/ only these may: the package root
    # re-exports them (shmbuf.ReplayBuffer, ...), shmbuf.diamond is the alias
    # of DIAMOND's module names, and shmbuf.ray.dreamer is Dreamer's facade
    # over Ray shards (it shares the Dreamer facade's schema and checks).
    allowed = {"shmbuf", "shmbuf.diamond", "shmbuf.ray.dreamer"}
    offenders = {m: sorted(t for t in targets if t.startswith("shmbuf.compat"))
                 for m, targets in import_graph().items()
                 if not m.startswith("shmbuf.compat") and m not in allowed}
    assert {m: t for m, t in offenders.items() if t} == {}


def test_the_graph_reader_sees_lazy_and_relative_imports():
    # A check that cannot fail proves nothing: the reader must see the edges
    # that the two tests above rely on.
    graph = import_graph()
    assert "shmbuf.protocol.ring" in graph["shmbuf.writing.writer"]
    # protocol.streams names the Ring in annotations only
    assert "shmbuf.protocol.ring" not in graph["shmbuf.protocol.streams"]
    assert "shmbuf.protocol.ring" in import_graph(annotations=True)["shmbuf.protocol.streams"]
    assert "shmbuf.compat._base" in graph["shmbuf.compat.dreamer"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


# The layers, lowest first.  A module may import its own layer and the ones
# below, never one above; docs/design.md ("Where things live") says what each holds.
LAYERS = [
    ("base", ["shmbuf._errors", "shmbuf._args", "shmbuf._registry"]),
    ("posix", ["shmbuf.posix"]),
    ("protocol", ["shmbuf.protocol"]),
    ("segment", ["shmbuf.segment"]),
    ("sampling", ["shmbuf.sampling", "shmbuf.select"]),
    ("writing", ["shmbuf.writing"]),
    ("disk and feed", ["shmbuf.disk", "shmbuf.feed"]),
    ("stores", ["shmbuf.store", "shmbuf.keyed", "shmbuf.params"]),
    ("opening", ["shmbuf._open"]),
    ("facades", ["shmbuf.compat", "shmbuf.diamond", "shmbuf"]),
    ("ecosystem", ["shmbuf.gym", "shmbuf.ray", "shmbuf.datasets"]),
    ("command line", ["shmbuf.cli", "shmbuf.__main__"]),
]


def layer_of(module: str) -> int:
    """The index in LAYERS of the longest prefix that names ``module``'s layer."""
    best, found = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, found = len(p), i
    assert found is not None, f"{module} is in no layer: add it to LAYERS"
    return found


def test_every_module_has_a_layer():
    for module in import_graph():
        layer_of(module)


def test_no_layer_imports_a_higher_one():
    upward = sorted(f"{m} ({LAYERS[layer_of(m)][0]}) -> {t} ({LAYERS[layer_of(t)][0]})"
                    for m, targets in import_graph().items() for t in targets
                    if layer_of(t) > layer_of(m)
                    and not (m == "shmbuf.ray.dreamer" and t.startswith("shmbuf.compat")))
    assert upward == []


def test_no_layer_names_a_higher_one_even_in_annotations():
    upward = sorted(f"{m} -> {t}" for m, targets in import_graph(annotations=True).items()
                    for t in targets if layer_of(t) > layer_of(m)
                    and not (m == "shmbuf.ray.dreamer" and t.startswith("shmbuf.compat")))
    assert upward == []


def test_the_layer_check_sees_an_upward_import():
    assert layer_of("shmbuf.protocol.ring") < layer_of("shmbuf.store.buffer")
    assert layer_of("shmbuf.compat.dreamer") > layer_of("shmbuf._open")
    assert layer_of("shmbuf") == layer_of("shmbuf.compat")   # the root re-exports the facades


def test_at_most_a_dozen_modules_at_the_top():
    top = sorted(f for f in os.listdir(PKG_DIR) if f.endswith(".py"))
    assert len(top) <= 12, top


# The modules past 600 lines, each with its reason in docs/design.md ("Where things
# live"): a module that grows past it is split, or named here and there.
LONG_MODULES = {"protocol/ring.py", "protocol/_prio.c", "protocol/appender.c",
                "protocol/layout.py", "compat/embodied.py"}


def test_the_long_modules_are_the_ones_design_md_names():
    long = set()
    for root, _, files in os.walk(PKG_DIR):
        for f in files:
            if f.endswith((".py", ".c", ".h")):
                path = os.path.join(root, f)
                with open(path) as fh:
                    if sum(1 for _ in fh) > 600:
                        long.add(os.path.relpath(path, PKG_DIR))
    assert long == LONG_MODULES
    with open(os.path.join(os.path.dirname(PKG_DIR), "docs", "design.md")) as fh:
        design = fh.read()
    count = ("Three", "Four", "Five", "Six", "Seven")[len(LONG_MODULES) - 3]
    assert f"{count} modules run past 600 lines" in design
    for m in LONG_MODULES:
        assert f"`{m}`" in design or f"`protocol/{os.path.basename(m)}`" in design, m
