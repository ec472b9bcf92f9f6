"""The whole OpenAI surface through the gateway (issue 16), with the official SDK over real sockets in
front of the emulators: Responses on every runtime (natively, and translated to chat on Triton),
embeddings, tokenize, capability-aware routing and its 400, A/B honesty, stored responses routed
back to their backend, /v1/models and OpenAI's rate-limit headers."""

from __future__ import annotations

import base64
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from jsonschema_rs import validate

from gateway.access.secrets import hash_key

from .harness import Emulators, GatewayProcess, backend_entry, eventually, wait_for

StartGateway = Callable[..., GatewayProcess]
RUNTIMES = ["vllm", "sglang", "trtllm", "triton"]
PARAMS: dict[str, Any] = {"type": "object", "required": ["city", "unit"], "additionalProperties": False,
                          "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                         "unit": {"type": "string", "enum": ["c", "f"]}}}
TOOLS: list[Any] = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                                      "parameters": PARAMS, "strict": True}}]
WEATHER: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]


def one(emulators: Emulators, gateway: StartGateway, runtime: str) -> GatewayProcess:
    return gateway([backend_entry(f"{runtime}-a", emulators.start(runtime), runtime)])


def tokens(gw: GatewayProcess, backend: str, kind: str) -> float:
    return gw.metric("gateway_tokens_total", backend=backend, kind=kind)


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_responses_on_every_runtime(emulators: Emulators, gateway: StartGateway, runtime: str) -> None:
    gw = one(emulators, gateway, runtime)
    raw = gw.client().responses.with_raw_response.create(
        model="moe", input="Tell me about the sea.", instructions="Be brief.", max_output_tokens=8)
    resp = raw.parse()
    assert raw.headers["x-gateway-backend"] == f"{runtime}-a"
    assert raw.headers["x-gateway-runtime"] == runtime
    assert resp.object == "response"
    assert resp.model == "moe"
    assert resp.output_text
    assert resp.status == "incomplete"  # cut by max_output_tokens
    assert resp.usage is not None
    assert resp.usage.output_tokens == (6 if runtime == "sglang" else 8)  # SGLang keeps 2 tokens of headroom
    assert tokens(gw, f"{runtime}-a", "prompt") == resp.usage.input_tokens
    assert tokens(gw, f"{runtime}-a", "completion") == resp.usage.output_tokens
    assert gw.metric("gateway_endpoint_requests_total", endpoint="responses", status="200") == 1


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_streamed_responses_on_every_runtime(emulators: Emulators, gateway: StartGateway, runtime: str) -> None:
    gw = one(emulators, gateway, runtime)
    events = list(gw.client().responses.create(model="moe", input="Tell me about the sea.", max_output_tokens=6,
                                               stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert deltas
    final = events[-1]
    assert final.type in ("response.completed", "response.incomplete")  # SGLang: incomplete when cut
    assert final.response.model == "moe"
    assert final.response.output_text == "".join(deltas)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    usage = final.response.usage
    assert usage is not None
    backend = f"{runtime}-a"
    assert tokens(gw, backend, "completion") == usage.output_tokens == len(deltas)
    assert tokens(gw, backend, "prompt") == usage.input_tokens
    # the time to first token was taken at the first output delta
    assert gw.metric("gateway_time_to_first_token_seconds_count", backend=backend) == 1
    assert gw.metric("gateway_inter_token_latency_seconds_count", backend=backend) == len(deltas) - 1


@pytest.mark.parametrize("runtime", ["vllm", "triton"])
def test_the_sdk_stream_helper_and_tools_in_responses(emulators: Emulators, gateway: StartGateway,
                                                      runtime: str) -> None:
    gw = one(emulators, gateway, runtime)
    with gw.client().responses.stream(model="moe", input="Tell me about the sea.", max_output_tokens=5) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert final.output_text == text
    assert final.usage is not None
    assert final.usage.output_tokens == 5
    if runtime == "triton":  # no tools there: the gateway refuses before asking it
        with pytest.raises(openai.BadRequestError) as info:
            gw.client().responses.create(model="moe", input="x", tools=[{"type": "function", "name": "f",
                                                                            "parameters": {}, "strict": False}])
        assert info.value.body["param"] == "tools"  # type: ignore[index]
        return
    resp = gw.client().responses.create(
        model="moe", input="What is the weather in Paris?", max_output_tokens=200, tool_choice="required",
        parallel_tool_calls=False,
        tools=[{"type": "function", "name": "get_weather", "parameters": PARAMS, "strict": True}])
    [call] = [o for o in resp.output if o.type == "function_call"]
    assert call.name == "get_weather"
    validate(PARAMS, __import__("json").loads(call.arguments))


def test_a_responses_request_is_retried_before_its_first_byte(emulators: Emulators, gateway: StartGateway) -> None:
    sick = emulators.start("vllm", fail_first=1, fail_status=503)
    gw = gateway([backend_entry("sick", sick, "vllm"), backend_entry("ok", emulators.start("sglang"), "sglang")])
    for _ in range(2):  # round robin: one of them starts on the sick backend
        events = list(gw.client().responses.create(model="moe", input="hi", max_output_tokens=4, stream=True))
        assert events[-1].type in ("response.completed", "response.incomplete")
    assert gw.metric("gateway_retries_total", backend="sick") == 1


@pytest.fixture
def demo(tmp_path: Path) -> Iterator[GatewayProcess]:
    gw = GatewayProcess(None, tmp_path)  # `gateway serve` without a config: the embedded demo fleet
    yield gw
    gw.stop()


def test_the_demo_fleet_serves_the_whole_surface_and_tools_never_reach_triton(demo: GatewayProcess) -> None:
    c = demo.client()
    eventually(lambda: demo.get("/ready").status_code == 200)
    for i in range(8):
        raw = c.chat.completions.with_raw_response.create(
            model="deepseek-v3", messages=WEATHER, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
            max_tokens=100, stream=False, user=f"u{i}")
        reply = raw.parse()
        assert raw.headers["x-gateway-runtime"] != "triton"
        calls = reply.choices[0].message.tool_calls
        assert calls is not None
        assert calls[0].function.name == "get_weather"  # type: ignore[union-attr]
        validate(PARAMS, __import__("json").loads(calls[0].function.arguments))  # type: ignore[union-attr]
    structured = c.chat.completions.create(
        model="deepseek-v3", messages=WEATHER, max_tokens=100,
        response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": PARAMS, "strict": True}})
    validate(PARAMS, __import__("json").loads(structured.choices[0].message.content or ""))
    assert demo.metric("gateway_requests_total", backend="triton-a") == 0
    assert demo.metric("gateway_retries_total") == 0
    resp = c.responses.create(model="deepseek-v3", input="Hello", max_output_tokens=4)
    assert resp.output_text
    emb = c.embeddings.create(model="bge-m3", input=["Hello", "Hello", "world"])
    assert [len(d.embedding) for d in emb.data] == [1024, 1024, 1024]
    assert emb.data[0].embedding == emb.data[1].embedding
    assert demo.metric("gateway_tokens_total", backend="embed-a", kind="prompt") == emb.usage.prompt_tokens
    tokenized = demo.post("/tokenize", json={"model": "deepseek-v3", "prompt": "Hello world"}).json()
    assert tokenized["count"] == len(tokenized["tokens"]) > 0
    models = {m.id: m for m in c.models.list()}
    assert set(models) == {"deepseek-v3", "bge-m3", "deepseek-v3-pd"}
    # the demo's P/D pair: a long prompt is split (prefill vllm-p0, decode vllm-d0), a short one is not
    long = c.chat.completions.create(model="deepseek-v3-pd", messages=[{"role": "user", "content": "hi " * 800}],
                                     max_tokens=4)
    assert long.choices[0].message.content
    assert c.chat.completions.create(model="deepseek-v3-pd", messages=WEATHER, max_tokens=4).choices[0].message.content
    assert demo.metric("gateway_pd_requests_total", prefill="vllm-p0", decode="vllm-d0", outcome="ok") == 1
    assert demo.metric("gateway_pd_decisions_total", decision="whole", reason="cached") == 1


def test_no_capable_backend_is_a_400_that_blames_no_backend(emulators: Emulators, gateway: StartGateway) -> None:
    gw = one(emulators, gateway, "triton")
    c = gw.client()
    for _ in range(4):  # more than health.failure_threshold: no ejection may follow
        with pytest.raises(openai.BadRequestError) as info:
            c.chat.completions.create(model="moe", messages=WEATHER, tools=TOOLS)
        err = info.value.body
        assert isinstance(err, dict)
        assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", "tools", "unsupported_parameter")
        assert "triton-a (triton) lacks tools" in err["message"]
    with pytest.raises(openai.BadRequestError) as info:
        c.embeddings.create(model="moe", input="x")
    assert info.value.body["param"] == "model"  # type: ignore[index]
    assert gw.metric("gateway_requests_total", backend="none", status="400") == 5
    assert gw.metric("gateway_requests_total", backend="triton-a") == 0
    assert gw.metric("gateway_backend_ejections_total") == 0
    assert gw.metric("gateway_backend_up", backend="triton-a") == 1
    assert c.chat.completions.create(model="moe", messages=WEATHER, max_tokens=3).choices[0].message.content


def test_a_request_only_one_arm_can_serve_is_not_an_ab_sample(emulators: Emulators, gateway: StartGateway) -> None:
    vllm, triton = emulators.start("vllm"), emulators.start("triton")
    backends = [backend_entry("v", vllm, "vllm"), backend_entry("t", triton, "triton")]
    split = {"arms": [{"name": "vllm", "weight": 50, "backends": ["v"]},
                      {"name": "triton", "weight": 50, "backends": ["t"]}]}
    gw = gateway(backends, [{"model": "moe", "split": split, "policy": "round_robin"}])
    c = gw.client()
    for i in range(6):
        raw = c.chat.completions.with_raw_response.create(model="moe", messages=WEATHER, tools=TOOLS,
                                                          tool_choice="required", max_tokens=100, user=f"u{i}")
        assert raw.headers["x-gateway-backend"] == "v"
    assert gw.metric("gateway_requests_total", backend="t") == 0
    for i in range(4):
        c.chat.completions.create(model="moe", messages=WEATHER, max_tokens=3, user=f"p{i}")
    assert gw.metric("gateway_ab_excluded_requests_total", model="moe", reason="capability") == 6
    assert gw.metric("gateway_arm_requests_total") == 4  # only the plain requests were assigned as samples
    assert gw.metric("gateway_arm_responses_total") == 4
    def arm_requests() -> int:  # the comparison counts completed seconds only: wait for this one to end
        return sum(a["requests"] for a in gw.get("/admin/compare?window=60").json()["arms"])

    assert wait_for(arm_requests, lambda n: n >= 4, what="the arms' figures") == 4


def test_previous_response_id_goes_back_to_the_backend_that_stored_it(emulators: Emulators,
                                                                      gateway: StartGateway) -> None:
    # distinct seeds: emulators draw their ids from seeded generators, and equal ids would be one key
    backends = [backend_entry(rt, emulators.start(rt, seed=i), rt) for i, rt in enumerate(("vllm", "sglang", "trtllm"))]
    gw = gateway(backends)
    c = gw.client()
    owners = {}
    for _ in range(6):
        raw = c.responses.with_raw_response.create(model="moe", input="Remember the sea.", max_output_tokens=4)
        owners[raw.parse().id] = raw.headers["x-gateway-backend"]
    stored = {rid: b for rid, b in owners.items() if b != "vllm"}  # vLLM keeps no responses by default
    assert len(stored) == 4
    for rid, backend in stored.items():
        for _ in range(2):
            raw = c.responses.with_raw_response.create(model="moe", input="And then?", previous_response_id=rid,
                                                       max_output_tokens=4)
            assert raw.headers["x-gateway-backend"] == backend
            assert raw.parse().status in ("completed", "incomplete")


def test_embeddings_route_and_its_own_comparison_rows(emulators: Emulators, gateway: StartGateway) -> None:
    gen = emulators.start("vllm")
    embedders = {rt: emulators.start(rt, embedding_dim=32) for rt in ("vllm", "sglang", "trtllm")}
    backends = [backend_entry("gen", gen, "vllm")] + [
        {**backend_entry(f"emb-{rt}", emu, rt), "usd_per_hour": 1.0} for rt, emu in embedders.items()]
    gw = gateway(backends, [{"model": "moe", "backends": ["gen"]},
                            {"model": "emb", "kind": "embeddings", "backends": [f"emb-{rt}" for rt in embedders],
                             "policy": "round_robin"}])
    c = gw.client()
    prompt = 0
    for _ in range(3):
        raw = c.embeddings.with_raw_response.create(model="emb", input=["The sea", "is blue"])
        emb = raw.parse()
        assert [len(d.embedding) for d in emb.data] == [32, 32]
        assert emb.model == "emb"
        prompt += emb.usage.prompt_tokens
    as_b64 = c.embeddings.create(model="emb", input="The sea", encoding_format="base64")
    assert len(base64.b64decode(str(as_b64.data[0].embedding))) == 32 * 4  # little-endian float32s
    prompt += as_b64.usage.prompt_tokens
    assert sum(tokens(gw, f"emb-{rt}", "prompt") for rt in embedders) == prompt
    assert gw.metric("gateway_tokens_total", kind="completion") == 0
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model="emb", messages=WEATHER)
    doc = wait_for(lambda: gw.get("/admin/compare?window=60").json(),
                   lambda d: sum(r["requests"] for r in d["runtimes"]) >= 4, what="the comparison")
    rows = {r["name"]: r for r in doc["runtimes"]}
    assert rows["vllm"]["backends"] == ["gen"]
    assert rows["vllm"]["requests"] == 0
    assert sum(rows[f"{rt}/embeddings"]["requests"] for rt in embedders) == 4
    assert sum(rows[f"{rt}/embeddings"]["prompt_tokens"] for rt in embedders) == prompt
    assert doc["total"]["prompt_tokens"] == 0  # the whole gateway's figures are generation's (the 400 counts there)


def test_tokenize_and_detokenize_go_only_where_they_are_served(emulators: Emulators, gateway: StartGateway) -> None:
    backends = [backend_entry(rt, emulators.start(rt), rt) for rt in RUNTIMES]
    gw = gateway(backends)
    served = set()
    for _ in range(6):
        r = gw.post("/tokenize", json={"model": "moe", "prompt": "Hello world"})
        assert r.status_code == 200
        body = r.json()
        assert body["count"] == len(body["tokens"]) > 0
        assert "model" not in body
        served.add(r.headers["x-gateway-backend"])
        back = gw.post("/detokenize", json={"model": "moe", "tokens": body["tokens"]})
        assert back.status_code == 200
        served.add(back.headers["x-gateway-backend"])
    assert served == {"vllm", "sglang"}
    chat = gw.post("/tokenize", json={"model": "moe", "messages": WEATHER})
    assert chat.status_code == 200
    assert gw.metric("gateway_endpoint_requests_total", endpoint="tokenize", status="200") == 7
    assert gw.metric("gateway_tokens_total") == 0  # tokenize is not charged
    bad = gw.post("/detokenize", json={"model": "moe", "tokens": "abc"})
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "tokens"


def test_models_report_the_smallest_context_of_healthy_backends(emulators: Emulators, gateway: StartGateway) -> None:
    vllm, triton = emulators.start("vllm"), emulators.start("triton")
    gw = gateway([backend_entry("v", vllm, "vllm"), backend_entry("t", triton, "triton", max_model_len=1024)])
    c = gw.client()
    [model] = c.models.list().data
    assert (model.id, model.owned_by) == ("moe", "gateway")
    assert model.created > 1_700_000_000
    assert model.max_model_len == 1024  # type: ignore[attr-defined]  # Triton's, configured
    assert c.models.retrieve("moe").id == "moe"
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("nope")
    emulators.stop(triton)
    eventually(lambda: gw.get("/v1/models").json()["data"][0]["max_model_len"] == 2048)  # vLLM's own card


def test_keys_with_limits_get_openai_rate_limit_headers(emulators: Emulators, gateway: StartGateway) -> None:
    emu = emulators.start("vllm")
    keys = [{"id": "lim", "key": hash_key("sk-lim"), "requests_per_minute": 2, "tokens_per_minute": 100000},
            {"id": "free", "key": hash_key("sk-free")}]
    gw = gateway([backend_entry("v", emu, "vllm")], auth={"api_keys": keys})
    c = openai.OpenAI(base_url=gw.base_url, api_key="sk-lim", max_retries=0)
    raw = c.responses.with_raw_response.create(model="moe", input="hi", max_output_tokens=3)
    h = raw.headers
    assert (h["x-ratelimit-limit-requests"], h["x-ratelimit-remaining-requests"]) == ("2", "1")
    assert h["x-ratelimit-limit-tokens"] == "100000"
    assert int(h["x-ratelimit-remaining-tokens"]) == 100000  # charged after the response
    assert h["x-ratelimit-reset-requests"].endswith("s")
    listed = httpx.get(gw.base_url + "/models", headers={"Authorization": "Bearer sk-lim"})
    assert listed.headers["x-ratelimit-remaining-requests"] == "0"
    with pytest.raises(openai.RateLimitError) as info:
        c.chat.completions.create(model="moe", messages=WEATHER, max_tokens=2)
    headers = info.value.response.headers
    assert 0 < int(headers["retry-after-ms"]) <= 30_000
    assert int(headers["Retry-After"]) * 1000 >= int(headers["retry-after-ms"])
    assert headers["x-ratelimit-remaining-requests"] == "0"
    c.close()
    free = openai.OpenAI(base_url=gw.base_url, api_key="sk-free", max_retries=0)
    raw_free = free.chat.completions.with_raw_response.create(model="moe", messages=WEATHER, max_tokens=2)
    assert not any(k.startswith("x-ratelimit") for k in raw_free.headers)
    free.close()
