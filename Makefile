# One place for the commands that humans and CI run. `make test` is exactly what CI runs.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install run check test test-fast test-real real-env bench clean

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

real-env:  ## the separate vLLM (CPU) environment and the tiny MoE model for tests/real
	bash scripts/real_vllm/setup_env.sh

test: install real-env check  ## everything CI runs: lint, types, unit, integration, emulator and real-vLLM tiers
	$(VENV)/bin/pytest

test-fast: install  ## the tiers without real vLLM
	$(VENV)/bin/pytest -m "not real"

bench: install
	$(PY) -m bench

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
