"""The contract every discovery source keeps, and the one loop that turns its answers into changes.

A source (`DnsSource`, `KubernetesSource`) is an async iterator of observations: `Resolved(endpoints)`
with every endpoint an answer names, each time it has an answer, or `Failed(error)` each time an
attempt fails. A source never ends and never raises (except `CancelledError` when its task is
cancelled): it retries failures itself (`gateway.retrying`, with backoff, through the `sleep` it was
given).

`changes(source)` is what the gateway consumes. It counts every observation once (resolutions and
errors, the gauges of endpoints; see metrics.py), keeps the set in force across failures (a failure
yields nothing), and yields a `Change` only when the set in force differs from the last one, plus
once for the first answer (even an empty one, so that the consumer knows the source is live).
Before the first answer the source has no endpoints (or the `known` ones it was started with).

Which endpoints are in force is the `hold`'s decision (hysteresis.py): with `LITERAL` (the
default; Kubernetes, whose list and watch always give the whole set, and for which a missing pod
is a fact) each answer is the set; a DNS entry's hold keeps an endpoint an answer left out until it
has been missing for `leave_after_answers` answers and `leave_after_s` seconds, because DNS answers
may name a subset of the records. The hold lives here, in the consumer, rather than in the DNS
source, so that it outlives a source restart: a reload that changes an entry's `dns:` block starts
a new source with the set in force as `known`, and its first partial answer drains nothing.

Run it in a task and stop it by cancelling the task; the source closes its sockets and clients on
the way out:

    async def follow(entry: DiscoveryEntry) -> None:
        async for change in changes(make_source(entry), metrics=metrics, hold=entry.hold):
            pool.replace(entry.name, backends_of(entry, change.endpoints))

    task = asyncio.create_task(follow(entry))
    ...
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Protocol

from tenacity import AttemptManager

from .endpoints import Endpoint
from .hysteresis import LITERAL, Hold, Presence
from .metrics import DiscoveryMetrics

log = logging.getLogger("gateway.discovery")

Sleep = Callable[[float], Awaitable[None]]
Clock = Callable[[], float]


@dataclass(frozen=True, slots=True)
class Resolved:
    """An answer: every endpoint it names (a DNS answer may name only some of the records)."""

    endpoints: frozenset[Endpoint]


@dataclass(frozen=True, slots=True)
class Failed:
    """An attempt that failed; the set in force stays."""

    error: str


Observation = Resolved | Failed


class Source(Protocol):
    """Something that finds endpoints. `name` is the discovery entry's name (the metrics label)."""

    @property
    def name(self) -> str: ...

    def observe(self) -> AsyncGenerator[Observation, None]: ...


@dataclass(frozen=True, slots=True)
class Change:
    """The set in force changed (or the source answered for the first time): the new set and the difference."""

    source: str
    endpoints: frozenset[Endpoint]
    added: frozenset[Endpoint]
    removed: frozenset[Endpoint]


def failure(attempt: AttemptManager, retried: type[BaseException] | tuple[type[BaseException], ...]) -> (
        BaseException | None):
    """After `with attempt:` in a `gateway.retrying.forever` loop: the error the attempt failed with
    (one the loop retries: the source yields `Failed` for it, then the loop sleeps its backoff), or
    None when it succeeded. Any other exception (a cancellation, which the attempt swallowed) is
    re-raised here, so that the source yields nothing more on its way out."""
    outcome = attempt.retry_state.outcome
    if outcome is None or not outcome.failed:
        return None
    error = outcome.exception()
    if error is not None and not isinstance(error, retried):
        raise error
    return error


async def changes(
    source: Source, *, metrics: DiscoveryMetrics | None = None, hold: Hold = LITERAL,
    clock: Clock = time.monotonic, known: frozenset[Endpoint] | None = None,
) -> AsyncGenerator[Change, None]:
    """Follow `source` forever, yielding only changes of the set in force (see the module docstring).
    `known`: endpoints in force before the first answer (those of a source this one replaces)."""
    presence = Presence.of(hold, known or frozenset(), clock())
    current = presence.endpoints
    answered = False
    failing = False
    if metrics is not None:
        metrics.declare(source.name)
    async with aclosing(source.observe()) as observations:
        async for observation in observations:
            if isinstance(observation, Failed):
                if metrics is not None:
                    metrics.failed(source.name)
                if not failing:
                    kept = f"keeping the last {len(current)} endpoint(s)" if current else "no endpoints yet"
                    log.warning("discovery %s failed (%s): %s", source.name, kept, observation.error)
                failing = True
                continue
            if failing:
                log.info("discovery %s answers again", source.name)
                failing = False
            held = presence.answer(observation.endpoints, clock())
            if metrics is not None:
                metrics.resolved(source.name, missing=len(held.missing))
            if held.missing:
                log.debug("discovery %s: %d endpoint(s) in force missing from the answer", source.name,
                          len(held.missing))
            if answered and held.endpoints == current:
                continue
            answered = True
            before, current = current, held.endpoints
            change = Change(source.name, current, current - before, before - current)
            if metrics is not None:
                metrics.changed(source.name, added=len(change.added), removed=len(change.removed), now=len(current))
            log.info("discovery %s: %d endpoint(s), +%d -%d", source.name, len(current), len(change.added),
                     len(change.removed))
            yield change


async def run(
    source: Source, on_change: Callable[[Change], object], *, metrics: DiscoveryMetrics | None = None,
    hold: Hold = LITERAL, clock: Clock = time.monotonic,
) -> None:
    """`changes` as a coroutine for a task: calls `on_change` for every change until cancelled.
    `on_change` runs on the loop and must not block; an exception from it ends the task."""
    async for change in changes(source, metrics=metrics, hold=hold, clock=clock):
        on_change(change)
