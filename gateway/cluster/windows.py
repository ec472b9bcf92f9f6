"""Every worker's last exported windows, and a retired worker's until they age out (pure).

The hub merges the workers' windows for `/admin/compare` and the fleet (`stats.export`). It keeps
the last export each worker gave (asked for every comparison and, besides, every few seconds), so
that a worker that crashes does not take its share of the comparison with it: its last export stays
in the merge, closed (`export.close`), until nothing of it is in any window (`export.expired`), as
its counters stay in the /metrics sums. What it served after its last export is lost, as for its
counters. Time comes in as arguments.
"""

from __future__ import annotations

from ..stats.export import Export, close, expired, export_book, merge

MAX_RETIRED = 4  # past this many retired exports, they are merged into one (a worker that crashes in a loop)


class WorkerWindows:
    def __init__(self) -> None:
        self._serving: dict[str, Export] = {}  # source -> its last export
        self._retired: list[Export] = []

    def update(self, source: str, export: Export) -> None:
        self._serving[source] = export

    def retire(self, source: str, now: float) -> None:
        kept = self._serving.pop(source, None)
        if kept is None:
            return
        self._retired.append(close(kept))
        if len(self.retired(now)) > MAX_RETIRED:  # exact counts still; reservoirs drawn in proportion
            self._retired = [close(export_book(merge(self._retired, now=now), now))]

    def retired(self, now: float) -> list[Export]:
        """The retired workers' closed exports still in some window at `now` (the others are forgotten)."""
        self._retired = [e for e in self._retired if not expired(e, now)]
        return list(self._retired)

    def exports(self, now: float) -> list[Export]:
        """Every serving worker's last export, then the retired ones still in some window."""
        return [*self._serving.values(), *self.retired(now)]
