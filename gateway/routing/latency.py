"""Per-backend latency models learned from what the proxy observes, for SLA-aware routing.

The model (deliberately small, so it learns from a few dozen requests and is cheap to evaluate):

* time to first token = `base_ttft_s + (ahead_tokens + uncached_tokens) / prefill_tokens_per_s`,
  where `uncached_tokens` is the request's prompt minus the prefix index's expected hit on that
  backend and `ahead_tokens` is the uncached prefill work queued before it: the larger of what this
  gateway has sent and not yet seen a first token for (`backlog_tokens`), and the engine-reported
  queue length times the mean uncached tokens per request (other gateways' work shows up there);
* the prefill rate is an EWMA of seconds per token (bias-corrected: the plain mean of the first
  `1 / alpha` samples, so the first sample does not dominate while the backend warms up) over
  observations `ttft / work` with
  `work = ahead + uncached` measured at dispatch, taken only when `work >= min_work_tokens` (short
  work measures fixed overhead, not throughput); those short observations feed an EWMA of
  `base_ttft_s` instead, which is subtracted from long ones;
* time per output token = an EWMA of observed inter-token latency per running-batch bucket
  (0-1, 2-3, 4-7, ... 128+ running requests: decode steps slow down as the batch grows); a request
  is predicted at `running + 1`, and an unseen bucket borrows the nearest seen one.

Unknown stays `None`: a backend never observed is neither feasible nor infeasible. The model also
says how much it has seen (`ttft_samples`) and how many of our requests still wait for their first
token (`pending`), so the SLA policy can tell a learned backend from a cold one and probe cold ones
one request at a time (see `sla.py`). No clock is read here; every duration arrives as an argument.
"""

from __future__ import annotations

from typing import Final

from backends.values import value

ITL_BUCKETS: Final = 9  # running batch: 0-1, 2-3, 4-7, 8-15, 16-31, 32-63, 64-127, 128-255, 256+


def itl_bucket(running: float) -> int:
    b = int(running).bit_length() - 1
    return 0 if b < 0 else (b if b < ITL_BUCKETS else ITL_BUCKETS - 1)


@value
class LatencyModel:
    """A frozen view of one backend's learned latency, carried by the snapshot."""

    prefill_tokens_per_s: float | None = None
    base_ttft_s: float = 0.0
    backlog_tokens: float = 0.0
    mean_uncached_tokens: float | None = None
    itl_s: tuple[float | None, ...] = (None,) * ITL_BUCKETS  # by bucket; unseen ones borrow the nearest
    ttft_samples: int = 0  # TTFT observations the prefill rate was learned from (confidence)
    pending: int = 0  # requests this gateway sent that have not had their first token yet
    # a decode's time to first token for requests prefilled elsewhere (P/D: the KV transfer, its
    # queue and its first step), learned from those requests; None until one was seen
    handoff_s: float | None = None

    def ttft_s(self, uncached_tokens: float, waiting: float | None = None) -> float | None:
        """Predicted time to first token for a request with `uncached_tokens` of prefill."""
        rate = self.prefill_tokens_per_s
        if rate is None:
            return None
        ahead = self.backlog_tokens
        if waiting and self.mean_uncached_tokens:
            ahead = max(ahead, waiting * self.mean_uncached_tokens)
        return self.base_ttft_s + (ahead + max(uncached_tokens, 0.0)) / rate

    def tpot_s(self, running: float) -> float | None:
        """Predicted time per output token with `running` requests in the batch (ours included)."""
        return self.itl_s[itl_bucket(running)]


def fill_buckets(observed: list[float | None]) -> tuple[float | None, ...]:
    """Give every unseen bucket the nearest seen one's value (the larger batch on equal distance:
    pessimistic), once per model instead of once per prediction."""
    seen = [i for i, v in enumerate(observed) if v is not None]
    if not seen:
        return (None,) * len(observed)
    filled = []
    for b in range(len(observed)):
        _, larger_first = min((abs(i - b), -i) for i in seen)
        filled.append(observed[-larger_first])
    return tuple(filled)


