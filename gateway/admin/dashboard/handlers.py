"""aiohttp handlers for the comparison JSON, the dashboard page and its static files.

The page and its script ship inside the package (no CDN) and are read once at start-up.
`GET /admin/compare?window=W&scope=replica|fleet`: `replica` (the default) is this gateway, all its
workers; `fleet` merges every live replica's windows from the shared store (`cluster.fleet`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from importlib import resources
from typing import Any

from aiohttp import web

from ... import json_codec
from ...errors import InvalidRequest
from ...stats import WINDOWS_S, Comparer

_STATIC_TYPES = {".html": "text/html", ".js": "application/javascript", ".css": "text/css"}


def _load_static() -> dict[str, bytes]:
    root = resources.files(__package__).joinpath("static")
    return {f.name: f.read_bytes() for f in root.iterdir() if f.is_file()}


SCOPES = ("replica", "fleet")
Documents = Callable[[int, str], Awaitable[dict[str, Any]]]  # (window, scope) -> the comparison


class DashboardHandlers:
    def __init__(self, comparer: Comparer, clock: Callable[[], float], *, documents: Documents | None = None) -> None:
        self._comparer = comparer
        self._clock = clock
        self._documents = documents
        self._static = _load_static()

    async def compare(self, request: web.Request) -> web.Response:
        raw = request.query.get("window", "60")
        try:
            window = int(raw)
        except ValueError:
            window = -1
        if window not in WINDOWS_S:
            raise InvalidRequest(f"window must be one of {', '.join(map(str, WINDOWS_S))} (seconds)", param="window")
        scope = request.query.get("scope", "replica")
        if scope not in SCOPES:
            raise InvalidRequest(f"scope must be one of {', '.join(SCOPES)}", param="scope")
        if self._documents is not None:
            doc = await self._documents(window, scope)
        else:
            doc = await self._comparer.document_async(self._clock(), window)
        return web.Response(body=json_codec.dumps(doc), content_type="application/json",
                            headers={"Cache-Control": "no-store"})

    async def page(self, request: web.Request) -> web.Response:
        return web.Response(body=self._static["index.html"], content_type="text/html", charset="utf-8")

    async def static(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        body = self._static.get(name)
        suffix = name[name.rfind("."):] if "." in name else ""
        if body is None or suffix not in _STATIC_TYPES:
            raise web.HTTPNotFound()
        return web.Response(body=body, content_type=_STATIC_TYPES[suffix], charset="utf-8")

    def install(self, app: web.Application) -> None:
        app.router.add_get("/admin/compare", self.compare)
        app.router.add_get("/dashboard", self.page)
        app.router.add_get("/dashboard/static/{name}", self.static)
