"""Routing intelligence end to end: prefix affinity, hints, SLA headers, sticky A/B arms, shadows."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import openai
import pytest

from .harness import Emulators, GatewayProcess, backend_entry, eventually

StartGateway = Callable[..., GatewayProcess]
SYSTEM = "You are a meticulous assistant for a large online bookshop. " * 40  # ~600 tokens shared



def fleet(emulators: Emulators, n: int = 3, runtime: str = "vllm") -> list[dict[str, object]]:
    return [backend_entry(f"b{i}", emulators.start(runtime), runtime) for i in range(n)]


def ask(c: openai.OpenAI, text: str, **kw: object) -> openai.APIResponse[openai.types.chat.ChatCompletion]:
    return c.chat.completions.with_raw_response.create(  # type: ignore[call-overload,no-any-return]
        model="moe", messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}],
        max_tokens=2, **kw,
    )


def test_shared_prefix_sticks_to_one_backend_and_hits_its_cache(emulators: Emulators, gateway: StartGateway) -> None:
    gw = gateway(fleet(emulators), routes=[{"model": "moe", "backends": ["b0", "b1", "b2"],
                                            "policy": "prefix_affinity"}])
    c = gw.client()
    first = ask(c, "question 0")
    rest = [ask(c, f"question {i}") for i in range(1, 8)]
    assert {r.headers["x-gateway-backend"] for r in rest} == {first.headers["x-gateway-backend"]}
    assert first.headers["x-gateway-route-reason"] == "hash"
    assert all(r.headers["x-gateway-route-reason"] == "affinity" for r in rest)
    cached = [r.parse().usage.prompt_tokens_details.cached_tokens for r in rest]  # type: ignore[union-attr]
    assert min(c or 0 for c in cached) > 0, cached
    assert gw.metric("gateway_routing_decisions_total", policy="prefix_affinity", reason="affinity") == 7


def test_prefix_key_and_session_hints_override_inference(emulators: Emulators, gateway: StartGateway) -> None:
    gw = gateway(fleet(emulators, 4), routes=[{"model": "moe", "backends": ["b0", "b1", "b2", "b3"],
                                               "policy": "prefix_affinity"}])
    c = gw.client()
    by_key = {
        key: {c.chat.completions.with_raw_response.create(
            model="moe", messages=[{"role": "user", "content": f"unrelated text {i}"}], max_tokens=1,
            extra_headers={"x-prefix-key": key}).headers["x-gateway-backend"] for i in range(4)}
        for key in ("tenant-a", "tenant-b", "tenant-c")
    }
    assert all(len(backends) == 1 for backends in by_key.values()), by_key


def test_bad_sla_header_is_a_400(emulators: Emulators, gateway: StartGateway) -> None:
    gw = gateway(fleet(emulators, 1))
    with pytest.raises(openai.BadRequestError) as info:
        ask(gw.client(), "x", extra_headers={"x-sla-ttft-ms": "soon"})
    assert info.value.body is not None


def test_unreachable_sla_is_served_best_effort_or_refused_when_strict(
    emulators: Emulators, gateway: StartGateway
) -> None:
    slow = emulators.start("vllm", speed=1.0, profile="deepseek-v3-8xh200")
    gw = gateway([backend_entry("slow", slow, "vllm")], routes=[{"model": "moe", "backends": ["slow"],
                                                                 "policy": "sla"}])
    c = gw.client()
    for _ in range(3):  # teach the gateway how slow it is (streaming: TTFT is measured)
        list(c.chat.completions.create(model="moe", messages=[{"role": "user", "content": "warm " * 300}],
                                       max_tokens=2, stream=True))
    best_effort = ask(c, "y", extra_headers={"x-sla-ttft-ms": "0.01"})
    assert best_effort.headers["x-gateway-route-reason"] == "sla_miss"
    with pytest.raises(openai.RateLimitError) as info:
        ask(c, "z", extra_headers={"x-sla-ttft-ms": "0.01", "x-sla-strict": "true"})
    assert int(info.value.response.headers["retry-after"]) >= 1
    assert gw.metric("gateway_sla_requests_total", backend="slow", outcome="missed") >= 1
    relaxed = ask(c, "w", extra_headers={"x-sla-ttft-ms": "60000"})
    assert relaxed.headers["x-gateway-route-reason"] == "sla"
    eventually(lambda: gw.metric("gateway_sla_requests_total", backend="slow", outcome="met") >= 1)


def split_route(fraction: float | None = None) -> list[dict[str, object]]:
    split: dict[str, object] = {"arms": [{"name": "vllm", "weight": 70, "backends": ["v"]},
                                         {"name": "sglang", "weight": 30, "backends": ["s"]}]}
    if fraction is not None:
        split["shadow"] = {"arm": "sglang", "fraction": fraction}
    return [{"model": "moe", "policy": "least_load", "split": split}]


def test_sessions_stick_to_their_arm_and_shares_follow_the_weights(
    emulators: Emulators, gateway: StartGateway
) -> None:
    gw = gateway([backend_entry("v", emulators.start("vllm"), "vllm"),
                  backend_entry("s", emulators.start("sglang"), "sglang")], routes=split_route())
    c = gw.client()
    arms: dict[str, set[str]] = {}
    for session in range(60):
        for _ in range(2):
            r = ask(c, "hi", extra_headers={"x-session-id": f"s{session}"})
            arms.setdefault(f"s{session}", set()).add(r.headers["x-gateway-arm"])
            assert r.headers["x-gateway-backend"] == {"vllm": "v", "sglang": "s"}[r.headers["x-gateway-arm"]]
    assert all(len(a) == 1 for a in arms.values()), "a session changed arm"
    shares = Counter(next(iter(a)) for a in arms.values())
    assert 25 <= shares["vllm"] <= 55, shares  # 70% of 60 = 42 +- 3 standard errors (~10.6)
    assert gw.metric("gateway_arm_requests_total", arm="vllm") == 2 * shares["vllm"]


def test_weights_change_at_run_time_without_a_restart(emulators: Emulators, gateway: StartGateway) -> None:
    gw = gateway([backend_entry("v", emulators.start("vllm"), "vllm"),
                  backend_entry("s", emulators.start("sglang"), "sglang")], routes=split_route())
    resp = gw.post("/admin/routes/moe/weights", json={"weights": {"vllm": 0, "sglang": 1}})
    assert resp.status_code == 200, resp.text
    assert resp.json()["weights"] == {"vllm": 0.0, "sglang": 1.0}
    c = gw.client()
    assert {ask(c, "x", extra_headers={"x-session-id": f"s{i}"}).headers["x-gateway-arm"]
            for i in range(10)} == {"sglang"}
    assert gw.post("/admin/routes/moe/weights", json={"weights": {"nope": 1}}).status_code == 400
    assert gw.post("/admin/routes/other/weights", json={"weights": {"vllm": 1}}).status_code == 404


def test_an_arm_without_healthy_backends_fails_over(emulators: Emulators, gateway: StartGateway) -> None:
    v, s = emulators.start("vllm"), emulators.start("sglang")
    gw = gateway([backend_entry("v", v, "vllm"), backend_entry("s", s, "sglang")], routes=split_route())
    emulators.stop(v)
    eventually(lambda: not next(b for b in gw.get("/admin/backends").json()["backends"] if b["name"] == "v")["healthy"])
    c = gw.client()
    assert {ask(c, "x", extra_headers={"x-session-id": f"s{i}"}).headers["x-gateway-arm"]
            for i in range(12)} == {"sglang"}
    assert gw.metric("gateway_arm_failovers_total", arm="vllm") >= 1


def test_shadow_traffic_is_mirrored_and_never_seen(emulators: Emulators, gateway: StartGateway) -> None:
    v, s = emulators.start("vllm"), emulators.start("sglang")
    gw = gateway([backend_entry("v", v, "vllm"), backend_entry("s", s, "sglang")],
                 routes=[{"model": "moe", "split": {"arms": [{"name": "vllm", "weight": 1, "backends": ["v"]},
                                                             {"name": "sglang", "weight": 0, "backends": ["s"]}],
                                                    "shadow": {"arm": "sglang", "fraction": 1.0}}}])
    c = gw.client()
    for i in range(5):
        assert ask(c, f"q{i}").headers["x-gateway-backend"] == "v"
    for i in range(3):  # a stream's shadow is sent the whole request, though the stream lets its body go
        list(c.chat.completions.create(model="moe", messages=[{"role": "user", "content": f"s{i}"}], max_tokens=2,
                                       stream=True))
    eventually(lambda: gw.metric("gateway_shadow_requests_total", arm="sglang", status="200") == 8)
    assert s.stats.requests_received >= 8
    assert gw.metric("gateway_requests_total", backend="s") == 0


def test_every_request_leaves_the_routing_backlog_as_it_found_it(emulators: Emulators, gateway: StartGateway) -> None:
    """Sent prefill is counted as backlog until the first token; failed, refused, cancelled and
    translated-away requests must not leave any behind (they would skew every SLA prediction)."""
    gw = gateway([backend_entry("v", emulators.start("vllm", fail_first=3, fail_status=400), "vllm"),
                  backend_entry("t", emulators.start("triton"), "triton")],
                 routes=[{"model": "moe", "backends": ["v"], "policy": "sla"},
                         {"model": "tri", "backends": ["t"], "policy": "sla"}])
    c = gw.client()
    for _ in range(3):  # the backend's own 400s
        with pytest.raises(openai.BadRequestError):
            ask(c, "x")
    with pytest.raises(openai.BadRequestError):  # Triton cannot express tools: refused before sending
        c.chat.completions.create(model="tri", messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                  tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
    ask(c, "ok")
    list(c.chat.completions.create(model="moe", messages=[{"role": "user", "content": SYSTEM}], max_tokens=2,
                                   stream=True))
    routing = {b["name"]: b["routing"] for b in gw.get("/admin/backends").json()["backends"]}
    assert routing["v"]["backlog_tokens"] == 0.0
    assert routing["t"]["backlog_tokens"] == 0.0
    assert routing["v"]["cached_prefix_blocks"] > 0
    assert routing["v"]["prefill_tokens_per_s"] is not None  # learned from the stream's first token
