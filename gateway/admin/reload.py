"""`POST /admin/reload`: re-read the config file; 200 with the new generation, or 400 with every error's
field path (the previous config keeps serving). With several workers, every one has reloaded before
the reply."""

from __future__ import annotations

from typing import Protocol

from aiohttp import web

from .. import json_codec
from ..errors import InvalidRequest
from ..state.reload import Reloaded, ReloadRejected


class Reloads(Protocol):
    """`state.reload.Reloader` for one process; the coordinator, which reloads every worker."""

    async def reload(self) -> Reloaded: ...


def install(app: web.Application, reloader: Reloads) -> None:
    async def reload(request: web.Request) -> web.Response:
        try:
            done = await reloader.reload()
        except ReloadRejected as exc:
            error = InvalidRequest("The new configuration is invalid; the previous one keeps serving.")
            error.code = "invalid_config"
            body = {**error.body().as_dict(), "errors": exc.errors}
            return web.Response(body=json_codec.dumps(body), status=400, content_type="application/json")
        return web.Response(
            body=json_codec.dumps({"status": "reloaded", "generation": done.generation,
                                   "restart_required": done.restart_required}),
            content_type="application/json",
        )

    app.router.add_post("/admin/reload", reload)
