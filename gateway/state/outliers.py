"""Outlier detection: which backends to eject, judged on completed requests. Pure: time comes in.

A backend is judged on what its requests finally came to, not on first bytes: a backend that accepts
every request and then kills its streams must be ejected although every one of them started well.
The rule is Envoy's outlier detection, reduced to what we need:

- consecutive failures: `consecutive` failed requests in a row eject, whatever the window holds;
- failure rate: over the last `window_s` seconds, at least `min_requests` judged requests of which
  a share `failure_rate` or more failed eject;
- the n-th ejection in a row lasts n times `base_ejection_s` (capped at `max_ejection_s`); a backend
  that stayed in for `max_ejection_s` since its last re-admission starts again at one;
- the guards, judged per candidate set (`may_eject`): a set is what one request chooses from (a
  route's backends, an A/B arm's; Envoy's cluster), and a backend is ejected only if every set it
  belongs to keeps a routable backend and stays within `max_ejected_share` of its members (Envoy's
  `max_ejection_percent`, per cluster). An ejection that would break either rule in any of its sets
  is skipped (and says so), since sending traffic to a failing backend beats sending it nowhere: the
  only backend of a route is never ejected, and a set of n loses at most `max_ejected_share` x n.

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
    said eject but a guard of one of its candidate sets forbade it (`reason` then names the set)."""

    eject_for_s: Final[float | None]
    spared: Final[bool]
    reason: Final[str]

    def __init__(self, eject_for_s: float | None = None, spared: bool = False, reason: str = "") -> None:
        self.eject_for_s = eject_for_s
        self.spared = spared
        self.reason = reason


KEEP: Final = Verdict()  # the backend stays as it is (the verdict of almost every request)


def fault(record: Record, ok: bool, now: float, rules: OutlierRules) -> str:
    """Record one completed request's verdict; the reason the rules would eject its backend now, or
    "" (the answer for almost every request). An ejected backend's further failures only count."""
    record.add(ok, now, rules.window_s)
    if ok:
        record.consecutive_failures = 0
        return ""
    record.consecutive_failures += 1
    if record.ejected_until is not None:
        return ""  # already out
    if record.consecutive_failures >= rules.consecutive:
        return f"{record.consecutive_failures} consecutive failures"
    judged, failed = record.totals(now, rules.window_s)
    if judged >= rules.min_requests and failed >= rules.failure_rate * judged:
        return f"{failed} of {judged} requests failed in {rules.window_s:g} s"
    return ""


def may_eject(members: int, *, ejected_others: int, routable_others: int, max_ejected_share: float) -> bool:
    """The guards of one candidate set of `members` backends (the candidate among them), counting the
    others: one of them stays routable, and with the candidate out at most `max_ejected_share` of the
    set is ejected. A set of one never loses its backend. (The epsilon: 0.29 x 100 is 28.999...)"""
    return routable_others > 0 and ejected_others + 1 <= max_ejected_share * members + 1e-9


def eject(record: Record, now: float, rules: OutlierRules) -> float:
    """Take the backend out: for `base_ejection_s` times its ejections in a row (capped); a backend
    that stayed in for `max_ejection_s` since its last re-admission starts again at one."""
    if now - record.readmitted_at >= rules.max_ejection_s:
        record.ejections = 0
    record.ejections += 1
    duration = min(rules.base_ejection_s * record.ejections, rules.max_ejection_s)
    record.ejected_until = now + duration
    return duration


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
