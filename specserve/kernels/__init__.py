"""Native CPU kernels built on first use (see skinny.py). Nothing here imports specserve."""
