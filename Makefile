# One place for the commands that humans and CI run. `make test` is exactly what CI runs.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install run check test test-fast real-env system-deps bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

run: install  ## install and run the gateway (no config: the embedded demo fleet)
	$(VENV)/bin/gateway serve $(if $(CONFIG),--config $(CONFIG))

check: install  ## lint and types
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

system-deps:  ## Debian packages the browser test and benchmarks use (chromium, wrk, nginx); needs root
	@if ! command -v chromium >/dev/null || ! command -v wrk >/dev/null || ! command -v nginx >/dev/null; then \
		if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium wrk nginx-light >/dev/null; \
		else echo "install chromium, wrk and nginx-light (apt-get) for the browser test and benchmarks"; fi; fi

real-env:  ## the separate vLLM (CPU) environment and the tiny MoE model for tests/real
	bash scripts/real_vllm/setup_env.sh

test: install system-deps real-env check  ## everything CI runs: lint, types, unit, integration, emulator and real-vLLM tiers
	$(VENV)/bin/pytest

test-fast: install  ## the tiers without real vLLM
	$(VENV)/bin/pytest -m "not real"

bench: install
	$(PY) -m bench overhead --quick

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
