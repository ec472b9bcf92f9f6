"""Data parallelism (`--data-parallel-size N`): one server of N engines, each with its own batching,
prefix cache, KV-event publisher and metrics series, placed as the runtime's own front end does.

* Which engine serves a request: the rank the request names (vLLM: the `X-data-parallel-rank`
  header; SGLang: `routed_dp_rank`, or its deprecated alias `data_parallel_rank`, in the body),
  else the runtime's own balancer. vLLM's `DPLBAsyncMPClient.get_core_engine_for_request`: the
  engine of least `waiting * 4 + running`, scanning from engine 0, first wins ties (it counts the
  request it just sent as waiting until the next stats update; here the engines' live counts
  already include it). SGLang's `DataParallelController`: round robin by default (`--load-balance-
  method auto` outside P/D prefill), and `bootstrap_room % dp_size` for a P/D request that carries
  a room (`follow_bootstrap_room`).
* Out-of-range ranks, as each engine answers them today: vLLM's input processor raises
  `ValueError("data_parallel_rank R is out of range [0, N).")` (a 400 BadRequestError; an error
  event in a stream, which has already started); a header that is not an integer is ignored.
  SGLang's tokenizer manager raises `ValueError("routed_dp_rank=R out of range [0, N)")` (a 400),
  except rank 0 on a server of one rank, which it ignores.
* KV events: rank r publishes on the endpoint's port + r (vLLM's `offset_endpoint_port`; `_dp<r>`
  appended to inproc/ipc names), its replay endpoint likewise, and stamps its rank in each batch
  (`[ts, events, data_parallel_rank]`; SGLang's `attn_dp_rank`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from aiohttp import web

from backends.emulator.driver import EngineDriver
from backends.emulator.kv_events import EventCollector, KvPublisher

RANK_HEADER: Final = "X-data-parallel-rank"
SERVED_HEADER: Final = "x-emulator-data-parallel-rank"  # the emulator's own: which engine served (tests)
SGLANG_FIELDS: Final = ("routed_dp_rank", "data_parallel_rank")
SERVED_KEY: Final = web.RequestKey("emulator_dp_rank", int)


@dataclass(slots=True)
class RankEngine:
    """One data-parallel rank's engine and what publishes its events."""

    rank: int
    driver: EngineDriver
    kv_collector: EventCollector | None = None
    kv_publisher: KvPublisher | None = None
    requests: int = field(default=0)  # client engine requests it was given (health checks aside; for tests)


class BadRank(ValueError):
    """A rank the engine refuses: its message is the engine's."""


def offset_endpoint(endpoint: str, rank: int) -> str:
    """vLLM's `offset_endpoint_port`: tcp ports move up by the rank; other names get `_dp<rank>`."""
    if rank == 0:
        return endpoint
    if endpoint.startswith("tcp://") and ":" in endpoint[6:]:
        head, _, port = endpoint.rpartition(":")
        if port.isdigit():
            return f"{head}:{int(port) + rank}"
    return f"{endpoint}_dp{rank}"


def vllm_rank(headers: Mapping[str, str], size: int) -> int | None:
    """The rank a vLLM request names (its header, case-insensitive; not an integer: none)."""
    value = headers.get(RANK_HEADER)
    if value is None:
        return None
    try:
        rank = int(value)
    except ValueError:
        return None
    if not 0 <= rank < size:
        raise BadRank(f"data_parallel_rank {rank} is out of range [0, {size}).")
    return rank


def sglang_rank(body: Mapping[str, Any], size: int) -> int | None:
    """The rank an SGLang request names in its body (`routed_dp_rank` first, then the alias)."""
    value = next((body[k] for k in SGLANG_FIELDS if body.get(k) is not None), None)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise BadRank(f"routed_dp_rank={value} is not an integer")
    if size <= 1 and value == 0:
        return None  # "routed_dp_rank=0 is ignored because dp_size=1"
    if not 0 <= value < size:
        raise BadRank(f"routed_dp_rank={value} out of range [0, {size})")
    return value


def vllm_balance(ranks: Sequence[RankEngine]) -> int:
    """vLLM's internal DP load balancing: least `waiting * 4 + running`, first from engine 0 wins."""
    best, best_score = 0, None
    for r in ranks:
        snap = r.driver.engine.snapshot()
        score = snap.waiting * 4 + snap.running
        if best_score is None or score < best_score:
            best, best_score = r.rank, score
    return best


class RoundRobin:
    """SGLang's default `round_robin` DP scheduler (and `follow_bootstrap_room` given a room)."""

    def __init__(self) -> None:
        self.counter = 0

    def choose(self, size: int, room: int | None = None) -> int:
        if room is not None:
            return room % size
        rank = self.counter % size
        self.counter = (self.counter + 1) % size
        return rank


def mark_served(request: web.Request, rank: int, size: int) -> None:
    """Note which rank serves `request`, for `served_rank_header` (data-parallel servers only)."""
    if size > 1:
        request[SERVED_KEY] = rank


async def served_rank_header(request: web.Request, response: web.StreamResponse) -> None:
    """aiohttp's `on_response_prepare`: the emulator's own header saying which engine served."""
    rank = request.get(SERVED_KEY)
    if rank is not None:
        response.headers[SERVED_HEADER] = str(rank)

