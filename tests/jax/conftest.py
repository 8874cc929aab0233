"""The JAX backend's tests run when jax is installed (``make install-jax``) and are skipped,
with the reason, when it is not."""
from __future__ import annotations

import pytest

from specserve.backends.jax import is_available, missing_reason


def pytest_collection_modifyitems(config, items):
    if is_available():
        return
    skip = pytest.mark.skip(reason=missing_reason())
    for item in items:
        if "/tests/jax/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def always_speculate(monkeypatch):
    """Every speculative engine really speculates (on a CPU the cost model often would not)."""
    monkeypatch.setenv("SPECSERVE_SPEC_POLICY", "always")
