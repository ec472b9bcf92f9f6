"""Fixtures for the real-vLLM tier: one vLLM server (CPU, tiny random MoE) and one gateway in front.

Both run as subprocesses in their own process groups for the whole session and are stopped by
process group id (SIGTERM, then SIGKILL after a grace period). The vLLM venv and the model live in
${IGW_CACHE:-~/.cache/igw}; scripts/real_vllm/setup_env.sh creates them when missing (about 1.5 min
cold, a no-op when done), so `pytest tests/real` works on a fresh machine.

Env knobs:
  IGW_CACHE                 where the vLLM venv and the model live
  IGW_VLLM_EXTRA_ARGS       extra vLLM flags (default "--enforce-eager": skips torch.compile, which
                            halves startup on 2 cores; set to "" for the exact reference-capture flags)
  IGW_VLLM_STARTUP_TIMEOUT  seconds to wait for vLLM's /health (default 600)

The P/D pair (`pd_pair`, tests/real/pd.py: two more vLLM servers sharing KV through ExampleConnector)
and the session's vLLM are launched together (`*_launched`: started, not waited for) when the collected
tests use both, whichever is asked for first; each fixture then waits for its own servers. Three
servers booting at once took 270 s to the last /health on the loaded 2-core machine, against 237 s
(the pair) + 176 s (the session server) one after the other.
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Iterator

import httpx
import openai
import pytest
import yaml

from tests.otlp import Receiver

from .harness import (
    BACKEND_NAME,
    GATEWAY_STARTUP_TIMEOUT_S,
    ROOT,
    ROUTE_MODEL,
    SERVED_MODEL,
    VLLM_STARTUP_TIMEOUT_S,
    KvEndpoints,
    ServerProcess,
    ensure_vllm_env,
    free_port,
    vllm_argv,
    vllm_env,
)
from .pd import PdPair


def vllm_extra_args() -> list[str]:
    return shlex.split(os.environ.get("IGW_VLLM_EXTRA_ARGS", "--enforce-eager"))


def _session_uses(request: pytest.FixtureRequest, fixture: str) -> bool:
    return any(fixture in getattr(item, "fixturenames", ()) for item in request.session.items)


@pytest.fixture(scope="session")
def vllm_kv() -> KvEndpoints:
    """The session vLLM's KV events: published from its start (the KV-event tests bind and replay)."""
    return KvEndpoints.fresh()


@pytest.fixture(scope="session")
def otlp() -> Iterator[Receiver]:
    """The session's OTLP collector: the session vLLM exports its spans here (the tracing tests)."""
    receiver = Receiver()
    yield receiver
    receiver.stop()


@pytest.fixture(scope="session")
def vllm_server_launched(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
                         vllm_kv: KvEndpoints, otlp: Receiver) -> Iterator[ServerProcess]:
    """The session's vLLM, started (not yet ready), and the P/D pair beside it when the session uses it."""
    ensure_vllm_env()
    workdir = tmp_path_factory.mktemp("vllm")
    port = free_port()
    extra = vllm_extra_args()
    tools = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]  # the tool-calling tests
    traces = ["--otlp-traces-endpoint", otlp.grpc_endpoint]  # its spans join the gateway's traces
    argv = vllm_argv(port, *vllm_kv.vllm_flag(), *tools, *traces, *extra)
    env = {**vllm_env(), "OTEL_SERVICE_NAME": "vllm", "OTEL_BSP_SCHEDULE_DELAY": "200"}  # (default: 5 s)
    server = ServerProcess.start("vLLM", argv, port=port, log_path=workdir / "vllm.log", env=env, cwd=workdir)
    try:
        if _session_uses(request, "pd_pair"):
            request.getfixturevalue("pd_pair_launched")  # boots beside this one
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def vllm_server(vllm_server_launched: ServerProcess) -> ServerProcess:
    waited = vllm_server_launched.wait_until_ok("/health", VLLM_STARTUP_TIMEOUT_S)
    print(f"[real] vLLM ready on {vllm_server_launched.url} after {waited:.1f} s", file=sys.stderr)
    return vllm_server_launched


@pytest.fixture(scope="session")
def pd_pair_launched(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PdPair]:
    """The P/D pair's two servers, started (not yet ready); stopped by pid at the session's end."""
    ensure_vllm_env()
    pair = PdPair.launch(tmp_path_factory.mktemp("pd"), *vllm_extra_args())
    try:
        yield pair
    finally:
        pair.stop()


@pytest.fixture(scope="session")
def pd_pair(request: pytest.FixtureRequest) -> PdPair:
    """A prefill and a decode vLLM sharing KV through ExampleConnector files (tests/real/pd.py), ready.
    The session's vLLM is launched first when the session uses it, so the three boot together."""
    if _session_uses(request, "vllm_server"):
        request.getfixturevalue("vllm_server_launched")
    pair: PdPair = request.getfixturevalue("pd_pair_launched")
    pair.wait_ready(VLLM_STARTUP_TIMEOUT_S)
    return pair


@pytest.fixture(scope="session")
def gateway_server(vllm_server: ServerProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    workdir = tmp_path_factory.mktemp("gateway")
    port = free_port()
    config = {
        "listen": {"host": "127.0.0.1", "port": port},
        "backends": [
            {
                "name": BACKEND_NAME,
                "runtime": "vllm",
                "url": vllm_server.url,
                "model": SERVED_MODEL,
                "usd_per_hour": 1.0,
            }
        ],
        "routes": [{"model": ROUTE_MODEL, "backends": [BACKEND_NAME], "policy": "least_load"}],
    }
    config_path = workdir / "gateway.yaml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    argv = [
        sys.executable, "-m", "gateway", "serve",
        "--config", str(config_path),
        "--host", "127.0.0.1",
        "--port", str(port),
    ]  # fmt: skip
    server = ServerProcess.start(
        "gateway", argv, port=port, log_path=workdir / "gateway.log", env=dict(os.environ), cwd=ROOT
    )
    try:
        waited = server.wait_until_ok("/ready", GATEWAY_STARTUP_TIMEOUT_S)
        print(f"[real] gateway ready on {server.url} after {waited:.1f} s", file=sys.stderr)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def client(gateway_server: ServerProcess) -> Iterator[openai.OpenAI]:
    """The official OpenAI SDK pointed at the gateway."""
    with openai.OpenAI(base_url=f"{gateway_server.url}/v1", api_key="x", max_retries=0, timeout=60.0) as c:
        yield c


@pytest.fixture(scope="session")
def http(gateway_server: ServerProcess) -> Iterator[httpx.Client]:
    """Plain HTTP to the gateway, for its non-OpenAI endpoints."""
    with httpx.Client(base_url=gateway_server.url, timeout=30.0) as c:
        yield c
