"""vLLM's OpenAI server: health on `/health`, load from its Prometheus `/metrics`.

vLLM renamed its KV and prefix-cache metrics in 0.10/0.11 (`gpu_` prefix dropped), so both names are
read. With data parallelism every engine (one per DP rank) reports its own series, labelled
`engine="<rank>"` (`PrometheusStatLogger`: labels `model_name`, `engine`): queue lengths add up, KV
fractions are averaged, and each rank's own figures are kept in `Load.per_rank`.
"""

from __future__ import annotations

from backends import prom
from backends.base import Load, LoadParseError, Runtime
from backends.openai_compat import OpenAICompatAdapter, prefix_hit_rate
from backends.prom import Scrape


def _first(*values: float | None) -> float | None:
    return next((v for v in values if v is not None), None)


def _per_engine(m: Scrape) -> tuple[Load, ...]:
    """Each engine's running, waiting and KV usage, by its `engine` label (its DP rank); empty when
    one engine reports (no data parallelism)."""
    by: dict[int, dict[str, float]] = {}
    for field, names in (("running", ("vllm:num_requests_running",)), ("waiting", ("vllm:num_requests_waiting",)),
                         ("kv_usage", ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"))):
        for name in names:
            samples = m.select(name)
            for s in samples:
                rank = prom.to_int(s.labels.get("engine"))
                if rank is not None and 0 <= rank < 1024:
                    by.setdefault(rank, {}).setdefault(field, s.value)
            if samples:
                break
    if len(by) < 2:
        return ()
    return tuple(Load(running=by.get(r, {}).get("running"), waiting=by.get(r, {}).get("waiting"),
                      kv_usage=by.get(r, {}).get("kv_usage")) for r in range(max(by) + 1))


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
            per_rank=_per_engine(m),
        )
