"""The picker's gRPC server (grpc.aio): Envoy's `ExternalProcessor/Process` and gRPC health.

The method is registered by its full name, `/envoy.service.ext_proc.v3.ExternalProcessor/Process`,
with the gateway's own generated messages (gateway/picker/proto/ext_proc.proto says why). Health
(`grpc.health.v1.Health`, overall and for the ext_proc service) reports SERVING while at least one
backend takes requests, NOT_SERVING otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Final

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from .exchange import Picking
from .proto import ext_proc_pb2 as pb
from .stream import Conversation

log = logging.getLogger(__name__)

SERVICE: Final = "envoy.service.ext_proc.v3.ExternalProcessor"
HEALTH_INTERVAL_S: Final = 0.5


class PickerServer:
    def __init__(self, picking: Picking, ready: Callable[[], bool], *, max_body_bytes: int,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        """`ready()`: whether any backend takes requests now (gRPC health follows it)."""
        self._picking = picking
        self._max_body = max_body_bytes
        self._ready = ready
        self._sleep = sleep
        self._server: grpc.aio.Server | None = None
        self._health = HealthServicer()
        self._watch: asyncio.Task[None] | None = None
        self.port = 0

    async def process(self, _requests: object,
                      context: grpc.aio.ServicerContext[pb.ProcessingRequest, pb.ProcessingResponse]) -> None:
        """One stream, read and written through `context` (no async generator per stream or per
        message; grpc.aio's own cost per message dominates anyway: bench/results/overhead-envoy.md)."""
        conversation = Conversation(self._picking, max_body_bytes=self._max_body)
        try:
            while not conversation.done:
                message: object = await context.read()  # (the stubs leave out EOF)
                if not isinstance(message, pb.ProcessingRequest):  # grpc.aio.EOF: Envoy closed its side
                    return
                for answer in await conversation.handle(message):
                    await context.write(answer)
        finally:
            conversation.close()

    async def start(self, host: str, port: int, *, reuse_port: bool = False) -> int:
        """Listen on host:port (0: any free port); returns the port. Without `reuse_port` the port is
        this process's alone (gRPC would otherwise share it with any other process binding it)."""
        server = self._server = grpc.aio.server(options=[("grpc.so_reuseport", 1 if reuse_port else 0)])
        handler = grpc.stream_stream_rpc_method_handler(
            self.process, request_deserializer=pb.ProcessingRequest.FromString,
            response_serializer=pb.ProcessingResponse.SerializeToString)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {"Process": handler}),))
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.port = server.add_insecure_port(target)
        await self._report()
        await server.start()
        self._watch = asyncio.create_task(self._follow(), name="picker-health")
        log.info("endpoint picker listening on %s:%d", host, self.port)
        return self.port

    async def _report(self) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if self._ready() else \
            health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ("", SERVICE):
            await self._health.set(service, status)

    async def _follow(self) -> None:
        while True:
            await self._sleep(HEALTH_INTERVAL_S)
            await self._report()

    async def stop(self, grace_s: float) -> None:
        """Stop taking streams; running ones get `grace_s` to finish (each records its request)."""
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        if self._server is not None:
            await self._health.enter_graceful_shutdown()
            await self._server.stop(grace_s)
