"""The simulation core, driven by a fake clock (plain floats): no sockets, no sleeps."""

from __future__ import annotations

import dataclasses

from backends.base import Runtime
from backends.emulator.engine import Engine, Finished, TokenEvent
from backends.emulator.prefix_cache import BlockHashCache, NoCache, PrefixCache, RadixCache
from backends.emulator.profiles import PROFILES, EngineParams

TINY = PROFILES["tiny"].runtimes[Runtime.VLLM]


def make(params: EngineParams = TINY, cache: PrefixCache | None = None) -> Engine:
    return Engine(params, cache if cache is not None else BlockHashCache(params.block_size))


def run(engine: Engine, now: float = 0.0, max_steps: int = 100_000) -> tuple[float, list[TokenEvent], int]:
    """Step until idle; returns the end time, all token events and the number of steps."""
    events: list[TokenEvent] = []
    steps = 0
    while (step := engine.step(now)) is not None and steps < max_steps:
        events.extend(step.tokens)
        now = step.end_s
        steps += 1
    return now, events, steps


def finished(events: list[TokenEvent]) -> dict[str, Finished]:
    return {e.rid: e.finished for e in events if e.finished is not None}


def prompt(seed: int, n: int) -> list[int]:
    return [seed * 100_000 + i for i in range(n)]


def test_ttft_grows_with_the_uncached_prefill_backlog() -> None:
    engine = make()
    for i in range(8):
        engine.submit(f"r{i}", prompt(i, 1500), output_tokens=4, finish_reason="length", now_s=0.0)
    _, events, _ = run(engine)
    ttfts = [finished(events)[f"r{i}"].ttft_s for i in range(8)]
    assert all(t is not None for t in ttfts)
    values = [t for t in ttfts if t is not None]
    assert values == sorted(values)
    # 8 x 1500 tokens at 100k tok/s: the last request waits for ~12k tokens of prefill ahead of it.
    assert values[-1] > 5 * values[0]
    assert values[-1] > 8 * 1500 / TINY.prefill_tokens_per_s * 0.9


def test_prefix_hits_cut_ttft() -> None:
    for cache in (BlockHashCache(TINY.block_size), RadixCache()):
        engine = make(cache=cache)
        shared = prompt(1, 1800)
        engine.submit("cold", [*shared, 1, 2, 3], output_tokens=2, finish_reason="length", now_s=0.0)
        t, events, _ = run(engine)
        engine.submit("warm", [*shared, 7, 8, 9], output_tokens=2, finish_reason="length", now_s=t)
        _, events2, _ = run(engine, t)
        cold, warm = finished(events)["cold"], finished(events2)["warm"]
        assert cold.cached_tokens == 0
        assert warm.cached_tokens >= 1800 - cache.granularity
        assert warm.cached_tokens % cache.granularity == 0
        assert warm.ttft_s is not None
        assert cold.ttft_s is not None
        assert warm.ttft_s < cold.ttft_s / 3


def test_cached_tokens_are_capped_below_the_prompt_length() -> None:
    engine = make(cache=RadixCache())
    p = prompt(2, 100)
    engine.submit("a", p, output_tokens=1, finish_reason="length", now_s=0.0)
    t, _, _ = run(engine)
    engine.submit("b", p, output_tokens=1, finish_reason="length", now_s=t)
    _, events, _ = run(engine, t)
    assert finished(events)["b"].cached_tokens == 99  # the last prompt token is always recomputed


def throughput(batch: int, params: EngineParams = TINY) -> float:
    engine = make(params, NoCache())
    for i in range(batch):
        engine.submit(f"r{i}", prompt(i, 16), output_tokens=200, finish_reason="length", now_s=0.0)
    end, events, _ = run(engine)
    return len(events) / end


def test_throughput_grows_with_batch_then_saturates() -> None:
    t1, t4, t16, t64 = (throughput(b) for b in (1, 4, 16, 64))
    assert t4 > 2 * t1
    assert t16 > t4
    assert t64 < 1.15 * t16  # max_num_seqs = 16: extra requests queue instead of batching


