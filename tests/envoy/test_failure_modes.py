"""Envoy without its picker, and the picker coming back: `failure_mode_allow` both ways (GIE's
FailClose and FailOpen), a picker restarted while Envoy runs, and the BUFFERED body mode. Each test
starts its own Envoy (their configs differ) in front of one module-wide fleet."""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from backends.emulator import RunningEmulator
from tests.integration.harness import Emulators, GatewayProcess, LoopThread, eventually

from .envoy import EnvoyProcess, config

HI: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello"}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def fleet(loop_thread: LoopThread) -> Iterator[list[RunningEmulator]]:
    emulators = Emulators(loop_thread)
    yield [emulators.start("vllm", model="moe"), emulators.start("vllm", model="moe")]
    emulators.stop_all()


def gateway_config(fleet: list[RunningEmulator], picker_port: int) -> dict[str, Any]:
    return {
        "backends": [{"name": f"e{i}", "runtime": "vllm", "url": e.url, "model": "moe"} for i, e in enumerate(fleet)],
        "routes": [{"model": "moe", "backends": [f"e{i}" for i in range(len(fleet))], "policy": "least_load"}],
        "health": {"interval_s": 0.2},
        "endpoint_picker": {"listen": {"host": "127.0.0.1", "port": picker_port}},
    }


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Callable[..., Any]]:
    started: list[GatewayProcess | EnvoyProcess] = []

    def run(kind: str, cfg: dict[str, Any]) -> Any:
        workdir = tmp_path / f"{kind}{len(started)}"
        workdir.mkdir()
        proc = GatewayProcess(cfg, workdir) if kind == "gateway" else EnvoyProcess(cfg, workdir)
        started.append(proc)
        return proc

    yield run
    for proc in reversed(started):
        proc.stop()


def pool(fleet: list[RunningEmulator]) -> list[str]:
    return [e.url.removeprefix("http://") for e in fleet]


def ask(envoy: EnvoyProcess) -> str:
    raw = envoy.client().chat.completions.with_raw_response.create(model="moe", messages=HI, max_tokens=2)
    assert raw.parse().choices[0].message.content
    return raw.headers.get("x-gateway-backend", "")


def test_fail_closed_without_a_picker_is_a_500(fleet: list[RunningEmulator], start: Callable[..., Any]) -> None:
    envoy = start("envoy", config(free_port(), pool(fleet), failure_mode_allow=False))
    with pytest.raises(openai.InternalServerError) as info:
        envoy.client().chat.completions.create(model="moe", messages=HI, max_tokens=2)
    assert info.value.status_code == 500


def test_fail_open_without_a_picker_goes_round_robin_over_the_pool(
    fleet: list[RunningEmulator], start: Callable[..., Any]
) -> None:
    """Fail-open needs the BUFFERED body mode (see the next test)."""
    envoy = start("envoy", config(free_port(), pool(fleet), failure_mode_allow=True, body_mode="BUFFERED"))
    served = [ask(envoy) for _ in range(4)]
    assert served == [""] * 4  # no picker chose: no gateway headers
    assert envoy.stat("cluster.pool.upstream_rq_completed") == 4
    assert envoy.stat("cluster.picked.upstream_rq_completed") == 0


def test_full_duplex_fails_open_only_when_the_picker_fails_before_the_body(
    fleet: list[RunningEmulator], start: Callable[..., Any]
) -> None:
    """Envoy 1.40 fails FULL_DUPLEX_STREAMED open only while no body chunk has been handed to the
    ext_proc stream (it keeps no copy of it): whether a POST's body went before the picker's connection
    failed is a race, so each answer is either a 500 or the pool's round robin, never anything else.
    Fail-open one can rely on needs BUFFERED (the test above)."""
    envoy = start("envoy", config(free_port(), pool(fleet), failure_mode_allow=True))
    statuses = []
    for _ in range(6):
        try:
            assert ask(envoy) == ""  # served, unpicked: the pool's round robin
            statuses.append(200)
        except openai.InternalServerError as exc:
            statuses.append(exc.status_code)
    assert set(statuses) <= {200, 500}
    assert envoy.stat("cluster.pool.upstream_rq_completed") == statuses.count(200)
    assert envoy.stat("cluster.picked.upstream_rq_completed") == 0


def test_fail_open_with_a_picker_still_routes_by_the_picker(
    fleet: list[RunningEmulator], start: Callable[..., Any]
) -> None:
    gateway = start("gateway", gateway_config(fleet, 0))
    envoy = start("envoy", config(gateway.picker_port, pool(fleet), failure_mode_allow=True, body_mode="BUFFERED"))
    assert ask(envoy) in {"e0", "e1"}
    assert envoy.stat("cluster.picked.upstream_rq_completed") == 1


def test_a_picker_restarted_while_envoy_runs_is_used_again(
    fleet: list[RunningEmulator], start: Callable[..., Any]
) -> None:
    port = free_port()
    gateway = start("gateway", gateway_config(fleet, port))
    envoy = start("envoy", config(port, pool(fleet)))
    assert ask(envoy) in {"e0", "e1"}
    gateway.stop()
    with pytest.raises(openai.InternalServerError):  # fail closed while it is away
        envoy.client().chat.completions.create(model="moe", messages=HI, max_tokens=2)
    again = start("gateway", gateway_config(fleet, port))

    def served() -> bool:
        try:
            return ask(envoy) in {"e0", "e1"}
        except openai.InternalServerError:
            return False

    eventually(served, timeout=20)
    assert again.metric("gateway_requests_total", status="200") >= 1  # recorded by the new picker


def test_buffered_body_mode_routes_too(fleet: list[RunningEmulator], start: Callable[..., Any]) -> None:
    gateway = start("gateway", gateway_config(fleet, 0))
    envoy = start("envoy", config(gateway.picker_port, pool(fleet), body_mode="BUFFERED"))
    assert ask(envoy) in {"e0", "e1"}
    chunks = list(envoy.client().chat.completions.create(model="moe", messages=HI, max_tokens=3, stream=True))
    assert any(c.choices and c.choices[0].delta.content for c in chunks)
    eventually(lambda: gateway.metric("gateway_requests_total", status="200") == 2)
