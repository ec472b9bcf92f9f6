"""The simulation core: an iteration-level continuous-batching engine (spec section 6.2).

`Engine.step(now_s)` runs one scheduler iteration starting at simulated time `now_s` and returns how
long it takes plus what happened (tokens emitted, requests finished). It never reads a clock or
sleeps, so tests drive it with a plain float; `driver.EngineDriver` turns durations into wall time.

Each iteration: admit waiting requests FCFS while the running count is below `max_num_seqs` and
their KV blocks fit; spend the token budget on one decode token per running request first, then on
prefill chunks (chunked prefill); preempt the newest request when decode runs out of KV blocks.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from backends.emulator.prefix_cache import PrefixCache
from backends.emulator.profiles import EngineParams


@dataclass(frozen=True, slots=True)
class Finished:
    """A finished request's accounting; all times are simulated seconds."""

    rid: str
    reason: str  # "stop" | "length" | "abort"
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    arrival_s: float
    scheduled_s: float | None
    first_token_s: float | None
    finished_s: float
    preemptions: int

    @property
    def e2e_s(self) -> float:
        return self.finished_s - self.arrival_s

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def queue_s(self) -> float:
        return (self.scheduled_s if self.scheduled_s is not None else self.finished_s) - self.arrival_s


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """One output token of one request, emitted at `time_s` (the end of the iteration)."""

    rid: str
    index: int  # 0-based position in the output
    time_s: float
    arrival_s: float
    cached_tokens: int
    finished: Finished | None


@dataclass(frozen=True, slots=True)
class Admitted:
    rid: str
    prompt_tokens: int
    cached_tokens: int  # local prefix-cache hits plus `external_tokens`
    external_tokens: int = 0  # loaded from another server (P/D transfer, shared storage)


