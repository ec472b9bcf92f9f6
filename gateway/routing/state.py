"""The routing memory the proxy feeds: prefix index + per-backend latency estimators.

This is the only mutable routing state. It lives in the proxy (one per gateway process), is read by
policies through `snapshot()`, and is updated with explicit values at four points of a request:
`dispatched` (a backend was chosen and the request sent), `first_token`, `completed`, `failed`.
It never reads a clock: durations come in as arguments.

With the engines' KV events (`gateway/kvcache`, passed in as `engines`), the snapshot's prefix
lookup is exact for the backends whose events are live, and every dispatch records what was
expected (the ticket's `expected_tokens`, sent back as `x-gateway-expected-cached-tokens`) so the
engine's report can be compared with it. The approximate index is fed either way: it is the
fallback whenever a backend's events stop.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Final, Protocol

from ..rank_settings import unit_backend
from .base import CHARS_PER_TOKEN, BackendView, EngineCaches, RequestFeatures, Snapshot
from .latency import LatencyEstimator, LatencyModel
from .prefix_index import DEFAULT_CAPACITY, PrefixIndex, Sent
from .tokens import TokenPrompt

EXACT: Final = "exact"
HANDOFF_BEFORE: Final = "before"  # `Ticket.remote`: the KV was computed before the decode leg was sent
HANDOFF_BESIDE: Final = "beside"  # ... alongside it (SGLang's rendezvous)
APPROXIMATE: Final = "approximate"


class EngineFeedback(EngineCaches, Protocol):
    """What the routing memory asks of the engines' caches around one request."""

    def predict(self, backend: str, prompt: TokenPrompt, rank: int | None) -> tuple[int | None, bool, int]:
        """(the backend's event-built index's expected cached tokens, of data-parallel `rank` when
        the request is pinned to one, else its best rank's; None when it has none; whether that
        index is live; the backend's event counter, for silence evidence)."""
        ...

    def observe(self, backend: str, prompt: TokenPrompt | None, *, predicted: int | None,
                cached_tokens: int | None, prompt_tokens: int | None, counter: int, rank: int | None) -> None:
        """The engine's usage for a request predicted at dispatch (served by `rank`, when pinned)."""
        ...

    def prepare(self, prompt: TokenPrompt, backends: Sequence[str]) -> None:
        """Compute the block keys the backends' indexes will look `prompt` up by (once per request,
        with its tokenization, so that routing decisions only look up)."""
        ...


@dataclass(slots=True)
class Ticket:
    """One dispatched request's routing bookkeeping, from `dispatched` to `completed`/`failed`."""

    sent: Final[Sent]
    uncached_tokens: Final[float]
    ahead_tokens: Final[float]  # uncached prefill this gateway had queued on the backend before this one
    running: Final[float]  # the backend's batch when we sent (engine-reported, else our in-flight count)
    prefilled: bool
    expected_tokens: Final[int]  # the cached tokens routing expected on this backend
    source: Final[str]  # which index said so
    exact_tokens: Final[int | None]  # the event-built index's prediction, live or not
    prompt: Final[TokenPrompt | None]
    counter: Final[int]
    server: Final[str]  # the backend (`sent.backend` is the routing unit: the backend or one of its ranks)
    rank: Final[int | None]  # the data-parallel rank the request was pinned to
    # P/D: the request's prefill ran elsewhere, `before` this send (vLLM, trtllm: its first token
    # times the handoff) or `beside` it (SGLang: it includes the prefill); None: prefilled here
    remote: Final[str | None]

    def __init__(  # written out, so the compiled build compiles it (`backends/values.py`)
        self, sent: Sent, uncached_tokens: float, ahead_tokens: float, running: float, prefilled: bool = False,
        expected_tokens: int = 0, source: str = APPROXIMATE, exact_tokens: int | None = None,
        prompt: TokenPrompt | None = None, counter: int = 0, server: str | None = None, rank: int | None = None,
        remote: str | None = None,
    ) -> None:
        self.server = sent.backend if server is None else server
        self.rank = rank
        self.remote = remote
        self.sent = sent
        self.uncached_tokens = uncached_tokens
        self.ahead_tokens = ahead_tokens
        self.running = running
        self.prefilled = prefilled
        self.expected_tokens = expected_tokens
        self.source = source
        self.exact_tokens = exact_tokens
        self.prompt = prompt
        self.counter = counter

    @property
    def backend(self) -> str:
        return self.sent.backend


