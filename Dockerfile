# Multi-stage build: wheels are built in a throwaway stage; the runtime image holds only the
# installed gateway and runs it as an unprivileged user.
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY gateway ./gateway
COPY backends ./backends
# GATEWAY_NATIVE=1: the request path compiled by mypyc (setup.py). mypyc type-checks as it compiles,
# so the build needs gcc, mypy, and the project's dependencies (for their types); the same steps were
# run by hand in a plain venv, and the wheel they made served requests (`build: native (mypyc)`).
RUN apt-get update && apt-get install -y --no-install-recommends gcc && rm -rf /var/lib/apt/lists/* \
 && pip install --no-cache-dir --upgrade pip setuptools "mypy>=1.11" types-PyYAML \
 && pip install --no-cache-dir . \
 && GATEWAY_NATIVE=1 pip wheel --no-cache-dir --no-build-isolation --no-deps --wheel-dir /wheels . \
 && pip wheel --no-cache-dir --wheel-dir /wheels /wheels/*.whl

FROM python:3.11-slim
RUN useradd --system --uid 10001 --home-dir /nonexistent --shell /usr/sbin/nologin gateway
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
COPY config /etc/gateway
USER 10001
EXPOSE 8080
ENV PYTHONUNBUFFERED=1
# It listens on 0.0.0.0: without `auth.admin_token_sha256` in the config, admin writes (reload, live
# weights) are refused with 403 (they are open only on a loopback-only listener); reads stay open.
# With no --config the gateway starts its embedded demo fleet; mount a config for real backends:
#   docker run -p 8080:8080 -v $PWD/my.yaml:/etc/gateway/my.yaml IMAGE serve --config /etc/gateway/my.yaml --host 0.0.0.0
ENTRYPOINT ["gateway"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8080"]
HEALTHCHECK --interval=10s --timeout=3s CMD python -c "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:8080/health', timeout=2)" || exit 1
