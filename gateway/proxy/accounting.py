"""The one place a request is recorded, and the one place a backend's verdict on it is recorded.

`finish` runs exactly once per generation request, from the dispatcher's `finally` (or for a request
a front refused before dispatch), whatever ended it: success, a backend error, the client gone (in a
stream or while waiting for a non-streaming answer), a refusal by the front, auth or a rate limit, or
a bug (status 500). It builds the one `Outcome` that Prometheus, the live statistics and the per-key
counters and token budgets are all fed from, and closes the routing ticket of the attempt that got a
response.

Usage is the engine's wherever it reported it. A request that reached an engine but ended before
the engine reported usage (the client left, the stream broke) is charged the gateway's estimate:
the prompt tokens `describe` estimated, and as completion tokens the token events the relay saw.
Such outcomes say so (`usage_estimated`), and nothing is ever charged twice.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Final

from backends.base import Endpoint, Usage

from ..observability.metrics import Recorder
from ..observability.outcome import NONE, Outcome
from ..observability.pd import PdMetrics
from ..routing import RoutingState
from ..settings import ApiKey
from ..state.pool import BackendState, Pool
from .exchange import Exchange, sla_outcome

# statuses of responses an engine produced (its usage then corrects the prefix memory)
RESPONSE_STARTED: Final = frozenset({"200", "stream_error", "stream_timeout", "client_closed"})
# endpoints that run no generation or pooling: nothing to charge when their answer is lost
NO_TOKENS: Final = frozenset({Endpoint.TOKENIZE, Endpoint.DETOKENIZE})

KeyCharge = Callable[[ApiKey, Outcome], None]

log = logging.getLogger(__name__)


class Accounting:
    def __init__(
        self, recorder: Recorder, routing: RoutingState, *, clock: Callable[[], float],
        charge_key: KeyCharge | None = None, pd: PdMetrics | None = None,
    ) -> None:
        self._recorder = recorder
        self._pd = pd
        self._routing = routing
        self._clock = clock
        self._charge_key = charge_key

    def judge(self, pool: Pool, state: BackendState, *, ok: bool, detail: str | None = None) -> None:
        """A completed request's verdict on its backend (outlier detection)."""
        verdict = pool.judge(state.name, ok, self._clock(), detail)
        if verdict.eject_for_s is not None:
            log.warning("backend %s ejected for %.0f s: %s (last error: %s)", state.name, verdict.eject_for_s,
                        verdict.reason, detail)
            self._recorder.ejected(state.name, state.runtime)
            self._routing.forget(state.name, state.units)  # what it cached may be gone by the time it returns
        elif verdict.spared:
            log.warning("backend %s not ejected: %s", state.name, verdict.reason)  # "..., but route `m` would ..."
            self._recorder.ejection_spared(state.name, state.runtime)

    def finish(self, ex: Exchange) -> None:
        """Record the request's outcome (exactly once) and teach the routing memory what happened."""
        if ex.recorded:
            return
        ex.recorded = True
        now = self._clock()
        duration = now - ex.started
        usage = ex.usage
        ttft = generation = None
        gaps = None
        stream = ex.stream
        if stream is not None:
            usage = stream.usage or usage
            if stream.first_token_at is not None and stream.last_token_at is not None:
                ttft = stream.first_token_at - ex.started
                generation = stream.last_token_at - stream.first_token_at
            if stream.gaps.count:
                gaps = stream.gaps
        elif usage is not None:
            generation = duration  # a non-streaming answer's tokens came at some point in its duration
        estimated = False
        if usage is None and ex.engine_worked and ex.endpoint not in NO_TOKENS:
            usage = Usage(prompt_tokens=ex.features.prompt_tokens, completion_tokens=stream.tokens if stream else 0)
            estimated = True
        state = ex.last
        expected = prediction = None
        if ex.ticket is not None:  # the attempt that got a response: close its ticket exactly once
            expected, prediction = ex.ticket.expected_tokens, ex.ticket.source
            if ex.status in RESPONSE_STARTED:
                self._routing.completed(
                    ex.ticket,
                    cached_tokens=None if estimated or usage is None else usage.cached_tokens,
                    prompt_tokens=None if estimated or usage is None else usage.prompt_tokens,
                    itl_s=gaps.mean_s if gaps is not None else None,
                )
            else:
                self._routing.failed(ex.ticket, reached_engine=True)
            ex.ticket = None
        if state is not None and ex.verdict is not None and ex.pool is not None:
            self.judge(ex.pool, state, ok=ex.verdict, detail=None if ex.verdict else ex.status)
        trace = ex.trace
        pair = ex.pair
        transfer = None
        if pair is not None and pair.prefill_ended_at is not None and stream is not None \
                and stream.first_token_at is not None:
            transfer = max(0.0, stream.first_token_at - pair.prefill_ended_at)
        outcome = Outcome(
            state.name if state else NONE,
            state.runtime if state else NONE,
            ex.model,
            ex.status,
            duration,
            usage,
            ttft,
            gaps,
            reason=ex.decision.reason if ex.decision else NONE,
            arm=ex.arm if ex.ab_excluded is None else None,  # not an A/B sample: kept out of the arms' figures
            sla=sla_outcome(ex.features.sla, ok=ex.status == "200", ttft_s=ttft, gaps=gaps, duration_s=duration,
                            usage=usage),
            finished_at=now,
            usage_estimated=estimated,
            generation_s=generation,
            expected_cached_tokens=expected,
            prediction=prediction,
            endpoint=ex.endpoint.value,
            rank=ex.rank if state is not None else None,
            request_id=ex.request_id,
            trace_id=trace.trace_id_hex if trace is not None else None,
            sampled=trace is not None and trace.sampled,
            topology=ex.topology,
            prefill=pair.prefill if pair is not None else None,
            prefill_s=pair.prefill_s if pair is not None else None,
            transfer_s=transfer,
        )
        self._recorder.record(outcome)
        if pair is not None and self._pd is not None:  # a split request: its pair's figures
            self._pd.finish(ex.model, pair, state.name if state else NONE, ok=ex.status == "200",
                            first_token_at=stream.first_token_at if stream is not None else None, started=ex.started)
        if ex.key is not None and self._charge_key is not None:
            self._charge_key(ex.key, outcome)
        if trace is not None:  # every span of the request ends (the one that opened the response too)
            trace.finish(outcome, state)
