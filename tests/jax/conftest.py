"""The JAX backend's tests run when jax is installed (``make install-jax``) and are skipped,
with the reason, when it is not (test_layering.py runs either way: the torch path must not
need jax)."""
from __future__ import annotations

import pytest

from specserve.backends.jax import is_available, missing_reason

# not `import jax`: with jax absent, that import finds this folder (tests/jax) as a namespace
# package once pytest has put tests/ on sys.path
JAX_MISSING = None if is_available() else missing_reason()

RUNS_WITHOUT_JAX = ("test_layering.py",)


def pytest_collection_modifyitems(config, items):
    if JAX_MISSING is None:
        return
    skip = pytest.mark.skip(reason=JAX_MISSING)
    for item in items:
        path = str(item.fspath).replace("\\", "/")
        if "/tests/jax/" in path and not path.endswith(RUNS_WITHOUT_JAX):
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def always_speculate(monkeypatch):
    """Every speculative engine really speculates (on a CPU the cost model often would not)."""
    monkeypatch.setenv("SPECSERVE_SPEC_POLICY", "always")
