"""Outlier detection: which backends to eject, judged on completed requests. Pure: time comes in.

A backend is judged on what its requests finally came to, not on first bytes: a backend that accepts
every request and then kills its streams must be ejected although every one of them started well.
The rule is Envoy's outlier detection, reduced to what we need:

- consecutive failures: `consecutive` failed requests in a row eject, whatever the window holds;
- failure rate: over the last `window_s` seconds, at least `min_requests` judged requests of which
  a share `failure_rate` or more failed eject;
- the n-th ejection in a row lasts n times `base_ejection_s` (capped at `max_ejection_s`); a backend
  that stayed in for `max_ejection_s` since its last re-admission starts again at one;
- never more than `max_ejected_share` of the fleet at once, and never the last routable backend:
  an ejection that would break either rule is skipped (and says so), since sending traffic to a
  failing backend beats sending it nowhere.

What is a failure is decided by the caller: a backend's own failure (connection failures, resets,
5xx other than 503, broken or truncated streams, no first token in time). Client disconnects, the
gateway's total timeout and a backend that sheds load (429/503) are not judged at all.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Final


@dataclass(frozen=True, slots=True)
class OutlierRules:
    consecutive: int = 5
    failure_rate: float = 0.5
    window_s: float = 30.0
    min_requests: int = 10
    base_ejection_s: float = 5.0
    max_ejection_s: float = 300.0
    max_ejected_share: float = 0.5


@dataclass(slots=True)
class Record:
    """One backend's recent verdicts: per-second [second, ok, failed] counts within the window."""

    seconds: deque[list[int]] = field(default_factory=deque)
    consecutive_failures: int = 0
    ejections: int = 0  # in a row (the ejection-time multiplier)
    ejected_until: float | None = None  # None while not ejected
    readmitted_at: float = 0.0

    def add(self, ok: bool, now: float, window_s: float) -> None:
        second = int(now)
        seconds = self.seconds
        if seconds and seconds[-1][0] == second:
            slot = seconds[-1]
        else:
            slot = [second, 0, 0]
            seconds.append(slot)
        slot[1 if ok else 2] += 1
        while seconds and seconds[0][0] <= second - window_s:
            seconds.popleft()

    def totals(self, now: float, window_s: float) -> tuple[int, int]:
        """(judged, failed) within the window that ends at `now`."""
        horizon = int(now) - window_s
        judged = failed = 0
        for second, ok, bad in self.seconds:
            if second > horizon:
                judged += ok + bad
                failed += bad
        return judged, failed


@dataclass(slots=True, unsafe_hash=True)
class Verdict:
    """What one judged request did to its backend: `eject` for how long, or `spared` when the rule
    said eject but the fleet cap forbade it."""

    eject_for_s: Final[float | None]
    spared: Final[bool]
    reason: Final[str]

    def __init__(self, eject_for_s: float | None = None, spared: bool = False, reason: str = "") -> None:
        self.eject_for_s = eject_for_s
        self.spared = spared
        self.reason = reason


KEEP: Final = Verdict()  # the backend stays as it is (the verdict of almost every request)


def judge(
    record: Record, ok: bool, now: float, rules: OutlierRules, *, ejected_others: int, fleet: int,
    routable_others: int,
) -> Verdict:
    """Record one completed request's verdict and say whether its backend is to be ejected now.

    `ejected_others` and `routable_others` count the rest of the fleet (`fleet` backends in all)."""
    record.add(ok, now, rules.window_s)
    if ok:
        record.consecutive_failures = 0
        return KEEP
    record.consecutive_failures += 1
    if record.ejected_until is not None:
        return KEEP  # already out
    reason = ""
    if record.consecutive_failures >= rules.consecutive:
        reason = f"{record.consecutive_failures} consecutive failures"
    else:
        judged, failed = record.totals(now, rules.window_s)
        if judged >= rules.min_requests and failed >= rules.failure_rate * judged:
            reason = f"{failed} of {judged} requests failed in {rules.window_s:g} s"
    if not reason:
        return KEEP
    if routable_others == 0 or (ejected_others + 1) > rules.max_ejected_share * fleet:
        return Verdict(spared=True, reason=reason)
    if now - record.readmitted_at >= rules.max_ejection_s:
        record.ejections = 0
    record.ejections += 1
    duration = min(rules.base_ejection_s * record.ejections, rules.max_ejection_s)
    record.ejected_until = now + duration
    return Verdict(eject_for_s=duration, reason=reason)


def readmit(record: Record, now: float) -> bool:
    """A passing health probe: back in once the ejection time has passed (True when re-admitted).
    The window starts afresh, so the old failures cannot eject it again at once."""
    if record.ejected_until is None or now < record.ejected_until:
        return False
    record.ejected_until = None
    record.readmitted_at = now
    record.consecutive_failures = 0
    record.seconds.clear()
    return True
