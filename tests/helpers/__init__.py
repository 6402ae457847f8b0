"""Test helpers: encoded-step workers, spawn targets and the crash and soak harnesses.

Not tests themselves.  Tests import them as ``helpers.<module>``: tests/ is on
sys.path (tests/conftest.py puts it there), and spawned children inherit that path,
so functions pickled by module name resolve in them too.
"""
