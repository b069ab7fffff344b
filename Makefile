# ckptlab: two commands from a fresh clone (see README "Full set-up and tests").
#   make lab    set up .venv and open JupyterLab on notebooks/ (the embedded sample)
#   make test   set up .venv and run every test (what CI runs)
PYTHON ?= python3
VENV   ?= .venv
TORCH_VERSION := 2.13.0
BIN    := $(VENV)/bin
# torch first, pinned, so pip never resolves an unpinned torch (that pulls GBs of CUDA wheels);
# the constraints file keeps every later install from moving it.
PIP    := $(BIN)/python -m pip --disable-pip-version-check
STAMP  := $(VENV)/.ckptlab-installed

.PHONY: setup gcc chromium nginx lab test test-fast test-oldest-torch test-newest-python lint bench clean
setup: $(STAMP)

$(STAMP): pyproject.toml setup.py ckptlab/format/_interp.c ckptlab/format/_walk.c ckptlab/dcp/_rows.c ckptlab/compare/_ckernels.c constraints.txt Makefile | gcc
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "ckptlab needs Python >= 3.11"' \
	  || { echo "make: need Python >= 3.11 as $(PYTHON)"; exit 1; }
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV) || { echo "make: '$(PYTHON) -m venv' failed: on Debian run 'apt-get install python3-venv' (or python3.11-venv) and retry"; exit 1; }
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet torch==$(TORCH_VERSION)
	$(PIP) install --quiet -c constraints.txt -e ".[widgets,dev]"
	@touch $(STAMP)

lab: setup
	$(BIN)/jupyter lab --ServerApp.ip=127.0.0.1 $(if $(filter 0,$(shell id -u)),--allow-root,) --notebook-dir=notebooks notebooks/00_start_here.ipynb

# The browser tests (marker `browser`) drive Debian's chromium through Playwright (never
# `playwright install`). Installed here when missing: apt-get as root, else through sudo. Without
# it those tests skip, or fail when CI is set (.ci/run sets it).
chromium:
	@[ -n "$$CKPTLAB_CHROMIUM" ] || command -v chromium >/dev/null 2>&1 && exit 0; \
	why=""; if [ "$$(id -u)" = 0 ]; then sudo=""; elif command -v sudo >/dev/null 2>&1; then sudo=sudo; \
	  else why="installing it needs root or sudo"; fi; \
	command -v apt-get >/dev/null 2>&1 || why="there is no apt-get (not Debian)"; \
	if [ -z "$$why" ]; then echo "make: installing Debian chromium for the browser tests"; \
	  $$sudo apt-get update -q && $$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium \
	    || why="apt-get install chromium failed"; fi; \
	if [ -n "$$why" ]; then \
	  echo "make: chromium is missing and $$why; the browser tests will be skipped (they fail when CI is set)."; \
	  echo "make: install it (Debian: sudo apt-get install --no-install-recommends chromium) or set CKPTLAB_CHROMIUM=/path/to/chromium."; \
	  if [ -n "$$CI" ]; then exit 1; fi; fi

# The compiled interpreter (ckptlab/format/_interp.c, built by setup.py with the install)
# needs a C compiler; DeepSpeed, which writes the runs of tests/checkpoint/test_deepspeed.py,
# compiles its CPU communication op with g++ on first use. Installed here when missing, as
# chromium is; without them ckptlab installs without its compiled part and those tests fail
# or skip (they fail when CI is set).
gcc:
	@command -v gcc >/dev/null 2>&1 && command -v g++ >/dev/null 2>&1 && exit 0; \
	why=""; if [ "$$(id -u)" = 0 ]; then sudo=""; elif command -v sudo >/dev/null 2>&1; then sudo=sudo; \
	  else why="installing it needs root or sudo"; fi; \
	command -v apt-get >/dev/null 2>&1 || why="there is no apt-get (not Debian)"; \
	if [ -z "$$why" ]; then echo "make: installing Debian gcc for the compiled interpreter"; \
	  $$sudo apt-get update -q && $$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends gcc g++ libc6-dev \
	    || why="apt-get install gcc g++ failed"; fi; \
	if [ -n "$$why" ]; then \
	  echo "make: gcc is missing and $$why; ckptlab installs without its compiled interpreter (its tests fail when CI is set)."; \
	  if [ -n "$$CI" ]; then exit 1; fi; fi

# The remote-checkpoint tests (tests/checkpoint/test_remote.py) and benchmarks/remote.py count
# requests in the access log of a real nginx they start on 127.0.0.1 (Debian's nginx-light).
# Installed here when missing, as chromium is; without it those tests skip, or fail when CI is set.
nginx:
	@[ -n "$$CKPTLAB_NGINX" ] || command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] && exit 0; \
	why=""; if [ "$$(id -u)" = 0 ]; then sudo=""; elif command -v sudo >/dev/null 2>&1; then sudo=sudo; \
	  else why="installing it needs root or sudo"; fi; \
	command -v apt-get >/dev/null 2>&1 || why="there is no apt-get (not Debian)"; \
	if [ -z "$$why" ]; then echo "make: installing Debian nginx-light for the remote tests"; \
	  $$sudo apt-get update -q && $$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends nginx-light \
	    || why="apt-get install nginx-light failed"; fi; \
	if [ -n "$$why" ]; then \
	  echo "make: nginx is missing and $$why; the remote tests will be skipped (they fail when CI is set)."; \
	  echo "make: install it (Debian: sudo apt-get install --no-install-recommends nginx-light) or set CKPTLAB_NGINX=/path/to/nginx."; \
	  if [ -n "$$CI" ]; then exit 1; fi; fi

