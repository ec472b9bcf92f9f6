"""trtllm-serve: OpenAI-compatible, but its request schema is `extra="forbid"`.

Any field it does not declare is a 400, so requests are filtered through an explicit allow-list per
endpoint (OpenAI fields it declares plus its documented extras; source: tensorrt_llm/serve/
openai_protocol.py). vLLM- or SGLang-only extras, and newer OpenAI fields (`store`, `metadata`, ...),
are dropped rather than forwarded. `priority` is dropped on purpose: trtllm reads it as a float in
[0, 1] where higher wins, vLLM as an int where lower wins, so passing it through would invert intent.

Load comes from `/metrics`, which is *not* Prometheus: it is a JSON array of per-iteration stats that
is drained on every read (`[]` means "nothing new", not "idle").
"""

from __future__ import annotations

from typing import Any, Final

import orjson

from backends.base import ClientRequest, Endpoint, Load, LoadParseError, Runtime
from backends.openai_compat import OpenAICompatAdapter, force_include_usage, prefix_hit_rate


def _fields(names: str) -> frozenset[str]:
    return frozenset(names.split())


_COMMON: Final = _fields(
    """
    model frequency_penalty logit_bias logprobs n presence_penalty response_format seed stop stream
    stream_options temperature top_p user best_of use_beam_search top_k top_p_min min_p repetition_penalty
    length_penalty early_stopping stop_token_ids include_stop_str_in_output ignore_eos min_tokens
    skip_special_tokens spaces_between_special_tokens truncate_prompt_tokens lora_request add_special_tokens
    disaggregated_params thinking_token_budget prompt_ignore_length
    """
)
CHAT_FIELDS: Final = _COMMON | _fields(
    """
    messages top_logprobs max_tokens max_completion_tokens tools tool_choice parallel_tool_calls
    reasoning_effort echo add_generation_prompt documents chat_template chat_template_kwargs cache_salt
    mm_processor_kwargs prompt_token_ids
    """
)
COMPLETION_FIELDS: Final = _COMMON | _fields("prompt echo max_tokens suffix return_context_logits detokenize")
# `ResponsesRequest` (openai_protocol.py): the OpenAI fields it declares (its `priority` is dropped, as above)
RESPONSES_FIELDS: Final = _fields(
    """
    background include input instructions max_output_tokens max_tool_calls metadata model parallel_tool_calls
    previous_response_id prompt reasoning service_tier store stream temperature text tool_choice tools
    top_logprobs top_p truncation user stream_options
    """
)
_ALLOWED: Final = {
    Endpoint.CHAT: CHAT_FIELDS, Endpoint.COMPLETIONS: COMPLETION_FIELDS, Endpoint.RESPONSES: RESPONSES_FIELDS,
}
STREAM_OPTION_FIELDS: Final = frozenset({"include_usage", "continuous_usage_stats"})


def _num(obj: dict[str, Any], key: str) -> float | None:
    value = obj.get(key)
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return None


def _sum(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) if present else None


class TRTLLMAdapter(OpenAICompatAdapter):
    __slots__ = ()

    def __init__(self) -> None:
        super().__init__(Runtime.TRTLLM)

    def prepare_body(self, req: ClientRequest, *, model: str) -> dict[str, Any]:
        allowed = _ALLOWED.get(req.endpoint)
        if allowed is None:  # embeddings: the client's fields go as they are (trtllm's 400 names a bad one)
            return {**req.body, "model": model}
        body = {k: v for k, v in req.body.items() if k in allowed}
        body["model"] = model
        if req.endpoint is Endpoint.RESPONSES:
            return body
        # trtllm rejects stream_options without stream (400), and unknown keys inside it.
        body.pop("stream_options", None)
        if req.stream:
            options = force_include_usage(req.body.get("stream_options"))
            if isinstance(options, dict):
                options = {k: v for k, v in options.items() if k in STREAM_OPTION_FIELDS}
            body["stream_options"] = options
        return body

    def parse_load(self, body: bytes, previous: Load | None) -> Load:
        """Newest iteration per attention-DP rank; `[]` keeps the previous snapshot."""
        try:
            rows = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise LoadParseError(f"trtllm-serve /metrics is not JSON: {exc}") from exc
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise LoadParseError("trtllm-serve /metrics is not a JSON array of objects")
        if not rows:
            return previous if previous is not None else Load()
        newest: dict[object, dict[str, Any]] = {}
        for row in rows:  # oldest first; later rows overwrite
            newest[row.get("attentionDpRank", 0)] = row
        latest = list(newest.values())
        kv_stats = [r["kvCacheStats"] for r in latest if isinstance(r.get("kvCacheStats"), dict)]
        used = _sum([_num(k, "usedNumBlocks") for k in kv_stats])
        capacity = _sum([_num(k, "maxNumBlocks") for k in kv_stats])
        reused = _sum([_num(k, "reusedBlocks") for k in kv_stats])
        missed = _sum([_num(k, "missedBlocks") for k in kv_stats])
        block = next((b for k in kv_stats if (b := _num(k, "tokensPerBlock")) is not None), None)
        # Blocks -> tokens so the totals share the unit of the other runtimes (the ratio is unchanged).
        scale = block or 1.0
        hits = reused * scale if reused is not None and missed is not None else None
        queries = (reused + missed) * scale if reused is not None and missed is not None else None
        rate = prefix_hit_rate(hits, queries, previous)
        if rate is None and kv_stats:
            rate = _num(kv_stats[-1], "cacheHitRate")
        return Load(
            running=_sum([_num(r, "numActiveRequests") for r in latest]),
            waiting=_sum([_num(r, "numQueuedRequests") for r in latest]),
            kv_usage=used / capacity if used is not None and capacity else None,
            prefix_hit_rate=rate,
            block_size=int(block) if block is not None else None,
            prefix_queries_total=queries,
            prefix_hits_total=hits,
        )
