"""What an EndpointSlice or a Pod contributes, the watch-event wire format, and the watched store.

Pure functions over the API's JSON (dicts with the API's camelCase keys), tested on payloads shaped
like a real API server's. No I/O here: kubernetes.py does the listing and watching.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from .. import json_codec
from .endpoints import Endpoint

Contribution = Callable[[Mapping[str, Any]], frozenset[Endpoint]]


class WatchProtocolError(Exception):
    """A line or body that is not what the list/watch protocol says (malformed JSON, missing keys)."""


class ApiStatusError(Exception):
    """The API server answered with a failure `Status` (HTTP status, or an ERROR watch event)."""

    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(f"{code} {reason}: {message}" if message else f"{code} {reason}")
        self.code = code
        self.reason = reason



class ResourceExpired(ApiStatusError):
    """410 Gone (reason Expired or Gone): the resourceVersion is too old; only a new list helps."""


def status_error(status: Any, *, http_status: int) -> ApiStatusError:
    """The error a `Status` object describes (or the bare HTTP status, when there is none);
    `ResourceExpired` for code 410."""
    code, reason, message = http_status, "", ""
    if isinstance(status, Mapping) and isinstance(status.get("code"), int):
        code, reason, message = status["code"], str(status.get("reason") or ""), str(status.get("message") or "")
    return (ResourceExpired if code == 410 else ApiStatusError)(code, reason, message)


def slice_endpoints(port: int | str | None) -> Contribution:
    """The ready endpoints of one discovery.k8s.io/v1 EndpointSlice, on the chosen port.

    `port` is the slice port's name or number; None takes the slice's only port (a slice with several
    contributes nothing: which one is meant is ambiguous). `conditions.ready` absent means ready, as
    the API says (an unknown state is to be read as ready); only the first address of an endpoint is
    used (the API says they are fungible, so one pod is one backend).
    """

    def contribute(obj: Mapping[str, Any]) -> frozenset[Endpoint]:
        number = _slice_port(obj.get("ports") or [], port)
        if number is None:
            return frozenset()
        found = set()
        for endpoint in obj.get("endpoints") or []:
            conditions = endpoint.get("conditions") or {}
            addresses = endpoint.get("addresses") or []
            if conditions.get("ready") is False or not addresses:
                continue
            found.add(Endpoint.of(str(addresses[0]), number))
        return frozenset(found)

    return contribute


def _slice_port(ports: Iterable[Mapping[str, Any]], wanted: int | str | None) -> int | None:
    listed = [p for p in ports if isinstance(p.get("port"), int)]
    if isinstance(wanted, int):
        return wanted if any(p["port"] == wanted for p in listed) else None
    if wanted is None:
        return listed[0]["port"] if len(listed) == 1 else None
    return next((p["port"] for p in listed if p.get("name") == wanted), None)


def pod_endpoints(port: int) -> Contribution:
    """A Pod's endpoint if it is serving: phase Running, condition Ready "True", an IP, and not being
    deleted (a pod with a deletionTimestamp is shutting down; it keeps Ready for a moment)."""

    def contribute(obj: Mapping[str, Any]) -> frozenset[Endpoint]:
        status = obj.get("status") or {}
        if (obj.get("metadata") or {}).get("deletionTimestamp") or status.get("phase") != "Running":
            return frozenset()
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
        ip = status.get("podIP")
        if not (ready and ip):
            return frozenset()
        role, bootstrap = pod_role(obj.get("metadata") or {})
        return frozenset({Endpoint.of(str(ip), port, role=role, bootstrap_port=bootstrap)})

    return contribute


# A pod's prefill/decode role: llm-d's label, or SGLang's; its bootstrap port: SGLang's annotation
# (a label is read too). Values that are not a role or a port are ignored (the entry's apply).
POD_ROLE_KEYS: Final = ("llm-d.ai/role", "sglang.ai/role")
POD_BOOTSTRAP_KEY: Final = "sglang.ai/bootstrap-port"
_ROLES: Final = frozenset({"prefill", "decode", "both"})


def pod_role(metadata: Mapping[str, Any]) -> tuple[str, int]:
    """(role or "", bootstrap port or 0) from a pod's labels and annotations."""
    labels = metadata.get("labels") or {}
    annotations = metadata.get("annotations") or {}
    role = ""
    for key in POD_ROLE_KEYS:
        value = str(labels.get(key) or annotations.get(key) or "").lower()
        if value in _ROLES:
            role = value
            break
    raw = str(annotations.get(POD_BOOTSTRAP_KEY) or labels.get(POD_BOOTSTRAP_KEY) or "")
    port = int(raw) if raw.isdigit() and 1 <= int(raw) <= 65535 else 0
    return role, port


