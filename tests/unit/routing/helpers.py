"""Builders for routing tests: views, snapshots, requests with features, a seeded index."""

from __future__ import annotations

import random
from typing import Any

from backends.base import Endpoint, Runtime
from gateway.routing import BackendView, RequestFeatures, RouteRequest, RoutingState, Snapshot, describe

RNG = random.Random(7)


def view(
    name: str,
    *,
    load: int = 0,
    waiting: float | None = None,
    running: float | None = None,
    healthy: bool = True,
    block_size: int | None = None,
    usd_per_hour: float | None = None,
    tps: float | None = None,
) -> BackendView:
    return BackendView(
        name=name,
        runtime=Runtime.VLLM,
        healthy=healthy,
        in_flight=load,
        waiting=waiting,
        running=running,
        kv_usage=None,
        usd_per_hour=usd_per_hour,
        block_size=block_size,
        output_tokens_per_s=tps,
    )


def chat(system: str, user: str = "hello") -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}


def features(system: str, user: str = "hello", **headers: str) -> RequestFeatures:
    return describe(chat(system, user), Endpoint.CHAT, {k.replace("_", "-"): v for k, v in headers.items()})


def req(feats: RequestFeatures, *, seq: int = 0, exclude: frozenset[str] = frozenset()) -> RouteRequest:
    return RouteRequest("m", seq, exclude, feats)


def doc(n: int, chars: int = 2048) -> str:
    """A deterministic distinct text of `chars` characters."""
    rng = random.Random(n)
    return "".join(rng.choice("abcdefghij klmnop") for _ in range(chars))


def warm(state: RoutingState, backend: BackendView, feats: RequestFeatures) -> None:
    """Send `feats` to `backend` and complete it without engine usage (the index keeps it)."""
    ticket = state.dispatched(backend, feats)
    state.completed(ticket, cached_tokens=None, prompt_tokens=None, itl_s=None)


def snap(state: RoutingState, *views: BackendView) -> Snapshot:
    return state.snapshot(Snapshot(tuple(views)))
