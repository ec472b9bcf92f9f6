"""The best-throughput figure: a decaying high quantile of completed spans, not the maximum ever seen.

The figure behind cost-at-best (`/admin/compare`) and the `cost` routing policy is the
`PEAK_QUANTILE` (90th) percentile of the output tokens/s of the aligned `PEAK_SPAN_S` (10-s) spans of
the last `PEAK_HORIZON_S` (hour) that carried any output. Spans end on whole multiples of
`PEAK_SPAN_S` of the clock (not of the group's start), so the spans of several processes on one time
base (the workers of a gateway, the replicas of a fleet) line up and their sums can be scored
together (`stats.export`). Each span's tokens are the ones the windows
attribute to it (`window.Series`: every finished request's completion tokens spread over its
generation lifetime), so a span only knows its tokens once the streams that were active in it have
finished. A span is therefore scored `PEAK_LAG_S` after it ends, and then once: tokens of streams
still running at that point (streams longer than about a minute) are left out of it, which
understates the figure rather than flatters it.

What this guarantees: one burst cannot set the figure unless it fills more than a tenth of the busy
spans of the hour; a peak ages out an hour after its span ended; idle spans neither raise nor lower
it; with no busy span in the last hour the figure is unknown (None). The figure first appears
`PEAK_SPAN_S + PEAK_LAG_S` seconds after a group starts. Time comes only from the caller.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from .quantiles import nearest_rank

PEAK_SPAN_S = 10  # the span throughput is measured over (aligned to the group's start)
PEAK_LAG_S = 60  # a span is scored this long after it ends: by then its streams have mostly finished
PEAK_HORIZON_S = 3600  # spans that ended longer ago than this no longer count
PEAK_QUANTILE = 0.9  # nearest-rank quantile over the busy spans of the horizon

TokensIn = Callable[[int, int], float]  # (first second, stop second) -> tokens attributed to them


class Peak:
    """Scores each completed span once, keeps the busy ones of the last hour, serves their p90."""

    __slots__ = ("_next_end", "_spans", "value")

    def __init__(self, start_s: int) -> None:
        # the end (exclusive second) of the next span to score: the first whole multiple after start
        self._next_end = (start_s // PEAK_SPAN_S + 1) * PEAK_SPAN_S
        self._spans: deque[tuple[int, float]] = deque()  # (end second, tokens/s), oldest first
        self.value: float | None = None

    def state(self) -> tuple[int, list[tuple[int, float]]]:
        """(the end of the next span to score, the scored busy spans): what `restore` takes back."""
        return self._next_end, list(self._spans)

    def restore(self, next_end: int, spans: list[tuple[int, float]]) -> None:
        """Adopt scored spans (e.g. the sums of several processes' spans) and where scoring goes on."""
        self._next_end = next_end
        self._spans = deque(sorted(spans))
        self.value = nearest_rank(sorted(tps for _, tps in spans), PEAK_QUANTILE) if spans else None

    def advance(self, now_s: int, tokens_in: TokensIn) -> None:
        """Score the spans that ended at least `PEAK_LAG_S` before `now_s`, forget those past the
        horizon, and update `value`. Cheap when there is nothing to do (the common case)."""
        horizon = now_s - PEAK_HORIZON_S  # spans ending at or before this have aged out
        changed = False
        ripe = now_s - PEAK_LAG_S
        if self._next_end <= ripe:
            if self._next_end <= horizon:  # after a long quiet spell: skip what would age out at once
                behind = (horizon - self._next_end) // PEAK_SPAN_S + 1
                self._next_end += behind * PEAK_SPAN_S
            while self._next_end <= ripe:
                tokens = tokens_in(self._next_end - PEAK_SPAN_S, self._next_end)
                if tokens > 0:
                    self._spans.append((self._next_end, tokens / PEAK_SPAN_S))
                    changed = True
                self._next_end += PEAK_SPAN_S
        spans = self._spans
        while spans and spans[0][0] <= horizon:
            spans.popleft()
            changed = True
        if changed:
            self.value = nearest_rank(sorted(tps for _, tps in spans), PEAK_QUANTILE) if spans else None
