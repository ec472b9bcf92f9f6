"""`GET /admin/workers`: the processes serving this gateway, as its supervisor sees them.

One row per worker (slot, pid, requests it has served, its config generation, how long it has been
up), the restarts so far, and `answered_by`: the worker whose connection carried this request (each
new connection may reach another one: the kernel spreads them, SO_REUSEPORT).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from .. import json_codec


def install(app: web.Application, workers: Callable[[], Awaitable[dict[str, Any]]]) -> None:
    async def admin_workers(request: web.Request) -> web.Response:
        return web.Response(body=json_codec.dumps(await workers()), content_type="application/json",
                            headers={"Cache-Control": "no-store"})

    app.router.add_get("/admin/workers", admin_workers)
