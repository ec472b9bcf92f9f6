"""Kubernetes discovery: a Service's EndpointSlices, or pods by label selector; list, then watch.

Yields (see source.py) the complete set of ready endpoints after the list and after every watch
event that touched a watched object (bookmarks only move the resourceVersion), and `Failed` for
every failed attempt. The protocol, as client-go's reflector runs it:

1. List (in pages of `page_size`), remember the list's `metadata.resourceVersion`, replace the store.
2. Watch from that resourceVersion with `allowWatchBookmarks=true` and a server-side
   `timeoutSeconds` drawn from [watch_timeout_s, 2*watch_timeout_s) (so replicas do not reconnect
   in step). Every event and BOOKMARK moves the resourceVersion forward.
3. The watch ends normally (the server's timeout): watch again from the last resourceVersion.
4. `410 Gone` (as the HTTP status of the watch or list, or as an ERROR event with code 410): that
   resourceVersion is too old; list again at once (not counted as an error, and the new list
   replaces the store, so objects deleted meanwhile leave). When the watch from that fresh list is
   too old again (before any event), the source waits a backoff before it watches again, so that a
   server which keeps answering 410 is not hammered.
5. Any other failure (refused connection, dropped stream, timeout, 5xx, 401/403, malformed data):
   counted, then after backoff a new client (credentials re-read) watches again from the last
   resourceVersion, or lists if there was no list yet. The last known set stays in force.

The retries run on `gateway.retrying.forever` (tenacity): one attempt is one step of the above (a
list, or the next watch event), so a failure streak, and its backoff, ends at the first step that
succeeds.

Library: kubernetes_asyncio rather than lightkube. kubernetes_asyncio runs on aiohttp, which the
gateway already uses (it works with our aiohttp 3.x and Python 3.11), its generated API takes
`allow_watch_bookmarks`, and its config loaders cover kubeconfig (client certificates, tokens, exec
plugins) and in-cluster service accounts. lightkube is lighter (about 1 s and 30 MB less to
import) but brings a second HTTP stack (httpx2, httpcore2, anyio), has no `allowWatchBookmarks`
in its watch API, and on 410 silently restarts the watch without a resourceVersion, hiding the
gap that a re-list must close. kubernetes_asyncio is heavy to import (a few seconds, ~40 MB), so
this module is imported only when a Kubernetes source is configured (see `make_source`).

We call the list endpoints with `_preload_content=False` and read the responses ourselves (JSON
dicts, status checked) instead of using `kubernetes_asyncio.watch.Watch`: that class retries a 410
once from the same expired resourceVersion before raising, and hands back non-JSON lines as strings;
the reflector above owns those decisions. The library still makes every request (URL, query
parameters, auth headers, TLS).
"""

from __future__ import annotations

import asyncio
import functools
import random
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, cast

import aiohttp
from kubernetes_asyncio.client import ApiClient, CoreV1Api, DiscoveryV1Api
from kubernetes_asyncio.client.exceptions import OpenApiException

from .. import json_codec
from ..retrying import Backoff, forever
from .kubernetes_auth import Credentials, CredentialsError
from .kubernetes_objects import (
    ApiStatusError,
    Contribution,
    ResourceExpired,
    Store,
    WatchEvent,
    WatchProtocolError,
    parse_event,
    parse_list,
    pod_endpoints,
    slice_endpoints,
    status_error,
)
from .source import Clock, Failed, Observation, Resolved, Sleep, failure

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
ListCall = Callable[..., Awaitable[aiohttp.ClientResponse]]

_FAILURES = (
    aiohttp.ClientError,
    TimeoutError,
    OSError,
    ApiStatusError,
    WatchProtocolError,
    CredentialsError,
    OpenApiException,
)


@dataclass(eq=False)
class _Session:
    """Where the reflector is: its client, the resourceVersion to watch from (None: list first), the
    open watch, and whether a 410 came since the last event."""

    api: ApiClient | None = None
    call: ListCall | None = None
    version: str | None = None
    events: AsyncGenerator[WatchEvent, None] | None = None
    expired: bool = False

    async def end_watch(self) -> None:
        if self.events is not None:
            events, self.events = self.events, None
            await events.aclose()

    async def disconnect(self) -> None:
        """Close the watch and the client: the next step makes a new client (credentials re-read)."""
        await self.end_watch()
        if self.api is not None:
            api, self.api, self.call = self.api, None, None
            await api.close()


