"""Sampling verification on the JAX backend: over thousands of seeded requests, the tokens
NGRAM speculation produces (2nd and 3rd) follow the exact target marginals (chi-square),
the marginals computed by the torch backend's runner, the harness of tests/model."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))   # tests/model's helpers import each other

from tests.jax.helpers import SMALL_BUCKETS  # noqa: E402
from tests.model import test_spec_sampling as ref  # noqa: E402


@pytest.mark.slow           # 3000 sampled requests, every batch size compiled: ~1-2 minutes
def test_ngram_sampling_matches_the_target_distribution(tmp_path):
    weights = ref.random_weights(ref.tiny_config(), seed=0)
    target = str(ref.write_tiny_model(tmp_path / "target", weights))
    marginals = ref._exact_marginals(ref._engine(target))
    engine = ref._engine(target, backend="jax", **SMALL_BUCKETS, **ref._spec_kwargs("ngram", ""))
    second, third = ref._sample_tokens(engine, ref.NUM_SAMPLES)
    histogram = engine.engine.get_server_info()["spec_accept_histogram"]
    assert sum(histogram[1:]) > 0.1 * sum(histogram), f"too few acceptances to test anything: {histogram}"
    p2, p3 = ref._chi_square_pvalue(second, marginals[0]), ref._chi_square_pvalue(third, marginals[1])
    assert p2 > ref.P_MIN and p3 > ref.P_MIN, (p2, p3, histogram)
