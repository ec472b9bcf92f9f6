from __future__ import annotations

import copy
from typing import Any

import orjson
import pytest

from backends.base import ClientRequest, Endpoint, Load, LoadParseError, Probe
from backends.trtllm import TRTLLMAdapter

ADAPTER = TRTLLMAdapter()


def _send(body: dict[str, Any], *, endpoint: Endpoint = Endpoint.CHAT, stream: bool = False) -> dict[str, Any]:
    req = ClientRequest(endpoint=endpoint, body=copy.deepcopy(body), stream=stream, include_usage=False)
    up = ADAPTER.build_request(req, model="TinyLlama", request_id="r9")
    assert dict(up.headers) == {"content-type": "application/json", "x-request-id": "r9"}
    result: dict[str, Any] = orjson.loads(up.body)
    return result


def test_probes() -> None:
    assert (ADAPTER.liveness, ADAPTER.readiness, ADAPTER.load_path) == (Probe("/health"), Probe("/health"), "/metrics")


def test_chat_keeps_openai_and_trtllm_fields_and_drops_the_rest() -> None:
    kept = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 8,
        "temperature": 0.5,
        "user": "u1",
        "top_k": 4,
        "min_tokens": 1,
        "cache_salt": "tenant",
        "stop": ["\n"],
    }
    dropped = {
        "min_p_typo": 1,
        "store": True,  # OpenAI, but not in trtllm's schema
        "metadata": {"a": "b"},
        "priority": 3,  # vLLM int priority; trtllm's is a float in [0, 1] with the opposite order
        "regex": "a+",  # SGLang-only
        "return_hidden_states": True,  # SGLang-only
        "stream_options": {"include_usage": True},  # 400 on trtllm without stream
    }
    assert _send({"model": "client", **kept, **dropped}) == {"model": "TinyLlama", **kept}


def test_completions_allow_list_differs_from_chat() -> None:
    body = {"model": "c", "prompt": "x", "max_tokens": 3, "echo": False, "top_logprobs": 2, "messages": []}
    assert _send(body, endpoint=Endpoint.COMPLETIONS) == {
        "model": "TinyLlama",
        "prompt": "x",
        "max_tokens": 3,
        "echo": False,
    }


def test_streaming_forces_usage_and_strips_unknown_stream_option_keys() -> None:
    body = {"model": "c", "messages": [], "stream": True, "stream_options": {"include_obfuscation": False}}
    assert _send(body, stream=True)["stream_options"] == {"include_usage": True}
    body["stream_options"] = {"continuous_usage_stats": True, "include_usage": False}
    assert _send(body, stream=True)["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}


# Spec 4.1.3 example row.
KV = {
    "maxNumBlocks": 101256,
    "freeNumBlocks": 101253,
    "usedNumBlocks": 3,
    "tokensPerBlock": 32,
    "allocTotalBlocks": 3126,
    "allocNewBlocks": 3126,
    "reusedBlocks": 4,
    "missedBlocks": 3121,
    "cacheHitRate": 0.00128,
}
ROW: dict[str, Any] = {
    "timestamp": "11-29-2026 17:20:00.123456",
    "iter": 154,
    "numActiveRequests": 12,
    "numQueuedRequests": 3,
    "numCompletedRequests": 1,
    "kvCacheStats": KV,
    "inflightBatchingStats": {"numScheduledRequests": 12, "numContextRequests": 1},
    "specDecodingStats": None,
    "attentionDpRank": 0,
}


def test_parse_load_takes_the_newest_iteration() -> None:
    older = {**ROW, "iter": 153, "numActiveRequests": 99, "numQueuedRequests": 99}
    load = ADAPTER.parse_load(orjson.dumps([older, ROW]), None)
    assert (load.running, load.waiting, load.block_size) == (12.0, 3.0, 32)
    assert load.kv_usage == pytest.approx(3 / 101256)
    assert load.prefix_hit_rate == pytest.approx(4 / 3125)
    assert (load.prefix_hits_total, load.prefix_queries_total) == (4 * 32.0, 3125 * 32.0)


def test_hit_rate_from_block_deltas_between_polls() -> None:
    previous = ADAPTER.parse_load(orjson.dumps([ROW]), None)
    later = {**ROW, "kvCacheStats": {**KV, "reusedBlocks": 54, "missedBlocks": 3171}}  # +50 reused, +50 missed
    assert ADAPTER.parse_load(orjson.dumps([later]), previous).prefix_hit_rate == pytest.approx(0.5)


def test_empty_array_means_no_news() -> None:
    previous = Load(running=1.0, waiting=2.0)
    assert ADAPTER.parse_load(b"[]", previous) is previous
    assert ADAPTER.parse_load(b"[]", None) == Load()


def test_attention_dp_ranks_add_up() -> None:
    rank1 = {**ROW, "attentionDpRank": 1, "numActiveRequests": 8}
    assert ADAPTER.parse_load(orjson.dumps([ROW, rank1]), None).running == 20.0


@pytest.mark.parametrize("body", [b"", b"{}", b"[1, 2]", b"not json", b'{"kvCacheStats": {}}', b"\xff"])
def test_malformed_bodies_raise_load_parse_error(body: bytes) -> None:
    with pytest.raises(LoadParseError):
        ADAPTER.parse_load(body, None)


def test_rows_with_odd_values_degrade_to_none() -> None:
    load = ADAPTER.parse_load(b'[{"numActiveRequests": "x", "kvCacheStats": null}]', None)
    assert load == Load()
