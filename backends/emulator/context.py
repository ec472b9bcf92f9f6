"""What every protocol face shares: the engine driver, fault gate, RNG, counters, and one helper that
runs a client request through the engine and yields its tokens as they are produced."""

from __future__ import annotations

import asyncio
import itertools
import random
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass

import zmq.asyncio
from aiohttp import web

from backends.emulator import tokenizer
from backends.emulator.config import EmulatorConfig, EmulatorStats
from backends.emulator.dp import RankEngine, RoundRobin, vllm_balance
from backends.emulator.driver import EngineDriver, Handle, SubRequest
from backends.emulator.engine import Finished, Snapshot, StepResult, TokenEvent
from backends.emulator.faults import FaultGate
from backends.emulator.kv_events import EventCollector, KvPublisher
from backends.emulator.kv_handoff import KvHandoff
from backends.emulator.profiles import EngineParams, Profile
from backends.emulator.sglang_kv import KvManager
from backends.emulator.shared_storage import SharedStorage
from backends.emulator.textgen import OutputPlan, plan_output, plan_text


@dataclass(frozen=True, slots=True)
class Token:
    """One emitted token for the face: which choice, its text, and the engine event behind it."""

    choice: int
    piece: str
    token_id: int
    event: TokenEvent

    @property
    def finished(self) -> Finished | None:
        return self.event.finished


HEALTH_PREFIX = "health-"  # engine requests made by health checks are not client requests


class StatsObserver:
    """Keeps `EmulatorStats` in step with the engine."""

    def __init__(self, stats: EmulatorStats, changed: asyncio.Event) -> None:
        self.stats = stats
        self.changed = changed

    def on_step(self, step: StepResult, snap: Snapshot) -> None:
        self.stats.tokens_generated += len(step.tokens)
        self.changed.set()

    def on_finished(self, fin: Finished) -> None:
        if fin.rid.startswith(HEALTH_PREFIX):
            return
        if fin.reason == "abort":
            self.stats.aborted += 1
        else:
            self.stats.completed += 1
        self.changed.set()

    def on_idle(self, snap: Snapshot) -> None:
        return None


class KvEventsObserver:
    """Publishes each engine step's KV-cache events as one batch, as vLLM's scheduler does (one
    observer per data-parallel rank, on that rank's publisher)."""

    def __init__(self, ctx: FaceContext, rank: int = 0) -> None:
        self.ctx = ctx
        self.rank = rank

    def on_step(self, step: StepResult, snap: Snapshot) -> None:
        self.ctx.flush_kv_events(self.rank)

    def on_finished(self, fin: Finished) -> None:
        return None

    def on_idle(self, snap: Snapshot) -> None:
        self.ctx.flush_kv_events(self.rank)


class Generation:
    """One client request in the engine. Iterate `tokens()`; call `abort()` if the client goes away."""

    def __init__(self, handle: Handle | None, plans: Sequence[OutputPlan], prompt_tokens: int, rank: int = 0) -> None:
        self._handle = handle
        self.plans = plans
        self.prompt_tokens = prompt_tokens
        self.rank = rank  # the data-parallel rank (engine) serving it
        self.cached_tokens = 0
        self.finished: list[Finished | None] = [None] * len(plans)
        # awaited once before the last token is handed out (a P/D prefill sends its KV then)
        self.before_finish: Callable[[], Awaitable[None]] | None = None

    @property
    def done(self) -> bool:
        return self._handle is None or self._handle.done

    @property
    def rids(self) -> list[str]:
        return [] if self._handle is None else list(self._handle.rids)

    async def tokens(self) -> AsyncIterator[Token]:
        if self._handle is None:  # the `hang` fault: never produce a first token
            await asyncio.Event().wait()
            return
        h = self._handle
        while not h.done:
            ev = await h.next()
            if h.done and self.before_finish is not None:
                hook, self.before_finish = self.before_finish, None
                await hook()
            choice = h.index_of[ev.rid]
            plan = self.plans[choice]
            self.cached_tokens = ev.cached_tokens
            if ev.finished is not None:
                self.finished[choice] = ev.finished
            yield Token(choice, plan.pieces[ev.index], plan.token_ids[ev.index], ev)

    def abort(self) -> None:
        if self._handle is not None and not self._handle.done:
            self._handle.abort()


