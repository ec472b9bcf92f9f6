"""The values a routing policy sees and returns. Policies are pure: no I/O, no clock, no globals.

A snapshot is "everything a policy may know at decision time": frozen per-backend views plus two
read-only windows onto learned state (the prefix index and the latency models). Those two are live
objects rather than copies because copying 16 backends' worth of prefix entries per request would
cost more than the decision itself; they are only mutated between decisions (the gateway is one
asyncio thread and `choose` never awaits), so a policy still sees a consistent state.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Final, Protocol

from backends.base import Runtime

if TYPE_CHECKING:
    from .latency import LatencyModel
    from .tokens import TokenPrompt

CHARS_PER_TOKEN: Final = 4  # the char-based token approximation (no tokenizer in the gateway)
UNIT_TOKENS: Final = 16  # the base hashing block; coarser engine blocks are whole multiples of it
UNIT_CHARS: Final = UNIT_TOKENS * CHARS_PER_TOKEN


def stride_for(block_size: int | None) -> int:
    """Base units per engine block: the engine's granularity rounded up to a multiple of 16 tokens.

    SGLang reports 1 (a radix tree caches any token run) and TRT-LLM 32/64, vLLM 16 (GPU) or 128
    (CPU); unknown means vLLM's GPU default. Hashing finer than 16 tokens would cost more per request
    than it could gain in prediction accuracy.
    """
    if not block_size or block_size <= UNIT_TOKENS:
        return 1
    return -(-block_size // UNIT_TOKENS)


# The classes below are built per request (or per backend per request): value classes with their
# `__init__` written out, so the compiled build compiles it (`backends/values.py`).


@dataclass(slots=True, unsafe_hash=True)
class SlaTarget:
    """A request's latency targets from `x-sla-ttft-ms` / `x-sla-tpot-ms` / `x-sla-strict`."""

    ttft_s: Final[float | None]
    tpot_s: Final[float | None]
    strict: Final[bool]

    def __init__(self, ttft_s: float | None = None, tpot_s: float | None = None, strict: bool = False) -> None:
        self.ttft_s = ttft_s
        self.tpot_s = tpot_s
        self.strict = strict


@dataclass(slots=True, unsafe_hash=True)
class RequestFeatures:
    """What `describe` extracts from a request, once, for every policy.

    `chain[i]` is a running hash of the rendered prompt's first `(i + 1) * UNIT_CHARS` characters
    (namespaced by the prefix key when there is one), so the chain for any engine granularity is a
    stride over it, and a prefix match is a run from the start.
    """

    chain: Final[tuple[int, ...]]
    prompt_bytes: Final[int]  # length of the hashed byte stream (chars for ASCII text, 4 per token id)
    prompt_tokens: Final[int]  # estimate: chars / CHARS_PER_TOKEN
    affinity_key: Final[int | None]  # the rendezvous key: prefix key, else session, else first block
    prefix_key: Final[str | None]
    session_key: Final[str | None]
    sticky_key: Final[str | None]  # for A/B arms: session, else the body's `user`
    sla: Final[SlaTarget | None]
    # the engine's prompt token ids, when the route has a tokenizer (then `prompt_tokens` counts them)
    tokens: Final[TokenPrompt | None]

    def __init__(
        self, chain: tuple[int, ...] = (), prompt_bytes: int = 0, prompt_tokens: int = 0,
        affinity_key: int | None = None, prefix_key: str | None = None, session_key: str | None = None,
        sticky_key: str | None = None, sla: SlaTarget | None = None, tokens: TokenPrompt | None = None,
    ) -> None:
        self.chain = chain
        self.prompt_bytes = prompt_bytes
        self.prompt_tokens = prompt_tokens
        self.affinity_key = affinity_key
        self.prefix_key = prefix_key
        self.session_key = session_key
        self.sticky_key = sticky_key
        self.sla = sla
        self.tokens = tokens


NO_FEATURES: Final = RequestFeatures()


@dataclass(slots=True, unsafe_hash=True)
class BackendView:
    """What a policy may know about one routing unit, frozen at snapshot time: a backend, or one
    data-parallel rank of a backend (then `name` is the unit's, `unit_name(backend, rank)`, and the
    load fields are the rank's; health is the backend's). Policies choose by `name` and need not
    know which: prefix memory, latency models and rendezvous scores are all per unit."""

    name: Final[str]
    runtime: Final[Runtime]
    healthy: Final[bool]
    in_flight: Final[int]
    waiting: Final[float | None]  # engine-reported queue; None when the engine does not say
    running: Final[float | None]
    kv_usage: Final[float | None]
    usd_per_hour: Final[float | None]
    block_size: Final[int | None]  # engine-reported prefix-cache granularity (tokens); None = unknown
    output_tokens_per_s: Final[float | None]  # best recent measured decode throughput; None = unknown
    backend: Final[str]  # the server: `name` itself, or the backend a data-parallel rank belongs to
    rank: Final[int | None]  # the data-parallel rank this unit pins requests to; None: not pinned

    def __init__(
        self, name: str, runtime: Runtime, healthy: bool, in_flight: int, waiting: float | None,
        running: float | None, kv_usage: float | None, usd_per_hour: float | None, block_size: int | None = None,
        output_tokens_per_s: float | None = None, backend: str | None = None, rank: int | None = None,
    ) -> None:
        self.name = name
        self.backend = name if backend is None else backend
        self.rank = rank
        self.runtime = runtime
        self.healthy = healthy
        self.in_flight = in_flight
        self.waiting = waiting
        self.running = running
        self.kv_usage = kv_usage
        self.usd_per_hour = usd_per_hour
        self.block_size = block_size
        self.output_tokens_per_s = output_tokens_per_s

    @property
    def load_score(self) -> float:
        """One comparable load number: what we have in flight plus what the engine says is queued."""
        return self.in_flight + (self.waiting or 0.0)


