"""Per-arm outcome families, so a dashboard can compare the arms of an A/B split directly.

The request families are per backend, and an arm is a set of backends that another arm or route may
share, so arm figures cannot be joined from them. This observer of every finished request (a
`Recorder` observer) counts the requests that carried an arm, by the arm:

- `gateway_arm_responses_total{model, arm, status}`: finished requests by outcome (the assignment
  counter `gateway_arm_requests_total` counts them when the arm is chosen);
- `gateway_arm_tokens_total{model, arm, kind}`: prompt and completion tokens;
- `gateway_arm_time_to_first_token_seconds{model, arm}` and
  `gateway_arm_inter_token_latency_seconds{model, arm}`: the same histograms, buckets and
  definitions as the per-backend ones.

Requests of routes without a split cost one attribute test. Shadow copies are not client requests
and never reach the observers.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from ..merge_rules import Merge, declare
from .lockfree import CounterChild, FastCounter, FastHistogram, HistogramChild
from .metrics import TTFT_BUCKETS
from .outcome import ITL_BUCKETS, Outcome


@dataclass(slots=True)
class _ArmSeries:
    prompt: CounterChild
    completion: CounterChild
    ttft: HistogramChild
    itl: HistogramChild
    statuses: dict[str, CounterChild]


class ArmMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ("model", "arm")
        self.responses = FastCounter(
            "gateway_arm_responses", "Finished requests of each A/B arm, by outcome.", (*labels, "status"))
        self.tokens = FastCounter(
            "gateway_arm_tokens", "Tokens of each A/B arm's requests, by kind.", (*labels, "kind"))
        self.ttft = FastHistogram(
            "gateway_arm_time_to_first_token_seconds", "Time to the first streamed event, per A/B arm.", labels,
            TTFT_BUCKETS,
        )
        self.itl = FastHistogram(
            "gateway_arm_inter_token_latency_seconds", "Gap between consecutive streamed events, per A/B arm.", labels,
            ITL_BUCKETS,
        )
        for family in (self.responses, self.tokens, self.ttft, self.itl):
            declare(Merge.SUM, family.name)  # each worker counts the requests it served
            registry.register(family)
        self._series: dict[tuple[str, str], _ArmSeries] = {}

    def record(self, o: Outcome) -> None:
        if o.arm is None:
            return
        key = (o.model, o.arm)
        s = self._series.get(key)
        if s is None:
            s = self._series[key] = _ArmSeries(
                prompt=self.tokens.labels(*key, "prompt"), completion=self.tokens.labels(*key, "completion"),
                ttft=self.ttft.labels(*key), itl=self.itl.labels(*key), statuses={},
            )
        status = s.statuses.get(o.status)
        if status is None:
            status = s.statuses[o.status] = self.responses.labels(*key, o.status)
        status.inc()
        if o.usage is not None:
            s.prompt.inc(o.usage.prompt_tokens)
            s.completion.inc(o.usage.completion_tokens)
        if o.ttft_s is not None:
            s.ttft.observe(o.ttft_s)
        if o.gaps is not None and o.gaps.count:
            s.itl.observe_counted(((c.value, c.count) for c in o.gaps.hist.cells.values()), o.gaps.sum)
