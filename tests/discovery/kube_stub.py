"""A stand-in for the Kubernetes API server: list and watch of one collection, on a real socket.

No API server can run on these machines, so this speaks the part of its protocol discovery uses,
as the API concepts documentation describes it:
- list: `{"kind": "...List", "metadata": {"resourceVersion": "N"}, "items": [...]}`, in pages of
  `limit` items with a `continue` token when asked;
- watch (`?watch=true&resourceVersion=N&allowWatchBookmarks=true`): a chunked stream of one JSON
  event per line, ADDED / MODIFIED / DELETED / BOOKMARK, replaying every logged change after N;
- history is kept like etcd's: after `compact()`, a watch from an older version gets HTTP 410 with a
  `Status` body, and `expire()` sends the other form, an ERROR event with code 410, then ends;
- `drop()` cuts open watch connections mid-stream, `end()` ends them as a server timeout does;
- a bearer token, when set, is required (401 otherwise); `fail_next` answers the next requests
  with an error status.

Every request is recorded (path, query parameters, Authorization) for the tests to assert on.
"""

from __future__ import annotations

import asyncio
import copy
import ssl
from dataclasses import dataclass
from typing import Any, Literal

import orjson
from aiohttp import web

Kind = Literal["pods", "endpointslices"]
_END, _DROP = "end", "drop"


@dataclass(frozen=True)
class Seen:
    path: str
    params: dict[str, str]
    authorization: str | None

    @property
    def watch(self) -> bool:
        return self.params.get("watch", "").lower() in ("true", "1")

    @property
    def resource_version(self) -> str | None:
        return self.params.get("resourceVersion")


def status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "code": code}


