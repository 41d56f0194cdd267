# The README's two commands. Both create .venv when missing and install what they need into it,
# at the exact versions of constraints/ci.txt.
#   make run   - lint yamls/, build the tiny data, train the tiny MPT on CPU with our callbacks
#   make test  - run the CPU test suite (what CI runs first)
# CI's other jobs (.ci/run):
#   make test-oldest - the oldest supported set (constraints/oldest.txt) in .venv-oldest, on the
#                      tests that touch Composer's and LLM-Foundry's APIs
#   make lock        - rewrite constraints/ci.txt: the newest set setup.cfg's ranges allow today,
#                      resolved in a fresh venv (then `make test` installs it)

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
OLDEST := .venv-oldest
RUN_ROOT ?= runs
DATA_ROOT ?= data
# What the oldest set runs: our Composer/LLM-Foundry entries in real runs, the attention
# registry, the bench's tiny path, the wheel install, the docs' CPU try, and te_swap beside
# LLM-Foundry's hf_checkpointer, load_path, optimizer options and hf_causal_lm.
OLDEST_TESTS ?= tests/test_te_swap.py tests/test_state_callback.py tests/test_stats_callback.py \
	tests/test_readme.py tests/test_cli_help.py \
	tests/test_lint_callback.py tests/test_attention.py tests/test_jsonl.py tests/test_bench.py \
	tests/test_packaging.py tests/test_docs_try.py tests/test_stats_resume.py \
	tests/test_plain_interop.py tests/test_swap_params.py tests/test_swap_convert.py \
	tests/test_stats_formats.py tests/test_resume_sharded.py tests/test_stats_microbatches.py

.PHONY: run test test-oldest lock

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# Stamp files re-run the install when setup.cfg or the pinned set changes.
$(VENV)/.installed-run: setup.cfg pyproject.toml constraints/ci.txt | $(BIN)/python
	$(BIN)/pip install --quiet -c constraints/ci.txt -e .
	touch $@

$(VENV)/.installed-test: setup.cfg pyproject.toml constraints/ci.txt | $(BIN)/python
	$(BIN)/pip install --quiet -c constraints/ci.txt -e ".[test]"
	touch $@ $(VENV)/.installed-run

$(OLDEST)/.installed-test: setup.cfg pyproject.toml constraints/oldest.txt
	$(PYTHON) -m venv $(OLDEST)
	$(OLDEST)/bin/pip install --quiet --upgrade pip
	$(OLDEST)/bin/pip install --quiet -c constraints/oldest.txt -e ".[test]"
	touch $@

run: $(VENV)/.installed-run
	$(BIN)/foundry-fp8 lint yamls/ foundry_fp8/tools/yamls/
	$(BIN)/foundry-fp8 tiny-data $(DATA_ROOT)
	WANDB_MODE=offline HF_HUB_OFFLINE=1 $(BIN)/python scripts/demo.py --data-root $(DATA_ROOT) --run-root $(RUN_ROOT)

test: $(VENV)/.installed-test
	$(BIN)/pytest -m "not gpu"

test-oldest: $(OLDEST)/.installed-test
	$(OLDEST)/bin/pytest -m "not gpu" $(OLDEST_TESTS)

lock:
	rm -rf .venv-lock
	$(PYTHON) -m venv .venv-lock
	.venv-lock/bin/pip install --quiet --upgrade pip
	.venv-lock/bin/pip install --quiet -e ".[test]"
	{ sed -n '1,2p' constraints/ci.txt; .venv-lock/bin/pip freeze --exclude-editable; } > constraints/ci.new
	mv constraints/ci.new constraints/ci.txt
	rm -rf .venv-lock
