# The gateway's container image. Two stages: `build` compiles the request path with mypyc and
# assembles a complete virtual environment in /opt/gateway; the runtime stage copies only that venv
# onto a clean base, so it holds no compiler, no headers, no pip and no build dependencies, and runs
# as the unprivileged uid 10001.
#
# BASE is any Debian-family image with python3 >= 3.11 and the venv module, used by both stages (the
# venv's interpreter link must resolve the same way in each):
#   python:3.11-slim                  the default, from a registry (Python in /usr/local)
#   localhost/debian-python:bookworm  made without a registry by scripts/container/base_image.sh
#                                     (debootstrap minbase; Debian's python3.11 in /usr, no pip)
# Built and run by tests/container (`make test-container`); the commands are in deploy/README.md.
ARG BASE=python:3.11-slim

# The runtime dependencies, read from pyproject.toml. Their own stage, so that editing anything else
# in pyproject.toml (lint settings, test markers) leaves the result, and so the build stage's
# dependency layer below, unchanged and cached.
FROM ${BASE} AS requirements
COPY pyproject.toml /src/
RUN python3 -c 'import tomllib; print("\n".join(tomllib.load(open("/src/pyproject.toml", "rb"))["project"]["dependencies"]))' \
      >/requirements.txt

FROM ${BASE} AS build
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# mypyc needs a C compiler and the Python headers. The official python images ship the headers;
# Debian's python3 gets them from python3-dev (the same 3.11 build as the interpreter).
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && if ! python3 -c 'import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))'; then \
      apt-get install -y --no-install-recommends python3-dev; fi \
 && rm -rf /var/lib/apt/lists/*
# The build venv: pip, setuptools, mypy (mypyc) and the project's dependencies, which mypyc
# type-checks against. This layer survives every edit but a change of dependencies.
COPY --from=requirements /requirements.txt /tmp/requirements.txt
RUN python3 -m venv /opt/build \
 && /opt/build/bin/pip install --upgrade pip "setuptools>=77" wheel "mypy>=1.11" types-PyYAML \
 && /opt/build/bin/pip install -r /tmp/requirements.txt
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY gateway ./gateway
COPY backends ./backends
# GATEWAY_NATIVE=1: the modules setup.py lists become C extensions. The runtime venv then gets that
# wheel and its dependencies' wheels from /wheels alone (--no-index), loses pip and setuptools, which
# it never needs again, and must hold and import the compiled build (the composition root imports
# the request path).
RUN GATEWAY_NATIVE=1 /opt/build/bin/pip wheel --no-build-isolation --no-deps --wheel-dir /wheels . \
 && /opt/build/bin/pip wheel --wheel-dir /wheels /wheels/*.whl \
 && python3 -m venv /opt/gateway \
 && /opt/gateway/bin/pip install --no-index --find-links /wheels moe-inference-gateway \
 && /opt/gateway/bin/pip uninstall --yes pip setuptools \
 && compiled="$(find /opt/gateway/lib -path '*/site-packages/gateway/*' -name '*.so' | wc -l)" \
 && echo "compiled modules: $compiled" && [ "$compiled" -gt 0 ] \
 && cd / && /opt/gateway/bin/python -c 'import gateway.app'

FROM ${BASE}
RUN groupadd --system --gid 10001 gateway \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin gateway
COPY --from=build /opt/gateway /opt/gateway
COPY config /etc/gateway
ENV PATH=/opt/gateway/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
USER 10001:10001
EXPOSE 8080
# It listens on 0.0.0.0: without `auth.admin_token_sha256` in the config, admin writes (reload, live
# weights) are refused with 403 (they are open only on a loopback-only listener); reads stay open.
# With no --config the gateway starts its embedded demo fleet; mount a config for real backends:
#   podman run -p 8080:8080 -v $PWD/my.yaml:/etc/gateway/my.yaml:ro IMAGE serve --config /etc/gateway/my.yaml --host 0.0.0.0
ENTRYPOINT ["/opt/gateway/bin/gateway"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8080"]
# The venv's interpreter by absolute path: the base may have no `python` on PATH. (Build with
# `--format docker`: the OCI image format has no HEALTHCHECK and podman drops it silently.)
HEALTHCHECK --interval=10s --timeout=3s --start-period=15s --retries=3 \
  CMD ["/opt/gateway/bin/python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/health', timeout=2)"]
