"""Regenerate the canned upstream bodies: `python -m bench.upstream.bodies`.

Shapes follow the real vLLM 0.32.0 transcripts (tests/data/vllm-0.32.0-cpu: chat.txt,
chat_stream_usage.txt, metrics.txt): same key order and nulls, `"model":"tiny-moe"`. The stream is
issue 13's "answer of 20 SSE chunks": exactly 20 data events (a role chunk, 18 token chunks, the
18th carrying `finish_reason` as vLLM sends it, and the usage chunk), then `data: [DONE]`. nginx
sends it in one write (sendfile, corked with the head: `tcp_nopush`).
"""

from __future__ import annotations

from pathlib import Path

import orjson

HERE = Path(__file__).resolve().parent
TOKENS = 18
STREAM_EVENTS = TOKENS + 2  # data events before [DONE]: role + tokens + usage
CHAT_ID = "chatcmpl-a2e20a642be45856"
CREATED = 1795974001
FINGERPRINT = "vllm-0.32.0-ff6c978c"
WORDS = ("voidie", " <=", "gory", " local", "as", " through", "abstract", "method", " remain", " support")


def chat_completion() -> bytes:
    return orjson.dumps({
        "id": CHAT_ID, "object": "chat.completion", "created": CREATED, "model": "tiny-moe",
        "choices": [{
            "index": 0,
            "message": {"role": "assistant",
                        "content": "voidie <=gory localas throughabstractmethod remainas throughabstractmethod",
                        "refusal": None, "annotations": None, "audio": None, "function_call": None,
                        "reasoning": None},
            "logprobs": None, "finish_reason": "length", "stop_reason": None, "token_ids": None,
            "routed_experts": None,
        }],
        "service_tier": None, "system_fingerprint": FINGERPRINT,
        "usage": {"prompt_tokens": 24, "total_tokens": 36, "completion_tokens": 12,
                  "prompt_tokens_details": {"cached_tokens": 0, "created_cache_tokens": 0, "multimodal_tokens": None},
                  "completion_tokens_details": None},
        "prompt_logprobs": None, "prompt_token_ids": None, "prompt_text": None, "kv_transfer_params": None,
        "ec_transfer_params": None, "metrics": None,
    })


def _event(obj: object) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


STREAM_HEAD = {"id": "chatcmpl-9374a11f0899b26f", "object": "chat.completion.chunk", "created": CREATED,
               "model": "tiny-moe"}


def sse_events(tokens: int, head: dict[str, object], usage_extra: dict[str, object]) -> list[bytes]:
    """A vLLM stream's events, one `data:` event each: role, `tokens` token chunks (the last carries
    `finish_reason`), usage (with `usage_extra` beside it), `[DONE]`."""
    out = [_event({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}],
                   "prompt_token_ids": None, "prompt_text": None})]
    for i in range(tokens):
        last = i == tokens - 1
        choice: dict[str, object] = {"index": 0, "delta": {"content": WORDS[i % len(WORDS)]}, "logprobs": None,
                                     "finish_reason": "length" if last else None}
        if last:
            choice["stop_reason"] = None
        choice["token_ids"] = None
        out.append(_event({**head, "choices": [choice]}))
    out.append(_event({**head, "choices": [], "usage": {
        "prompt_tokens": 24, "total_tokens": 24 + tokens, "completion_tokens": tokens,
        "prompt_tokens_details": {"cached_tokens": 0, "created_cache_tokens": 0}}, **usage_extra}))
    out.append(b"data: [DONE]\n\n")
    return out


def sse_stream(tokens: int = TOKENS) -> bytes:
    return b"".join(sse_events(tokens, STREAM_HEAD, {"system_fingerprint": FINGERPRINT}))


METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny-moe"} 0.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny-moe"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny-moe"} 0.0
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="tiny-moe"} 1844.0
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="tiny-moe"} 768.0
"""


def main() -> None:
    (HERE / "chat.json").write_bytes(chat_completion())
    (HERE / "stream.sse").write_bytes(sse_stream())
    (HERE / "metrics.prom").write_text(METRICS)
    (HERE / "health").write_bytes(b"")


if __name__ == "__main__":
    main()
