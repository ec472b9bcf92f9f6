"""Python load generators that wrk cannot replace; each runs in its own process and prints one JSON line.

- `openloop`: requests on a fixed timetable (rate r: request i is due at t0 + i/r), latency measured
  from the *scheduled* time, so a slow server cannot slow the generator down and hide its queueing
  (no coordinated omission). wrk2 is not available, hence this.
- `ttft`: sequential streaming requests, time from send to the first `data:` event, targets interleaved.
- `streams`: N concurrent streaming requests opened over a ramp, held to the end; errors and the
  maximum number open at once.

`python -m bench.loadgen openloop --url U --body FILE --rate R --duration S`
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import uvloop

HEADERS = {"Content-Type": "application/json"}


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def _session(limit: int = 0) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=limit, force_close=False),
                                 timeout=aiohttp.ClientTimeout(total=None, sock_connect=30))


async def ramp(n: int, ramp_s: float, start: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Start `start()` n times evenly over `ramp_s` seconds, each as a task; returns when all have ended."""
    loop = asyncio.get_running_loop()
    begin = loop.time()
    tasks = []
    for i in range(n):
        delay = begin + i * ramp_s / n - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(loop.create_task(start()))
    await asyncio.gather(*tasks)


async def openloop(url: str, body: bytes, rate: float, duration_s: float) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    latencies: list[float] = []
    errors: Counter[str] = Counter()
    lag_max = 0.0
    async with _session() as session:
        async def one(due: float) -> None:
            try:
                async with session.post(url, data=body, headers=HEADERS) as resp:
                    await resp.read()
                    if resp.status != 200:
                        errors[f"status {resp.status}"] += 1
                        return
            except (aiohttp.ClientError, OSError) as exc:
                errors[type(exc).__name__] += 1
                return
            latencies.append(loop.time() - due)

        n = int(rate * duration_s)
        start = loop.time() + 0.1
        tasks = []
        for i in range(n):
            due = start + i / rate
            delay = due - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            else:
                lag_max = max(lag_max, -delay)
            tasks.append(asyncio.create_task(one(due)))
        await asyncio.gather(*tasks)
    ms = [x * 1e3 for x in latencies]
    return {"rate": rate, "sent": n, "ok": len(latencies), "errors": dict(errors), "p50_ms": pct(ms, 50),
            "p90_ms": pct(ms, 90), "p99_ms": pct(ms, 99), "p999_ms": pct(ms, 99.9), "max_ms": max(ms, default=None),
            "generator_lag_max_ms": lag_max * 1e3}


async def ttft(urls: list[str], body: bytes, n: int, warmup: int) -> dict[str, Any]:
    """Time to the first `data:` event per target; targets take turns so drift hits all alike."""
    samples: dict[str, list[float]] = {u: [] for u in urls}
    errors: Counter[str] = Counter()
    async with _session() as session:
        for i in range(warmup + n):
            for url in urls:
                t0 = time.perf_counter()
                first: float | None = None
                buf = b""
                try:
                    async with session.post(url, data=body, headers=HEADERS) as resp:
                        async for chunk in resp.content.iter_any():
                            if first is None:
                                buf += chunk
                                if b"data:" in buf:
                                    first = time.perf_counter() - t0
                        if resp.status != 200 or first is None:
                            errors[f"{url} status {resp.status}"] += 1
                            continue
                except (aiohttp.ClientError, OSError) as exc:
                    errors[f"{url} {type(exc).__name__}"] += 1
                    continue
                if i >= warmup:
                    samples[url].append(first * 1e3)
    return {"errors": dict(errors), "targets": {
        u: {"n": len(v), "p50_ms": pct(v, 50), "p90_ms": pct(v, 90), "p99_ms": pct(v, 99),
            "mean_ms": statistics.fmean(v) if v else None} for u, v in samples.items()}}


async def streams(url: str, body: bytes, n: int, ramp_s: float, timeout_s: float) -> dict[str, Any]:
    """Open `n` streams over `ramp_s` seconds and read each to [DONE] (each within `timeout_s`: a
    connection stuck in a full accept queue would otherwise hang for TCP's ~15 minutes of retries)."""
    errors: Counter[str] = Counter()
    state = {"open": 0, "max_open": 0, "ok": 0, "events": 0}
    loop = asyncio.get_running_loop()

    async def one(session: aiohttp.ClientSession) -> None:
        opened = False
        try:
            async with session.post(url, data=body, headers=HEADERS,
                                    timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                if resp.status != 200:
                    errors[f"status {resp.status}"] += 1
                    return
                opened = True
                state["open"] += 1
                state["max_open"] = max(state["max_open"], state["open"])
                done = False
                async for line in resp.content:
                    if line.startswith(b"data:"):
                        state["events"] += 1
                        if line.startswith(b"data: [DONE]"):
                            done = True
                        elif b'"error"' in line:
                            errors["error event"] += 1
                if done:
                    state["ok"] += 1
                else:
                    errors["ended without [DONE]"] += 1
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            errors[type(exc).__name__ + ("" if opened else " before the response head")] += 1
        finally:
            if opened:
                state["open"] -= 1

    async def report() -> None:
        while True:
            await asyncio.sleep(1)
            print(orjson.dumps({"progress": state}).decode(), file=sys.stderr, flush=True)

    async with _session() as session:
        reporter = asyncio.create_task(report())
        start = loop.time()
        await ramp(n, ramp_s, lambda: one(session))
        reporter.cancel()
    return {"n": n, "ok": state["ok"], "max_open": state["max_open"], "events": state["events"],
            "errors": dict(errors), "elapsed_s": loop.time() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    ol = sub.add_parser("openloop")
    ol.add_argument("--url", required=True)
    ol.add_argument("--rate", type=float, required=True)
    ol.add_argument("--duration", type=float, default=10)
    tt = sub.add_parser("ttft")
    tt.add_argument("--url", action="append", required=True)
    tt.add_argument("-n", type=int, default=300)
    tt.add_argument("--warmup", type=int, default=20)
    st = sub.add_parser("streams")
    st.add_argument("--url", required=True)
    st.add_argument("-n", type=int, default=10_000)
    st.add_argument("--ramp", type=float, default=10)
    st.add_argument("--timeout", type=float, default=120, help="seconds allowed per stream")
    for p in (ol, tt, st):
        p.add_argument("--body", type=Path, required=True)
    args = parser.parse_args()
    body = args.body.read_bytes()
    if args.cmd == "openloop":
        result = uvloop.run(openloop(args.url, body, args.rate, args.duration))
    elif args.cmd == "ttft":
        result = uvloop.run(ttft(args.url, body, args.n, args.warmup))
    else:
        result = uvloop.run(streams(args.url, body, args.n, args.ramp, args.timeout))
    print(orjson.dumps(result).decode(), flush=True)


if __name__ == "__main__":
    main()
