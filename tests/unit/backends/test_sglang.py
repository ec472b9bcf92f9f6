from __future__ import annotations

import pytest

from backends.base import Load, LoadParseError, Probe
from backends.sglang import SGLangAdapter

ADAPTER = SGLangAdapter()

# Spec 3.7 example (multiprocess output: labels sorted, no _created series).
LABELS = b'engine_type="unified",model_name="deepseek-ai/DeepSeek-V3",moe_ep_rank="0",pp_rank="0",tp_rank="0"'
SPEC_METRICS = b"""# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{{L}} 42.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{{L}} 3.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{{L}} 0.2
# HELP sglang:cache_hit_rate The prefix cache hit rate.
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{{L}} 0.41
# HELP sglang:gen_throughput The generation throughput (token/s).
# TYPE sglang:gen_throughput gauge
sglang:gen_throughput{{L}} 2875.3
# HELP sglang:prompt_tokens_total Number of prefill tokens processed.
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{engine_type="unified",is_streaming="true",model_name="deepseek-ai/DeepSeek-V3"} 9.1e+06
# HELP sglang:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE sglang:time_to_first_token_seconds histogram
sglang:time_to_first_token_seconds_bucket{engine_type="unified",is_streaming="true",le="0.1",model_name="m"} 12.0
""".replace(b"{L}", LABELS)


def test_probes() -> None:
    assert ADAPTER.liveness == Probe("/ping")
    assert ADAPTER.readiness.path == "/health"
    assert ADAPTER.readiness.timeout_s >= 20  # /health runs a 1-token generation, 503 only after 20 s
    assert ADAPTER.load_path == "/metrics"


def test_parse_load_on_spec_example() -> None:
    load = ADAPTER.parse_load(SPEC_METRICS, None)
    # Without sglang:cached_tokens_total there are no cumulative hit counters.
    assert load == Load(running=42.0, waiting=3.0, kv_usage=0.2, prefix_hit_rate=0.41, block_size=1)


def _gauge(name: str, value: float, **labels: str) -> str:
    rendered = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return f"sglang:{name}{{{rendered}}} {value}\n"


def test_tp_ranks_of_one_dp_group_are_not_double_counted_and_dp_groups_add_up() -> None:
    lines = ["# TYPE sglang:num_running_reqs gauge\n"]
    for dp, running in (("0", 10.0), ("1", 6.0)):
        for tp in ("0", "1"):
            lines.append(_gauge("num_running_reqs", running, dp_rank=dp, tp_rank=tp))
            lines.append(_gauge("num_queue_reqs", 1.0, dp_rank=dp, tp_rank=tp))
            lines.append(_gauge("token_usage", 0.2 if dp == "0" else 0.4, dp_rank=dp, tp_rank=tp))
            lines.append(_gauge("page_size", 64.0, dp_rank=dp, tp_rank=tp))
    lines.append('sglang:cached_tokens_total{cache_source="device"} 30.0\n')
    lines.append('sglang:cached_tokens_total{cache_source="host"} 10.0\n')
    lines.append('sglang:prompt_tokens_total{is_streaming="true"} 100.0\n')
    load = ADAPTER.parse_load("".join(lines).encode(), None)
    assert (load.running, load.waiting, load.block_size) == (16.0, 2.0, 64)
    assert load.kv_usage == pytest.approx(0.3)
    assert (load.prefix_hits_total, load.prefix_queries_total) == (40.0, 100.0)
    assert load.prefix_hit_rate is None  # no sglang:cache_hit_rate gauge in this body


@pytest.mark.parametrize("body", [b"", b"\x00\x01", b"Not Found"])
def test_malformed_or_metricless_bodies_raise_load_parse_error(body: bytes) -> None:
    with pytest.raises(LoadParseError):
        ADAPTER.parse_load(body, None)
