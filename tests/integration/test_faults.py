"""Retries before the first byte, circuit breaking, timeouts and disconnects, against emulators with
fault knobs. Waits poll a condition with a deadline; nothing sleeps to synchronise."""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx
import openai
import pytest

from .harness import Emulators, GatewayProcess, backend_entry, eventually

StartGateway = Callable[..., GatewayProcess]
MESSAGES: list[openai.types.chat.ChatCompletionMessageParam] = [{"role": "user", "content": "hello"}]



def sdk(gw: GatewayProcess) -> openai.OpenAI:
    return gw.client()


@pytest.mark.parametrize("status", [503, 429])
def test_overloaded_backend_is_retried_on_another(emulators: Emulators, gateway: StartGateway, status: int) -> None:
    sick = emulators.start("vllm", fail_first=1000, fail_status=status)
    ok = emulators.start("sglang")
    gw = gateway([backend_entry("sick", sick, "vllm"), backend_entry("ok", ok, "sglang")])
    c = sdk(gw)
    for _ in range(6):
        raw = c.chat.completions.with_raw_response.create(model="moe", messages=MESSAGES, max_tokens=2)
        assert raw.headers["x-gateway-backend"] == "ok"
        assert raw.parse().choices[0].message.content
    assert gw.metric("gateway_retries_total", backend="sick") >= 1
    assert sick.stats.requests_received >= 1


def test_refused_connection_is_retried_on_another(emulators: Emulators, gateway: StartGateway) -> None:
    dead, ok = emulators.start("vllm"), emulators.start("vllm")
    gw = gateway([backend_entry("dead", dead, "vllm"), backend_entry("ok", ok, "vllm")],
                 health={"interval_s": 60.0})  # no probe will notice: only the retry can save us
    emulators.stop(dead)
    c = sdk(gw)
    for _ in range(4):
        assert c.chat.completions.create(model="moe", messages=MESSAGES, max_tokens=2).choices
    assert gw.metric("gateway_retries_total", backend="dead") >= 1


def test_all_backends_down_is_a_quick_503_with_retry_after(emulators: Emulators, gateway: StartGateway) -> None:
    a, b = emulators.start("vllm"), emulators.start("sglang")
    gw = gateway([backend_entry("a", a, "vllm"), backend_entry("b", b, "sglang")])
    emulators.stop(a)
    emulators.stop(b)
    started = time.monotonic()
    resp = gw.post("/v1/chat/completions", json={"model": "moe", "messages": MESSAGES})
    assert resp.status_code == 503
    assert resp.headers["retry-after"]
    assert resp.json()["error"]["message"]
    assert time.monotonic() - started < 5
    eventually(lambda: gw.get("/ready").status_code == 503)


def test_failing_backend_is_ejected_then_readmitted(emulators: Emulators, gateway: StartGateway) -> None:
    flaky = emulators.start("vllm", fail_first=2, fail_status=500)
    ok = emulators.start("vllm")
    gw = gateway([backend_entry("flaky", flaky, "vllm"), backend_entry("ok", ok, "vllm")])
    c = sdk(gw)
    statuses = []
    for _ in range(4):  # round robin: the flaky backend's two 500s eject it (threshold 2)
        try:
            c.chat.completions.create(model="moe", messages=MESSAGES, max_tokens=1)
            statuses.append(200)
        except openai.InternalServerError as exc:
            statuses.append(exc.status_code)
    assert statuses.count(500) == 2

    def flaky_state() -> dict[str, object]:
        return next(b for b in gw.get("/admin/backends").json()["backends"] if b["name"] == "flaky")

    assert gw.metric("gateway_backend_ejections_total", backend="flaky") == 1
    # the emulator is healthy again, so after the cool-down a probe re-admits it
    eventually(lambda: flaky_state()["healthy"] is True)
    seen = {c.chat.completions.with_raw_response.create(model="moe", messages=MESSAGES, max_tokens=1)
            .headers["x-gateway-backend"] for _ in range(4)}
    assert seen == {"flaky", "ok"}


def test_a_backend_hanging_before_its_first_token_times_out_and_is_not_retried(
    emulators: Emulators, gateway: StartGateway
) -> None:
    """No first byte in time is not proof of no work (the engine may be generating): 504, and the
    request is never run a second time elsewhere."""
    hung = emulators.start("vllm", hang=True)
    ok = emulators.start("vllm")
    gw = gateway([backend_entry("hung", hung, "vllm"), backend_entry("ok", ok, "vllm")],
                 timeouts={"first_token_s": 0.5, "total_s": 1.5})
    answers = []
    for stream in (False, True, False, True):
        resp = gw.post("/v1/chat/completions", json={"model": "moe", "messages": MESSAGES, "max_tokens": 2,
                                                      "stream": stream})
        answers.append(resp.status_code)
        if resp.status_code == 504:
            assert resp.json()["error"]["code"] == "upstream_timeout"
    assert sorted(answers) == [200, 200, 504, 504]  # round robin: every other request meets the hang
    assert ok.stats.requests_received == 2  # only its own: nothing was retried onto it
    assert gw.metric("gateway_retries_total", backend="hung") == 0
    assert gw.metric("gateway_requests_total", backend="hung", status="504") == 2


def test_backend_dying_mid_stream_ends_the_stream_with_an_error_event(
    emulators: Emulators, gateway: StartGateway
) -> None:
    dying = emulators.start("vllm", die_after_tokens=3)
    gw = gateway([backend_entry("dying", dying, "vllm")])
    received: list[object] = []
    stream = sdk(gw).chat.completions.create(model="moe", messages=MESSAGES, max_tokens=50, stream=True)
    with pytest.raises(openai.APIError) as info:
        received.extend(stream)
    assert received, "the tokens before the failure were relayed"
    assert "mid-stream" in info.value.message
    assert gw.metric("gateway_requests_total", backend="dying", status="stream_error") == 1


def test_client_disconnect_aborts_the_upstream_request(emulators: Emulators, gateway: StartGateway) -> None:
    slow = emulators.start("vllm", speed=1.0, profile="deepseek-v3-8xh200")
    gw = gateway([backend_entry("slow", slow, "vllm")])
    body = {"model": "moe", "messages": MESSAGES, "max_tokens": 2000, "stream": True}
    with httpx.stream("POST", gw.base_url + "/chat/completions", json=body, timeout=30) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                break  # got the first token: hang up
    started = time.monotonic()
    eventually(lambda: slow.stats.aborted >= 1, timeout=5)
    assert time.monotonic() - started < 1.5
    eventually(lambda: gw.metric("gateway_requests_total", backend="slow", status="client_closed") == 1)
