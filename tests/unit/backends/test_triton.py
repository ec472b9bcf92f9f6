from __future__ import annotations

from typing import Any

import orjson
import pytest

from backends.base import ClientRequest, Endpoint, LoadParseError, Probe, TranslationError, UpstreamFormatError
from backends.triton import TritonAdapter

ADAPTER = TritonAdapter()


def _req(body: dict[str, Any], *, endpoint: Endpoint = Endpoint.CHAT, stream: bool = False) -> ClientRequest:
    return ClientRequest(endpoint=endpoint, body=body, stream=stream, include_usage=False, created=1764434400)


def test_probes() -> None:
    assert ADAPTER.liveness == Probe("/v2/health/live")
    assert ADAPTER.readiness == Probe("/v2/health/ready")
    assert 400 not in ADAPTER.readiness.ok  # Triton answers 400 while not ready


def test_chat_translation() -> None:
    body = {
        "model": "route",
        "messages": [{"role": "user", "content": "Hi"}],
        "max_completion_tokens": 20,
        "max_tokens": 99,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 40,
        "seed": 7,
        "presence_penalty": 0.1,
        "frequency_penalty": 0.2,
        "repetition_penalty": 1.1,
        "min_tokens": 2,
        "stop": "\n\n",
        "user": "ignored",
    }
    up = TritonAdapter(chat_template="plain").build_request(_req(body), model="ensemble", request_id="r1")
    assert up.path == "/v2/models/ensemble/generate"
    assert dict(up.headers) == {"content-type": "application/json", "x-request-id": "r1"}
    assert orjson.loads(up.body) == {
        "text_input": "User: Hi\nAssistant:",
        "max_tokens": 20,
        "stream": False,
        "bad_words": "",
        "stop_words": ["\n\n"],
        "exclude_input_in_output": True,
        "return_num_input_tokens": True,
        "return_num_output_tokens": True,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 40,
        "seed": 7,
        "presence_penalty": 0.1,
        "frequency_penalty": 0.2,
        "repetition_penalty": 1.1,
        "min_tokens": 2,
    }


def test_streaming_completion_with_defaults() -> None:
    req = _req(
        {"model": "r", "prompt": ["Once"], "stream": True, "temperature": 0, "top_k": -1},
        endpoint=Endpoint.COMPLETIONS,
        stream=True,
    )
    up = ADAPTER.build_request(req, model="my model/v", request_id="r")
    assert up.path == "/v2/models/my%20model%2Fv/generate_stream"
    sent = orjson.loads(up.body)
    assert (sent["text_input"], sent["max_tokens"], sent["stream"], sent["stop_words"]) == ("Once", 16, True, "")
    assert sent["top_k"] == 1  # temperature 0 -> greedy
    assert "temperature" not in sent


def test_chat_default_max_tokens_and_template() -> None:
    up = ADAPTER.build_request(_req({"messages": [{"role": "user", "content": "Hi"}]}), model="e", request_id="r")
    sent = orjson.loads(up.body)
    assert sent["max_tokens"] == 512
    assert sent["text_input"] == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize(
    ("body", "endpoint", "needle"),
    [
        ({"prompt": ["a", "b"]}, Endpoint.COMPLETIONS, "prompt"),
        ({"prompt": [1, 2, 3]}, Endpoint.COMPLETIONS, "prompt"),
        ({"prompt": "a", "n": 2}, Endpoint.COMPLETIONS, "n > 1"),
        ({"prompt": "a", "echo": True}, Endpoint.COMPLETIONS, "echo"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, Endpoint.CHAT, "tools"),
        ({"messages": [{"role": "user", "content": "x"}], "logprobs": True}, Endpoint.CHAT, "logprobs"),
        (
            {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}},
            Endpoint.CHAT,
            "response_format",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, Endpoint.CHAT, "max_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": "5"}, Endpoint.CHAT, "max_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, Endpoint.CHAT, "temperature"),
        ({"messages": [{"role": "user", "content": "x"}], "stop": [1]}, Endpoint.CHAT, "stop"),
        ({"messages": [{"role": "user", "content": "x"}], "seed": -1}, Endpoint.CHAT, "seed"),
        ({"messages": []}, Endpoint.CHAT, "messages"),
    ],
)
def test_untranslatable_requests_raise_translation_error(body: dict[str, Any], endpoint: Endpoint, needle: str) -> None:
    with pytest.raises(TranslationError, match=needle):
        ADAPTER.build_request(_req(body, endpoint=endpoint), model="e", request_id="r")


