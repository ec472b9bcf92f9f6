"""Microbenchmark of one routing decision: 16 backends, 10k cached prefixes, 4k-char prompts.

Measures `decide` (the proxy's per-attempt call: SLA screen when needed + policy.choose) per policy,
and `describe` (once per request) separately. Prints the median and p99 in microseconds.

    ./.venv/bin/python bench/routing_micro.py
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable

from backends.base import Endpoint, Runtime
from gateway.routing import POLICIES, BackendView, RouteRequest, RoutingState, Snapshot, decide, describe

BACKENDS = 16
PREFIXES = 10_000
PROMPT_CHARS = 4096
ITERATIONS = 20_000


def _text(rng: random.Random, n: int) -> str:
    words = ["alpha", "beta", "gamma", "delta", "kappa", "omega", "sigma", "theta"]
    out = []
    size = 0
    while size < n:
        w = rng.choice(words) + str(rng.randrange(1000))
        out.append(w)
        size += len(w) + 1
    return " ".join(out)[:n]


def _body(tenant: str, question: str) -> dict[str, object]:
    return {"model": "m", "messages": [{"role": "system", "content": tenant}, {"role": "user", "content": question}]}


def _measure(fn: Callable[[], object], iterations: int) -> tuple[float, float]:
    samples = []
    clock = time.perf_counter_ns
    for _ in range(iterations):
        t0 = clock()
        fn()
        samples.append(clock() - t0)
    samples.sort()
    return statistics.median(samples) / 1000, samples[int(len(samples) * 0.99)] / 1000


def main() -> None:
    rng = random.Random(0)
    state = RoutingState(capacity=100_000)
    views = tuple(
        BackendView(
            name=f"b{i:02d}", runtime=Runtime.VLLM, healthy=True, in_flight=rng.randrange(8), waiting=rng.randrange(3),
            running=rng.randrange(16), kv_usage=0.5, usd_per_hour=2.0 + i % 4,
            block_size=(16, 32, 64, 128)[i % 4], output_tokens_per_s=500.0 + 50 * i,
        )
        for i in range(BACKENDS)
    )
    tenants = [_text(rng, 3000) for _ in range(200)]
    # 10k distinct cached prompts spread over the backends (each ~64 blocks deep).
    for n in range(PREFIXES):
        feats = describe(_body(tenants[n % len(tenants)], _text(rng, 1000)), Endpoint.CHAT, {})
        view = views[n % BACKENDS]
        ticket = state.dispatched(view, feats)
        state.completed(ticket, cached_tokens=None, prompt_tokens=None, itl_s=0.02)
        state.first_token(ticket, 0.1)
    for view in views:
        state.observe(view.name, work_tokens=2000, ttft_s=0.2, running=8, itl_s=0.02)
    # Worst case: one hot tenant whose 3k-char prefix every backend holds (spilled everywhere).
    hot_tenant = tenants[0]
    for view in views:
        state.dispatched(view, describe(_body(hot_tenant, _text(rng, 1000)), Endpoint.CHAT, {}))
    snap = state.snapshot(Snapshot(views))
    print(f"{BACKENDS} backends, {PREFIXES} cached prompts, index entries per backend: "
          f"{state.index.size('b00')}; prompts of {PROMPT_CHARS} chars")

    hit_body = _body(tenants[7], _text(rng, PROMPT_CHARS - 3000))  # shared tenant prefix: 2 holders
    miss_body = _body(_text(rng, 3000), _text(rng, PROMPT_CHARS - 3000))  # nobody has it
    for label, body in (("hit", hit_body), ("miss", miss_body)):
        med, p99 = _measure(lambda b=body: describe(b, Endpoint.CHAT, {}), ITERATIONS // 4)  # type: ignore[misc]
        print(f"describe ({label} prompt, {PROMPT_CHARS} chars): median {med:.1f} us, p99 {p99:.1f} us")
    sla_headers = {"x-sla-ttft-ms": "500", "x-sla-tpot-ms": "50"}
    hot_body = _body(hot_tenant, _text(rng, PROMPT_CHARS - 3000))
    cases = [
        ("hit", describe(hit_body, Endpoint.CHAT, {})),
        ("hot-all", describe(hot_body, Endpoint.CHAT, {})),
        ("miss", describe(miss_body, Endpoint.CHAT, {})),
        ("hit+sla", describe(hit_body, Endpoint.CHAT, sla_headers)),
        ("hot+sla", describe(hot_body, Endpoint.CHAT, sla_headers)),
    ]
    for name, policy in POLICIES.items():
        for label, feats in cases:
            req = RouteRequest("m", 1, features=feats)
            med, p99 = _measure(lambda p=policy, r=req: decide(p, r, snap, rng), ITERATIONS)  # type: ignore[misc]
            print(f"decide {name:16s} {label:8s}: median {med:5.1f} us, p99 {p99:5.1f} us")


if __name__ == "__main__":
    main()
