"""One config generation's request path: parse -> choose -> open (attempts) -> relay, plus shadows.

Routing happens per attempt: `describe` the request once, pick the A/B arm once (sticky), then let
the route's policy choose among the arm's backends over a fresh snapshot. The routing memory (prefix
index, latency estimators) is told what was sent, when the first token came and what the engine
reported, so the next decision knows more. Recording is not done here: the dispatcher's `finally`
hands the request's Exchange to accounting once, whatever happened (`dispatch`, `accounting`).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Mapping
from typing import Any, Final

from backends.base import Endpoint
from backends.capabilities import Feature
from backends.responses_chat import chat_view

from ..client import UpstreamPool
from ..errors import InvalidRequest, ModelNotFound
from ..observability.metrics import Recorder
from ..observability.pd import PdMetrics
from ..routing import BadRoutingHeader, RoutingState, describe
from ..routing.capabilities import needs
from ..routing.features import api_key_digest
from ..routing.registry import PREFIX_POLICIES, policy_for
from ..routing.response_owners import ResponseOwners
from ..settings import Settings
from ..state.generations import Generation
from ..state.pool import BackendState, Pool
from ..state.splits import LiveSplit, Splits
from ..tokenize import PromptTokenizer
from .accounting import Accounting
from .attempts import Attempts, Opened, no_healthy_backend
from .capable import Capabilities
from .deadlines import Deadlines
from .exchange import Exchange
from .pairs import Pairs
from .relay import Relay
from .request import parse_request
from .routes import RouteState
from .shadow import Shadows
from .sink import ResponseSink

_NOT_SAMPLES: Final = frozenset({Endpoint.TOKENIZE, Endpoint.DETOKENIZE})  # no generation to compare
_GENERATIONS: Final = frozenset({Endpoint.CHAT, Endpoint.COMPLETIONS, Endpoint.RESPONSES})


def routing_view(body: Mapping[str, Any], endpoint: Endpoint) -> tuple[Mapping[str, Any], Endpoint]:
    """What `describe` hashes for each endpoint: a Responses request as the chat messages it stands
    for (so it shares prefix affinity with chat), embeddings as a prompt, tokenize as nothing (the
    engine computes no KV for it, so no prefix memory may be learned from it)."""
    if endpoint is Endpoint.CHAT or endpoint is Endpoint.COMPLETIONS:
        return body, endpoint
    user = body.get("user")
    if endpoint is Endpoint.RESPONSES:
        return {**chat_view(body), "user": user}, Endpoint.CHAT
    if endpoint is Endpoint.EMBEDDINGS:
        return {"prompt": body.get("input"), "user": user}, Endpoint.COMPLETIONS
    return {"prompt": "", "user": user}, Endpoint.COMPLETIONS


class Proxy:
    def __init__(
        self,
        settings: Settings,
        pool: Pool,
        recorder: Recorder,
        upstream: UpstreamPool,
        accounting: Accounting,
        *,
        clock: Callable[[], float],
        rng: random.Random,
        wall_clock: Callable[[], float] = time.time,
        throughput: Callable[[str], float | None] | None = None,
        routing: RoutingState | None = None,
        splits: Splits | None = None,
        owners: ResponseOwners | None = None,
        tokenizers: Mapping[str, PromptTokenizer] | None = None,
        pd: PdMetrics | None = None,
    ) -> None:
        """`throughput(backend)` gives measured output tokens/s (for the cost policy); `routing` (the
        routing memory), `splits` (live A/B weights) and `owners` (which backend stores which
        response) are passed in so that they survive reloads; `tokenizers` are the routes'
        tokenizers by route model (`tokenize.resolve_tokenizers`)."""
        self.pool = pool
        self.capabilities = Capabilities(settings, lambda name: pool[name].config)
        self.owners = owners if owners is not None else ResponseOwners()
        self._recorder = recorder
        self._clock = clock
        self._wall_clock = wall_clock
        self._rng = rng
        splits = splits if splits is not None else Splits()
        tokenizers = tokenizers or {}
        self._routes = {
            r.model: RouteState(r, policy_for(r.policy, load_factor=r.load_factor),
                                splits.for_route(r) if r.split is not None else None,
                                tokenizer=tokenizers.get(r.model))
            for r in settings.routes
        }
        self.routing = routing if routing is not None else RoutingState()
        # a disaggregated route's prefill is chosen by prefix affinity
        self._hash_prompts = any(r.policy in PREFIX_POLICIES or r.disaggregates for r in settings.routes)
        deadlines = Deadlines(asyncio.get_running_loop())  # built inside the loop it serves
        self._attempts = Attempts(
            pool, upstream, self.routing, recorder, accounting, deadlines, timeouts=settings.timeouts,
            max_attempts=settings.retries.max_attempts, clock=clock, rng=rng, throughput=throughput,
        )
        self._pairs = Pairs(pool, upstream, self.routing, accounting, deadlines, pd, timeouts=settings.timeouts,
                            max_attempts=settings.retries.max_attempts, clock=clock, rng=rng)
        self._relay = Relay(deadlines, timeouts=settings.timeouts, clock=clock)
        self.shadows = Shadows(self._attempts, recorder, self.routing, deadlines, timeouts=settings.timeouts,
                               clock=clock, rng=rng)

    @property
    def route_models(self) -> list[str]:
        return list(self._routes)

    @property
    def live_splits(self) -> dict[str, LiveSplit]:
        """The live split of each split route (the app keeps them once this generation commits)."""
        return {m: r.split for m, r in self._routes.items() if r.split is not None}

    def weights(self, model: str) -> dict[str, float]:
        """The live A/B weights of a split route (empty for other routes)."""
        route = self._routes.get(model)
        return route.split.weights if route is not None and route.split is not None else {}

    def set_weights(self, model: str, weights: Mapping[str, float]) -> dict[str, float]:
        route = self._routes.get(model)
        if route is None or route.split is None:
            raise KeyError(model)
        route.split.set_weights(weights)
        return route.split.weights

    def parse(self, ex: Exchange, body: bytes, headers: Mapping[str, str]) -> None:
        """Parse the body (once), find its route and describe it for routing; raises 400/404."""
        parsed = ex.parsed = parse_request(body, ex.endpoint, created=int(self._wall_clock()))
        key = ex.key
        allowed = None if key is None else key.models
        if allowed is not None and parsed.model not in allowed:  # as if it did not exist: no leak
            raise ModelNotFound(f"The model `{parsed.model}` does not exist.", param="model")
        if parsed.model not in self._routes:
            visible = [m for m in self._routes if allowed is None or m in allowed]
            raise ModelNotFound(
                f"The model `{parsed.model}` does not exist. Available models: {', '.join(visible)}.", param="model"
            )
        ex.model = parsed.model
        state = self._routes[parsed.model]
        route = state.config
        fields = parsed.request.body
        need = ex.needs = needs(fields, ex.endpoint)
        capable = self.capabilities.capable(route, self.pool.expand(route.candidates), need)
        owner = self.owners.owner(fields.get("previous_response_id")) if ex.endpoint is Endpoint.RESPONSES else None
        ex.capable = (owner,) if owner is not None and owner in capable.backends else capable.backends
        ex.bridged = capable.bridged
        request, endpoint = routing_view(fields, ex.endpoint)
        tokenizer = state.tokenizer
        # the engine's prompt tokens, for generations only (no KV is computed for tokenize, and
        # pooling models do not reuse a prefix cache routing could predict)
        tokens = tokenizer.prompt(request, endpoint) if tokenizer is not None and ex.endpoint in _GENERATIONS else None
        try:
            ex.features = describe(request, endpoint, headers, tokens=tokens, hash_prompt=self._hash_prompts)
        except BadRoutingHeader as bad:
            raise InvalidRequest(str(bad), param=bad.header) from bad
        if tokens is not None:
            self.routing.prepare(ex.features, ex.capable)

    async def serve(self, ex: Exchange, headers: Mapping[str, str], sink: ResponseSink) -> None:
        """Serve a parsed request; the response goes to `sink`. GatewayErrors raised mean nothing was
        sent: the front renders them."""
        assert ex.parsed is not None
        ex.pool = self.pool
        route = self._routes[ex.model]
        candidates = self._candidates(route, ex, headers)
        spec = self._pairs.applies(route, ex)
        answered: Opened | None = None
        if spec is not None:  # prefill/decode disaggregation: maybe a prefill leg first
            prepared = await self._pairs.prepare(route, ex, spec, candidates)
            if isinstance(prepared, Opened):
                answered = prepared  # a trtllm context leg that finished the request
            else:
                candidates = prepared
        if ex.pair is None:
            await self._answer(route, ex, candidates, answered, sink)
        else:  # a prefill leg beside the decode's (SGLang) ends with the request (`Pairs.around`)
            await self._pairs.around(ex, self._answer(route, ex, candidates, answered, sink))

    async def _answer(self, route: RouteState, ex: Exchange, candidates: list[str], answered: Opened | None,
                      sink: ResponseSink) -> None:
        assert ex.parsed is not None
        if answered is not None:
            opened = answered
        elif ex.pair is not None:
            opened = await self._pairs.decode(ex, lambda names: self._attempts.open(route, ex, names), candidates)
        else:
            opened = await self._attempts.open(route, ex, candidates)
        # No `await` in a `finally` or `except` of a compiled module: mypyc (2.4) then leaves the
        # exception set, and a later request of the connection raises it (tests/unit/test_native_rules.py).
        try:
            self.shadows.maybe(route, ex)
            if ex.parsed.request.stream:
                await self._relay.stream(sink, opened, ex)
            else:
                self._relay.body(sink, opened, ex)
            if ex.response_id is not None and ex.status == "200" and Feature.STORED_RESPONSES in \
                    self.capabilities.of(opened.state.name, route.config):
                self.owners.remember(ex.response_id, opened.state.name)  # previous_response_id comes back here
        finally:
            opened.resp.close()
            opened.release()

    def pick(self, ex: Exchange, headers: Mapping[str, str], allowed: Callable[[BackendState], bool]) -> BackendState:
        """Route a parsed request without sending it (the Endpoint Picker: Envoy sends it): the route's
        policy and A/B arm choose among the candidates that `allowed` keeps, as `serve` would; the
        chosen backend counts the request in flight until `release` (raises 503 when none is kept)."""
        assert ex.parsed is not None
        ex.pool = self.pool
        route = self._routes[ex.model]
        candidates = self.pool.expand(self._candidates(route, ex, headers))
        kept = [n for n in candidates if allowed(self.pool[n])]
        if not kept:
            raise no_healthy_backend(self.pool, f"No backend of model `{ex.model}` is in the requested subset",
                                     candidates, self._clock(), retry_after_s=1)
        state = self._attempts.decide(route, ex, kept)
        state.in_flight += 1
        if ex.rank is not None:
            state.rank_in_flight[ex.rank] += 1
        ex.sent_at = self._clock()
        return state

    @staticmethod
    def release(ex: Exchange) -> None:
        """A picked request is over: it no longer counts in its backend's (and rank's) in-flight requests."""
        state = ex.last
        if state is not None:
            state.in_flight -= 1
            if ex.rank is not None:
                state.rank_in_flight[ex.rank] -= 1

    def _candidates(self, route: RouteState, ex: Exchange, headers: Mapping[str, str]) -> list[str]:
        """The backends this request may use: the route's, or its A/B arm's (chosen once)."""
        split = route.split
        capable = ex.capable
        if split is None:
            return list(capable)
        sticky = ex.features.sticky_key
        if sticky is None and split.sticky == "api_key":
            digest = ex.key.id if ex.key is not None else api_key_digest(headers)
            sticky = "k:" + digest if digest else None
        excluded = None
        if len(capable) < len(self.pool.expand(route.config.candidates)):  # only some backends can serve it
            can = set(capable)
            healthy = {s.name for s in self.pool if s.healthy and s.name in can}
            healthy.update(g for g, members in self.pool.groups().items() if healthy.intersection(members))
            if any(a.weight > 0 and not can.intersection(self.pool.expand(a.backends)) for a in split.arms):
                stored = ex.needs is not None and Feature.STORED_RESPONSES in ex.needs.features
                excluded = "stored_response" if stored else "capability"
        else:
            can = None
            healthy = self.pool.healthy_names()  # arms may name discovery pools
        if excluded is None and ex.endpoint in _NOT_SAMPLES:
            excluded = "endpoint"
        choice = split.choose(sticky, healthy, self._rng)
        if choice is None:
            raise no_healthy_backend(self.pool, f"No arm of `{route.config.model}` has a healthy backend", capable,
                                     self._clock())
        ex.arm = choice.arm
        if excluded is not None:  # not an A/B sample: counted apart, kept out of the arms' statistics
            ex.ab_excluded = excluded
            self._recorder.ab_excluded(route.config.model, excluded)
        else:
            self._recorder.arm_assigned(route.config.model, choice.arm, failed_over_from=(
                choice.preferred if choice.failed_over else None))
        backends = split.arm(choice.arm).backends
        return list(backends) if can is None else [b for b in self.pool.expand(backends) if b in can]

    async def close(self) -> None:
        await self.shadows.close()


def proxy_of(generation: Generation) -> Proxy:
    """A config generation's proxy, typed: the composition root builds every generation with one, and
    `state.generations` holds it knowing only how to close it (the state room imports nothing above it)."""
    proxy = generation.proxy
    assert isinstance(proxy, Proxy)
    return proxy