@dataclass(frozen=True, slots=True)
class WatchEvent:
    type: str  # ADDED | MODIFIED | DELETED | BOOKMARK
    object: Mapping[str, Any]

    @property
    def key(self) -> str:
        return object_key(self.object)

    @property
    def resource_version(self) -> str | None:
        rv = (self.object.get("metadata") or {}).get("resourceVersion")
        return str(rv) if rv else None


def object_key(obj: Mapping[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"


def parse_event(line: bytes) -> WatchEvent:
    """One line of a watch stream. An ERROR event raises `ApiStatusError` (410 among them)."""
    try:
        data = json_codec.loads(line)
    except json_codec.JSONDecodeError as exc:
        raise WatchProtocolError(f"watch event is not JSON: {line[:200]!r}") from exc
    if not isinstance(data, dict) or not isinstance(data.get("type"), str) or not isinstance(data.get("object"), dict):
        if isinstance(data, dict) and data.get("kind") == "Status":  # a bare Status instead of an event
            raise status_error(data, http_status=500)
        raise WatchProtocolError(f"watch event without `type` and `object`: {line[:200]!r}")
    if data["type"] == "ERROR":
        raise status_error(data["object"], http_status=500)
    if data["type"] not in ("ADDED", "MODIFIED", "DELETED", "BOOKMARK"):
        raise WatchProtocolError(f"unknown watch event type {data['type']!r}")
    return WatchEvent(data["type"], data["object"])


@dataclass(frozen=True, slots=True)
class ListPage:
    items: list[Mapping[str, Any]]
    resource_version: str
    continue_token: str | None


def parse_list(body: bytes) -> ListPage:
    try:
        data = json_codec.loads(body)
    except json_codec.JSONDecodeError as exc:
        raise WatchProtocolError(f"list response is not JSON: {body[:200]!r}") from exc
    meta = data.get("metadata") if isinstance(data, dict) else None
    items = data.get("items") if isinstance(data, dict) else None
    if not isinstance(meta, dict) or not meta.get("resourceVersion") or not isinstance(items, list | None):
        raise WatchProtocolError(f"list response without metadata.resourceVersion: {body[:200]!r}")
    return ListPage([i for i in items or [] if isinstance(i, dict)], str(meta["resourceVersion"]),
                    meta.get("continue") or None)


class Store:
    """The watched objects' contributions by object key; the source's endpoints are their union."""

    def __init__(self, contribute: Contribution) -> None:
        self._contribute = contribute
        self._by_key: dict[str, frozenset[Endpoint]] = {}

    def replace(self, items: Iterable[Mapping[str, Any]]) -> None:
        """A fresh list: forget everything else (objects deleted while we were not watching go too)."""
        self._by_key = {object_key(i): self._contribute(i) for i in items}

    def apply(self, event: WatchEvent) -> None:
        if event.type == "DELETED":
            self._by_key.pop(event.key, None)
        elif event.type in ("ADDED", "MODIFIED"):
            self._by_key[event.key] = self._contribute(event.object)

    def endpoints(self) -> frozenset[Endpoint]:
        return frozenset().union(*self._by_key.values())
