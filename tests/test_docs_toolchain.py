"""The docs build cannot hide a warning, and a fresh install builds with what CI built with.

- ``.ci/run`` builds the site strictly and never quietly (``--quiet`` drops the
  warnings before strict mode counts them), once of them in a brand-new
  environment installed as the README says, with CI's docs constraints.
- setup.cfg's docs extra pins its tools exactly, to the versions of
  ``.ci/constraints-docs.txt``, and the test extra takes the same pins.
- Every docstring of the package parses without a warning from griffe (the
  parser behind the API reference), rendered on a page or not: a member that
  no page shows today can be shown tomorrow, and its warning would then abort
  the strict build.
"""
import configparser
import logging
import pathlib
import re
import shlex

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = pathlib.Path(__file__).resolve().parent.parent
CI = ROOT / ".ci" / "run"
DOCS_CONSTRAINTS = ROOT / ".ci" / "constraints-docs.txt"


def _ci_commands() -> list[list[str]]:
    """.ci/run's commands as shell words, continuation lines joined, comments dropped."""
    text = CI.read_text().replace("\\\n", " ")
    return [words for line in text.splitlines() if (words := shlex.split(line, comments=True))]


def _mkdocs_builds() -> list[list[str]]:
    return [w for w in _ci_commands()
            if any(pathlib.PurePath(x).name == "mkdocs" for x in w) and "build" in w]


def _extra(name: str) -> list[Requirement]:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    lines = cfg["options.extras_require"][name].splitlines()
    return [Requirement(r.strip()) for r in lines if r.strip() and not r.strip().startswith("#")]


def _pinned(req: Requirement) -> str:
    specs = list(req.specifier)
    assert len(specs) == 1 and specs[0].operator == "==", f"{req} is not pinned exactly"
    return specs[0].version


def _constraints() -> dict[str, str]:
    pins = {}
    for line in DOCS_CONSTRAINTS.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            req = Requirement(line)
            pins[canonicalize_name(req.name)] = _pinned(req)
    return pins


def test_ci_builds_the_docs_strictly_and_never_quietly():
    builds = _mkdocs_builds()
    assert len(builds) >= 2, builds
    for words in builds:
        assert "--strict" in words, f".ci/run builds the docs without --strict: {words}"
        quiet = [w for w in words if w in ("-q", "--quiet") or re.fullmatch(r"-[a-z]*q[a-z]*", w)]
        assert not quiet, f"--quiet drops the warnings before strict mode counts them: {words}"


def test_ci_builds_the_docs_in_a_brand_new_environment_as_the_readme_says():
    commands = _ci_commands()
    venvs = {w[-1] for w in commands if w[:3] == ["python", "-m", "venv"]}
    assert not any("--system-site-packages" in w for w in commands)
    installs = [w for w in commands if "install" in w and "-e" in w
                and w[w.index("-e") + 1] == ".[docs]"]
    assert installs, ".ci/run never installs the docs extra on its own"
    (install,) = installs
    pip = next(w for w in install if w.endswith("/bin/pip"))
    env = pip[:-len("/bin/pip")]
    assert env in venvs, f"{pip} is not in an environment .ci/run makes"
    assert f"PIP_CONSTRAINT=$PWD/{DOCS_CONSTRAINTS.relative_to(ROOT)}" in install
    assert any(w[0] == f"{env}/bin/mkdocs" for w in _mkdocs_builds()), \
        "the site is not built with that environment's mkdocs"
    assert commands.index(install) < next(i for i, w in enumerate(commands)
                                          if w[0] == f"{env}/bin/mkdocs")


def test_the_docs_extra_pins_what_ci_builds_with_and_the_test_extra_takes_it():
    constraints = _constraints()
    docs = _extra("docs")
    names = {canonicalize_name(r.name) for r in docs}
    assert {"mkdocs", "mkdocs-material", "mkdocstrings", "mkdocstrings-python",
            "griffelib"} <= names
    for req in docs:
        name = canonicalize_name(req.name)
        assert name in constraints, f"setup.cfg pins {name}, {DOCS_CONSTRAINTS.name} does not"
        assert _pinned(req) == constraints[name], \
            f"{name}: setup.cfg pins {_pinned(req)}, {DOCS_CONSTRAINTS.name} {constraints[name]}"
    test = _extra("test")
    assert any(canonicalize_name(r.name) == "shmbuf" and r.extras == {"docs"} for r in test), \
        "the test extra must take the docs extra's pins (shmbuf[docs])"
    for req in test:
        name = canonicalize_name(req.name)
        if name in names:
            assert _pinned(req) == constraints[name], f"the test extra pins {req}"


def test_every_docstring_parses_without_a_griffe_warning(caplog):
    griffe = pytest.importorskip("griffe", reason="the docs extra's parser (the test extra has it)")
    yaml = pytest.importorskip("yaml")
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    plugin = next(p["mkdocstrings"] for p in config["plugins"]
                  if isinstance(p, dict) and "mkdocstrings" in p)
    options = plugin["handlers"]["python"]["options"]
    extensions = griffe.load_extensions(*[str(ROOT / e) for e in options.get("extensions", [])])
    with caplog.at_level(logging.WARNING, logger="griffe"):
        package = griffe.load("shmbuf", search_paths=[str(ROOT)], extensions=extensions,
                              resolve_aliases=False)
        count = 0
        seen = set()
        stack = [package]
        while stack:
            obj = stack.pop()
            if obj.is_alias or obj.path in seen:
                continue
            seen.add(obj.path)
            if obj.docstring is not None:
                obj.docstring.parse(options["docstring_style"], **options["docstring_options"])
                count += 1
            stack.extend(obj.members.values())
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert count > 300, f"only {count} docstrings found: is griffe reading the package?"
    assert not warnings, "\n".join(warnings)