def test_decode_step_time_grows_with_batch_and_context() -> None:
    engine = make(cache=NoCache())
    engine.submit("a", prompt(1, 16), output_tokens=50, finish_reason="length", now_s=0.0)
    engine.step(0.0)
    single = engine.step(1.0)
    assert single is not None
    big = make(cache=NoCache())
    for i in range(16):
        big.submit(f"r{i}", prompt(i, 1000), output_tokens=50, finish_reason="length", now_s=0.0)
    now = 0.0
    while (s := big.step(now)) is not None and s.prefill_tokens:
        now = s.end_s
    batch = big.step(now)
    assert batch is not None
    assert batch.decode_tokens == 16
    assert batch.duration_s > single.duration_s * 1.5


def test_kv_pressure_makes_requests_wait() -> None:
    params = dataclasses.replace(TINY, kv_blocks=20)  # 320 tokens of KV
    engine = make(params, NoCache())
    for i in range(4):
        engine.submit(f"r{i}", prompt(i, 100), output_tokens=10, finish_reason="length", now_s=0.0)
    engine.step(0.0)
    snap = engine.snapshot()
    assert snap.running == 2
    assert snap.waiting == 2
    assert snap.kv_usage > 0.6
    _, events, _ = run(engine, 1.0)
    done = finished(events)
    assert len(done) == 4
    assert done["r3"].queue_s > done["r0"].queue_s


def test_decode_running_out_of_blocks_preempts_the_newest_request() -> None:
    params = dataclasses.replace(TINY, kv_blocks=8)  # 128 tokens
    engine = make(params, NoCache())
    for i in range(2):
        engine.submit(f"r{i}", prompt(i, 40), output_tokens=40, finish_reason="length", now_s=0.0)
    preempted = 0
    now, events = 0.0, list[TokenEvent]()
    while (s := engine.step(now)) is not None:
        preempted += s.preempted
        events.extend(s.tokens)
        now = s.end_s
    done = finished(events)
    assert preempted >= 1
    assert done["r1"].preemptions >= 1
    assert all(f.output_tokens == 40 for f in done.values())


def test_chunked_prefill_spreads_a_long_prompt_over_iterations() -> None:
    engine = make(cache=NoCache())
    engine.submit("long", prompt(1, 5000), output_tokens=1, finish_reason="length", now_s=0.0)
    _, events, steps = run(engine)
    assert steps == 3  # 2048 + 2048 + 904 tokens
    assert events[0].finished is not None


def test_abort_removes_a_request_and_frees_its_blocks() -> None:
    engine = make()
    engine.submit("a", prompt(1, 64), output_tokens=100, finish_reason="length", now_s=0.0)
    engine.step(0.0)
    fin = engine.abort("a", 1.0)
    assert fin is not None
    assert fin.reason == "abort"
    assert engine.idle
    assert engine.snapshot().kv_used_blocks == 0
    assert engine.abort("a", 2.0) is None


def test_profiles_encode_the_runtime_ordering() -> None:
    ds = PROFILES["deepseek-v3-8xh200"].runtimes
    single = {rt: 1.0 / (p.t_fixed_s + p.w_base_s + p.w_moe_s * 0.25) for rt, p in ds.items()}
    assert 45 <= single[Runtime.SGLANG] <= 60  # ~52 tok/s per stream
    assert 55 <= single[Runtime.TRTLLM] <= 65  # ~60 tok/s per stream
    sat = {rt: throughput(1024, p) for rt, p in ds.items() if rt in (Runtime.VLLM, Runtime.SGLANG)}
    assert 2.0 <= sat[Runtime.SGLANG] / sat[Runtime.VLLM] <= 3.0  # SGLang ~2.5x vLLM on DeepSeek
    mx = PROFILES["mixtral-8x7b-h100"].runtimes
    tpot = {rt: p.t_fixed_s + p.w_base_s + p.w_moe_s * 0.25 for rt, p in mx.items()}
    assert 1.3 <= tpot[Runtime.VLLM] / tpot[Runtime.TRTLLM] <= 1.7  # TRT-LLM ~1.5x lower latency
    assert PROFILES["deepseek-v3-8xh200"].usd_per_hour == 96.0
