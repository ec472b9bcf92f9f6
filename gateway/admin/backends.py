"""`GET /admin/backends`: every backend's health, ejection state, load and what routing believes, and
where it came from (`source`: `static`, or the discovery entry that found it; `draining` while it
leaves)."""

from __future__ import annotations

from aiohttp import web
from yarl import URL

from .. import json_codec
from ..kvcache import KvCaches
from ..proxy.service import proxy_of
from ..state.generations import Generations


def redact_url(url: str) -> str:
    """The URL without userinfo (credentials must never reach /admin output)."""
    parsed = URL(url)
    return str(parsed.with_user(None)) if parsed.user is not None or parsed.password is not None else url


def install(app: web.Application, generations: Generations) -> None:
    async def admin_backends(request: web.Request) -> web.Response:
        backends = []
        generation = generations.current
        routing = proxy_of(generation).routing
        caches = routing.engines if isinstance(routing.engines, KvCaches) else None
        now = caches.clock() if caches is not None else 0.0
        for s in generation.pool:
            load = s.load
            learned = routing.latency.get(s.name)
            backends.append({
                "name": s.name,
                "runtime": s.config.runtime.value,
                "url": redact_url(s.config.base_url),
                "model": s.config.model,
                "source": s.source,
                "draining": s.draining,
                "healthy": s.healthy,
                "probe_ok": s.probe_ok,
                "ejected": s.ejected,
                "ejected_until": s.ejected_until,
                "ejections": s.ejections,
                "consecutive_failures": s.consecutive_failures,
                "in_flight": s.in_flight,
                "load_score": s.view().load_score,
                "load": {
                    "running": load.running,
                    "waiting": load.waiting,
                    "kv_usage": load.kv_usage,
                    "prefix_hit_rate": load.prefix_hit_rate,
                    "block_size": load.block_size,
                },
                "usd_per_hour": s.config.usd_per_hour,
                "last_error": s.last_error,
                # what the routing memory believes (the inputs of prefix_affinity and sla)
                "routing": {
                    "cached_prefix_blocks": routing.index.size(s.name),
                    "backlog_tokens": learned.backlog_tokens if learned else 0.0,
                    "prefill_tokens_per_s": learned.prefill_tokens_per_s if learned else None,
                    "predicted_tpot_s": learned.tpot_s((load.running or s.in_flight) + 1) if learned else None,
                },
                # the engine's own KV events (null when the backend has no `kv_events`)
                "kv_events": cache.describe(now) if caches is not None and (cache := caches.get(s.name)) else None,
            })
        body = {"backends": backends, "generation": generation.number}
        return web.Response(body=json_codec.dumps(body), content_type="application/json")

    app.router.add_get("/admin/backends", admin_backends)
