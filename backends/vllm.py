"""vLLM's OpenAI server: health on `/health`, load from its Prometheus `/metrics`.

vLLM renamed its KV and prefix-cache metrics in 0.10/0.11 (`gpu_` prefix dropped), so both names are
read. With data parallelism every engine reports its own series (label `engine`): queue lengths add
up, KV fractions are averaged.
"""

from __future__ import annotations

from backends import prom
from backends.base import Load, LoadParseError, Runtime
from backends.openai_compat import OpenAICompatAdapter, prefix_hit_rate


def _first(*values: float | None) -> float | None:
    return next((v for v in values if v is not None), None)


class VLLMAdapter(OpenAICompatAdapter):
    __slots__ = ()

    def __init__(self) -> None:
        super().__init__(Runtime.VLLM)

    def parse_load(self, body: bytes, previous: Load | None) -> Load:
        m = prom.parse(body)
        running = m.sum("vllm:num_requests_running")
        waiting = m.sum("vllm:num_requests_waiting")
        kv = _first(m.mean("vllm:kv_cache_usage_perc"), m.mean("vllm:gpu_cache_usage_perc"))
        hits = _first(m.counter("vllm:prefix_cache_hits"), m.counter("vllm:gpu_prefix_cache_hits"))
        queries = _first(m.counter("vllm:prefix_cache_queries"), m.counter("vllm:gpu_prefix_cache_queries"))
        if running is None and waiting is None and kv is None:
            raise LoadParseError("no vLLM load metrics (vllm:num_requests_*, vllm:kv_cache_usage_perc)")
        return Load(
            running=running,
            waiting=waiting,
            kv_usage=kv,
            prefix_hit_rate=prefix_hit_rate(hits, queries, previous),
            block_size=prom.to_int(m.label("vllm:cache_config_info", "block_size")),
            prefix_queries_total=queries,
            prefix_hits_total=hits,
        )
