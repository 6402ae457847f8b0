"""The core never imports Ray; ``shmbuf.ray`` imports the real one (no shadowing)."""
import subprocess
import sys
import textwrap


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_importing_shmbuf_and_every_core_module_leaves_ray_out():
    assert _run("""
        import importlib, pathlib, sys
        import shmbuf
        root = pathlib.Path(shmbuf.__file__).parent
        for path in sorted(root.rglob("*.py")):   # not pkgutil.walk_packages: it imports
            parts = path.relative_to(root.parent).with_suffix("").parts  # every package
            # shmbuf.ray imports Ray; so does torchrl.data, which shmbuf.compat.torchrl imports
            if parts[1:2] == ("ray",) or parts[2:3] == ("torchrl",) or parts[-1] == "__main__":
                continue
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            try:
                importlib.import_module(name)
            except ModuleNotFoundError as exc:   # an optional extra (gymnasium, torch)
                assert not exc.name.startswith("shmbuf"), exc
        print(sorted(k for k in sys.modules if k == "ray" or k.startswith("ray.")))
    """) == "[]"


def test_shmbuf_ray_imports_the_real_ray_package():
    out = _run("""
        import shmbuf.ray, ray, sys
        assert shmbuf.ray.ray is ray is sys.modules["ray"], (shmbuf.ray.ray, ray)
        assert sys.modules["shmbuf.ray"] is not ray
        print(ray.__file__)
    """)
    assert out.endswith("/ray/__init__.py") and "/shmbuf/" not in out
