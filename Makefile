# The README's two commands. Both create .venv when missing and install what they need into it.
#   make run   - lint yamls/, build the tiny data, train the tiny MPT on CPU with our callbacks
#   make test  - run the CPU test suite (what CI runs)

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
RUN_ROOT ?= runs
DATA_ROOT ?= data

.PHONY: run test lint-yamls

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# Stamp files re-run the install when setup.cfg changes.
$(VENV)/.installed-run: setup.cfg pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e .
	touch $@

$(VENV)/.installed-test: setup.cfg pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e ".[test]"
	touch $@ $(VENV)/.installed-run

run: $(VENV)/.installed-run
	$(BIN)/foundry-fp8 lint yamls/
	$(BIN)/python -m foundry_fp8.data $(DATA_ROOT)
	WANDB_MODE=offline HF_HUB_OFFLINE=1 $(BIN)/python -m foundry_fp8.demo --data-root $(DATA_ROOT) --run-root $(RUN_ROOT)

test: $(VENV)/.installed-test
	$(BIN)/pytest -m "not gpu"