UNKNOWN: Final = LatencyModel()


class LatencyEstimator:
    """Learns one backend's `LatencyModel` from explicit observations. Pure: no clock, no I/O."""

    def __init__(self, *, alpha: float = 0.2, min_work_tokens: float = 256.0) -> None:
        if not 0 < alpha <= 1:
            raise ValueError("alpha must be in (0, 1]")
        self.alpha = alpha
        self.min_work_tokens = min_work_tokens
        self._s_per_token: float | None = None
        self._ttft_samples = 0
        self._base_s: float | None = None
        self._base_samples = 0
        self._backlog = 0.0
        self._pending = 0
        self._mean_uncached: float | None = None
        self._itl: list[float | None] = [None] * ITL_BUCKETS
        self._handoff_s: float | None = None
        self._handoff_samples = 0
        self._model: LatencyModel | None = UNKNOWN

    def _ewma(self, old: float | None, sample: float) -> float:
        return sample if old is None else old + self.alpha * (sample - old)

    def _warming(self, old: float | None, sample: float, n: int) -> float:
        """The EWMA after its `n`-th sample, bias-corrected: the running mean while `1/n > alpha`."""
        return sample if old is None else old + max(self.alpha, 1.0 / n) * (sample - old)

    @property
    def backlog_tokens(self) -> float:
        return self._backlog

    def dispatched(self, uncached_tokens: float) -> float:
        """A request with `uncached_tokens` of prefill was sent; returns the backlog ahead of it."""
        ahead = self._backlog
        self._backlog += uncached_tokens
        self._pending += 1
        self._mean_uncached = self._ewma(self._mean_uncached, uncached_tokens)
        self._model = None
        return ahead

    def prefilled(self, uncached_tokens: float) -> None:
        """The request's first token arrived, or it ended without one: its prefill left the queue."""
        self._backlog = max(self._backlog - uncached_tokens, 0.0)
        self._pending = max(self._pending - 1, 0)
        self._model = None

    def observe_ttft(self, *, work_tokens: float, ttft_s: float) -> None:
        """One request's time to first token, with `work_tokens` = prefill queued ahead + its own."""
        if ttft_s <= 0:
            return
        if work_tokens < self.min_work_tokens:
            self._base_samples += 1
            self._base_s = self._warming(self._base_s, ttft_s, self._base_samples)
        else:
            prefill_s = max(ttft_s - (self._base_s or 0.0), 1e-4)
            self._ttft_samples += 1
            self._s_per_token = self._warming(self._s_per_token, prefill_s / work_tokens, self._ttft_samples)
        self._model = None

    def observe_handoff(self, ttft_s: float) -> None:
        """One time to first token of a request whose prefill ran on another server (P/D), measured
        from the decode leg's send: it teaches `handoff_s`, never the prefill rate."""
        if ttft_s <= 0:
            return
        self._handoff_samples += 1
        self._handoff_s = self._warming(self._handoff_s, ttft_s, self._handoff_samples)
        self._model = None

    def observe_itl(self, *, running: float, itl_s: float) -> None:
        """One request's mean inter-token latency while `running` requests shared the batch."""
        if itl_s <= 0:
            return
        b = itl_bucket(running)
        self._itl[b] = self._ewma(self._itl[b], itl_s)
        self._model = None

    @property
    def model(self) -> LatencyModel:
        """The current frozen model (rebuilt only after a change)."""
        if self._model is None:
            spt = self._s_per_token
            self._model = LatencyModel(
                prefill_tokens_per_s=None if spt is None else 1.0 / spt,
                base_ttft_s=self._base_s or 0.0,
                backlog_tokens=self._backlog,
                mean_uncached_tokens=self._mean_uncached,
                itl_s=fill_buckets(self._itl),
                ttft_samples=self._ttft_samples,
                pending=self._pending,
                handoff_s=self._handoff_s,
            )
        return self._model
