"""vLLM's prefill/decode legs (issue 23) over real sockets: NixlConnector's two legs with the KV
pulled through the prefill's side channel, the silent recompute without valid params, the bounded
lease of unread blocks, `kv_load_failure_policy: fail`, ExampleConnector's shared directory, and the
side channel of each data-parallel rank."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from backends.emulator import DisaggConfig, RunningEmulator
from tests.emulator.conftest import MakeEmulator
from tests.polling import until

LONG = "Summarise the following text. " + "The quick brown fox jumps over the lazy dog. " * 40
BODY: dict[str, Any] = {"model": "tiny-moe", "messages": [{"role": "user", "content": LONG}], "max_tokens": 4}
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False}
NIXL_KEYS = {"do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id", "remote_request_id",
             "remote_host", "remote_port", "tp_size"}


async def post(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> httpx.Response:
    async with httpx.AsyncClient(timeout=30) as c:
        return await c.post(url + "/v1/chat/completions", json=body, headers=headers or {})


def prefill_leg(**extra: Any) -> dict[str, Any]:
    """Leg 1 as the proxy sends it: one token, not streamed, with do_remote_decode."""
    return {**BODY, "max_tokens": 1, "stream": False, "kv_transfer_params": PREFILL_PARAMS, **extra}


def folders(path: Path) -> int:
    return len(list(path.iterdir()))


async def metric(url: str, name: str, **labels: str) -> float:
    async with httpx.AsyncClient(timeout=30) as c:
        text = (await c.get(url + "/metrics")).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


async def pair(emulator: MakeEmulator, **prefill: Any) -> tuple[RunningEmulator, RunningEmulator]:
    p = await emulator("vllm", disagg=DisaggConfig(role="prefill", **prefill))
    d = await emulator("vllm", disagg=DisaggConfig(role="decode"))
    return p, d


async def test_nixl_two_legs_pull_the_kv_and_skip_the_prefill(emulator: MakeEmulator) -> None:
    p, d = await pair(emulator, engine_id="prefill-engine")
    leg1 = await post(p.url, prefill_leg())
    assert leg1.status_code == 200
    params = leg1.json()["kv_transfer_params"]
    assert set(params) == NIXL_KEYS
    assert params["do_remote_prefill"] is True
    assert params["do_remote_decode"] is False
    assert params["remote_engine_id"] == "prefill-engine"
    assert (params["remote_host"], params["remote_port"]) == ("127.0.0.1", p.side_channel_ports[0])
    assert leg1.json()["choices"][0]["finish_reason"] == "length"
    assert p.snapshot().kv_used_blocks == len(params["remote_block_ids"]) > 0  # kept for the decode
    assert p.stats.kv_produced == 1

    leg2 = await post(d.url, {**BODY, "kv_transfer_params": params})
    assert leg2.status_code == 200
    prompt = leg2.json()["usage"]["prompt_tokens"]
    loaded = min(prompt // 16 * 16, prompt - 1)  # whole 16-token blocks, the last prompt token recomputed
    assert leg2.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == loaded
    assert leg2.json()["usage"]["completion_tokens"] == 4
    assert await metric(d.url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == loaded
    assert await metric(d.url, "vllm:prompt_tokens_by_source_total", source="local_compute") == prompt - loaded
    assert await metric(d.url, "vllm:external_prefix_cache_hits_total") == loaded
    assert (d.stats.kv_pulled, d.stats.kv_pulled_tokens, d.stats.kv_recomputed) == (1, loaded, 0)
    await until(lambda: p.snapshot().kv_used_blocks == 0)  # read, then freed (NIXL's notification)
    assert not p.ctx.handoffs[0].leases


async def test_the_official_client_reads_the_prefill_params(emulator: MakeEmulator) -> None:
    p, _ = await pair(emulator)
    async with openai.AsyncOpenAI(base_url=p.url + "/v1", api_key="unused") as client:
        reply = await client.chat.completions.create(
            model="tiny-moe", messages=BODY["messages"], max_tokens=1,
            extra_body={"kv_transfer_params": PREFILL_PARAMS})
    assert set((reply.model_extra or {})["kv_transfer_params"]) == NIXL_KEYS


async def test_a_decode_without_valid_params_recomputes_silently(emulator: MakeEmulator) -> None:
    p = await emulator("vllm", disagg=DisaggConfig(role="prefill"))
    d = await emulator("vllm", disagg=DisaggConfig(role="decode"), prefix_reuse=False)  # no local hits either
    params = (await post(p.url, prefill_leg())).json()["kv_transfer_params"]
    broken = {k: v for k, v in params.items() if k != "remote_host"}
    for bad in (None, broken, {**params, "remote_block_ids": []}, {**params, "remote_engine_id": "someone-else"}):
        reply = await post(d.url, {**BODY, "kv_transfer_params": bad})
        assert reply.status_code == 200
        assert reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    prompt = reply.json()["usage"]["prompt_tokens"]
    assert await metric(d.url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == 0
    assert await metric(d.url, "vllm:prompt_tokens_by_source_total", source="local_compute") == 4 * prompt
    assert d.stats.kv_recomputed == 3  # None is no P/D request at all
    good = await post(d.url, {**BODY, "kv_transfer_params": params})  # the blocks were never read: still there
    assert good.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    again = await post(d.url, {**BODY, "kv_transfer_params": params})  # read once, then freed
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert d.stats.kv_recomputed == 4


async def test_unread_blocks_are_freed_after_the_lease(emulator: MakeEmulator) -> None:
    p, d = await pair(emulator, kv_lease_s=0.2)
    params = (await post(p.url, prefill_leg())).json()["kv_transfer_params"]
    assert p.snapshot().kv_used_blocks > 0
    await until(lambda: p.stats.kv_expired == 1)
    assert p.snapshot().kv_used_blocks == 0
    late = await post(d.url, {**BODY, "kv_transfer_params": params})
    assert late.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert d.stats.kv_recomputed == 1


async def test_a_prefill_that_stops_keeps_nothing(emulator: MakeEmulator) -> None:
    p, _ = await pair(emulator)
    body = {**BODY, "stream": False, "kv_transfer_params": PREFILL_PARAMS}
    body.pop("max_tokens")  # a natural stop, not FINISHED_LENGTH_CAPPED
    reply = await post(p.url, body)
    assert reply.json()["choices"][0]["finish_reason"] == "stop"
    assert reply.json()["kv_transfer_params"] is None
    assert p.snapshot().kv_used_blocks == 0
    assert p.stats.kv_produced == 0


async def test_a_decode_only_server_produces_no_params(emulator: MakeEmulator) -> None:
    _, d = await pair(emulator)
    reply = await post(d.url, prefill_leg())
    assert reply.status_code == 200
    assert reply.json()["kv_transfer_params"] is None
    assert d.side_channel_ports  # a NixlConnector server always serves its side channel


async def test_load_failure_policy_fail_fails_the_request(emulator: MakeEmulator) -> None:
    p = await emulator("vllm", disagg=DisaggConfig(role="prefill"))
    d = await emulator("vllm", disagg=DisaggConfig(role="decode", load_failure_policy="fail"))
    params = (await post(p.url, prefill_leg())).json()["kv_transfer_params"]
    ok = await post(d.url, {**BODY, "kv_transfer_params": params})
    assert ok.status_code == 200
    failed = await post(d.url, {**BODY, "kv_transfer_params": params})  # already read
    assert failed.status_code == 500
    assert failed.json()["error"]["type"] == "InternalServerError"
    assert d.stats.pd_failed == 1


async def test_example_connector_finds_the_kv_by_prompt(emulator: MakeEmulator, tmp_path: Path) -> None:
    shared = DisaggConfig(connector="ExampleConnector", shared_storage_path=str(tmp_path))
    p = await emulator("vllm", disagg=replace(shared, role="prefill"))
    d = await emulator("vllm", disagg=replace(shared, role="decode"))
    leg1 = await post(p.url, prefill_leg())
    assert leg1.json()["kv_transfer_params"] is None  # the connector exchanges no params
    assert folders(tmp_path) == 1
    leg2 = await post(d.url, {**BODY, "kv_transfer_params": None})
    prompt = leg2.json()["usage"]["prompt_tokens"]
    aligned = (prompt - 2) // 16 * 16  # align_to_block_size(len(prompt) - 1)
    assert leg2.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == aligned
    assert await metric(d.url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == aligned
    other = await post(d.url, {**BODY, "messages": [{"role": "user", "content": "Another prompt. " + LONG}]})
    assert other.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # not in the shared directory
    assert folders(tmp_path) == 1  # a decode-only server writes nothing


async def test_each_data_parallel_rank_has_its_own_side_channel(emulator: MakeEmulator) -> None:
    p = await emulator("vllm", data_parallel_size=2, disagg=DisaggConfig(role="prefill", engine_id="wide"))
    d = await emulator("vllm", disagg=DisaggConfig(role="decode"))
    assert len(set(p.side_channel_ports)) == 2
    leg1 = await post(p.url, prefill_leg(), headers={"X-data-parallel-rank": "1"})
    params = leg1.json()["kv_transfer_params"]
    assert (params["remote_engine_id"], params["remote_port"]) == ("wide_dp1", p.side_channel_ports[1])
    assert p.ctx.ranks[1].driver.engine.held_blocks > 0
    assert p.ctx.ranks[0].driver.engine.held_blocks == 0
    leg2 = await post(d.url, {**BODY, "kv_transfer_params": params})
    assert leg2.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    await until(lambda: p.ctx.ranks[1].driver.engine.held_blocks == 0)
