"""The torch path never imports jax: building the server's modules and a torch engine
leaves ``jax`` out of sys.modules (the extra stays optional)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import sys
import specserve.engine, specserve.engine_setup, specserve.server.api, specserve.cli, specserve.launch_server
import specserve.speculative.eagle, specserve.speculative.ngram, specserve.runner.head_runner
import specserve.backends
print("JAX" if any(m == "jax" or m.startswith("jax.") for m in sys.modules) else "NOJAX")
"""


def test_torch_path_does_not_import_jax():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "NOJAX"
