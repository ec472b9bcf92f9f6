"""The measuring client of the routing benchmarks: open-loop replay over aiohttp, per-request timings,
Prometheus scrapes and small statistics helpers. Times here are wall seconds; callers convert."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from prometheus_client.parser import text_string_to_metric_families

from bench.workload import TimedRequest


@dataclass(slots=True)
class Result:
    """One request as the client saw it (wall seconds, relative to the request's send time)."""

    index: int
    kind: str
    group: str
    session: str | None
    status: int = 0
    ttft_s: float | None = None
    itls_s: list[float] = field(default_factory=list)
    e2e_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    backend: str = ""
    arm: str = ""
    reason: str = ""
    sla_ttft_s: float | None = None  # the request's TTFT target (simulated seconds), if any
    late_s: float = 0.0  # how late the client fired it compared with its schedule
    error: str = ""
    expected_cached: int | None = None  # the gateway's x-gateway-expected-cached-tokens


def body_of(req: TimedRequest, model: str) -> bytes:
    return orjson.dumps({
        "model": model, "messages": list(req.messages), "max_tokens": req.max_tokens, "stream": True,
        "stream_options": {"include_usage": True}, "temperature": 0,
    })


async def stream_one(http: aiohttp.ClientSession, url: str, req: TimedRequest, index: int, *, model: str,
                     extra_headers: Mapping[str, str] | None = None, timeout_s: float = 600.0) -> Result:
    """POST one streaming chat completion and time its tokens at the client."""
    sla = req.headers.get("x-sla-ttft-ms")
    res = Result(index, req.kind, req.group, req.session, sla_ttft_s=float(sla) / 1000 if sla else None)
    headers = {"content-type": "application/json", **req.headers, **(extra_headers or {})}
    t0 = time.perf_counter()
    last: float | None = None
    try:
        async with http.post(url + "/v1/chat/completions", data=body_of(req, model), headers=headers,
                             timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            res.status = resp.status
            res.backend = resp.headers.get("x-gateway-backend", "")
            res.arm = resp.headers.get("x-gateway-arm", "")
            res.reason = resp.headers.get("x-gateway-route-reason", "")
            expected = resp.headers.get("x-gateway-expected-cached-tokens")
            res.expected_cached = int(expected) if expected is not None else None
            if resp.status != 200:
                res.error = (await resp.text())[:200]
                return res
            buf = b""
            async for chunk in resp.content.iter_any():
                now = time.perf_counter()
                buf += chunk
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    if not event.startswith(b"data: ") or event == b"data: [DONE]":
                        continue
                    data = orjson.loads(event[6:])
                    if data.get("error"):
                        res.error = str(data["error"])[:200]
                        continue
                    choices = data.get("choices") or []
                    if choices and (choices[0].get("delta") or {}).get("content"):
                        if last is None:
                            res.ttft_s = now - t0
                        else:
                            res.itls_s.append(now - last)
                        last = now
                    usage = data.get("usage")
                    if usage:
                        res.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                        res.completion_tokens = int(usage.get("completion_tokens") or 0)
                        details = usage.get("prompt_tokens_details") or {}
                        res.cached_tokens = int(details.get("cached_tokens") or 0)
            res.e2e_s = time.perf_counter() - t0
    except (aiohttp.ClientError, TimeoutError) as exc:
        res.error = type(exc).__name__
    return res


async def replay(url: str | Sequence[str], requests: Sequence[TimedRequest], *, speed: float, model: str,
                 on_done: Callable[[Result], None] | None = None, connections: int = 2048,
                 extra_headers: Mapping[str, str] | None = None) -> list[Result]:
    """Fire every request at its scheduled time (`at_s / speed` wall seconds after the start), without
    waiting for earlier answers (open loop). With several URLs, request i goes to url[i % n]."""
    urls = [url] if isinstance(url, str) else list(url)
    conn = aiohttp.TCPConnector(limit=connections, limit_per_host=connections, force_close=False)
    async with aiohttp.ClientSession(connector=conn) as http:
        start = time.perf_counter()

        async def one(i: int, req: TimedRequest) -> Result:
            due = start + req.at_s / speed
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            late = time.perf_counter() - due
            r = await stream_one(http, urls[i % len(urls)], req, i, model=model, extra_headers=extra_headers)
            r.late_s = late
            if on_done is not None:
                on_done(r)
            return r

        return list(await asyncio.gather(*(one(i, r) for i, r in enumerate(requests))))


async def scrape(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """Every sample of a Prometheus endpoint, summed over labels, by sample name."""
    async with http.get(url, timeout=aiohttp.ClientTimeout(total=10)) as resp:
        text = await resp.text()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + float(s.value)
    return out


def hit_counters(metrics: Mapping[str, float]) -> tuple[float, float]:
    """(hit tokens, queried tokens) from one engine's own counters (vLLM, SGLang or TRT-LLM names)."""
    if "vllm:prefix_cache_queries_total" in metrics:
        return metrics["vllm:prefix_cache_hits_total"], metrics["vllm:prefix_cache_queries_total"]
    if "sglang:prompt_tokens_total" in metrics:
        return metrics.get("sglang:cached_tokens_total", 0.0), metrics["sglang:prompt_tokens_total"]
    return math.nan, math.nan


def pct(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100, nearest rank); NaN for no values."""
    if not values:
        return math.nan
    s = sorted(values)
    k = max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))
    return s[k]


def median(values: Sequence[float]) -> float:
    v = [x for x in values if not math.isnan(x)]
    return pct(v, 50) if v else math.nan


def fmt(v: float | None, spec: str = ".2f") -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def to_jsonable(obj: Any) -> Any:
    if isinstance(obj, float) and math.isnan(obj):
        return None
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [to_jsonable(v) for v in obj]
    return obj
