"""SGLang's bootstrap server: the rendezvous HTTP server a prefill runs on
`--disaggregation-bootstrap-port` (`CommonKVBootstrapServer` in `srt/disaggregation/common/conn.py`).

Each prefill rank registers where its KV manager listens (`PUT /route`: `rank_ip`, `rank_port`,
its DP/CP/TP/PP ranks and sizes, `page_size`, `load_balance_method`); a decode asks `GET /route`
with all four ranks -1 for the server's layout (`PrefillServerInfo`: `dp_size`,
`follow_bootstrap_room`, `page_size`, ...; 503 "Prefill server not fully registered yet" until
every rank registered) and with one rank's coordinates for that rank's `rank_ip`/`rank_port` (404
"Bootstrap info not found ..."). `/register_dp_rank` and `/query_dp_ranks` record and answer the
DP rank of a room for servers that do not follow the room; `/health` says OK.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

FIELDS_MISSING = "Missing inputs for bootstrap server."


@dataclass(slots=True)
class BootstrapStore:
    """What the prefill ranks registered (the server's state)."""

    dp_size: int | None = None
    page_size: int | None = None
    follow_bootstrap_room: bool | None = None
    expected: int = 1
    ranks: dict[int, dict[str, Any]] = field(default_factory=dict)  # dp rank -> {rank_ip, rank_port}
    room_to_dp_rank: dict[int, int] = field(default_factory=dict)

    def register(self, data: dict[str, Any]) -> None:
        if self.dp_size is None:
            self.dp_size = int(data["attn_dp_size"] if data.get("system_dp_size", 1) == 1 else data["system_dp_size"])
            self.expected = self.dp_size * int(data.get("attn_tp_size", 1)) * int(data.get("pp_size", 1))
        if self.page_size is None:
            self.page_size = int(data["page_size"])
        if self.follow_bootstrap_room is None:
            self.follow_bootstrap_room = data.get("load_balance_method", "follow_bootstrap_room") == (
                "follow_bootstrap_room")
        dp_group = int(data["attn_dp_rank"] if data.get("system_dp_size", 1) == 1 else data["system_dp_rank"])
        self.ranks[dp_group] = {"rank_ip": str(data["rank_ip"]), "rank_port": int(data["rank_port"])}

    @property
    def ready(self) -> bool:
        return self.dp_size is not None and len(self.ranks) >= self.expected


def build_app(store: BootstrapStore) -> web.Application:
    app = web.Application()

    async def route(request: web.Request) -> web.Response:
        if request.method == "PUT":
            store.register(await request.json())
            return web.Response(text="OK")
        if request.method != "GET":
            return web.Response(text="Method not allowed", status=405, content_type="application/json")
        q = request.query
        keys = ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank")
        if not all(q.get(k) for k in keys):
            return web.Response(text=FIELDS_MISSING, status=400)
        try:
            ranks = [int(q[k]) for k in keys]
        except ValueError:
            return web.Response(text=FIELDS_MISSING, status=400)
        if not store.ready:
            return web.Response(text=f"Prefill server not fully registered yet ({len(store.ranks)} workers "
                                     "registered).", status=503)
        if ranks == [-1, -1, -1, -1]:
            return web.json_response({
                "attn_tp_size": 1, "attn_cp_size": 1, "dp_size": store.dp_size, "pp_size": 1,
                "page_size": store.page_size, "kv_cache_dtype": "auto",
                "follow_bootstrap_room": True if store.follow_bootstrap_room is None else store.follow_bootstrap_room,
                "enable_dsa_cache_layer_split": False, "prefill_http_port": None,
            })
        info = store.ranks.get(ranks[0]) if ranks[1:] == [0, 0, 0] else None
        if info is None:
            return web.Response(text=f"Bootstrap info not found for dp_rank={ranks[0]} cp_rank={ranks[1]} "
                                     f"tp_rank={ranks[2]} pp_rank={ranks[3]}", status=404)
        return web.json_response(info)

    async def register_dp_rank(request: web.Request) -> web.Response:
        data = await request.json()
        store.room_to_dp_rank[int(data["bootstrap_room"])] = int(data["dp_rank"])
        return web.Response(text="OK")

    async def query_dp_ranks(request: web.Request) -> web.Response:
        data = await request.json()
        rooms = [int(r) for r in data["bootstrap_rooms"]]
        return web.json_response({str(r): store.room_to_dp_rank[r] for r in rooms if r in store.room_to_dp_rank})

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="OK")

    app.router.add_route("*", "/route", route)
    app.router.add_post("/register_dp_rank", register_dp_rank)
    app.router.add_post("/query_dp_ranks", query_dp_ranks)
    app.router.add_get("/health", health)
    return app
