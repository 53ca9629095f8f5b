# The test command installs everything it needs from nothing: python3 and pip are enough.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# make bench BENCH=regex: only the asv benchmarks matching it; make bench-compare OLD=rev
BENCH ?= .
OLD ?= HEAD~1
HISTORY := asv_bench/bench-history

.PHONY: demo test test-cudasim test-main test-slow bench bench-compare bench-html lint install gpu-check mutate mutate-diff

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# Pinned: an unpinned torch pulls a multi-GB CUDA build.
	$(BIN)/python -m pip install -q torch==2.13.0
	# numba-cuda without its toolkit extra: the tests run its kernels in the CUDA simulator;
	# torchrec's extra for the interop tests, torch pinned again so nothing moves it
	$(BIN)/python -m pip install -q -e ".[dev,numba,torchrec]" "numba-cuda>=0.20" torch==2.13.0
	# TorchRec itself without its dependencies: they name the CUDA fbgemm-gpu (the extra has the CPU one)
	$(BIN)/python -m pip install -q --no-deps torchrec==1.8.0
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m leanstate demo

# The CUDA-simulator tests run in their own process (the variable must be set before numba
# is imported; collecting none, exit 5, fails) beside the rest on three workers, a test
# file to a worker (a file's ranks start once): the rest wait on ranks, subprocesses and
# fsync a third of the time, which the third worker and the simulator fill. Then, alone,
# the regression gate: this tree's hot paths against its baseline commit's (HEAD when the
# sources changed, else HEAD~1), rounds interleaved; a figure fails above 1.75x its time.
test: $(STAMP)
	$(MAKE) --no-print-directory -j2 --output-sync=target test-cudasim test-main
	$(BIN)/python -m leanstate bench --gate

test-cudasim: $(STAMP)
	NUMBA_ENABLE_CUDASIM=1 $(BIN)/python -m pytest -q -p no:cacheprovider -m "cudasim and not slow"

test-main: $(STAMP)
	$(BIN)/python -m pytest -q -n 3 --dist loadfile -m "not cudasim and not slow and not gpu"

# The long property runs and the full-size fault trials, the simulator's in its own process.
test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m "slow and not cudasim and not gpu"
	NUMBA_ENABLE_CUDASIM=1 $(BIN)/python -m pytest -q -p no:cacheprovider -m "cudasim and slow"

# The quick table (kept as JSON under $(HISTORY)), then asv's quick set in this venv, kept
# under asv_bench/results; make bench-html draws both.
bench: $(STAMP)
	mkdir -p $(HISTORY)
	$(BIN)/python -m leanstate bench --quick --json $(HISTORY)/$$(date +%Y%m%d-%H%M%S)-$$(git rev-parse --short HEAD).json
	cd asv_bench && ../$(BIN)/asv machine --yes
	cd asv_bench && LEANSTATE_ASV=quick ../$(BIN)/asv run -E existing:$(abspath $(BIN)/python) \
		--set-commit-hash $$(git rev-parse HEAD) --bench "$(BENCH)"

# What got slower or faster between $(OLD) and the working tree: both trees' hot paths in
# two worker processes (the old sources from git), their rounds interleaved, judged on the
# median of the paired time ratios and a sign test (compat/_tools/gate.py).
bench-compare: $(STAMP)
	$(BIN)/python -m leanstate bench --against $(OLD) --rounds 9

# A history page that opens offline (file://, no scripts): asv_bench/html-offline/index.html
bench-html: $(STAMP)
	$(BIN)/python -m leanstate bench --html asv_bench/html-offline --asv-results asv_bench/results \
		--history $(wildcard $(HISTORY)/*.json)

# On a CUDA machine: the gpu-marked tests and the GPU bench, into $$OUT (or ./gpu-check).
gpu-check: $(STAMP)
	$(BIN)/python -m leanstate gpu-check --out "$${OUT:-gpu-check}"

# Mutation testing (not part of make test; hours for every group): make mutate GROUPS=zero,testing
# MUTATE_ARGS="--minutes 90" (or --rerun-survivors, --report-only). cosmic-ray, because it
# writes each mutant into the source file and runs the tests in a new process group: the gloo
# ranks and subprocesses the tests start import this tree and see the mutant, numba compiles
# it, and a hung mutant's processes are killed at the timeout (mutmut 3 mutates a copy of the
# tree through trampolines that neither the child processes nor @njit code would run). The
# groups and their test files: tests/mutation/groups.toml; the report: tests/MUTATION.md.
GROUPS ?=
MUTATE_ARGS ?=
mutate: $(STAMP)
	$(BIN)/python -m leanstate._tools.mutation --groups "$(GROUPS)" $(MUTATE_ARGS)

# Every mutant on the lines changed since REV (not a sample), before a change lands: the
# outcomes printed and in .mutation/diff.json; exit 1 while a survivor is unexplained.
REV ?= origin/main
mutate-diff: $(STAMP)
	$(BIN)/python -m leanstate._tools.mutation --diff "$(REV)" --groups "$(GROUPS)" $(MUTATE_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
