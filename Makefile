# The test command installs everything it needs from nothing: python3 and pip are enough.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-slow bench lint install gpu-check

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# Pinned: an unpinned torch pulls a multi-GB CUDA build.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e ".[dev,numba,cuda]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m leanstate demo

test: $(STAMP)
	# CUDA-simulator tests run in their own process: the variable must be set before numba
	# is imported. Collecting none (exit 5) fails.
	NUMBA_ENABLE_CUDASIM=1 $(BIN)/python -m pytest -q -m cudasim
	$(BIN)/python -m pytest -q -m "not cudasim and not slow and not gpu"

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m "slow"

# The quick table, then an asv run of the store and checkpoint suites in this venv, kept
# under asv_bench/results for asv compare / asv publish.
bench: $(STAMP)
	$(BIN)/python -m leanstate bench --quick
	cd asv_bench && ../$(BIN)/asv machine --yes
	cd asv_bench && ../$(BIN)/asv run -E existing:$(abspath $(BIN)/python) \
		--set-commit-hash $$(git rev-parse HEAD) -a repeat=1 -a rounds=1 --bench "kv_store|checkpoint"

# On a CUDA machine: the gpu-marked tests and the GPU bench, into $$OUT (or ./gpu-check).
gpu-check: $(STAMP)
	$(BIN)/python -m leanstate gpu-check --out "$${OUT:-gpu-check}"

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
