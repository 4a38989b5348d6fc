# kvgate: the two Quick start commands are `make demo` and `make test`; both create or reuse .venv.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo demo-budgets test test-unit lint typecheck unit bench envoy-config proto clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	@if ! command -v wrk >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
		(apt-get update -qq && apt-get install -y -qq wrk) >/dev/null 2>&1 || echo "note: wrk not installed; benchmarks use the built-in load generator"; fi
	@if ! command -v promtool >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus) >/dev/null 2>&1 \
		|| echo "note: prometheus not installed; the Prometheus tests will be skipped"; fi
	@if ! command -v redis-server >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server) >/dev/null 2>&1 \
		|| echo "note: redis-server not installed; the several-replica tests will be skipped"; fi
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/kvgate demo

# a tenant runs into a small daily spend budget and sees the 429 with its reset time (docs/budgets.md)
demo-budgets: $(STAMP)
	$(BIN)/kvgate demo-budgets

test: $(STAMP) lint typecheck
	$(BIN)/kvgate envoy-config --check
	$(BIN)/python -m scaler.codegen --check
	$(BIN)/python -m pytest -q -p no:cacheprovider

# the in-process tier only (tests/tiers.py): no Envoy, no child process; about a minute on 2 cores
test-unit: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider -m unit

lint: $(STAMP)
	$(BIN)/ruff check .

typecheck: $(STAMP)
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/kvgate bench overhead
	$(BIN)/kvgate bench overhead --stream
	$(BIN)/kvgate bench sim
	$(BIN)/kvgate bench queue
	$(BIN)/kvgate bench scenarios --out bench-out
	$(BIN)/kvgate bench live

envoy-config: $(STAMP)
	$(BIN)/kvgate envoy-config --write

proto: $(STAMP)
	$(BIN)/python -m scaler.codegen

clean:
	rm -rf $(VENV) .kvgate-run .pytest_cache .mypy_cache .ruff_cache *.egg-info