@dataclass(frozen=True, slots=True)
class StepResult:
    start_s: float
    duration_s: float
    tokens: tuple[TokenEvent, ...]
    admitted: tuple[Admitted, ...]
    prefill_tokens: int
    decode_tokens: int
    preempted: int

    @property
    def end_s(self) -> float:
        return self.start_s + self.duration_s


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Gauge values as of the end of the last iteration."""

    running: int
    waiting: int
    kv_used_blocks: int
    kv_total_blocks: int
    block_size: int
    waiting_uncached_tokens: int
    cache_size_tokens: int
    deferred: int = 0  # of `waiting`: requests waiting for their KV from a prefill server (vLLM "deferred")

    @property
    def kv_usage(self) -> float:
        return self.kv_used_blocks / self.kv_total_blocks if self.kv_total_blocks else 0.0


class _Req:
    __slots__ = (
        "arrival_s",
        "blocks",
        "cached",
        "external",
        "finish_reason",
        "first_token_s",
        "generated",
        "preemptions",
        "prefilled",
        "rid",
        "scheduled_s",
        "target",
        "tokens",
    )

    def __init__(self, rid: str, tokens: tuple[int, ...], target: int, finish_reason: str, arrival_s: float):
        self.rid = rid
        self.tokens = tokens
        self.target = target
        self.finish_reason = finish_reason
        self.arrival_s = arrival_s
        self.cached = 0
        self.external = 0  # prompt tokens whose KV another server computed (at most P-1)
        self.prefilled = 0
        self.generated = 0
        self.blocks = 0
        self.scheduled_s: float | None = None
        self.first_token_s: float | None = None
        self.preemptions = 0

    @property
    def prefill_target(self) -> int:
        # After a preemption the generated tokens are recomputed along with the prompt (vLLM recompute).
        return len(self.tokens) + (self.generated if self.preemptions else 0)

    def finished(self, reason: str, now_s: float) -> Finished:
        return Finished(
            self.rid, reason, len(self.tokens), self.cached, self.generated, self.arrival_s, self.scheduled_s,
            self.first_token_s, now_s, self.preemptions,
        )


class Engine:
    """Continuous batching over simulated time. Not thread-safe; one event loop drives it."""

    def __init__(self, params: EngineParams, cache: PrefixCache) -> None:
        self.params = params
        self.cache = cache
        self._waiting: deque[_Req] = deque()
        self._running: list[_Req] = []
        self._by_id: dict[str, _Req] = {}
        self._used = 0  # KV blocks held by running requests (kept incrementally: O(1) per check)
        self.held_blocks = 0  # blocks a prefill keeps for a decode to read (P/D; part of `_used`)
        self.deferred = 0  # requests whose KV is still being transferred (they wait outside the queue)

    # --- inputs -------------------------------------------------------------------------------
    def submit(self, rid: str, tokens: Sequence[int], *, output_tokens: int, finish_reason: str, now_s: float,
               external_tokens: int = 0) -> None:
        """Queue a request that will emit `output_tokens` tokens and then finish with `finish_reason`;
        `external_tokens` leading prompt tokens have KV loaded from elsewhere (no prefill cost)."""
        if rid in self._by_id:
            raise ValueError(f"duplicate request id {rid!r}")
        req = _Req(rid, tuple(tokens), max(1, output_tokens), finish_reason, now_s)
        req.external = max(0, min(external_tokens, len(req.tokens) - 1))
        self._by_id[rid] = req
        self._waiting.append(req)

    def hold_blocks(self, blocks: int) -> None:
        """Keep `blocks` KV blocks allocated after their request finished (a prefill's KV awaiting
        its decode: vLLM's delayed free, SGLang's and TRT-LLM's send buffers)."""
        self.held_blocks += blocks
        self._used += blocks

    def release_blocks(self, blocks: int) -> None:
        blocks = min(blocks, self.held_blocks)
        self.held_blocks -= blocks
        self._used -= blocks

    def blocks_for(self, tokens: int) -> int:
        return self._blocks_for(tokens)

    def abort(self, rid: str, now_s: float) -> Finished | None:
        """Remove a request wherever it is; None if it already finished or never existed."""
        req = self._by_id.pop(rid, None)
        if req is None:
            return None
        if req in self._running:
            self._running.remove(req)
            self._used -= req.blocks
        else:
            self._waiting.remove(req)
        req.blocks = 0
        return req.finished("abort", now_s)

    @property
    def idle(self) -> bool:
        return not self._waiting and not self._running

    def snapshot(self) -> Snapshot:
        p = self.params
        backlog = sum(r.prefill_target - r.prefilled - (r.external if not r.preemptions else 0) for r in self._waiting)
        backlog += sum(r.prefill_target - r.prefilled for r in self._running)
        return Snapshot(
            running=len(self._running), waiting=len(self._waiting) + self.deferred, kv_used_blocks=self._used_blocks(),
            kv_total_blocks=p.kv_blocks, block_size=p.block_size, waiting_uncached_tokens=backlog,
            cache_size_tokens=self.cache.size_tokens, deferred=self.deferred,
        )

    # --- the iteration ------------------------------------------------------------------------
    def _used_blocks(self) -> int:
        return self._used

    def _blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.params.block_size)

    def _admit(self, now_s: float) -> list[Admitted]:
        p, admitted = self.params, []
        # Like vLLM v1's scheduler, admit only while this step's token budget has room after the running
        # requests (one decode token each, or their remaining prefill): under prefill overload requests
        # stay *waiting*, which is what the engine's queue metrics (and SLA routing) must see.
        budget = p.max_batched_tokens - sum(max(r.prefill_target - r.prefilled, 1) for r in self._running)
        while self._waiting and len(self._running) < p.max_num_seqs and budget > 0:
            req = self._waiting[0]
            prompt = req.tokens
            # The last prompt token is always recomputed, so at most P-1 tokens can come from cache.
            cached = self.cache.match(prompt[:-1]) if req.preemptions == 0 else 0
            # KV loaded from another server fills in after the local hits (vLLM: the connector's
            # tokens are counted beyond `num_computed_tokens`); lost again after a preemption.
            external = max(0, req.external - cached) if req.preemptions == 0 else 0
            cached += external
            need = self._blocks_for(req.prefill_target + 1 - cached)
            if self._used_blocks() + need > p.kv_blocks and self._running:
                break  # KV full: head-of-line request waits for blocks to be freed
            self._waiting.popleft()
            req.blocks = need
            self._used += need
            if req.preemptions == 0:
                req.cached = cached
                req.scheduled_s = now_s
                admitted.append(Admitted(req.rid, len(prompt), cached, external))
            req.prefilled = cached
            self._running.append(req)
            budget -= max(req.prefill_target - cached, 1)
        return admitted

    def _preempt_for(self, needed: int) -> int:
        """Free blocks by sending the newest running requests back to the queue head."""
        count = 0
        while needed > self.params.kv_blocks - self._used_blocks() and len(self._running) > 1:
            victim = self._running.pop()
            self._used -= victim.blocks
            victim.blocks = 0
            victim.prefilled = 0
            victim.preemptions += 1
            self._waiting.appendleft(victim)
            count += 1
        return count

    def step(self, now_s: float) -> StepResult | None:
        """Run one iteration starting at `now_s`; None when there is nothing to do."""
        if self.idle:
            return None
        p = self.params
        admitted = self._admit(now_s)
        decoding = [r for r in self._running if r.prefilled >= r.prefill_target]
        grow = sum(1 for r in decoding if (len(r.tokens) + r.generated) % p.block_size == 0)
        preempted = self._preempt_for(grow) if grow else 0
        if preempted:
            still = set(map(id, self._running))
            decoding = [r for r in decoding if id(r) in still]
        budget = p.max_batched_tokens - len(decoding)
        chunks: list[tuple[_Req, int]] = []
        for r in self._running:
            if budget <= 0:
                break
            remaining = r.prefill_target - r.prefilled
            if remaining > 0:
                c = min(remaining, budget)
                chunks.append((r, c))
                budget -= c
        prefill_tokens = sum(c for _, c in chunks)
        b = len(decoding)
        ctx = sum(len(r.tokens) + r.generated for r in decoding)
        duration = p.t_fixed_s + prefill_tokens / p.prefill_tokens_per_s
        if b:
            memory = p.w_base_s + p.w_moe_s * (1.0 - 0.75**b) + p.kv_read_s_per_token * ctx
            duration += max(memory, b * p.decode_s_per_token)
        end = now_s + duration
        events: list[TokenEvent] = []
        for r in decoding:
            if (len(r.tokens) + r.generated) % p.block_size == 0:
                r.blocks += 1
                self._used += 1
            events.append(self._emit(r, end))
        for r, c in chunks:
            r.prefilled += c
            if r.prefilled >= r.prefill_target:
                if r.preemptions == 0 or r.first_token_s is None:
                    self.cache.insert(r.tokens)
                if r.generated < r.target:
                    events.append(self._emit(r, end))
        self._evict()
        return StepResult(now_s, duration, tuple(events), tuple(admitted), prefill_tokens, b, preempted)

    def _emit(self, r: _Req, end: float) -> TokenEvent:
        index = r.generated
        r.generated += 1
        if r.first_token_s is None:
            r.first_token_s = end
        fin = None
        if r.generated >= r.target:
            fin = r.finished(r.finish_reason, end)
            self._running.remove(r)
            del self._by_id[r.rid]
            self._used -= r.blocks
            r.blocks = 0
        return TokenEvent(r.rid, index, end, r.arrival_s, r.cached, fin)

    def _evict(self) -> None:
        # Cached KV lives in blocks no running request holds (plus the shared prefixes they hit).
        p = self.params
        free_tokens = (p.kv_blocks - self._used_blocks()) * p.block_size
        pinned = max((r.cached for r in self._running), default=0)
        self.cache.evict_to(free_tokens + pinned)
