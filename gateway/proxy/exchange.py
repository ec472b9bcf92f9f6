"""One client request's journey through the gateway, and what we conclude from it at the end."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from statistics import fmean

from backends.base import Usage

from ..errors import BackendError
from ..observability.metrics import NONE
from ..routing import NO_FEATURES, Decision, RequestFeatures, SlaTarget
from ..routing.state import Ticket
from ..state.pool import BackendState
from .request import ParsedRequest

_IDS = random.Random()  # seeded from os.urandom once; request ids need uniqueness, not secrecy


def new_request_id() -> str:
    """32 hex digits, like a uuid4 without the syscall that os.urandom costs on every request."""
    return f"{_IDS.getrandbits(128):032x}"


def request_id(client_value: str | None) -> str:
    """The client's `x-request-id` when it is usable (printable, at most 128 characters: it is echoed
    in headers and sent upstream), else a new one."""
    if client_value and len(client_value) <= 128 and client_value.isprintable():
        return client_value
    return new_request_id()


@dataclass(slots=True)
class Exchange:
    """Mutable per-request bookkeeping, threaded through parsing, routing, retries and relaying."""

    request_id: str
    started: float
    model: str = NONE  # the route's model once known (a metrics label, so never the raw client value)
    parsed: ParsedRequest | None = None
    features: RequestFeatures = NO_FEATURES
    arm: str | None = None
    tried: set[str] = field(default_factory=set)
    last: BackendState | None = None  # the backend of the latest attempt
    error: BackendError | None = None  # the latest retryable failure
    decision: Decision | None = None
    ticket: Ticket | None = None
    sent_at: float = 0.0


def sla_outcome(
    target: SlaTarget | None,
    *,
    ok: bool,
    ttft_s: float | None,
    gaps_s: Sequence[float],
    duration_s: float,
    usage: Usage | None,
) -> str | None:
    """"met" or "missed" for a request that carried SLA targets, None otherwise.

    TTFT is the gateway-measured first event of a stream; for a non-streaming request the whole
    response is its first token, so its duration stands in. TPOT is the mean gap between streamed
    events, or (duration - TTFT) / (tokens - 1) for non-streams, where TTFT is unknown and the check
    is therefore done on the duration alone.
    """
    if target is None:
        return None
    if not ok:
        return "missed"
    if target.ttft_s is not None and (ttft_s if ttft_s is not None else duration_s) > target.ttft_s:
        return "missed"
    if target.tpot_s is not None and gaps_s and fmean(gaps_s) > target.tpot_s:
        return "missed"
    if target.tpot_s is not None and not gaps_s and usage is not None and usage.completion_tokens > 1:
        budget = (target.ttft_s or 0.0) + target.tpot_s * (usage.completion_tokens - 1)
        if duration_s > budget:
            return "missed"
    return "met"
