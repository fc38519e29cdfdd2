# Every target works as the first command on a fresh machine: it creates .venv and installs
# what it needs. torch goes in first, pinned, because an unpinned torch pulls a multi-GB CUDA
# build where a CPU wheel is at hand (override with TORCH_SPEC=...).
PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: test demo lint bench bench-smoke format clean image

$(VENV)/.torch:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet "$(TORCH_SPEC)"
	touch $@

$(VENV)/.dev: pyproject.toml $(VENV)/.torch
	$(PIP) install --quiet -e ".[dataplane,controlplane,operator,dev]"
	touch $@

$(VENV)/.run: pyproject.toml $(VENV)/.torch
	$(PIP) install --quiet -e ".[dataplane,controlplane,operator,demo]"
	touch $@

# TEST_WORKERS: the suite runs on this many pytest-xdist workers (each worker's torch, and the
# servers it starts, take one thread: tests/conftest.py), then the `serial` tests (timings
# compared on this machine) run alone; TEST_WORKERS=0 runs everything in one process.
# PYTEST_ARGS: passed to both runs (a run that selects no test is not a failure).
TEST_WORKERS ?= 2
test: $(VENV)/.dev
	$(PY) -m pytest -q -n $(TEST_WORKERS) -m "not serial" $(PYTEST_ARGS) || [ $$? -eq 5 ]
	$(PY) -m pytest -q -m serial $(PYTEST_ARGS) || [ $$? -eq 5 ]

# DEMO_ARGS: flags for `loraplane demo` (see `loraplane demo --help`), e.g.
#   make demo DEMO_ARGS=--once      the scripted tour, then exit (0: everything behaved)
#   make demo DEMO_ARGS="--port 9000 --controlplane-port 9080"   or --rebuild, --workdir DIR
demo: $(VENV)/.run
	$(VENV)/bin/loraplane demo $(DEMO_ARGS)

lint: $(VENV)/.dev
	$(VENV)/bin/ruff check loraplane tests benchmarks
	$(VENV)/bin/ruff format --check loraplane tests benchmarks
	$(VENV)/bin/mypy

format: $(VENV)/.dev
	$(VENV)/bin/ruff check --fix loraplane tests benchmarks
	$(VENV)/bin/ruff format loraplane tests benchmarks

# bench: every script in benchmarks/ at full size, one at a time (half an hour or more on 2
# cores); bench-smoke: each with --smoke (tiny sizes, about a minute in all: what CI runs).
# Both run every script even when one fails and end with a summary; without CUDA the *_gpu.py
# ones are skipped (bench-smoke takes the CPU path of those that have one). The status is
# non-zero when a script failed or (bench) missed a goal; the summary counts goals met, missed
# and skipped (a goal only a GPU can meet, where a CPU measured it: never met, never missed).
# BENCH_ARGS: only these scripts, e.g. make bench-smoke BENCH_ARGS="ingest tiers", or all but
# some: BENCH_ARGS="--skip engine_gpu"
bench: $(VENV)/.dev
	$(PY) benchmarks/_run.py $(BENCH_ARGS)

bench-smoke: $(VENV)/.dev
	$(PY) benchmarks/_run.py --smoke $(BENCH_ARGS)

# image: the Dockerfile's targets from their public base (python:3.11-slim, PyPI and PyTorch's
# CPU index; a Docker engine that reaches them): $(IMAGE) (full: every component) and
# $(IMAGE)-slim (control plane and operator, no torch). CI builds and runs them without a
# registry (.ci/image.sh). IMAGE_ARGS: more flags, e.g. IMAGE_ARGS="--build-arg
# TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128" for the CUDA variant.
IMAGE ?= loraplane:dev
image:
	docker build $(IMAGE_ARGS) -t $(IMAGE) .
	docker build $(IMAGE_ARGS) --target slim -t $(IMAGE)-slim .

clean:
	rm -rf $(VENV) .loraplane .pytest_cache .mypy_cache .ruff_cache .hypothesis benchmarks/results/*.json
