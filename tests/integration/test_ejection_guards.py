"""The outlier guards are judged per route and per arm, on a real gateway process: a model's only
backend is never ejected, and a 503 caused by ejection names the backend and what ejected it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx

from .harness import Emulators, GatewayProcess, backend_entry, wait_for
from .test_errors import assert_openai_error

StartGateway = Callable[..., GatewayProcess]


def chat(gw: GatewayProcess, model: str) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return gw.post("/v1/chat/completions", json=body)


def backend(gw: GatewayProcess, name: str) -> dict[str, Any]:
    found: dict[str, Any] = next(b for b in gw.get("/admin/backends").json()["backends"] if b["name"] == name)
    return found


def test_five_failures_do_not_eject_a_models_only_backend(emulators: Emulators, gateway: StartGateway) -> None:
    """Two models of one backend each: ejecting either would leave half the gateway's backends, but
    all of its model's; the backend answers again after its failures, and so does its model."""
    flaky = emulators.start("vllm", fail_first=5, fail_status=500)
    other = emulators.start("vllm")
    gw = gateway(
        [backend_entry("flaky", flaky, "vllm"), backend_entry("other", other, "vllm")],
        routes=[{"model": "one", "backends": ["flaky"]}, {"model": "two", "backends": ["other"]}],
        health={"interval_s": 0.2, "failure_threshold": 5, "cooldown_s": 60.0},
    )
    assert [chat(gw, "one").status_code for _ in range(5)] == [500] * 5
    after = chat(gw, "one")
    assert after.status_code == 200, after.text  # not 503 for the 60-s cool-down
    assert after.headers["x-gateway-backend"] == "flaky"
    assert gw.metric("gateway_backend_ejections_total", backend="flaky") == 0
    assert gw.metric("gateway_backend_ejections_spared_total", backend="flaky") == 1
    assert backend(gw, "flaky")["ejected"] is False
    assert chat(gw, "two").status_code == 200
    log = gw.log_path.read_text()
    assert "backend flaky not ejected: 5 consecutive failures, but route `one` would have no routable backend left" \
        in log


def test_a_503_caused_by_ejection_names_the_backend_and_its_last_failure(
    emulators: Emulators, gateway: StartGateway
) -> None:
    """A route of two: the failing one is ejected (the other still serves), then the other stops;
    the 503 says which is ejected, after what, and why the other is out."""
    failing = emulators.start("vllm", fail_rate=1.0, fail_status=500)
    stopping = emulators.start("vllm")
    gw = gateway(
        [backend_entry("failing", failing, "vllm"), backend_entry("stopping", stopping, "vllm")],
        routes=[{"model": "m", "backends": ["failing", "stopping"], "policy": "round_robin"}],
        health={"interval_s": 0.2, "failure_threshold": 2, "cooldown_s": 60.0},
    )
    statuses = [chat(gw, "m").status_code for _ in range(4)]  # round robin: two 500s eject `failing`
    assert statuses.count(500) == 2
    assert gw.metric("gateway_backend_ejections_total", backend="failing") == 1
    emulators.stop(stopping)
    wait_for(lambda: backend(gw, "stopping"), lambda b: b["probe_ok"] is False, timeout=30,
             what="the stopped backend's failing probe")
    resp = chat(gw, "m")
    assert resp.status_code == 503
    assert int(resp.headers["Retry-After"]) >= 1
    err = assert_openai_error(resp.json())
    assert (err["type"], err["code"]) == ("server_error", "no_healthy_backend")
    message = str(err["message"])
    assert message.startswith("No healthy backend for model `m`: ")
    assert "`failing` is ejected (2 consecutive failures; last failure: status 500) for " in message
    assert "`stopping` fails its health probe" in message


def test_a_503_after_the_last_backend_refused_names_the_ejected_others(
    emulators: Emulators, gateway: StartGateway
) -> None:
    """The other backend stopped before a probe noticed (probes every 30 s): the request finds it
    refusing connections, and the 503 says why it had nowhere else to go."""
    failing = emulators.start("vllm", fail_rate=1.0, fail_status=500)
    stopping = emulators.start("vllm")
    gw = gateway(
        [backend_entry("failing", failing, "vllm"), backend_entry("stopping", stopping, "vllm")],
        routes=[{"model": "m", "backends": ["failing", "stopping"], "policy": "round_robin"}],
        health={"interval_s": 30.0, "failure_threshold": 2, "cooldown_s": 60.0},
    )
    statuses = [chat(gw, "m").status_code for _ in range(4)]
    assert statuses.count(500) == 2
    assert gw.metric("gateway_backend_ejections_total", backend="failing") == 1
    emulators.stop(stopping)
    resp = chat(gw, "m")
    assert resp.status_code == 503
    assert resp.headers["Retry-After"] == "1"  # the refusing one may be back any moment
    message = str(assert_openai_error(resp.json())["message"])
    assert message.startswith("No backend could be reached (`stopping`: ")
    assert "`failing` is ejected (2 consecutive failures; last failure: status 500) for " in message