class KubernetesSource:
    """Ready endpoints of `service`'s EndpointSlices, or of the pods matching `label_selector`."""

    def __init__(
        self,
        name: str,
        *,
        credentials: Credentials,
        namespace: str | None = None,
        service: str | None = None,
        label_selector: str | None = None,
        port: int | str | None = None,
        backoff: Backoff | None = None,
        sleep: Sleep = asyncio.sleep,
        clock: Clock = time.monotonic,
        rng: random.Random | None = None,
        watch_timeout_s: float = 300.0,
        list_timeout_s: float = 30.0,
        page_size: int = 500,
    ) -> None:
        if (service is None) == (label_selector is None):
            raise ValueError("KubernetesSource needs `service` or `label_selector`")
        self._name = name
        self._credentials = credentials
        self._namespace = namespace
        self._selector = f"{SERVICE_NAME_LABEL}={service}" if service is not None else cast(str, label_selector)
        self._slices = service is not None
        if service is not None:
            self._contribute: Contribution = slice_endpoints(port)
        elif isinstance(port, int):
            self._contribute = pod_endpoints(port)
        else:
            raise ValueError("a label selector needs a port number")
        self._rng = rng or random.Random()
        self._backoff = backoff or Backoff(rng=self._rng)
        self._sleep = sleep
        self._clock = clock
        self._watch_timeout_s = watch_timeout_s
        self._list_timeout_s = list_timeout_s
        self._page_size = page_size

    @property
    def name(self) -> str:
        return self._name

    async def observe(self) -> AsyncGenerator[Observation, None]:
        store = Store(self._contribute)
        session = _Session()
        try:
            while True:  # one step per pass; the loop retries a step that fails
                async for attempt in forever(wait=self._backoff, sleep=self._sleep, retry_on=_FAILURES):
                    answers: list[Resolved] = []
                    with attempt:
                        await self._step(session, store, answers)
                    error = failure(attempt, _FAILURES)
                    for answer in answers:  # a relist's set, also when the watch from it failed
                        yield answer
                    if error is not None and not isinstance(error, ResourceExpired):
                        yield Failed(f"{type(error).__name__}: {error}")
                        await session.disconnect()
        finally:
            await session.disconnect()

    async def _step(self, session: _Session, store: Store, answers: list[Resolved]) -> None:
        """One step: a client if there is none, then the list (when there is no version to watch
        from) or the next watch event, each answer appended to `answers`. A 410 relists at once; a
        410 again before any event relists too, then raises `ResourceExpired` for the loop's backoff."""
        if session.api is None or session.call is None:
            session.api, default_namespace = await self._credentials.client()
            session.call = self._list_call(session.api, self._namespace or default_namespace)
        call = session.call
        if session.version is None:
            session.version = await self._list(call, store)
            answers.append(Resolved(store.endpoints()))
            return
        try:
            if session.events is None:
                session.events = self._watch(call, session.version)
            event = await anext(session.events, None)
        except ResourceExpired:
            await session.end_watch()
            session.version = None
            again, session.expired = session.expired, True
            session.version = await self._list(call, store)
            answers.append(Resolved(store.endpoints()))
            if again:
                raise
            return
        if event is None:  # the watch ended (the server's timeout): the next step watches again
            await session.end_watch()
            return
        session.expired = False
        session.version = event.resource_version or session.version
        if event.type != "BOOKMARK":
            store.apply(event)
            answers.append(Resolved(store.endpoints()))

    def _list_call(self, api: ApiClient, namespace: str) -> ListCall:
        if self._slices:
            method: Any = DiscoveryV1Api(api).list_namespaced_endpoint_slice
        else:
            method = CoreV1Api(api).list_namespaced_pod
        call = functools.partial(method, namespace, label_selector=self._selector, _preload_content=False)
        return cast(ListCall, call)

    async def _list(self, call: ListCall, store: Store) -> str:
        """List every page; returns the list's resourceVersion, the one to watch from."""
        items: list[Any] = []
        token: str | None = None
        while True:
            extra = {"_continue": token} if token else {}
            response = await call(limit=self._page_size, _request_timeout=self._list_timeout_s, **extra)
            async with response:
                body = await response.read()
                if response.status != 200:
                    raise _status(body, response.status)
            page = parse_list(body)
            items.extend(page.items)
            if page.continue_token is None:
                store.replace(items)
                return page.resource_version
            token = page.continue_token

    async def _watch(self, call: ListCall, version: str) -> AsyncGenerator[WatchEvent, None]:
        timeout_s = int(self._watch_timeout_s * (1.0 + self._rng.random()))
        started = self._clock()
        response = await call(
            watch=True,
            resource_version=version,
            allow_watch_bookmarks=True,
            timeout_seconds=timeout_s,
            _request_timeout=aiohttp.ClientTimeout(sock_connect=self._list_timeout_s, sock_read=timeout_s + 30),
        )
        events = 0
        async with response:
            if response.status != 200:
                raise _status(await response.read(), response.status)
            try:
                async for line in response.content:
                    if line.strip():
                        events += 1
                        yield parse_event(line)
            except ValueError as exc:  # aiohttp: a line longer than its read buffer
                raise WatchProtocolError(str(exc)) from exc
        if events == 0 and self._clock() - started < timeout_s / 2:
            raise WatchProtocolError("the watch closed at once without an event")


def _status(body: bytes, http_status: int) -> ApiStatusError:
    try:
        status = json_codec.loads(body)
    except json_codec.JSONDecodeError:
        status = None
    return status_error(status, http_status=http_status)