class FaceContext:
    def __init__(
        self, config: EmulatorConfig, profile: Profile, params: EngineParams, driver: EngineDriver,
        gate: FaultGate, stats: EmulatorStats,
    ) -> None:
        self.config = config
        self.profile = profile
        self.params = params
        self.driver = driver
        self.gate = gate
        self.stats = stats
        self.rng = random.Random(config.seed)
        self.created = int(time.time())
        self._counter = itertools.count(1)
        self.changed = asyncio.Event()  # set on every engine event; lets tests wait without sleeping
        self.fingerprint_hash = uuid.UUID(int=random.Random(config.seed + 1).getrandbits(128)).hex[:8]
        self.kv_collector: EventCollector | None = None  # set when KV-cache events are published
        self.kv_publisher: KvPublisher | None = None
        # the data-parallel ranks' engines (`dp.py`); one, `driver`'s, without data parallelism
        self.ranks: list[RankEngine] = [RankEngine(0, driver)]
        self._round_robin = RoundRobin()
        self.pinned_requests = 0  # requests that named their rank (tests: a gateway pins, or never does)
        # prefill/decode disaggregation: each rank's kept KV and side channel (vLLM NIXL, trtllm),
        # the ExampleConnector's shared directory, and the ZMQ context of the pulls
        self.handoffs: list[KvHandoff] = []
        self.shared_storage: SharedStorage | None = None
        self._zctx: zmq.asyncio.Context | None = None
        self.on_stop: list[Callable[[], Awaitable[None]]] = []  # what a face started (SGLang's bootstrap server)
        self.bootstrap_port: int | None = None  # SGLang prefill: its bootstrap server's bound port
        self.sglang_kv: list[KvManager] = []  # SGLang P/D: each rank's KV manager

    def zmq_context(self) -> zmq.asyncio.Context:
        if self._zctx is None:
            self._zctx = zmq.asyncio.Context()
        return self._zctx

    def close_zmq(self) -> None:
        if self._zctx is not None:
            self._zctx.term()
            self._zctx = None

    @property
    def data_parallel_size(self) -> int:
        return len(self.ranks)

    def choose_rank(self, rank: int | None = None, *, room: int | None = None) -> int:
        """The engine for a request: the rank it names, else the runtime's own DP balancer."""
        if rank is not None:
            self.pinned_requests += 1
            return rank
        if len(self.ranks) == 1:
            return 0
        if self.config.runtime.value == "sglang":
            return self._round_robin.choose(len(self.ranks), room)
        return vllm_balance(self.ranks)

    def flush_kv_events(self, rank: int = 0) -> None:
        """Publish what rank `rank`'s cache reported since the last flush as one batch (once per
        engine step, and after a cache reset outside any step)."""
        r = self.ranks[rank]
        if r.kv_collector is not None and r.kv_publisher is not None:
            r.kv_publisher.publish(r.kv_collector.take())

    @property
    def model(self) -> str:
        return self.config.model

    def next_int(self) -> int:
        return next(self._counter)

    def hex_id(self, n: int) -> str:
        return f"{self.rng.getrandbits(n * 4):0{n}x}"

    def snapshot(self) -> Snapshot:
        """The server's state: its one engine's, or every rank's added up."""
        if len(self.ranks) == 1:
            return self.driver.engine.snapshot()
        snaps = [r.driver.engine.snapshot() for r in self.ranks]
        return Snapshot(
            running=sum(s.running for s in snaps), waiting=sum(s.waiting for s in snaps),
            kv_used_blocks=sum(s.kv_used_blocks for s in snaps), kv_total_blocks=sum(s.kv_total_blocks for s in snaps),
            block_size=snaps[0].block_size, waiting_uncached_tokens=sum(s.waiting_uncached_tokens for s in snaps),
            cache_size_tokens=sum(s.cache_size_tokens for s in snaps), deferred=sum(s.deferred for s in snaps),
        )

    def plans(
        self, n: int, *, max_tokens: int | None, stop: Sequence[str] = (), text: str | None = None
    ) -> list[OutputPlan]:
        """What each of `n` choices will say: free text, or exactly `text` (a constrained output)."""
        if text is not None:
            return [plan_text(text, max_tokens=max_tokens) for _ in range(n)]
        return [
            plan_output(self.rng, max_tokens=max_tokens, default_tokens=self.profile.default_output_tokens, stop=stop)
            for _ in range(n)
        ]

    def start(self, prompt: Sequence[int], plans: Sequence[OutputPlan], *, health: bool = False,
              rank: int | None = None, room: int | None = None, chosen: int | None = None,
              external_tokens: int = 0) -> Generation:
        """Submit a request (one engine request per choice) unless the `hang` fault holds it back:
        to data-parallel `rank` when it names one (validated by the face), else where the runtime's
        balancer puts it (`room`: a P/D request's bootstrap room, which SGLang follows); `chosen`:
        a rank the face already chose (`choose_rank`), e.g. before a KV transfer; `external_tokens`:
        leading prompt tokens whose KV came from a prefill server."""
        if chosen is None:
            chosen = 0 if health else self.choose_rank(rank, room=room)
        if self.config.faults.hang:
            return Generation(None, plans, len(prompt), chosen)
        base = (HEALTH_PREFIX if health else "") + self.hex_id(16)
        subs = [
            SubRequest(f"{base}-{i}", prompt, len(p.token_ids), p.finish_reason, external_tokens)
            for i, p in enumerate(plans)
        ]
        engine = self.ranks[chosen]
        if not health:
            engine.requests += len(subs)
        return Generation(engine.driver.submit(subs), plans, len(prompt), chosen)


def tokenize_prompt(prompt: object) -> list[int]:
    """Token ids of an OpenAI completions `prompt`: a string, a list of ids, or a list of strings."""
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return [int(t) for t in prompt]
    if isinstance(prompt, list) and prompt:
        return tokenize_prompt(prompt[0])
    return []


def abort_transport(request: web.Request) -> None:
    """Close the client connection without a final event (the `die_after_tokens` fault)."""
    transport = request.transport
    if transport is not None:
        transport.abort()


CONTEXT_KEY = web.AppKey("emulator_context", FaceContext)
