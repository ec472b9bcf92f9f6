"""The supervisor-worker channel over a real Unix socket: calls both ways, failures, closing."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from gateway.cluster.channel import Channel, ChannelClosed, RemoteError


@pytest.fixture
async def pair(tmp_path: Path) -> AsyncIterator[tuple[Channel, Channel]]:
    """(hub side, worker side), each reading in its own task."""
    accepted: asyncio.Future[Channel] = asyncio.get_running_loop().create_future()
    tasks: list[asyncio.Task[None]] = []

    async def connected(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        channel = Channel(reader, writer, {}, name="hub")
        accepted.set_result(channel)
        await channel.run()

    path = tmp_path / "hub.sock"
    server = await asyncio.start_unix_server(connected, path=str(path))
    reader, writer = await asyncio.open_unix_connection(str(path))
    worker = Channel(reader, writer, {}, name="worker")
    tasks.append(asyncio.create_task(worker.run()))
    hub = await accepted
    yield hub, worker
    await worker.close()
    await hub.close()
    server.close()
    for t in tasks:
        t.cancel()


async def hang(body: Any) -> None:
    """A handler that never answers."""
    await asyncio.Event().wait()


async def test_calls_go_both_ways_with_plain_and_async_handlers(pair: tuple[Channel, Channel]) -> None:
    hub, worker = pair
    hub.handle("admit", lambda body: None if body[1] > 0 else [3, "requests"])

    async def slow_export(body: dict[str, Any]) -> dict[str, Any]:
        await asyncio.sleep(0)
        return {"max_samples": body["max_samples"], "groups": list(range(5))}

    worker.handle("stats", slow_export)
    assert await worker.call("admit", ["k", 10, 0]) is None
    assert await worker.call("admit", ["k", 0, 0]) == [3, "requests"]
    assert await hub.call("stats", {"max_samples": 16}) == {"max_samples": 16, "groups": [0, 1, 2, 3, 4]}
    answers = await asyncio.gather(*(worker.call("admit", ["k", i, 0]) for i in range(1, 101)))
    assert answers == [None] * 100  # concurrent calls are matched to their own answers


async def test_notifications_arrive_in_order_without_an_answer(pair: tuple[Channel, Channel]) -> None:
    hub, worker = pair
    got: list[int] = []
    done = asyncio.Event()

    def probes(body: list[int]) -> None:
        got.extend(body)
        if len(got) == 30:
            done.set()

    worker.handle("probes", probes)
    for i in range(10):
        hub.notify("probes", [3 * i, 3 * i + 1, 3 * i + 2])
    await asyncio.wait_for(done.wait(), 5)
    assert got == list(range(30))


async def test_a_failing_or_unknown_handler_fails_the_call_not_the_channel(pair: tuple[Channel, Channel]) -> None:
    hub, worker = pair

    def broken(body: Any) -> None:
        raise ValueError("unknown arm(s) ['x']")

    hub.handle("weights", broken)
    with pytest.raises(RemoteError, match="unknown arm"):
        await worker.call("weights", ["ab", {"x": 1}])
    with pytest.raises(RemoteError, match="unknown method"):
        await worker.call("nothing")
    hub.handle("ping", lambda body: "pong")
    assert await worker.call("ping") == "pong"


async def test_pending_calls_fail_when_the_other_end_goes(pair: tuple[Channel, Channel]) -> None:
    hub, worker = pair
    hub.handle("hang", hang)
    call = asyncio.create_task(worker.call("hang", timeout_s=30))
    await hub.close()  # the supervisor is gone
    with pytest.raises(ChannelClosed):
        await call
    await asyncio.wait_for(worker.closed.wait(), 5)
    with pytest.raises(ChannelClosed):
        await worker.call("anything")
    worker.notify("charge", [1])  # dropped, no error


async def test_a_call_times_out(pair: tuple[Channel, Channel]) -> None:
    hub, worker = pair
    hub.handle("hang", hang)
    with pytest.raises(TimeoutError):
        await worker.call("hang", timeout_s=0.05)