def scaled(hit: int, features: RequestFeatures) -> int:
    """An approximate-index hit (estimated tokens of 4 characters) in the request's engine tokens."""
    tokens = features.tokens
    if tokens is None or hit <= 0 or not features.prompt_bytes:
        return hit
    return min(hit * CHARS_PER_TOKEN * tokens.count // features.prompt_bytes, tokens.cacheable)


class PrefixView:
    """The snapshot's prefix lookup: the approximate index, overlaid with the engines' caches where
    their events are live."""

    __slots__ = ("engines", "index")

    def __init__(self, index: PrefixIndex, engines: EngineCaches | None) -> None:
        self.index = index
        self.engines = engines

    def match(self, backend: str, chain: tuple[int, ...], stride: int) -> int:
        return self.index.match(backend, chain, stride)

    def hits(self, features: RequestFeatures, views: Sequence[BackendView]) -> list[int]:
        tokens = features.tokens
        engines = self.engines
        exact: list[int] | None = None
        if tokens is not None and engines is not None:
            exact = [-1] * len(views)  # -1: no live events for that backend
            engines.overlay(tokens, views, exact)
            if min(exact) >= 0 and max(exact) > 0:  # every candidate live, and one holds some of it
                return exact
        chain = features.chain
        out = self.index.hits(chain, views) if chain else [0] * len(views)
        if tokens is not None and features.prompt_bytes and max(out) > 0:
            ratio_num, ratio_den = CHARS_PER_TOKEN * tokens.count, features.prompt_bytes
            cap = tokens.cacheable
            out = [min(h * ratio_num // ratio_den, cap) for h in out]
        # A prompt that no live engine holds any of (evicted everywhere) keeps the approximate
        # index's answer: where it was sent before is where its conversation and its tenant live,
        # and placing it there keeps them together instead of scattering them.
        if exact is None or max(exact) <= 0:
            return out
        return [a if e < 0 else e for e, a in zip(exact, out, strict=True)]

    def held(self, backend: str) -> int:
        return self.index.size(backend)

    def placed(self, key: int, views: Sequence[BackendView]) -> int:
        return self.index.placed(key, views)


class _Models(Mapping[str, LatencyModel]):
    """The estimators' frozen models, rebuilt on read and only for backends that learned something
    since the last read: a request changes its backend's estimator three times (dispatch, first
    token, completion) but a decision reads each model at most once, and most never do."""

    def __init__(self, estimators: Mapping[str, LatencyEstimator]) -> None:
        self._estimators = estimators
        self._models: dict[str, LatencyModel] = {}
        self.stale: set[str] = set()

    def __getitem__(self, backend: str) -> LatencyModel:
        model = self._models.get(backend)
        if model is None or backend in self.stale:
            estimator = self._estimators[backend]  # KeyError for a backend nothing was learned of
            self.stale.discard(backend)
            model = self._models[backend] = estimator.model
        return model

    def __iter__(self) -> Iterator[str]:
        return iter(self._estimators)

    def __len__(self) -> int:
        return len(self._estimators)

    def __contains__(self, backend: object) -> bool:
        return backend in self._estimators

    def drop(self, backend: str) -> None:
        self._models.pop(backend, None)
        self.stale.discard(backend)


class RoutingState:
    """Prefix index and latency estimators, with the request-lifecycle hooks the proxy calls."""

    def __init__(self, *, capacity: int = DEFAULT_CAPACITY, alpha: float = 0.2,
                 engines: EngineFeedback | None = None) -> None:
        self.index = PrefixIndex(capacity=capacity)
        self.alpha = alpha
        self.engines = engines
        self._view = PrefixView(self.index, engines)
        self._estimators: dict[str, LatencyEstimator] = {}
        self._models = _Models(self._estimators)

    @property
    def latency(self) -> Mapping[str, LatencyModel]:
        return self._models

    def _publish(self, backend: str) -> None:
        self._models.stale.add(backend)

    def estimator(self, backend: str) -> LatencyEstimator:
        """The backend's estimator (read it freely; feed it through this class so the snapshot's
        models stay current)."""
        est = self._estimators.get(backend)
        if est is None:
            est = self._estimators[backend] = LatencyEstimator(alpha=self.alpha)
        return est

    def observe(
        self,
        backend: str,
        *,
        work_tokens: float | None = None,
        ttft_s: float | None = None,
        running: float | None = None,
        itl_s: float | None = None,
        handoff_s: float | None = None,
    ) -> None:
        """Feed one backend's estimator directly (warm-up, replays, tests)."""
        est = self.estimator(backend)
        if work_tokens is not None and ttft_s is not None:
            est.observe_ttft(work_tokens=work_tokens, ttft_s=ttft_s)
        if handoff_s is not None:
            est.observe_handoff(handoff_s)
        if running is not None and itl_s is not None:
            est.observe_itl(running=running, itl_s=itl_s)
        self._publish(backend)

    def prepare(self, features: RequestFeatures, backends: Sequence[str]) -> None:
        """Once per request, before routing: precompute what the engines' caches will look up."""
        if features.tokens is not None and self.engines is not None:
            self.engines.prepare(features.tokens, backends)

    def snapshot(self, base: Snapshot) -> Snapshot:
        """`base` (the pool's views) with this state's prefix index and latency models attached."""
        return Snapshot(base.backends, self._view, self.latency)

    def dispatched(self, view: BackendView, features: RequestFeatures, *, remote: str | None = None) -> Ticket:
        """The request is being sent to `view`'s backend (call right before sending). `remote`: its
        prefill ran on another server (`Ticket.remote`), so none is queued here."""
        sent = self.index.record(view.name, features, block_size=view.block_size)
        expected = scaled(sent.predicted_tokens, features)
        source, exact, counter = APPROXIMATE, None, 0
        tokens = features.tokens
        if tokens is not None and self.engines is not None:
            exact, live, counter = self.engines.predict(view.backend, tokens, view.rank)
            if live and exact is not None:
                expected, source = exact, EXACT
        uncached = 0.0 if remote is not None else float(max(features.prompt_tokens - expected, 0))
        ahead = self.estimator(view.name).dispatched(uncached)
        self._publish(view.name)
        running = view.running if view.running is not None else float(view.in_flight)
        return Ticket(sent, uncached, ahead, running, expected_tokens=expected, source=source, exact_tokens=exact,
                      prompt=tokens, counter=counter, server=view.backend, rank=view.rank, remote=remote)

    def first_token(self, ticket: Ticket, ttft_s: float | None) -> None:
        """The first token arrived after `ttft_s` (None when unmeasured, e.g. non-streaming)."""
        if ticket.prefilled:
            return
        ticket.prefilled = True
        est = self.estimator(ticket.backend)
        est.prefilled(ticket.uncached_tokens)
        if ttft_s is not None:
            remote = ticket.remote
            if remote is None:
                est.observe_ttft(work_tokens=ticket.ahead_tokens + ticket.uncached_tokens, ttft_s=ttft_s)
            elif remote == HANDOFF_BEFORE:  # (beside: the prefill's time is in it too, it teaches nothing)
                est.observe_handoff(ttft_s)
        self._publish(ticket.backend)

    def completed(
        self,
        ticket: Ticket,
        *,
        cached_tokens: int | None,
        prompt_tokens: int | None,
        itl_s: float | None,
    ) -> None:
        """The response ended: correct the index with the engine's usage, learn the mean ITL."""
        self.first_token(ticket, None)
        self.index.observe(ticket.sent, cached_tokens=cached_tokens, prompt_tokens=prompt_tokens)
        if self.engines is not None and ticket.prompt is not None:
            self.engines.observe(ticket.server, ticket.prompt, predicted=ticket.exact_tokens,
                                 cached_tokens=cached_tokens, prompt_tokens=prompt_tokens, counter=ticket.counter,
                                 rank=ticket.rank)
        if itl_s is not None:
            self.observe(ticket.backend, running=ticket.running + 1, itl_s=itl_s)

    def failed(self, ticket: Ticket, *, reached_engine: bool) -> None:
        """The attempt failed. When the engine provably did no work (connect error, 429, 503) the
        blocks this send added are forgotten; otherwise the engine may hold them and they stay."""
        self.first_token(ticket, None)
        if not reached_engine:
            self.index.abandon(ticket.sent)

    def forget(self, backend: str, units: Iterable[str] = ()) -> None:
        """The backend restarted or was ejected: its cache is gone, on every data-parallel rank
        (`units`) too (latency knowledge is kept)."""
        self.index.forget(backend)
        for unit in units:
            self.index.forget(unit)

    def retain(self, backends: Iterable[str]) -> None:
        """Keep what is known of `backends` (and of their data-parallel ranks' units) only."""
        keep = set(backends)
        keep.update(n for n in [*self.index.backends(), *self._estimators] if unit_backend(n) in keep)
        self.index.retain(keep)
        for name in [n for n in self._estimators if n not in keep]:
            del self._estimators[name]
            self._models.drop(name)