def test_non_streaming_chat_response() -> None:
    upstream = {
        "context_logits": 0.0,
        "model_name": "ensemble",
        "model_version": "1",
        "num_input_tokens": 9,
        "num_output_tokens": 7,
        "sequence_end": False,
        "text_output": "Paris is the capital of France.",
    }
    req = _req({"messages": [{"role": "user", "content": "Capital?"}], "max_tokens": 7})
    out = orjson.loads(
        ADAPTER.translate_response(req, 200, orjson.dumps(upstream), model="route", request_id="abc").body
    )
    assert out == {
        "id": "chatcmpl-abc",
        "object": "chat.completion",
        "created": 1764434400,
        "model": "route",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Paris is the capital of France."},
                "logprobs": None,
                "finish_reason": "length",
            }
        ],
        "usage": {"prompt_tokens": 9, "completion_tokens": 7, "total_tokens": 16},
    }


def test_non_streaming_completion_without_token_counts_estimates_them() -> None:
    req = _req({"prompt": "12345678"}, endpoint=Endpoint.COMPLETIONS)
    reply = ADAPTER.translate_response(req, 200, b'{"text_output":["abcde"]}', model="m", request_id="r")
    out = orjson.loads(reply.body)
    assert out["object"] == "text_completion"
    assert out["id"].startswith("cmpl-")
    assert out["choices"] == [{"index": 0, "text": "abcde", "logprobs": None, "finish_reason": "stop"}]
    assert out["usage"] == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}


@pytest.mark.parametrize("body", [b"<html>", b"[]", b'{"error":"x"}'])
def test_unexpected_2xx_bodies_raise_upstream_format_error(body: bytes) -> None:
    with pytest.raises(UpstreamFormatError):
        ADAPTER.translate_response(
            _req({"prompt": "x"}, endpoint=Endpoint.COMPLETIONS), 200, body, model="m", request_id="r"
        )


# Spec 4.2.3 example (prometheus-cpp: integer values, alphabetical labels).
TRITON_METRICS = b"""# HELP nv_trt_llm_request_metrics TRT LLM request metrics
# TYPE nv_trt_llm_request_metrics gauge
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="waiting",version="1"} 1
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="context",version="1"} 1
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="scheduled",version="1"} 1
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="max",version="1"} 512
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="active",version="1"} 0
# HELP nv_trt_llm_kv_cache_block_metrics TRT LLM KV cache block metrics
# TYPE nv_trt_llm_kv_cache_block_metrics gauge
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="fraction",model="tensorrt_llm",version="1"} 0.4875
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="tokens_per",model="tensorrt_llm",version="1"} 64
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="used",model="tensorrt_llm",version="1"} 1
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="free",model="tensorrt_llm",version="1"} 6239
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="max",model="tensorrt_llm",version="1"} 6239
# HELP nv_inference_request_success Number of successful inference requests, all batch sizes
# TYPE nv_inference_request_success counter
nv_inference_request_success{model="ensemble",version="1"} 1042
# HELP nv_inference_pending_request_count Instantaneous number of pending requests awaiting execution per-model.
# TYPE nv_inference_pending_request_count gauge
nv_inference_pending_request_count{model="tensorrt_llm",version="1"} 0
"""


def test_parse_load_on_spec_example() -> None:
    load = ADAPTER.parse_load(TRITON_METRICS, None)
    assert (load.waiting, load.running, load.kv_usage, load.block_size) == (1.0, 1.0, 0.4875, 64)
    assert load.prefix_hit_rate is None


def test_parse_load_on_older_backend_without_waiting_scheduled_or_fraction() -> None:
    body = b"""nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="active",version="1"} 5
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="used",model="tensorrt_llm",version="1"} 25
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="max",model="tensorrt_llm",version="1"} 100
nv_inference_pending_request_count{model="ensemble",version="1"} 2
nv_inference_pending_request_count{model="tensorrt_llm",version="1"} 2
"""
    load = ADAPTER.parse_load(body, None)
    assert (load.waiting, load.running, load.kv_usage, load.block_size) == (2.0, 5.0, 0.25, None)


@pytest.mark.parametrize("body", [b"", b"nv_gpu_utilization 0.5\n", b"{bad", b"\xff"])
def test_bodies_without_trtllm_metrics_raise_load_parse_error(body: bytes) -> None:
    with pytest.raises(LoadParseError):
        ADAPTER.parse_load(body, None)


def test_triton_errors_become_openai_errors() -> None:
    err = ADAPTER.normalise_error(400, b'{"error":"Request for unknown model: \'foo\' is not found"}')
    assert err.as_dict() == {
        "error": {
            "message": "Request for unknown model: 'foo' is not found",
            "type": "invalid_request_error",
            "param": None,
            "code": None,
        }
    }
    assert ADAPTER.normalise_error(500, b"").type == "server_error"


def test_unknown_chat_template_is_rejected_at_construction() -> None:
    with pytest.raises(ValueError, match="chat template"):
        TritonAdapter(chat_template="nope")
