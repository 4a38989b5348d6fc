# kvgate: the two Quick start commands are `make demo` and `make test`; both create or reuse .venv.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo demo-budgets test test-unit lint typecheck unit bench bench-docs envoy-config proto docs docs-reference docs-check image clean

$(STAMP): pyproject.toml setup.py ext_proc/_jsonscan.c
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	@$(BIN)/python -c "import ext_proc._jsonscan" 2>/dev/null || echo "note: ext_proc/_jsonscan.c did not build (a C compiler and the Python headers are needed): intake runs its slower pure-Python passes, and the tests that need the extension fail"
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
	$(BIN)/python -m kvgate.dev.docs --check
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

# the docs site (docs/, mkdocs.yml) into site/; --strict: a broken link or a page left out of the nav fails
docs: $(STAMP)
	$(BIN)/mkdocs build --strict

# regenerate docs/reference/{config,metrics,cli}.md from the pydantic models, the metric declarations and argparse
docs-reference: $(STAMP)
	$(BIN)/python -m kvgate.dev.docs

docs-check: $(STAMP)
	$(BIN)/python -m kvgate.dev.docs --check

# the container image, tagged as the chart pulls it (helm/kvgate: image.repository, appVersion);
# needs a working docker, podman or buildah (else says so and fails). IMAGE=repo:tag to name it, PUSH=1 to push
image: $(STAMP)
	$(BIN)/python -m kvgate.dev.image $(if $(IMAGE),--tag $(IMAGE)) $(if $(PUSH),--push)

# the benchmarks page's figures and plots: the pinned scenarios into docs/benchmarks/results (report.md, PNGs)
bench-docs: $(STAMP)
	$(BIN)/kvgate bench scenarios --out docs/benchmarks/results

clean:
	rm -rf $(VENV) .kvgate-run .pytest_cache .mypy_cache .ruff_cache *.egg-info site build ext_proc/*.so
