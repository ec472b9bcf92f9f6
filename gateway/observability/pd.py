"""Prefill/decode disaggregation's figures: the decisions, each leg, and each pair.

A disaggregated request is one client request (counted once, by accounting, with the decode leg's
usage, in the usual families under the decode backend); these families say what its legs did:

- `gateway_pd_decisions_total{model, decision, reason}`: split or whole, and why
  (`routing.disaggregation`);
- `gateway_pd_legs_total{model, role, backend, outcome}`: every leg sent, by its outcome (`ok`,
  `no_params`: a prefill answered without usable kv_transfer_params where the route expects them,
  or the backend error's kind); a failed prefill is judged against its own backend only;
- `gateway_pd_prefill_seconds{model, backend}`: leg 1's time, request sent to answer read;
- `gateway_pd_transfer_seconds{model, prefill, decode}`: from the prefill's end to the decode's
  first token (streams), the KV transfer plus the decode's admission;
- `gateway_pd_ttft_seconds{model, prefill, decode}`: the true TTFT, client request to the first
  decode token, prefill leg included (streams);
- `gateway_pd_requests_total{model, prefill, decode, outcome}`: each split request by how its pair
  did: `ok`, `handoff_failed` (no usable params: the decode recomputed the prefill),
  `prefill_failed` (no prefill answered: the decode served it alone; prefill="none"),
  `finished` (trtllm: the context leg's answer was the whole answer, returned as is), or
  `decode_failed`.

Labels are config names only. Every family adds up over workers (`Merge.SUM`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from prometheus_client import CollectorRegistry

from ..merge_rules import Merge, declare
from ..routing.state import HANDOFF_BEFORE, HANDOFF_BESIDE
from .lockfree import FastCounter, FastHistogram

PREFILL_BUCKETS: Final = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96)
TRANSFER_BUCKETS: Final = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12)
TTFT_BUCKETS: Final = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80)
NO_PREFILL: Final = "none"

FAMILIES: Final = ("gateway_pd_decisions", "gateway_pd_legs", "gateway_pd_prefill_seconds",
                   "gateway_pd_transfer_seconds", "gateway_pd_ttft_seconds", "gateway_pd_requests")
declare(Merge.SUM, *FAMILIES)


@dataclass(slots=True)
class PairRecord:
    """What a split request's prefill leg did, for accounting to record with the decode's outcome."""

    reason: str  # the plan's reason (`PairPlan.reason`)
    prefill: str | None = None  # the backend whose prefill answered (None: none did)
    prefill_s: float | None = None
    prefill_ended_at: float | None = None  # on the request clock
    # ok | failed (params expected, none usable) | prefill_failed | finished (trtllm: the context leg's
    # answer was the whole answer)
    handoff: str = "ok"
    task: asyncio.Future[None] | None = None  # a prefill leg running beside the decode's (SGLang)
    # with `task`: when that prefill failed, sets the exchange up for the next decode attempt and
    # says where to send it (another pair, or the request whole)
    again: Callable[[], list[str]] | None = None

    @property
    def remote(self) -> str | None:
        """Where the decode leg's prompt KV comes from, for its routing ticket (`Ticket.remote`):
        None when the decode computes it (no usable handoff)."""
        if self.handoff != "ok":
            return None
        return HANDOFF_BESIDE if self.task is not None else HANDOFF_BEFORE


class PdMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        def counter(name: str, doc: str, labels: tuple[str, ...]) -> FastCounter:
            c = FastCounter(name, doc, labels)
            registry.register(c)
            return c

        def histogram(name: str, doc: str, labels: tuple[str, ...], buckets: tuple[float, ...]) -> FastHistogram:
            h = FastHistogram(name, doc, labels, buckets)
            registry.register(h)
            return h

        self.decisions = counter("gateway_pd_decisions", "Disaggregation decisions (split|whole) by reason.",
                                 ("model", "decision", "reason"))
        self.legs = counter("gateway_pd_legs", "Legs of disaggregated requests by role and outcome.",
                            ("model", "role", "backend", "outcome"))
        self.prefill = histogram("gateway_pd_prefill_seconds", "Prefill leg time, sent to answered.",
                                 ("model", "backend"), PREFILL_BUCKETS)
        self.transfer = histogram("gateway_pd_transfer_seconds",
                                  "From the prefill leg's end to the decode's first token (streams).",
                                  ("model", "prefill", "decode"), TRANSFER_BUCKETS)
        self.ttft = histogram("gateway_pd_ttft_seconds",
                              "True TTFT of split requests: arrival to the decode's first token (streams).",
                              ("model", "prefill", "decode"), TTFT_BUCKETS)
        self.requests = counter("gateway_pd_requests", "Split requests by how their pair did.",
                                ("model", "prefill", "decode", "outcome"))

    def decision(self, model: str, decision: str, reason: str) -> None:
        self.decisions.labels(model, decision, reason).inc()

    def leg(self, model: str, role: str, backend: str, outcome: str, seconds: float | None = None) -> None:
        self.legs.labels(model, role, backend, outcome).inc()
        if seconds is not None and role == "prefill":
            self.prefill.labels(model, backend).observe(seconds)

    def finish(self, model: str, pair: PairRecord, decode: str, *, ok: bool, first_token_at: float | None,
               started: float) -> None:
        """A split request is over (accounting's `finish`): its pair's figures."""
        prefill = pair.prefill or NO_PREFILL
        if not ok:
            outcome = "decode_failed"
        elif pair.handoff == "prefill_failed":
            outcome = "prefill_failed"
        elif pair.handoff == "failed":
            outcome = "handoff_failed"
        elif pair.handoff == "finished":
            outcome = "finished"
        else:
            outcome = "ok"
        self.requests.labels(model, prefill, decode, outcome).inc()
        if first_token_at is None or not ok:
            return
        self.ttft.labels(model, prefill, decode).observe(first_token_at - started)
        if pair.prefill_ended_at is not None:
            self.transfer.labels(model, prefill, decode).observe(max(0.0, first_token_at - pair.prefill_ended_at))
