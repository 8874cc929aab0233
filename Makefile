PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
HOST ?= 127.0.0.1
PORT ?= 30000
SPEC_ARGS ?= --speculative-algorithm NGRAM
# Integer kernels on the GGUF's blocks: about 2x the exact float32 path end to end here (README),
# with a bfloat16 KV cache (half the memory, ~1.1x decoding here, the same perplexity:
# `specserve bench kv-cache`), as llama.cpp keeps a half-precision cache.
# `make serve QUANT_ARGS=` serves the exact path (bit-identical to HF transformers float32).
QUANT_ARGS ?= --quantization gguf --kv-cache-dtype bf16
SERVE_ARGS ?=
JAX_VERSION := 0.10.2

BENCH_ARGS ?=

.PHONY: install install-jax serve test test-all bench bench-http model clean

install: $(BIN)/.installed

$(BIN)/.installed: pyproject.toml requirements.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -r requirements.txt
	$(BIN)/pip install -q --no-deps -e .
	touch $@

# The JAX backend's optional extra (pip install -e .[jax]): --backend jax, tests/jax.
install-jax: $(BIN)/.installed-jax

$(BIN)/.installed-jax: $(BIN)/.installed
	$(BIN)/pip install -q jax==$(JAX_VERSION) jaxlib==$(JAX_VERSION)
	touch $@

model: install
	$(BIN)/python -m specserve.loading.default_model

serve: install model $(if $(findstring --backend jax,$(SERVE_ARGS)),install-jax)
	$(BIN)/python -m specserve.launch_server --host $(HOST) --port $(PORT) $(SPEC_ARGS) $(if $(findstring --backend jax,$(SERVE_ARGS)),,$(QUANT_ARGS)) $(SERVE_ARGS)

test: install model
	$(BIN)/python -m pytest -q -x tests

test-all: install model
	SPECSERVE_SLOW=1 $(BIN)/python -m pytest -q tests

bench: install model
	$(BIN)/python -m specserve.cli bench plain

# The server `make serve` starts, under load, beside the offline Engine and llama.cpp (when installed).
bench-http: install model
	$(BIN)/python -m specserve.cli bench http --server-args="$(strip $(SPEC_ARGS) $(QUANT_ARGS) $(SERVE_ARGS))" $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
