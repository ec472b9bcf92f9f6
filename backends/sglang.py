"""SGLang's OpenAI server: cheap liveness on `/ping`, readiness on `/health`, load from `/metrics`.

`/health` runs a 1-token generation and may take up to SGLANG_HEALTH_CHECK_TIMEOUT (20 s) before it
answers 503, hence the long readiness timeout. Metrics need `--enable-metrics`.

Scheduler gauges are published per rank. Ranks of one data-parallel group (tp/pp/ep) report the same
scheduler state, so within a `dp_rank` the maximum is taken, and across DP groups queues are summed
while fractions are averaged; each DP group's own figures are kept in `Load.per_rank` (by `dp_rank`,
which SGLang adds to the scheduler's labels when it runs data-parallel).
"""

from __future__ import annotations

import math

from backends import prom
from backends.base import Load, LoadParseError, Probe, Runtime
from backends.openai_compat import OpenAICompatAdapter


def _per_dp_group(m: prom.Scrape, name: str) -> list[float]:
    groups: dict[str, float] = {}
    for s in m.select(name):
        key = s.labels.get("dp_rank", "")
        groups[key] = max(groups.get(key, s.value), s.value)
    return list(groups.values())


def _sum(values: list[float]) -> float | None:
    return math.fsum(values) if values else None


def _mean(values: list[float]) -> float | None:
    return math.fsum(values) / len(values) if values else None


def _per_rank(m: prom.Scrape) -> tuple[Load, ...]:
    """Each DP rank's running, queued and KV usage (the maximum over the rank's tp/pp/ep ranks);
    empty without `dp_rank` labels of two ranks or more."""
    by: dict[int, dict[str, float]] = {}
    for field, name in (("running", "sglang:num_running_reqs"), ("waiting", "sglang:num_queue_reqs"),
                        ("kv_usage", "sglang:token_usage")):
        for s in m.select(name):
            rank = prom.to_int(s.labels.get("dp_rank"))
            if rank is not None and 0 <= rank < 1024:
                values = by.setdefault(rank, {})
                values[field] = max(values.get(field, s.value), s.value)
    if len(by) < 2:
        return ()
    return tuple(Load(running=by.get(r, {}).get("running"), waiting=by.get(r, {}).get("waiting"),
                      kv_usage=by.get(r, {}).get("kv_usage")) for r in range(max(by) + 1))


class SGLangAdapter(OpenAICompatAdapter):
    __slots__ = ()

    def __init__(self) -> None:
        super().__init__(Runtime.SGLANG)

    @property
    def liveness(self) -> Probe:
        return Probe("/ping")

    @property
    def readiness(self) -> Probe:
        return Probe("/health", timeout_s=25.0)

    def parse_load(self, body: bytes, previous: Load | None) -> Load:
        m = prom.parse(body)
        running = _sum(_per_dp_group(m, "sglang:num_running_reqs"))
        waiting = _sum(_per_dp_group(m, "sglang:num_queue_reqs"))
        kv = _mean(_per_dp_group(m, "sglang:token_usage"))
        if running is None and waiting is None and kv is None:
            raise LoadParseError("no SGLang load metrics (is --enable-metrics set?)")
        page_sizes = _per_dp_group(m, "sglang:page_size")
        # Cumulative token counters, when exposed, for callers that want an interval ratio.
        hits = m.counter("sglang:cached_tokens")
        queries = m.counter("sglang:prompt_tokens")
        return Load(
            running=running,
            waiting=waiting,
            kv_usage=kv,
            prefix_hit_rate=_mean(_per_dp_group(m, "sglang:cache_hit_rate")),
            block_size=prom.to_int(max(page_sizes)) if page_sizes else 1,
            prefix_queries_total=queries if hits is not None else None,
            prefix_hits_total=hits if queries is not None else None,
            per_rank=_per_rank(m),
        )
