"""The hub keeps every worker's last windows; a retired worker's stay in the comparison, closed,
until no window covers them, and a worker crashing in a loop cannot make them grow without bound."""

from __future__ import annotations

from typing import Any

import orjson

from gateway.cluster.windows import MAX_RETIRED, WorkerWindows
from gateway.stats.book import StatsBook
from gateway.stats.export import KEEP_S, export_book, merge
from gateway.stats.figures import figures
from tests.unit.stats.fixtures import outcome, settings


def export_of(*at: float, now: float) -> dict[str, Any]:
    book = StatsBook(settings(), started_at=0.0)
    for t in at:
        book.record(outcome("v1", t))
    exported: dict[str, Any] = orjson.loads(orjson.dumps(export_book(book, now)))
    return exported


def requests(windows: WorkerWindows, now: float, window: int = 3600) -> int:
    book = merge(windows.exports(now), now=now)
    return int(figures(book, book.total, now, window)["requests"])


def test_a_retired_workers_windows_stay_until_no_window_covers_them() -> None:
    windows = WorkerWindows()
    windows.update("w0", export_of(1.5, 2.5, now=10.0))
    windows.update("w1", export_of(3.5, now=10.0))
    windows.retire("w0", 10.0)
    assert len(windows.exports(10.0)) == 2
    assert requests(windows, 10.0, 60) == 3
    windows.update("w0-new", export_of(now=11.0))  # its replacement, nothing served yet
    assert requests(windows, 11.0, 60) == 3
    assert requests(windows, 80.0, 60) == 0  # aged out of the 1-minute window, as the live ones did
    assert requests(windows, 80.0, 300) == 3
    assert len(windows.retired(10.0 + KEEP_S)) == 1
    assert windows.retired(10.0 + KEEP_S + 1) == []  # no window covers it: forgotten
    assert len(windows.exports(10.0 + KEEP_S + 1)) == 2  # the serving workers'


def test_retiring_an_unknown_worker_keeps_nothing() -> None:
    windows = WorkerWindows()
    windows.retire("never-exported", 5.0)
    assert windows.exports(5.0) == []


def test_a_worker_crashing_in_a_loop_keeps_a_bounded_number_of_exports_with_exact_counts() -> None:
    windows = WorkerWindows()
    for i in range(3 * MAX_RETIRED):
        windows.update(f"w0-{i}", export_of(10.0 * i + 0.5, 10.0 * i + 1.5, now=10.0 * i + 5.0))
        windows.retire(f"w0-{i}", 10.0 * i + 5.0)
        assert len(windows.retired(10.0 * i + 5.0)) <= MAX_RETIRED
    assert requests(windows, 10.0 * 3 * MAX_RETIRED) == 2 * 3 * MAX_RETIRED
