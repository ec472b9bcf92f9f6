"""The gateway in front of a real vLLM server (CPU build, tiny random-weight MoE), via the OpenAI SDK.

Generated text is random (random weights), so these tests pin down shapes, names, usage accounting,
headers, prefix caching and error passthrough, never content.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import httpx
import openai
import pytest
from openai.types import CompletionUsage
from openai.types.chat import ChatCompletionMessageParam
from prometheus_client.parser import text_string_to_metric_families

from .harness import BACKEND_NAME, KV_BLOCK_SIZE, MAX_MODEL_LEN, ROUTE_MODEL, SERVED_MODEL, ServerProcess

# Session fixtures start vLLM (1-2 min, longer on a fresh machine that first builds the venv); the
# first test pays for it, so the per-test timeout here is generous. Every call has its own timeout.
pytestmark = [pytest.mark.real, pytest.mark.timeout(900)]

QUESTION: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is a good book about the sea?"}]


def _assert_usage_consistent(usage: CompletionUsage | None, max_tokens: int) -> None:
    assert usage is not None
    assert usage.prompt_tokens > 0
    assert 1 <= usage.completion_tokens <= max_tokens
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


# --- the fixture itself ---------------------------------------------------------------------------


def test_vllm_metrics_parse_and_expose_prefix_cache(vllm_server: ServerProcess) -> None:
    resp = httpx.get(f"{vllm_server.url}/metrics", timeout=10.0)
    assert resp.status_code == 200
    families = {f.name: f for f in text_string_to_metric_families(resp.text)}
    assert "vllm:prefix_cache_hits" in families, sorted(families)
    assert "vllm:kv_cache_usage_perc" in families
    [info] = families["vllm:cache_config_info"].samples
    assert info.labels["block_size"] == str(KV_BLOCK_SIZE)


def test_vllm_serves_the_tiny_model(vllm_server: ServerProcess) -> None:
    resp = httpx.get(f"{vllm_server.url}/v1/models", timeout=10.0)
    assert resp.status_code == 200
    [model] = resp.json()["data"]
    assert model["id"] == SERVED_MODEL
    assert model["max_model_len"] == MAX_MODEL_LEN


# --- chat -----------------------------------------------------------------------------------------


def test_chat_non_streaming(client: openai.OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=ROUTE_MODEL, messages=QUESTION, max_tokens=12, temperature=0
    )
    assert raw.status_code == 200
    assert raw.headers["x-gateway-backend"] == BACKEND_NAME
    assert raw.headers["x-gateway-runtime"] == "vllm"
    assert raw.headers.get("x-request-id")
    completion = raw.parse()
    assert completion.object == "chat.completion"
    assert completion.model == ROUTE_MODEL  # rewritten back from tiny-moe
    assert completion.id.startswith("chatcmpl-")
    [choice] = completion.choices
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    assert choice.finish_reason in ("length", "stop")
    _assert_usage_consistent(completion.usage, 12)
    assert completion.usage is not None
    if choice.finish_reason == "length":
        assert completion.usage.completion_tokens == 12


def test_chat_streaming_with_usage(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=ROUTE_MODEL,
        messages=QUESTION,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    content_chunks = [c for c in chunks if c.choices]
    usage_chunks = [c for c in chunks if c.usage is not None]
    assert len(content_chunks) >= 2, chunks
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert all(c.model == ROUTE_MODEL for c in chunks)
    assert len({c.id for c in chunks}) == 1
    assert content_chunks[-1].choices[0].finish_reason in ("length", "stop")
    # Exactly one usage chunk, last, with no choices (the OpenAI shape vLLM also uses).
    assert usage_chunks == [chunks[-1]]
    assert chunks[-1].choices == []
    _assert_usage_consistent(chunks[-1].usage, 8)


def test_chat_streaming_without_usage_sends_no_usage_chunk(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=ROUTE_MODEL, messages=QUESTION, max_tokens=8, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks
    # The gateway may ask vLLM for usage for its own accounting, but must not leak it to this client.
    assert [c.usage for c in chunks] == [None] * len(chunks)
    assert all(c.choices for c in chunks)
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    assert all(c.model == ROUTE_MODEL for c in chunks)


# --- completions ----------------------------------------------------------------------------------


def test_completions_non_streaming(client: openai.OpenAI) -> None:
    raw = client.completions.with_raw_response.create(
        model=ROUTE_MODEL, prompt="Once upon a time there was a ship", max_tokens=10, temperature=0
    )
    assert raw.headers["x-gateway-backend"] == BACKEND_NAME
    completion = raw.parse()
    assert completion.object == "text_completion"
    assert completion.model == ROUTE_MODEL
    [choice] = completion.choices
    assert isinstance(choice.text, str)
    assert choice.finish_reason in ("length", "stop")
    _assert_usage_consistent(completion.usage, 10)


def test_completions_streaming(client: openai.OpenAI) -> None:
    stream = client.completions.create(
        model=ROUTE_MODEL,
        prompt="Once upon a time there was a ship",
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text_chunks = [c for c in chunks if c.choices]
    assert len(text_chunks) >= 2, chunks
    assert all(c.model == ROUTE_MODEL for c in chunks)
    assert text_chunks[-1].choices[0].finish_reason in ("length", "stop")
    assert [c for c in chunks if c.usage is not None] == [chunks[-1]]
    _assert_usage_consistent(chunks[-1].usage, 10)


# --- prefix cache ---------------------------------------------------------------------------------


def test_prefix_cache_hit_through_the_gateway(client: openai.OpenAI) -> None:
    # A fresh nonce first, so nothing earlier in the session shares this prefix.
    system = f"Session {uuid.uuid4().hex}. " + "You are a careful assistant for an online bookshop. " * 40

    def ask(question: str) -> CompletionUsage:
        completion = client.chat.completions.create(
            model=ROUTE_MODEL,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
            max_tokens=4,
            temperature=0,
        )
        assert completion.usage is not None
        return completion.usage

    first = ask("Which novel should I read first?")
    assert first.prompt_tokens >= 300
    second = ask("And which one after that?")
    assert second.prompt_tokens_details is not None
    cached = second.prompt_tokens_details.cached_tokens
    assert cached is not None
    assert cached >= KV_BLOCK_SIZE
    assert cached % KV_BLOCK_SIZE == 0  # whole blocks only
    assert cached <= second.prompt_tokens


# --- errors ---------------------------------------------------------------------------------------

# About 3,000 tokens, more than max_model_len (2,048).
TOO_LONG: list[ChatCompletionMessageParam] = [{"role": "user", "content": "word " * 3000}]


def _assert_openai_error_shape(body: Any) -> dict[str, Any]:
    """`body`: the parsed JSON of an error response."""
    assert set(body) == {"error"}
    error: dict[str, Any] = body["error"]
    assert {"message", "type", "param", "code"} <= set(error)
    assert isinstance(error["message"], str)
    return error


def test_prompt_longer_than_context_passes_vllm_error_through(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as excinfo:
        client.chat.completions.create(model=ROUTE_MODEL, messages=TOO_LONG, max_tokens=4)
    exc = excinfo.value
    assert exc.status_code == 400
    assert "maximum context length" in exc.message
    error = _assert_openai_error_shape(exc.response.json())
    assert "maximum context length" in error["message"]


def test_prompt_longer_than_context_streaming_is_a_400_too(client: openai.OpenAI) -> None:
    # vLLM rejects it before the stream starts, so the client sees a plain 400, not an SSE error.
    with pytest.raises(openai.BadRequestError) as excinfo:
        client.chat.completions.create(model=ROUTE_MODEL, messages=TOO_LONG, max_tokens=4, stream=True)
    assert excinfo.value.status_code == 400
    assert "maximum context length" in excinfo.value.message


def test_unknown_model_is_a_404_from_the_gateway(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as excinfo:
        client.chat.completions.create(model="no-such-model", messages=QUESTION, max_tokens=4)
    assert excinfo.value.status_code == 404
    error = _assert_openai_error_shape(excinfo.value.response.json())
    assert "no-such-model" in error["message"]


# --- gateway views of the backend -----------------------------------------------------------------


def test_models_lists_the_route(client: openai.OpenAI) -> None:
    ids = [m.id for m in client.models.list()]
    assert ROUTE_MODEL in ids


def test_admin_backends_shows_scraped_vllm_load(http: httpx.Client) -> None:
    deadline = time.monotonic() + 30.0
    backend: dict[str, Any] = {}
    while time.monotonic() < deadline:
        resp = http.get("/admin/backends")
        assert resp.status_code == 200
        [backend] = [b for b in resp.json()["backends"] if b["name"] == BACKEND_NAME]
        load = backend.get("load") or {}
        if all(load.get(k) is not None for k in ("running", "waiting", "kv_usage", "block_size")):
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"no scraped vLLM load in /admin/backends within 30 s: {backend}")
    assert backend["runtime"] == "vllm"
    assert backend["model"] == SERVED_MODEL
    assert backend["healthy"] is True
    assert isinstance(backend["in_flight"], int)
    load = backend["load"]
    assert load["block_size"] == KV_BLOCK_SIZE
    assert load["running"] >= 0
    assert load["waiting"] >= 0
    assert 0.0 <= load["kv_usage"] <= 1.0


def test_gateway_metrics_parse(http: httpx.Client) -> None:
    resp = http.get("/metrics")
    assert resp.status_code == 200
    assert list(text_string_to_metric_families(resp.text))


def test_two_clients_with_the_same_request_id_are_both_served(client: openai.OpenAI) -> None:
    """vLLM takes X-Request-Id as its engine request id and refuses or mixes up duplicates. The
    client's id is the client's: it is echoed back, and upstream each attempt carries the gateway's
    own, so two concurrent clients that happen to send the same id are both served."""
    from concurrent.futures import ThreadPoolExecutor

    def ask(_: int) -> tuple[str, str, str]:
        raw = client.chat.completions.with_raw_response.create(
            model=ROUTE_MODEL, messages=[{"role": "user", "content": "Tell me a long story."}], max_tokens=24,
            extra_headers={"x-request-id": "same-id-from-two-clients"},
        )
        reply = raw.parse()
        assert reply.choices[0].message.content is not None
        return raw.headers["x-request-id"], reply.id, reply.choices[0].message.content

    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(ask, range(2)))
    assert [a[0] for a in answers] == ["same-id-from-two-clients"] * 2
    assert answers[0][1] != answers[1][1]  # vLLM saw two distinct engine request ids
