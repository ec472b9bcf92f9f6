"""The hub's comparison keeps a crashed worker's share: its last windows stay in the merge until they
age out (here on an injected clock, with workers played by their stats books, no sockets)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry

from gateway.cluster.host_views import HostViews
from gateway.stats.book import StatsBook
from gateway.stats.export import KEEP_S, export_book
from tests.unit.stats.fixtures import outcome, settings


@dataclass(eq=False)
class FakeWorker:
    slot: int
    source: str
    book: StatsBook


class Host:
    """Workers answering the hub's `stats` and `collect` from their books, on a clock the test moves."""

    def __init__(self) -> None:
        self.now = 100.0
        self.workers: dict[int, FakeWorker] = {}
        self.asked: list[str] = []
        self.views = HostViews(each=self.each, current=lambda w: self.workers.get(w.slot) is w,
                               registry=CollectorRegistry(), clock=lambda: self.now, replica="r")

    def start(self, slot: int, served_at: list[float]) -> FakeWorker:
        book = StatsBook(settings(), started_at=0.0)
        for t in served_at:
            book.record(outcome("v1", t))
        worker = self.workers[slot] = FakeWorker(slot, f"worker-{slot}-{len(self.asked)}", book)
        return worker

    def crash(self, slot: int) -> None:
        self.views.retire(self.workers.pop(slot))

    async def each(self, method: str, body: Any = None, *, timeout_s: float = 10.0) -> list[tuple[Any, Any]]:
        self.asked.append(method)
        if method == "stats":
            return [(w, export_book(w.book, self.now, max_samples=body["max_samples"])) for w in self.workers.values()]
        return [(w, []) for w in self.workers.values()]


async def requests(host: Host, window: int) -> tuple[int, int, int]:
    doc = await host.views.compare(window, "replica")
    return doc["total"]["requests"], doc["workers"], doc["retired_workers"]


async def test_a_crashed_workers_share_stays_in_the_comparison_until_it_ages_out() -> None:
    host = Host()
    host.start(0, [90.5 + i / 10 for i in range(25)])
    host.start(1, [91.5 + i / 10 for i in range(15)])
    assert await requests(host, 60) == (40, 2, 0)
    host.crash(0)
    host.start(0, [])  # its replacement
    host.now = 101.0
    assert await requests(host, 60) == (40, 2, 1)  # not 15: the dead worker's 25 stay
    host.now = 160.0
    assert await requests(host, 60) == (0, 2, 1)  # out of the last minute, like the survivor's
    assert await requests(host, 300) == (40, 2, 1)
    host.now = 100.0 + KEEP_S + 1
    assert await requests(host, 3600) == (0, 2, 0)  # no window covers it: forgotten


async def test_the_baseline_keeps_every_workers_windows_fresh_unless_a_comparison_just_did() -> None:
    host = Host()
    host.start(0, [95.5])
    await host.views.refresh()
    assert host.asked == ["collect", "stats"]
    host.now += 1.0
    await requests(host, 60)
    host.now += 1.0
    await host.views.refresh()  # a comparison asked a second ago: only the metrics
    assert host.asked == ["collect", "stats", "stats", "collect"]
    host.crash(0)
    host.now += 1.0
    assert (await requests(host, 60))[0] == 1