class KubeStub:
    def __init__(self, kind: Kind, *, namespace: str = "llm", token: str | None = None) -> None:
        self.kind = kind
        self.namespace = namespace
        self.token = token
        self.version = 100
        self.compacted = 0  # watches from a version older than this get 410
        self.objects: dict[str, dict[str, Any]] = {}
        self.history: list[tuple[int, dict[str, Any]]] = []  # (version, event)
        self.requests: list[Seen] = []
        self._failures: list[int] = []
        self._streams: list[asyncio.Queue[dict[str, Any] | str]] = []
        self._runner: web.AppRunner | None = None
        self.url = ""

    @property
    def path(self) -> str:
        if self.kind == "pods":
            return f"/api/v1/namespaces/{self.namespace}/pods"
        return f"/apis/discovery.k8s.io/v1/namespaces/{self.namespace}/endpointslices"

    async def start(self, *, tls: ssl.SSLContext | None = None) -> None:
        app = web.Application()
        app.router.add_get("/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, shutdown_timeout=1.0, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0, ssl_context=tls)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{port}"

    async def stop(self) -> None:
        self.end()
        if self._runner is not None:
            await self._runner.cleanup()

    @property
    def watches(self) -> list[Seen]:
        return [r for r in self.requests if r.watch]

    @property
    def open_watches(self) -> int:
        return len(self._streams)

    # -- changes the tests make -------------------------------------------------------------------

    def _change(self, kind: str, obj: dict[str, Any], *, notify: bool) -> None:
        self.version += 1
        obj = copy.deepcopy(obj)
        obj.setdefault("metadata", {})["resourceVersion"] = str(self.version)
        name = obj["metadata"]["name"]
        if kind == "DELETED":
            self.objects.pop(name, None)
        else:
            self.objects[name] = obj
        event = {"type": kind, "object": obj}
        self.history.append((self.version, event))
        if notify:
            for stream in self._streams:
                stream.put_nowait(event)

    def add(self, obj: dict[str, Any], *, notify: bool = True) -> None:
        self._change("ADDED", obj, notify=notify)

    def modify(self, obj: dict[str, Any], *, notify: bool = True) -> None:
        self._change("MODIFIED", obj, notify=notify)

    def delete(self, name: str, *, notify: bool = True) -> None:
        self._change("DELETED", self.objects[name], notify=notify)

    def bookmark(self) -> str:
        """Objects outside the selection changed: the version moves, and watchers hear of it."""
        self.version += 5
        rv = str(self.version)
        kind = "Pod" if self.kind == "pods" else "EndpointSlice"
        for stream in self._streams:
            stream.put_nowait({"type": "BOOKMARK", "object": {"kind": kind, "metadata": {"resourceVersion": rv}}})
        return rv

    def compact(self) -> None:
        self.compacted = self.version
        self.history.clear()

    def expire(self) -> None:
        """Compact, and tell open watches so with an ERROR event (code 410); they end after it."""
        self.compact()
        gone = status(410, "Expired", f"too old resource version: {self.compacted - 1} ({self.compacted})")
        for stream in self._streams:
            stream.put_nowait({"type": "ERROR", "object": gone})

    def drop(self) -> None:
        for stream in self._streams:
            stream.put_nowait(_DROP)

    def end(self) -> None:
        for stream in self._streams:
            stream.put_nowait(_END)

    def fail_next(self, code: int, times: int = 1) -> None:
        self._failures.extend([code] * times)

    # -- the protocol -------------------------------------------------------------------------------

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        seen = Seen(request.path, dict(request.query), request.headers.get("Authorization"))
        self.requests.append(seen)
        if self.token is not None and seen.authorization != f"Bearer {self.token}":
            return _json(401, status(401, "Unauthorized", "Unauthorized"))
        if self._failures:
            code = self._failures.pop(0)
            return _json(code, status(code, "InternalError", "the stub was told to fail"))
        if request.path != self.path:
            return _json(404, status(404, "NotFound", f"the stub serves {self.path}"))
        selector = _selector(seen.params.get("labelSelector", ""))
        if seen.watch:
            return await self._watch(request, seen, selector)
        items = [o for o in self.objects.values() if _matches(o, selector)]
        meta: dict[str, Any] = {"resourceVersion": str(self.version)}
        if "limit" in seen.params:  # pages; the continue token is the offset of the next one
            start, limit = int(seen.params.get("continue", "0")), int(seen.params["limit"])
            items, rest = items[start:start + limit], items[start + limit:]
            if rest:
                meta["continue"] = str(start + limit)
        kind = "PodList" if self.kind == "pods" else "EndpointSliceList"
        return _json(200, {"kind": kind, "apiVersion": "v1", "metadata": meta, "items": items})

    async def _watch(self, request: web.Request, seen: Seen, selector: dict[str, str]) -> web.StreamResponse:
        since = int(seen.resource_version or self.version)
        if since < self.compacted:
            return _json(410, status(410, "Expired", f"too old resource version: {since} ({self.compacted})"))
        backlog = [event for version, event in self.history if version > since]
        queue: asyncio.Queue[dict[str, Any] | str] = asyncio.Queue()
        for event in backlog:
            queue.put_nowait(event)
        self._streams.append(queue)  # no await between taking the backlog and listening: nothing is lost
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        try:
            await response.prepare(request)
            while True:
                item = await queue.get()
                if item == _END:
                    break
                if item == _DROP:
                    assert request.transport is not None
                    request.transport.abort()
                    return response
                assert isinstance(item, dict)
                if item["type"] in ("ADDED", "MODIFIED", "DELETED") and not _matches(item["object"], selector):
                    continue
                await response.write(orjson.dumps(item) + b"\n")
                if item["type"] == "ERROR":
                    break
            await response.write_eof()
            return response
        except ConnectionResetError:  # the client went away first
            return response
        finally:
            self._streams.remove(queue)


def _json(code: int, body: dict[str, Any]) -> web.Response:
    return web.Response(status=code, body=orjson.dumps(body), content_type="application/json")


def _selector(text: str) -> dict[str, str]:
    pairs = [part.split("=", 1) for part in text.split(",") if "=" in part]
    return {k.strip(): v.strip() for k, v in pairs}


def _matches(obj: dict[str, Any], selector: dict[str, str]) -> bool:
    labels = obj.get("metadata", {}).get("labels") or {}
    return all(labels.get(k) == v for k, v in selector.items())


def pod(name: str, ip: str, *, ready: bool = True, phase: str = "Running", app: str = "sglang") -> dict[str, Any]:
    """A v1 Pod as the API server returns it, trimmed to what discovery reads (and a little more)."""
    return {
        "kind": "Pod", "apiVersion": "v1",
        "metadata": {"name": name, "namespace": "llm", "uid": f"uid-{name}", "labels": {"app": app}},
        "spec": {"containers": [{"name": "engine", "ports": [{"containerPort": 30000}]}]},
        "status": {"phase": phase, "podIP": ip, "podIPs": [{"ip": ip}], "conditions": [
            {"type": "Initialized", "status": "True"},
            {"type": "Ready", "status": "True" if ready else "False"},
            {"type": "ContainersReady", "status": "True" if ready else "False"},
        ]},
    }


def endpoint_slice(name: str, service: str, *endpoints: tuple[str, bool]) -> dict[str, Any]:
    """A discovery.k8s.io/v1 EndpointSlice of `service` with a named `http` port 8000."""
    return {
        "kind": "EndpointSlice", "apiVersion": "discovery.k8s.io/v1", "addressType": "IPv4",
        "metadata": {"name": name, "namespace": "llm", "labels": {"kubernetes.io/service-name": service}},
        "endpoints": [
            {"addresses": [ip], "conditions": {"ready": ready, "serving": ready, "terminating": False},
             "targetRef": {"kind": "Pod", "namespace": "llm", "name": f"pod-{ip}"}}
            for ip, ready in endpoints
        ],
        "ports": [{"name": "http", "protocol": "TCP", "port": 8000}, {"name": "metrics", "protocol": "TCP",
                                                                       "port": 9090}],
    }
