"""One client request's journey through the gateway: the mutable record every step fills in, and
what the request's SLA outcome was. Accounting reads it once, at the end (`accounting.Accounting`)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Final

from backends.base import Endpoint, Usage

from ..errors import BackendError
from ..observability.outcome import NONE, Gaps
from ..observability.pd import PairRecord
from ..routing import NO_FEATURES, Decision, RequestFeatures, SlaTarget
from ..routing.capabilities import Needs
from ..routing.state import Ticket
from ..settings import ApiKey
from ..state.pool import BackendState, Pool
from ..tracing.trace import Trace
from .request import ParsedRequest
from .sse import StreamStats

# Request ids need uniqueness, not secrecy: 64 random bits per process (from os.urandom, once) and a
# counter. A counter's decimal digits cost a fraction of formatting a random 128-bit number.
_PROCESS: Final = f"{random.SystemRandom().getrandbits(64):016x}-"
_issued = 0


def new_request_id() -> str:
    """Unique across processes and within one (`<16 hex digits>-<n>`), without a syscall per request."""
    global _issued
    _issued += 1
    return _PROCESS + str(_issued)


def request_id(client_value: str | None) -> str:
    """The client's `x-request-id` when it is usable (printable, at most 128 characters: it is echoed
    in headers and logged), else a new one. It is the client's: upstream, every attempt carries an id
    of the gateway's own (`Exchange.upstream_id`), because engines key requests by that header."""
    if client_value and len(client_value) <= 128 and client_value.isprintable():
        return client_value
    return new_request_id()


@dataclass(slots=True)
class Exchange:
    """Mutable per-request bookkeeping, threaded through parsing, routing, retries and relaying."""

    request_id: Final[str]  # the client's (echoed back), or ours when it sent none
    endpoint: Final[Endpoint]
    started: Final[float]
    # How it ended. Anything that does not set it explicitly ended in the gateway's own failure.
    status: str
    model: str  # the route's model once known (a metrics label, so never the raw client value)
    key: ApiKey | None
    parsed: ParsedRequest | None
    features: RequestFeatures
    needs: Needs | None  # what the request needs from a backend (`routing.capabilities`)
    capable: tuple[str, ...]  # the route's backends that can serve it
    bridged: frozenset[str]  # ... of which these serve it through the Responses-to-chat bridge
    arm: str | None
    ab_excluded: str | None  # why this request is not an A/B sample (e.g. only one arm can serve it)
    rate_headers: dict[str, str] | None  # the key's x-ratelimit-* headers
    tried: Final[set[str]]
    last: BackendState | None  # the backend of the latest attempt
    upstream_id: str  # the id the latest attempt was sent upstream with
    error: BackendError | None  # the latest failed attempt's error
    decision: Decision | None
    ticket: Ticket | None  # the routing ticket of the attempt that got a response
    rank: int | None  # the data-parallel rank the latest attempt was pinned to (None: not pinned)
    sent_at: float
    engine_worked: bool  # the latest attempt reached an engine that may have generated
    usage: Usage | None  # the engine's usage (non-streaming responses)
    stream: StreamStats | None  # what the SSE relay measured (streams)
    response_id: str | None  # a Responses answer's id (stored responses are routed back to it)
    # the backend's verdict on the response it opened (outlier detection): True served, False failed,
    # None not the backend's doing (the client left, the gateway's own deadline)
    verdict: bool | None
    pool: Pool | None  # the pool of the config generation serving it
    recorded: bool
    trace: Trace | None  # its trace when tracing is on (`gateway.tracing`), else None
    pair: PairRecord | None  # a split (disaggregated) request's prefill leg (`proxy.pairs`)
    topology: str | None  # on a disaggregated route: "split" or "whole"
    planned: str | None  # the routing unit its next decision takes, when healthy (a split's decode)

    def __init__(
        self, request_id: str, endpoint: Endpoint, started: float, *, status: str = "500", model: str = NONE,
        parsed: ParsedRequest | None = None, features: RequestFeatures = NO_FEATURES, arm: str | None = None,
        capable: tuple[str, ...] = (), bridged: frozenset[str] = frozenset(), trace: Trace | None = None,
    ) -> None:
        self.request_id = request_id
        self.endpoint = endpoint
        self.started = started
        self.status = status
        self.model = model
        self.key = None
        self.parsed = parsed
        self.features = features
        self.needs = None
        self.capable = capable
        self.bridged = bridged
        self.arm = arm
        self.ab_excluded = None
        self.rate_headers = None
        self.tried = set()
        self.last = None
        self.upstream_id = ""
        self.error = None
        self.decision = None
        self.ticket = None
        self.rank = None
        self.sent_at = 0.0
        self.engine_worked = False
        self.usage = None
        self.stream = None
        self.response_id = None
        self.verdict = None
        self.pool = None
        self.recorded = False
        self.trace = trace
        self.pair = None
        self.topology = None
        self.planned = None


def sla_outcome(
    target: SlaTarget | None,
    *,
    ok: bool,
    ttft_s: float | None,
    gaps: Gaps | None,
    duration_s: float,
    usage: Usage | None,
) -> str | None:
    """"met" or "missed" for a request that carried SLA targets, None otherwise.

    TTFT is the gateway-measured first token of a stream; for a non-streaming request the whole
    response is its first token, so its duration stands in. TPOT is the mean gap between streamed
    tokens, or (duration - TTFT) / (tokens - 1) for non-streams, where TTFT is unknown and the check
    is therefore done on the duration alone.
    """
    if target is None:
        return None
    if not ok:
        return "missed"
    if target.ttft_s is not None and (ttft_s if ttft_s is not None else duration_s) > target.ttft_s:
        return "missed"
    mean = gaps.mean_s if gaps is not None else None
    if target.tpot_s is not None and mean is not None and mean > target.tpot_s:
        return "missed"
    if target.tpot_s is not None and mean is None and usage is not None and usage.completion_tokens > 1:
        budget = (target.ttft_s or 0.0) + target.tpot_s * (usage.completion_tokens - 1)
        if duration_s > budget:
            return "missed"
    return "met"
