from __future__ import annotations

import copy
from typing import Any

import orjson
import pytest

from backends.base import ClientRequest, Endpoint, ErrorBody, Usage
from backends.openai_compat import normalise_error, parse_usage, rewrite_model
from backends.sglang import SGLangAdapter
from backends.trtllm import TRTLLMAdapter
from backends.vllm import VLLMAdapter

from .captures import response

CHAT = {"model": "client-name", "messages": [{"role": "user", "content": "hi"}], "top_k": 5, "cache_salt": "t"}


def _req(body: dict[str, Any], *, endpoint: Endpoint = Endpoint.CHAT, stream: bool = False) -> ClientRequest:
    return ClientRequest(endpoint=endpoint, body=body, stream=stream, include_usage=False)


@pytest.mark.parametrize("adapter", [VLLMAdapter(), SGLangAdapter()])
def test_non_streaming_request_rewrites_model_and_forwards_everything_else(adapter: VLLMAdapter) -> None:
    body = copy.deepcopy(CHAT)
    up = adapter.build_request(_req(body), model="backend-model", request_id="r1")
    assert up.path == "/v1/chat/completions"
    assert dict(up.headers) == {"content-type": "application/json", "x-request-id": "r1"}
    assert orjson.loads(up.body) == {**CHAT, "model": "backend-model"}
    assert body == CHAT  # the client's dict is not mutated


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        (None, {"include_usage": True}),
        (
            {"include_usage": False, "continuous_usage_stats": True},
            {"include_usage": True, "continuous_usage_stats": True},
        ),
        ({}, {"include_usage": True}),
    ],
)
def test_streaming_forces_include_usage_and_keeps_other_options(
    options: dict[str, Any] | None, expected: dict[str, Any]
) -> None:
    body: dict[str, Any] = {"model": "m", "prompt": "x", "stream": True}
    if options is not None:
        body["stream_options"] = options
    up = VLLMAdapter().build_request(_req(body, endpoint=Endpoint.COMPLETIONS, stream=True), model="b", request_id="r")
    assert up.path == "/v1/completions"
    assert orjson.loads(up.body)["stream_options"] == expected


def test_openai_runtimes_relay_their_own_sse() -> None:
    assert VLLMAdapter().stream_translator(_req(CHAT, stream=True), model="m", request_id="r") is None


def test_translate_response_rewrites_only_the_model() -> None:
    body = response("chat.txt").body
    out = VLLMAdapter().translate_response(_req(CHAT), 200, body, model="client-name", request_id="r")
    assert orjson.loads(out.body) == {**orjson.loads(body), "model": "client-name"}
    assert out.usage == Usage(24, 12, 0)
    assert VLLMAdapter().translate_response(_req(CHAT), 200, body, model="tiny-moe", request_id="r").body is body
    garbage = VLLMAdapter().translate_response(_req(CHAT), 200, b"not json", model="x", request_id="r")
    assert garbage.body == b"not json"
    assert garbage.usage is None


@pytest.mark.parametrize(
    ("capture", "usage"),
    [
        ("chat.txt", Usage(24, 12, 0)),
        ("completions.txt", Usage(6, 8, 0)),
        ("chat_long_prefix_second_cached.txt", Usage(784, 16, 768)),
    ],
)
def test_parse_usage_on_real_responses(capture: str, usage: Usage) -> None:
    parsed = parse_usage(orjson.loads(response(capture).body))
    assert parsed is not None
    assert (parsed.prompt_tokens, parsed.cached_tokens) == (usage.prompt_tokens, usage.cached_tokens)


def test_parse_usage_on_stream_usage_chunk_and_odd_shapes() -> None:
    chunk = response("chat_stream_usage.txt").body.split(b"\n\n")[-3].removeprefix(b"data: ")
    assert parse_usage(orjson.loads(chunk)) == Usage(24, 6, 0)
    assert parse_usage({"usage": {"prompt_tokens": 3, "completion_tokens": 1, "prompt_tokens_details": None}}) == Usage(
        3, 1, None
    )
    assert parse_usage({"usage": None}) is None
    assert parse_usage({"choices": []}) is None
    assert parse_usage({"usage": {"prompt_tokens": "3", "completion_tokens": 1}}) is None


@pytest.mark.parametrize(
    "capture",
    [
        "err_bad_temperature.txt",
        "err_malformed_json.txt",
        "err_max_tokens_too_big.txt",
        "err_missing_messages.txt",
        "err_n_zero.txt",
        "err_prompt_too_long.txt",
        "err_unknown_model.txt",
        "err_wrong_type.txt",
    ],
)
def test_real_vllm_errors_keep_their_fields(capture: str) -> None:
    r = response(capture)
    expected = orjson.loads(r.body)["error"]
    assert normalise_error(r.status, r.body).as_dict() == {"error": expected}


