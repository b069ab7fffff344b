# ckptlab: two commands from a fresh clone (see README "Quick start").
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

.PHONY: setup lab test test-fast lint bench clean
setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt Makefile
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "ckptlab needs Python >= 3.11"' \
	  || { echo "make: need Python >= 3.11 as $(PYTHON)"; exit 1; }
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV) || { echo "make: '$(PYTHON) -m venv' failed: on Debian run 'apt-get install python3-venv' (or python3.11-venv) and retry"; exit 1; }
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet torch==$(TORCH_VERSION)
	$(PIP) install --quiet -c constraints.txt -e ".[widgets,dev]"
	@touch $(STAMP)

lab: setup
	$(BIN)/jupyter lab --ServerApp.ip=127.0.0.1 --notebook-dir=notebooks notebooks/00_start_here.ipynb

# The README's test command: everything but the GPU tests, notebooks executed by nbmake.
test: setup
	$(BIN)/python -m pytest -m "not gpu" --nbmake --nbmake-timeout=120 --nbmake-kernel=python3 tests notebooks

test-fast: setup
	$(BIN)/python -m pytest -m "not gpu and not slow" -x -q tests

lint: setup
	$(BIN)/ruff check ckptlab tests benchmarks

bench: setup
	$(BIN)/python benchmarks/offsets.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