class PrefixLookup(Protocol):
    """Read-only view of what the backends hold in their prefix caches."""

    def match(self, backend: str, chain: tuple[int, ...], stride: int) -> int:
        """How many leading blocks of `chain` (at `stride` base units per block) `backend` is
        believed to hold, by the approximate index (what the gateway sent)."""
        ...

    def hits(self, features: RequestFeatures, views: Sequence[BackendView]) -> list[int]:
        """The expected cached prompt tokens of each of `views` for this request: exact where the
        backend's KV events are live and the request has tokens, else the approximate index's
        `match` at the view's engine granularity (in the engine's tokens when the request has
        them, else in estimated tokens)."""
        ...

    def held(self, backend: str) -> int:
        """How much this gateway has placed on `backend` that it believes still cached (blocks of
        the approximate index): the long-run share of the content a backend was given."""
        ...

    def placed(self, key: int, views: Sequence[BackendView]) -> int:
        """The index in `views` of the backend this gateway last sent the explicit affinity key
        `key` to (x-prefix-key, x-session-id), while it remembers it; -1 for a new key."""
        ...


class EngineCaches(Protocol):
    """The engines' own prefix caches, built from their KV events (`gateway/kvcache`)."""

    def overlay(self, prompt: TokenPrompt, views: Sequence[BackendView], hits: list[int]) -> None:
        """Replace `hits[i]` by the exact expected cached tokens of each backend whose events are live."""
        ...


class _NoPrefixes:
    """The lookup of a gateway that has not sent anything yet."""

    def match(self, backend: str, chain: tuple[int, ...], stride: int) -> int:
        return 0

    def hits(self, features: RequestFeatures, views: Sequence[BackendView]) -> list[int]:
        return [0] * len(views)

    def held(self, backend: str) -> int:
        return 0

    def placed(self, key: int, views: Sequence[BackendView]) -> int:
        return -1


NO_PREFIXES: PrefixLookup = _NoPrefixes()


_NO_LATENCY: Mapping[str, LatencyModel] = MappingProxyType({})


@dataclass(slots=True, unsafe_hash=True)
class Snapshot:
    backends: Final[tuple[BackendView, ...]]
    prefix: Final[PrefixLookup]
    latency: Final[Mapping[str, LatencyModel]]  # by backend name; absent = unknown

    def __init__(self, backends: tuple[BackendView, ...], prefix: PrefixLookup = NO_PREFIXES,
                 latency: Mapping[str, LatencyModel] = _NO_LATENCY) -> None:
        self.backends = backends
        self.prefix = prefix
        self.latency = latency

    def healthy(self, exclude: frozenset[str] = frozenset()) -> tuple[BackendView, ...]:
        """The candidates: healthy and not excluded (`exclude` names backends: a tried backend's
        ranks are all excluded), in config order (`backends` itself when that is all of them, so
        callers can recognise the unfiltered set by identity)."""
        backends = self.backends
        if exclude:
            out = [b for b in backends if b.healthy and b.backend not in exclude]
        else:
            out = [b for b in backends if b.healthy]
        return backends if len(out) == len(backends) else tuple(out)


_NONE_TRIED: frozenset[str] = frozenset()


@dataclass(slots=True, unsafe_hash=True)
class RouteRequest:
    """The routing-relevant description of a request."""

    model: Final[str]
    seq: Final[int]  # a per-route request counter, so round robin stays a pure function
    exclude: Final[frozenset[str]]  # backends (servers, not ranks) already tried for this request
    features: Final[RequestFeatures]  # from `describe`, once per request

    def __init__(self, model: str, seq: int, exclude: frozenset[str] = _NONE_TRIED,
                 features: RequestFeatures = NO_FEATURES) -> None:
        self.model = model
        self.seq = seq
        self.exclude = exclude
        self.features = features


@dataclass(slots=True, unsafe_hash=True)
class Decision:
    """A choice, with a low-cardinality `reason` for metrics and the response headers.

    `reject` is set only by SLA-strict routing when no backend can meet the target: the proxy must
    then answer 429 with `Retry-After: ceil(retry_after_s)` instead of sending to `backend` (which
    names the best-effort candidate, for logs).
    """

    backend: Final[str]
    reason: Final[str]  # "round_robin", "least_load", "affinity", "hash", "spill", "sla", "sla_miss", "cost", ...
    expected_hit_tokens: Final[int]  # what the prefix index predicts the backend has cached
    predicted_ttft_s: Final[float | None]
    reject: Final[bool]
    retry_after_s: Final[float | None]

    def __init__(self, backend: str, reason: str, expected_hit_tokens: int = 0, predicted_ttft_s: float | None = None,
                 reject: bool = False, retry_after_s: float | None = None) -> None:
        self.backend = backend
        self.reason = reason
        self.expected_hit_tokens = expected_hit_tokens
        self.predicted_ttft_s = predicted_ttft_s
        self.reject = reject
        self.retry_after_s = retry_after_s


class Policy(Protocol):
    name: str

    def choose(self, req: RouteRequest, snapshot: Snapshot, rng: random.Random) -> Decision | None:
        """The backend for `req`, or None when no candidate is healthy."""
        ...
