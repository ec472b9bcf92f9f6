"""How a request is pinned to one data-parallel rank of a server, per runtime (pure byte transforms).

* vLLM reads the `X-data-parallel-rank` header (`OpenAIServing._get_data_parallel_rank`) on every
  generation endpoint; the body is untouched.
* SGLang reads `routed_dp_rank` in the chat and completions bodies (`data_parallel_rank` before its
  rename in PR #19268, 2026-02; `Backend.dp_rank_field` chooses). The field is appended to the
  serialised body (a compact JSON object, as `orjson.dumps` writes it) without parsing it again.
  Other SGLang endpoints are not pinned: its Responses and embeddings requests did not read a rank
  in the versions the gateway supports (the engine's own balancer places them).
* trtllm-serve and Triton take no rank (`gateway/rank_settings.py`).

A client's own rank fields never reach an engine: `CLIENT_RANK_FIELDS` are removed from every
request body when it is parsed, and no client header is forwarded upstream at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from backends.base import Runtime, UpstreamRequest

RANK_HEADER: Final = "x-data-parallel-rank"
# every body field an engine reads as a rank (SGLang's current and deprecated names, and the P/D
# decode leg's prefill rank): the gateway owns them
CLIENT_RANK_FIELDS: Final = ("routed_dp_rank", "data_parallel_rank", "disagg_prefill_dp_rank")
_BODY_PATHS: Final = frozenset({"/v1/chat/completions", "/v1/completions"})


@dataclass(frozen=True, slots=True)
class RankPin:
    """How one backend takes a rank: a header, or a body field (`field`, JSON-quoted bytes)."""

    header: bool
    field: bytes | None = None


def rank_pin(runtime: Runtime, field: str | None = None) -> RankPin | None:
    """How `runtime` takes a rank (`field`: SGLang's body field); None for a runtime that takes none."""
    if runtime is Runtime.VLLM:
        return RankPin(header=True)
    if runtime is Runtime.SGLANG:
        return RankPin(header=False, field=b'"' + (field or "routed_dp_rank").encode() + b'":')
    return None


def pinned(upstream: UpstreamRequest, pin: RankPin, rank: int) -> UpstreamRequest:
    """`upstream` pinned to data-parallel `rank` (unchanged where the runtime reads no rank)."""
    if pin.header:
        return UpstreamRequest(upstream.path, upstream.body, {**upstream.headers, RANK_HEADER: str(rank)})
    body = upstream.body
    field = pin.field
    if field is None or upstream.path not in _BODY_PATHS or len(body) < 2 or body[-1:] != b"}":
        return upstream
    sep = b"," if body != b"{}" else b""
    return UpstreamRequest(upstream.path, body[:-1] + sep + field + str(rank).encode() + b"}", upstream.headers)


def strip_client_ranks(body: dict[str, object]) -> None:
    """Remove the client's own rank fields from a parsed request body (in place)."""
    for name in CLIENT_RANK_FIELDS:
        body.pop(name, None)
