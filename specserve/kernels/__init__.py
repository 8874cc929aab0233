"""Native CPU kernels built on first use (see build.py). Nothing here imports specserve beyond config."""
