"""Replay every captured request against the vLLM emulator and compare what a client or scraper
could tell apart: status, content type, JSON key structure and order, nulls, SSE event structure,
error bodies; ids, timestamps, generated text and token counts are ignored."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from backends.emulator import RunningEmulator
from tests.data import VLLM_CAPTURES as CAPTURES
from tests.emulator.conftest import MakeEmulator

# Captures whose bodies are deterministic in the emulator: compared byte for byte after parsing.
EXACT = {
    "err_bad_temperature", "err_malformed_json", "err_max_tokens_too_big", "err_missing_messages", "err_n_zero",
    "err_prompt_too_long", "err_prompt_too_long_stream", "err_unknown_model", "err_unknown_path",
    "err_wrong_method", "err_wrong_type", "version",
}
SKIP = {"metrics", "metrics_openmetrics"}  # compared by family in test_metric_families_match_the_capture


@dataclass(frozen=True)
class Capture:
    name: str
    method: str
    path: str
    req_headers: dict[str, str]
    req_body: bytes
    status: int
    resp_headers: dict[str, str]
    resp_body: bytes


def _headers(lines: list[str]) -> dict[str, str]:
    out = {}
    for line in lines:
        key, _, value = line.partition(":")
        out[key.strip().lower()] = value.strip()
    return out


def load(name: str, directory: Path = CAPTURES) -> Capture:
    text = (directory / f"{name}.txt").read_text()
    req, resp = text.split("### response\n", 1)
    req_lines = req.split("### request\n", 1)[1]
    req_head, _, req_body = req_lines.partition("\n\n")
    method, path = req_head.splitlines()[0].split(" ", 1)
    resp_head, _, resp_body = resp.partition("\n\n")
    status_line, *hdr_lines = resp_head.splitlines()
    return Capture(
        name, method, path, _headers(req_head.splitlines()[1:]), req_body.strip().encode(),
        int(status_line.split()[1]), _headers(hdr_lines), resp_body.encode(),
    )


def names() -> list[str]:
    return sorted(p.stem for p in CAPTURES.glob("*.txt") if p.stem not in SKIP and p.stem != "README")


def shape(value: Any) -> Any:
    """The structure of a JSON value: key order kept, leaves reduced to their JSON type, and lists of
    scalars (token ids) reduced to one element so their length does not matter."""
    if isinstance(value, dict):
        return [(k, shape(v)) for k, v in value.items()]
    if isinstance(value, list):
        if all(not isinstance(v, dict | list) for v in value):
            return ["scalar-list"]
        return [shape(v) for v in value]
    if value is None:
        return None
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int | float):
        return "number"
    return "string"


def sse_events(body: bytes) -> list[bytes]:
    assert body.endswith(b"\n\n")
    return [e for e in body.split(b"\n\n") if e]


async def replay(emu: RunningEmulator, cap: Capture) -> tuple[int, str, bytes]:
    headers = {k: v for k, v in cap.req_headers.items() if k in ("content-type", "x-request-id")}
    async with aiohttp.ClientSession() as session, session.request(
        cap.method, emu.url + cap.path, data=cap.req_body or None, headers=headers,
    ) as resp:
        return resp.status, resp.headers.get("Content-Type", ""), await resp.read()


def check_head(cap: Capture, status: int, ctype: str, body: bytes) -> str | None:
    """The status and content type are the capture's; returns the captured content type."""
    assert status == cap.status, body
    want_ctype = cap.resp_headers.get("content-type")
    if want_ctype is not None:
        assert ctype == want_ctype
    return want_ctype


def check_json(cap: Capture, body: bytes, *, exact: bool) -> Any:
    """The JSON body equals the capture's (`exact`) or has its shape; returns it parsed."""
    got, want = orjson.loads(body), orjson.loads(cap.resp_body)
    if exact:
        assert got == want
    else:
        assert shape(got) == shape(want)
    return got


@pytest.mark.parametrize("name", names())
async def test_replay_matches_capture(emulator: MakeEmulator, name: str) -> None:
    emu = await emulator("vllm", model="tiny-moe", max_model_len=2048)
    cap = load(name)
    if name == "chat_long_prefix_second_cached":
        await replay(emu, load("chat_long_prefix_first"))
    status, ctype, body = await replay(emu, cap)
    want_ctype = check_head(cap, status, ctype, body)
    if not cap.resp_body.strip():
        assert body == b""
        return
    if want_ctype == "text/event-stream; charset=utf-8":
        got_events, want_events = sse_events(body), sse_events(cap.resp_body.rstrip(b"\n") + b"\n\n")
        assert len(got_events) == len(want_events)
        assert got_events[-1] == want_events[-1] == b"data: [DONE]"

        def shapes(events: list[bytes]) -> list[str]:
            return sorted(repr(shape(orjson.loads(e.removeprefix(b"data: ")))) for e in events[:-1])

        assert shapes(got_events) == shapes(want_events)
        return
    got = check_json(cap, body, exact=name in EXACT)
    if name == "chat_long_prefix_second_cached":
        assert got["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


async def test_metric_families_match_the_capture(emulator: MakeEmulator) -> None:
    emu = await emulator("vllm")
    await replay(emu, load("chat"))
    await replay(emu, load("chat_stream_usage"))
    cap_text = load("metrics").resp_body.decode()
    want = {f.name: f for f in text_string_to_metric_families(cap_text) if f.name.startswith("vllm:")}
    async with aiohttp.ClientSession() as s, s.get(emu.metrics_url + "/metrics") as r:
        ours = {f.name: f for f in text_string_to_metric_families(await r.text()) if f.name.startswith("vllm:")}
    required = {
        "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:request_success", "vllm:cache_config_info",
        "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds",
        "vllm:prompt_tokens", "vllm:generation_tokens",
    }
    assert required <= set(ours)
    for name, fam in ours.items():
        assert name in want, f"{name} is not a vLLM 0.32 family"
        assert fam.type == want[name].type, name
        if name == "vllm:cache_config_info":
            labels = set(fam.samples[0].labels)
            assert {"block_size", "num_gpu_blocks", "enable_prefix_caching", "engine"} <= labels
            assert labels <= set(want[name].samples[0].labels)
            continue

        def signature(f: Any) -> set[tuple[str, frozenset[str]]]:
            return {(s.name, frozenset(s.labels)) for s in f.samples if not s.name.endswith("_created")}

        def label_names(f: Any) -> set[tuple[str, frozenset[str]]]:
            return {(s.name, frozenset(k for k in s.labels if k != "le")) for s in f.samples}

        assert label_names(fam) == label_names(want[name]) or signature(fam) <= signature(want[name]), name
    buckets = {s.labels["le"] for s in ours["vllm:time_to_first_token_seconds"].samples if "le" in s.labels}
    want_buckets = {s.labels["le"] for s in want["vllm:time_to_first_token_seconds"].samples if "le" in s.labels}
    assert buckets == want_buckets


async def test_metrics_content_type_ignores_accept_like_the_capture(emulator: MakeEmulator) -> None:
    emu = await emulator("vllm")
    want = {load(n).resp_headers["content-type"] for n in ("metrics", "metrics_openmetrics")}
    accept = load("metrics_openmetrics").req_headers["accept"]
    got = set()
    async with aiohttp.ClientSession() as s:
        for headers in ({}, {"Accept": accept}):
            async with s.get(emu.url + "/metrics", headers=headers) as r:
                got.add(r.headers["Content-Type"])
                assert not (await r.text()).endswith("# EOF\n")
    assert got == want == {"text/plain; version=1.0.0; charset=utf-8"}
