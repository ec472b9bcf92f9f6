"""`GET/PUT /admin/routes/{model}/weights`: read and change a split route's A/B weights at run time.

A change takes effect for the next request; sessions move only as far as the new weights require
(weighted rendezvous hashing). Weights are live state: a reload that changes the route's split starts
from the file's weights. The write goes through the gateway's coordinator (`cluster.coordinator`): with
several workers every one of them has it before the reply; with a shared store every replica has it
within `state.sync_interval_s`, and it survives restarts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from aiohttp import web

from .. import json_codec
from ..errors import InvalidRequest, ModelNotFound


class LiveWeights(Protocol):
    def weights(self, model: str) -> dict[str, float]: ...

    async def set_weights(self, model: str, weights: Mapping[str, float]) -> dict[str, float]: ...


def install(app: web.Application, live: LiveWeights) -> None:
    async def get_weights(request: web.Request) -> web.Response:
        model = request.match_info["model"]
        weights = live.weights(model)
        if not weights:
            raise ModelNotFound(f"`{model}` is not a split route.", param="model")
        return web.json_response({"model": model, "weights": weights}, dumps=lambda o: json_codec.dumps(o).decode())

    async def put_weights(request: web.Request) -> web.Response:
        model = request.match_info["model"]
        try:
            body = json_codec.loads(await request.read())
        except json_codec.JSONDecodeError as exc:
            raise InvalidRequest(f"Body is not valid JSON: {exc}") from None
        weights = body.get("weights") if isinstance(body, dict) else None
        if not isinstance(weights, dict) or not all(
            isinstance(k, str) and isinstance(v, int | float) and not isinstance(v, bool) for k, v in weights.items()
        ):
            raise InvalidRequest('Expected {"weights": {"<arm>": <number>, ...}}.', param="weights")
        try:
            applied = await live.set_weights(model, {k: float(v) for k, v in weights.items()})
        except KeyError:
            raise ModelNotFound(f"`{model}` is not a split route.", param="model") from None
        except ValueError as exc:
            raise InvalidRequest(str(exc), param="weights") from None
        return web.json_response({"model": model, "weights": applied},
                                 dumps=lambda o: json_codec.dumps(o).decode())

    app.router.add_get("/admin/routes/{model}/weights", get_weights)
    app.router.add_put("/admin/routes/{model}/weights", put_weights)
    app.router.add_post("/admin/routes/{model}/weights", put_weights)