@pytest.mark.parametrize(
    ("status", "body", "expected"),
    [
        # SGLang / trtllm-serve / vLLM < 0.10.1: flat
        (
            400,
            b'{"object":"error","message":"bad","type":"BadRequest","param":null,"code":400}',
            ErrorBody("bad", "BadRequest", None, 400),
        ),
        # SGLang unknown model (OpenAI-style string code)
        (
            404,
            b'{"error":{"message":"nope","type":"invalid_request_error","param":"model","code":"model_not_found"}}',
            ErrorBody("nope", "invalid_request_error", "model", "model_not_found"),
        ),
        # auth on vLLM / SGLang, trtllm validation, Triton
        (401, b'{"error":"Unauthorized"}', ErrorBody("Unauthorized", "authentication_error")),
        (403, b'{"error":"Forbidden"}', ErrorBody("Forbidden", "permission_error")),
        (
            400,
            b'{"error":"Request for unknown model"}',
            ErrorBody("Request for unknown model", "invalid_request_error"),
        ),
        # FastAPI detail (capture err_unknown_path / err_wrong_method)
        (404, b'{"detail":"Not Found"}', ErrorBody("Not Found", "not_found_error")),
        (405, b'{"detail":"Method Not Allowed"}', ErrorBody("Method Not Allowed", "invalid_request_error")),
        # garbage
        (
            502,
            b"<html><body>Bad gateway</body></html>",
            ErrorBody("Backend returned HTTP 502 Bad Gateway", "server_error"),
        ),
        (503, b"", ErrorBody("Backend returned HTTP 503 Service Unavailable", "server_error")),
        (
            503,
            b"LLM is unavailable. Please check the server logs for more details.",
            ErrorBody(
                "Backend returned HTTP 503 Service Unavailable: LLM is unavailable. Please check the server logs for "
                "more details.",
                "server_error",
            ),
        ),
        (429, b"\xff\xfe\x00", ErrorBody("Backend returned HTTP 429 Too Many Requests", "rate_limit_error")),
        (599, b"[1,2]", ErrorBody("Backend returned HTTP 599", "server_error")),
        (
            500,
            b'{"error":{"type":"","param":5,"code":true}}',
            ErrorBody("Backend returned HTTP 500 Internal Server Error", "server_error"),
        ),
        (500, b'{"error":null}', ErrorBody("Backend returned HTTP 500 Internal Server Error", "server_error")),
    ],
)
def test_every_error_shape_normalises(status: int, body: bytes, expected: ErrorBody) -> None:
    assert normalise_error(status, body) == expected


def test_stream_error_event_payload_of_vllm_normalises() -> None:
    body = b'{"error": {"message": "Internal server error", "type": "InternalServerError", "param": null, "code": 500}}'
    assert VLLMAdapter().normalise_error(500, body) == ErrorBody(
        "Internal server error", "InternalServerError", None, 500
    )


def test_the_model_is_renamed_in_place_without_reserialising() -> None:
    from backends.openai_compat import rewrite_model

    body = (b'{"id":"chatcmpl-1","object":"chat.completion","model":"tiny-moe","choices":[{"index":0,'
            b'"message":{"role":"assistant","content":"a \\"model\\":\\"tiny-moe\\" in text"}}],'
            b'"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}')
    reply = rewrite_model(body, "deepseek-v3")
    assert reply.body == body.replace(b'"model":"tiny-moe"', b'"model":"deepseek-v3"', 1)  # byte for byte
    assert reply.usage is not None
    assert reply.usage.completion_tokens == 2
    spaced = b'{"id": "x", "model": "tiny-moe", "choices": []}'
    assert rewrite_model(spaced, "m").body == b'{"id": "x", "model": "m", "choices": []}'


def test_usage_of_every_endpoint_is_read() -> None:
    responses = {"usage": {"input_tokens": 17, "input_tokens_details": {"cached_tokens": 16, "cache_write_tokens": 0},
                           "output_tokens": 6, "total_tokens": 23}}
    assert parse_usage(responses) == Usage(17, 6, 16)
    assert parse_usage({"usage": {"input_tokens": 3, "output_tokens": 1}}) == Usage(3, 1, None)
    assert parse_usage({"usage": {"prompt_tokens": 4, "total_tokens": 4}}) == Usage(4, 0, None)  # OpenAI embeddings
    assert parse_usage({"usage": {"prompt_tokens": 4, "total_tokens": 4, "completion_tokens": 0}}) == Usage(4, 0)
    assert parse_usage({"usage": {"prompt_tokens": 4}}) is None
    assert parse_usage({"usage": {"input_tokens": "x", "output_tokens": 1}}) is None


def test_tokenize_answers_are_not_given_a_model() -> None:
    body = b'{"count":2,"max_model_len":2048,"tokens":[1,2],"token_strs":null}'
    assert rewrite_model(body, "moe").body == body


def test_new_endpoints_go_to_their_paths_unchanged_but_the_model() -> None:
    for endpoint, path, body in (
        (Endpoint.EMBEDDINGS, "/v1/embeddings", {"model": "m", "input": ["a"], "encoding_format": "base64"}),
        (Endpoint.TOKENIZE, "/tokenize", {"model": "m", "prompt": "a", "add_special_tokens": False}),
        (Endpoint.DETOKENIZE, "/detokenize", {"model": "m", "tokens": [1, 2]}),
        (Endpoint.RESPONSES, "/v1/responses", {"model": "m", "input": "a", "stream": True}),
    ):
        req = ClientRequest(endpoint=endpoint, body=body, stream=bool(body.get("stream")), include_usage=False)
        up = SGLangAdapter().build_request(req, model="served", request_id="r")
        assert up.path == path
        assert orjson.loads(up.body) == {**body, "model": "served"}  # no stream_options added to Responses
    strict = ClientRequest(endpoint=Endpoint.RESPONSES, body={"model": "m", "input": "a", "seed": 1, "store": True},
                           stream=False, include_usage=False)
    assert orjson.loads(TRTLLMAdapter().build_request(strict, model="s", request_id="r").body) == {
        "model": "s", "input": "a", "store": True}  # trtllm-serve's ResponsesRequest forbids other fields
