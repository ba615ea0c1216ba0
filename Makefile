# Libra: `make demo` runs a rollout, `make test` runs the checks and tests.
# Every target installs what it needs into .venv first (idempotent: re-installs only
# when pyproject.toml changes).

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.libra-installed
RUNS := runs

.PHONY: setup test lint unit demo bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@

lint: setup
	$(BIN)/ruff check libra envs_contrib tests
	$(BIN)/ruff format --check libra envs_contrib tests
	$(BIN)/mypy

unit: setup
	$(BIN)/python -m pytest -q

test: lint unit

demo: setup
	mkdir -p $(RUNS)
	$(BIN)/libra rollout --env calc --server emulated -n 64 --out $(RUNS)/demo.jsonl

bench: setup
	$(BIN)/libra bench engine

clean:
	rm -rf $(VENV) $(RUNS) .mypy_cache .ruff_cache .pytest_cache
