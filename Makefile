# Two commands for a fresh machine: `make train` and `make test`. Both create .venv on first use.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# No NVIDIA GPU: pin the CPU wheel of torch. With one: keep the CUDA torch the user already has.
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
VENV_FLAGS := $(if $(HAS_GPU),--system-site-packages,)
CONSTRAINTS := $(if $(HAS_GPU),,-c constraints/cpu.txt)
PYTEST_ARGS ?=
# Two test processes, a test file each at a time: much of a multi-rank test is waiting (process start, imports,
# timeouts), which the other process fills; a third finds no idle core on 2 (measured: 1.96 cores busy, no faster).
# TEST_WORKERS=0 runs the suite in this process.
TEST_WORKERS ?= 2

.PHONY: venv train test lint format clean

venv: $(STAMP)

$(STAMP): pyproject.toml constraints/cpu.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV_FLAGS) $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check $(CONSTRAINTS) -e '.[dev]'
	@touch $(STAMP)

train: $(STAMP)
	$(BIN)/modelpar-train $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