# The README's test command: everything but the GPU tests, notebooks executed by nbmake.
test: setup chromium nginx
	$(BIN)/python -m pytest -m "not gpu" --nbmake --nbmake-timeout=120 --nbmake-kernel=python3 tests notebooks

test-fast: setup
	$(BIN)/python -m pytest -m "not gpu and not slow" -x -q tests

# The core suite (no widgets, browser or notebooks) on the oldest torch pyproject.toml claims,
# in a venv of its own. Not part of `make test`: PyPI's torch 2.7.0 wheel pulls ~5 GB of CUDA
# wheels (it runs on CPU); where PyTorch's CPU index is reachable, pass
# OLDEST_TORCH_INDEX=https://download.pytorch.org/whl/cpu to take the CPU-only wheel instead.
OLDEST_TORCH       := 2.7.0
OLDEST_VENV        ?= .venv-torch$(OLDEST_TORCH)
OLDEST_TORCH_INDEX ?=
CORE_TESTS := tests/format tests/checkpoint tests/plan tests/write tests/gds tests/testing \
	tests/property tests/test_io.py tests/test_torch_compat.py tests/test_samples.py
test-oldest-torch: nginx
	@test -x $(OLDEST_VENV)/bin/python || $(PYTHON) -m venv $(OLDEST_VENV)
	$(OLDEST_VENV)/bin/python -m pip --disable-pip-version-check install --quiet \
	  $(if $(OLDEST_TORCH_INDEX),--index-url $(OLDEST_TORCH_INDEX),) torch==$(OLDEST_TORCH)
	echo "torch==$(OLDEST_TORCH)" > $(OLDEST_VENV)/constraints.txt
	$(OLDEST_VENV)/bin/python -m pip --disable-pip-version-check install --quiet \
	  -c $(OLDEST_VENV)/constraints.txt -e ".[dev]"
	$(OLDEST_VENV)/bin/python -m pytest -q -p no:cacheprovider -m "not gpu" $(CORE_TESTS)

# The pickle interpreter (both implementations) and the compiled parts on the newest CPython
# pyproject.toml claims, in a venv of its own, without torch: PyPI has no CPU-only torch wheel
# for it (its cp313 wheel needs ~4 GB of CUDA packages, which this project never installs), so
# this runs the suites that need no torch. CI runs it after `make test`.
NEWEST_PYTHON ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.13*/bin/python3.13) $(shell command -v python3.13))
NEWEST_VENV   ?= .venv-newest
NEWEST_TESTS  := tests/format/test_interp.py tests/format/test_records.py tests/dcp/test_rows.py tests/test_io.py \
	tests/compare/test_kernels_pair.py \
	tests/test_lazy.py tests/write/test_state.py tests/write/test_commit.py \
	tests/write/test_files.py tests/write/test_worker.py
test-newest-python:
	@if [ -z "$(NEWEST_PYTHON)" ]; then echo "make: no CPython 3.13 found: set NEWEST_PYTHON=/path/to/python3.13"; \
	  if [ -n "$$CI" ]; then exit 1; fi; exit 0; fi
	@test -x $(NEWEST_VENV)/bin/python || $(NEWEST_PYTHON) -m venv $(NEWEST_VENV)
	$(NEWEST_VENV)/bin/python -m pip --disable-pip-version-check install --quiet \
	  "numpy>=1.24" setuptools wheel "pytest>=8" "pytest-timeout>=2.3" "hypothesis>=6.100" "psutil>=5.9"
	$(NEWEST_VENV)/bin/python -m pip --disable-pip-version-check install --quiet --no-deps \
	  --no-build-isolation -e .
	$(NEWEST_VENV)/bin/python -c 'import sys, ckptlab.format._interp; print("ckptlab: compiled interpreter built for", sys.version.split()[0])'
	CI=1 $(NEWEST_VENV)/bin/python -m pytest -q -p no:cacheprovider -m "not gpu" $(NEWEST_TESTS)

lint: setup
	$(BIN)/ruff check ckptlab tests benchmarks

bench: setup chromium nginx
	$(BIN)/python benchmarks/offsets.py
	$(BIN)/python benchmarks/remote.py
	$(BIN)/python benchmarks/bytemap.py --browser
	$(BIN)/python benchmarks/gds.py

clean:
	rm -rf $(VENV) $(NEWEST_VENV) .pytest_cache .ruff_cache .hypothesis
