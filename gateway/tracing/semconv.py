"""Every span attribute name and value the gateway writes, in one place.

GenAI names are those of the semantic conventions at v1.41.0, their last release in the main
conventions repository (`docs/gen-ai/gen-ai-spans.md` there). The GenAI conventions have since
moved to their own repository, which renamed or refined a few: with
`OTEL_SEMCONV_STABILITY_OPT_IN=gen_ai_latest_experimental` (a comma-separated list; the value the
conventions define for this transition) the newer ones are written instead (`Names.latest`):

- `gen_ai.usage.cache_creation.input_tokens` is `gen_ai.usage.cache_write.input_tokens`;
- `gen_ai.response.finish_reasons` reports `error` for a generation that ended abnormally (a stream
  cut before its last event, an engine error) instead of leaving it out;
- `gen_ai.request.top_k` is an int (a double at v1.41);
- new: `gen_ai.request.previous_response.id` (the Responses API's `previous_response_id`) and
  `gen_ai.request.reasoning.level` (`reasoning_effort`, or Responses' `reasoning.effort`).

What the conventions have no name for is under `gateway.*`: the backend and runtime, the routing
decision, retries, the A/B arm, shadow copies and the request's cost. HTTP and network names
(`server.address`, `server.port`, `error.type`, `http.response.status_code`) are the stable
general conventions.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from backends.base import Endpoint

OPT_IN_ENV: Final = "OTEL_SEMCONV_STABILITY_OPT_IN"
LATEST: Final = "gen_ai_latest_experimental"

# -- GenAI (v1.41.0) ----------------------------------------------------------------------------------
GEN_AI_OPERATION_NAME: Final = "gen_ai.operation.name"
GEN_AI_PROVIDER_NAME: Final = "gen_ai.provider.name"
GEN_AI_REQUEST_MODEL: Final = "gen_ai.request.model"
GEN_AI_REQUEST_MAX_TOKENS: Final = "gen_ai.request.max_tokens"
GEN_AI_REQUEST_STREAM: Final = "gen_ai.request.stream"
GEN_AI_REQUEST_TEMPERATURE: Final = "gen_ai.request.temperature"
GEN_AI_REQUEST_TOP_P: Final = "gen_ai.request.top_p"
GEN_AI_REQUEST_TOP_K: Final = "gen_ai.request.top_k"
GEN_AI_REQUEST_SEED: Final = "gen_ai.request.seed"
GEN_AI_REQUEST_CHOICE_COUNT: Final = "gen_ai.request.choice.count"
GEN_AI_RESPONSE_ID: Final = "gen_ai.response.id"
GEN_AI_RESPONSE_MODEL: Final = "gen_ai.response.model"
GEN_AI_RESPONSE_FINISH_REASONS: Final = "gen_ai.response.finish_reasons"
GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK: Final = "gen_ai.response.time_to_first_chunk"
GEN_AI_USAGE_INPUT_TOKENS: Final = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS: Final = "gen_ai.usage.output_tokens"
GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: Final = "gen_ai.usage.cache_read.input_tokens"
GEN_AI_USAGE_CACHE_CREATION_INPUT_TOKENS: Final = "gen_ai.usage.cache_creation.input_tokens"  # v1.41
# -- GenAI, the conventions repository's newer names (behind the opt-in) --------------------------------
GEN_AI_USAGE_CACHE_WRITE_INPUT_TOKENS: Final = "gen_ai.usage.cache_write.input_tokens"
GEN_AI_REQUEST_PREVIOUS_RESPONSE_ID: Final = "gen_ai.request.previous_response.id"
GEN_AI_REQUEST_REASONING_LEVEL: Final = "gen_ai.request.reasoning.level"
FINISH_ERROR: Final = "error"

# -- general conventions (stable) ---------------------------------------------------------------------
SERVER_ADDRESS: Final = "server.address"
SERVER_PORT: Final = "server.port"
ERROR_TYPE: Final = "error.type"
HTTP_RESPONSE_STATUS_CODE: Final = "http.response.status_code"
ERROR_OTHER: Final = "_OTHER"

# -- the gateway's own ----------------------------------------------------------------------------------
GATEWAY_REQUEST_ID: Final = "gateway.request.id"  # the client's x-request-id, or ours
GATEWAY_UPSTREAM_REQUEST_ID: Final = "gateway.upstream.request.id"  # the id an attempt was sent upstream with
GATEWAY_ENDPOINT: Final = "gateway.endpoint"  # chat, completions, responses, embeddings, tokenize, detokenize
GATEWAY_STATUS: Final = "gateway.status"  # the outcome label of gateway_requests_total (200, 503, client_closed...)
GATEWAY_BACKEND: Final = "gateway.backend"
GATEWAY_RUNTIME: Final = "gateway.runtime"
GATEWAY_RETRIES: Final = "gateway.retries"  # attempts after the first
GATEWAY_ATTEMPT: Final = "gateway.attempt"  # 1 for the first attempt, 2 for its retry...
GATEWAY_COST_USD: Final = "gateway.cost.usd"  # price x the request's share of the backend's measured throughput
GATEWAY_PRICE_USD_PER_HOUR: Final = "gateway.backend.usd_per_hour"  # the backend's configured price
GATEWAY_USAGE_ESTIMATED: Final = "gateway.usage.estimated"  # usage is the gateway's estimate (no engine figure)
GATEWAY_AB_ARM: Final = "gateway.ab.arm"
GATEWAY_AB_EXCLUDED: Final = "gateway.ab.excluded"  # why a split route's request is not an A/B sample
GATEWAY_SHADOW: Final = "gateway.shadow"  # a mirrored copy: its answer is discarded
GATEWAY_LEG: Final = "gateway.leg"  # prefill | decode, for a disaggregated request's legs
GATEWAY_ROUTING_POLICY: Final = "gateway.routing.policy"
GATEWAY_ROUTING_REASON: Final = "gateway.routing.reason"
GATEWAY_ROUTING_CANDIDATES: Final = "gateway.routing.candidates"
GATEWAY_ROUTING_CHOSEN: Final = "gateway.routing.chosen"
GATEWAY_ROUTING_EXPECTED_CACHED_TOKENS: Final = "gateway.routing.expected_cached_tokens"
GATEWAY_ROUTING_PREDICTED_TTFT: Final = "gateway.routing.predicted_ttft_s"
GATEWAY_SLA_TTFT: Final = "gateway.sla.ttft_s"  # the client's targets (x-sla-ttft-ms, x-sla-tpot-ms)
GATEWAY_SLA_TPOT: Final = "gateway.sla.tpot_s"
GATEWAY_SLA_VERDICT: Final = "gateway.sla.verdict"  # routing's: predicted_met | predicted_miss | rejected
GATEWAY_SLA_OUTCOME: Final = "gateway.sla.outcome"  # measured at the end: met | missed

# Span names of the gateway's own steps (a request's span and its attempts are named as the
# conventions say: `{gen_ai.operation.name} {gen_ai.request.model}`).
ROUTE_SPAN: Final = "route"

# `gen_ai.operation.name` per endpoint (the Responses API is an inference operation: chat).
OPERATIONS: Final[Mapping[Endpoint, str]] = {
    Endpoint.CHAT: "chat", Endpoint.COMPLETIONS: "text_completion", Endpoint.RESPONSES: "chat",
    Endpoint.EMBEDDINGS: "embeddings", Endpoint.TOKENIZE: "tokenize", Endpoint.DETOKENIZE: "detokenize",
}


@dataclass(frozen=True, slots=True)
class Names:
    """The names that depend on which GenAI conventions are written (see the module docstring)."""

    latest: bool

    @property
    def cache_write_input_tokens(self) -> str:
        return GEN_AI_USAGE_CACHE_WRITE_INPUT_TOKENS if self.latest else GEN_AI_USAGE_CACHE_CREATION_INPUT_TOKENS

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Names:
        values = {v.strip() for v in env.get(OPT_IN_ENV, "").split(",")}
        return cls(latest=LATEST in values)


def span_name(operation: str, model: str | None) -> str:
    """`{gen_ai.operation.name} {gen_ai.request.model}`, or the operation alone before the model is known."""
    return f"{operation} {model}" if model else operation
