"""A real Envoy in front of emulated engines, with the gateway (its own process) as Envoy's Endpoint
Picker, driven with the OpenAI SDK through Envoy: the bytes go through Envoy, the gateway chooses
and records. One gateway and one Envoy serve the whole module (each test reads deltas of counters,
or uses its own route)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from backends.emulator import RunningEmulator
from tests.integration.harness import Emulators, GatewayProcess, LoopThread, eventually

from .envoy import SUBSET_HEADER, EnvoyProcess, config

KEY, SLOW_KEY = "sk-team", "sk-slow"
HI: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello through envoy"}]


def digest(key: str) -> str:
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


def addr(emu: RunningEmulator) -> str:
    return emu.url.removeprefix("http://")


@dataclass
class Stack:
    gateway: GatewayProcess
    envoy: EnvoyProcess
    emus: dict[str, RunningEmulator]

    def client(self, key: str = KEY) -> openai.OpenAI:
        return self.envoy.client(key)

    def metric(self, name: str, **labels: str) -> float:
        return self.gateway.metric(name, **labels)


@pytest.fixture(scope="module")
def stack(loop_thread: LoopThread, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    emulators = Emulators(loop_thread)
    emus = {
        "a": emulators.start("vllm", model="moe"), "b": emulators.start("sglang", model="moe"),
        "bad": emulators.start("vllm", model="flaky", fail_first=10_000, fail_status=500),
        "good": emulators.start("vllm", model="flaky"),
    }
    backends: list[dict[str, Any]] = [
        {"name": "a", "runtime": "vllm", "url": emus["a"].url, "model": "moe"},
        {"name": "b", "runtime": "sglang", "url": emus["b"].url, "model": "moe"},
        {"name": "bad", "runtime": "vllm", "url": emus["bad"].url, "model": "flaky"},
        {"name": "good", "runtime": "vllm", "url": emus["good"].url, "model": "flaky"},
        {"name": "gone", "runtime": "vllm", "url": "http://127.0.0.1:9", "model": "down"},  # nothing listens
    ]
    gw_config = {
        "backends": backends,
        "routes": [
            {"model": "moe", "backends": ["a", "b"], "policy": "prefix_affinity"},
            {"model": "flaky", "backends": ["bad", "good"], "policy": "round_robin"},
            {"model": "down", "backends": ["gone"]},
        ],
        "health": {"interval_s": 0.2, "failure_threshold": 2, "cooldown_s": 30, "max_ejected_share": 0.5},
        "auth": {"api_keys": [{"id": "team", "key": digest(KEY), "requests_per_minute": 100_000},
                              {"id": "slow", "key": digest(SLOW_KEY), "requests_per_minute": 1}]},
        "endpoint_picker": {"listen": {"host": "127.0.0.1", "port": 0}},
    }
    workdir = tmp_path_factory.mktemp("envoy-stack")
    (workdir / "gw").mkdir()
    gateway = GatewayProcess(gw_config, workdir / "gw")
    try:
        assert gateway.picker_port is not None
        envoy = EnvoyProcess(config(gateway.picker_port, [addr(emus["a"]), addr(emus["b"])]), workdir / "envoy")
        try:
            yield Stack(gateway, envoy, emus)
        finally:
            envoy.stop()
    finally:
        gateway.stop()
        emulators.stop_all()


def test_a_chat_goes_through_envoy_to_the_backend_the_gateway_chose(stack: Stack) -> None:
    raw = stack.client().chat.completions.with_raw_response.create(model="moe", messages=HI, max_tokens=4)
    reply = raw.parse()
    assert reply.choices[0].message.content
    assert raw.headers["x-gateway-backend"] in {"a", "b"}
    assert raw.headers["server"] == "envoy"  # the bytes came through Envoy
    assert raw.headers["x-request-id"]


def test_prefix_affinity_holds_through_envoy(stack: Stack) -> None:
    client = stack.client()
    for n in range(3):
        messages: list[ChatCompletionMessageParam] = [
            {"role": "system", "content": f"You are assistant number {n}. " * 40}, {"role": "user", "content": "go"}]
        served = {client.chat.completions.with_raw_response.create(model="moe", messages=messages, max_tokens=2)
                  .headers["x-gateway-backend"] for _ in range(4)}
        assert len(served) == 1, served


def test_streams_and_answers_are_accounted_as_clients_received_them(stack: Stack) -> None:
    client = stack.client()
    before = {k: stack.metric("gateway_tokens_total", model="moe", kind=k) for k in ("prompt", "completion")}
    requests_before = stack.metric("gateway_requests_total", model="moe", status="200")
    key_before = stack.metric("gateway_key_tokens_total", key="team")
    prompt = completion = 0
    for n in range(3):
        reply = client.chat.completions.create(model="moe", messages=[{"role": "user", "content": f"q{n}"}],
                                               max_tokens=6)
        assert reply.usage is not None
        prompt += reply.usage.prompt_tokens
        completion += reply.usage.completion_tokens
        text = ""
        for chunk in client.chat.completions.create(model="moe", messages=[{"role": "user", "content": f"s{n}"}],
                                                    max_tokens=6, stream=True,
                                                    stream_options={"include_usage": True}):
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            if chunk.usage is not None:
                prompt += chunk.usage.prompt_tokens
                completion += chunk.usage.completion_tokens
        assert text
    eventually(lambda: stack.metric("gateway_requests_total", model="moe", status="200") == requests_before + 6)
    assert stack.metric("gateway_tokens_total", model="moe", kind="prompt") - before["prompt"] == prompt
    assert stack.metric("gateway_tokens_total", model="moe", kind="completion") - before["completion"] == completion
    assert stack.metric("gateway_key_tokens_total", key="team") - key_before == prompt + completion
    assert stack.metric("gateway_time_to_first_token_seconds_count", model="moe") >= 3
    # the live comparison counts them too (completed seconds only: wait for the last one to pass)
    eventually(lambda: sum(b["requests"] for b in stack.gateway.get(
        "/admin/compare", params={"window": 3600}).json()["backends"] if b["name"] in {"a", "b"})
        == stack.metric("gateway_requests_total", model="moe"))


def test_a_subset_hint_keeps_the_choice_inside_it(stack: Stack) -> None:
    only_b = addr(stack.emus["b"])
    client = stack.client()
    for n in range(4):
        raw = client.chat.completions.with_raw_response.create(
            model="moe", messages=[{"role": "user", "content": f"subset {n}"}], max_tokens=2,
            extra_headers={SUBSET_HEADER: only_b})
        assert raw.headers["x-gateway-backend"] == "b"


def test_a_subset_outside_the_pool_is_a_503_never_fail_open(stack: Stack) -> None:
    with pytest.raises(openai.InternalServerError) as info:
        stack.client().chat.completions.create(model="moe", messages=HI, max_tokens=2,
                                               extra_headers={SUBSET_HEADER: "10.255.0.1:8000"})
    assert info.value.status_code == 503
    assert "subset" in info.value.message


def test_unknown_model_is_an_openai_404(stack: Stack) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        stack.client().chat.completions.create(model="nope", messages=HI, max_tokens=2)
    assert info.value.code == "model_not_found"


def test_a_bad_body_is_an_openai_400(stack: Stack) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        stack.client().chat.completions.create(model="moe", messages=[], max_tokens=2)
    assert info.value.param == "messages"


def test_no_backend_is_an_openai_503(stack: Stack) -> None:
    eventually(lambda: not stack.gateway.get("/admin/backends").json()["backends"][4]["healthy"])
    with pytest.raises(openai.InternalServerError) as info:
        stack.client().chat.completions.create(model="down", messages=HI, max_tokens=2)
    assert info.value.status_code == 503
    assert "No healthy backend for model `down`" in info.value.message
    assert int(info.value.response.headers["retry-after"]) >= 1


def test_a_spent_rate_limit_is_an_openai_429(stack: Stack) -> None:
    client = stack.client(SLOW_KEY)
    client.chat.completions.create(model="moe", messages=HI, max_tokens=2)
    with pytest.raises(openai.RateLimitError) as info:
        client.chat.completions.create(model="moe", messages=HI, max_tokens=2)
    assert info.value.code == "rate_limit_exceeded"
    assert int(info.value.response.headers["retry-after"]) >= 1


def test_a_wrong_key_is_an_openai_401(stack: Stack) -> None:
    with pytest.raises(openai.AuthenticationError):
        stack.client("sk-wrong").chat.completions.create(model="moe", messages=HI, max_tokens=2)


def test_a_failing_backend_is_ejected_by_what_envoy_brought_back(stack: Stack) -> None:
    client = stack.client()
    statuses = []
    for _ in range(6):
        try:
            client.chat.completions.create(model="flaky", messages=HI, max_tokens=2)
            statuses.append(200)
        except openai.InternalServerError as exc:
            statuses.append(exc.status_code)
    assert statuses.count(500) >= 2  # the failing engine's own answers, passed through Envoy
    eventually(lambda: stack.metric("gateway_backend_ejections_total", backend="bad") >= 1)
    served = {client.chat.completions.with_raw_response.create(model="flaky", messages=HI, max_tokens=2)
              .headers["x-gateway-backend"] for _ in range(4)}
    assert served == {"good"}
