"""The gateway's vLLM legs against a real pair's transcripts (tests/data/vllm-0.32.0-cpu-pd:
two vLLM 0.32.0 servers sharing KV through ExampleConnector files, recorded by
scripts/real_vllm/record_pd.py): the legs it builds are the ones recorded, and what it reads from
the prefill's answer is what a shared-storage connector really says."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest

from backends.disaggregation import PREFILL_ONLY, vllm_decode_body, vllm_handoff, vllm_prefill_body
from tests.data import VLLM_PD_CAPTURES as CAPTURES

PAIRS = ("chat", "chat_stream", "completions")
FACTS: dict[str, Any] = json.loads((CAPTURES / "storage.json").read_text())


def exchange(name: str) -> tuple[dict[str, Any], int, bytes]:
    """(request body, status, response body) of one transcript."""
    text = (CAPTURES / f"{name}.txt").read_text()
    request, response = text.split("### response\n", 1)
    body = request.split("### request\n", 1)[1].partition("\n\n")[2]
    head, _, reply = response.partition("\n\n")
    return json.loads(body), int(head.split()[1]), reply.encode()


def usage_of(reply: bytes) -> dict[str, Any]:
    """The usage of a JSON answer or of an SSE stream's usage chunk."""
    if reply.startswith(b"data: "):
        chunks = [orjson.loads(line[6:]) for line in reply.splitlines() if line.startswith(b"data: {")]
        [usage] = [c["usage"] for c in chunks if c.get("usage")]
        return dict(usage)
    return dict(orjson.loads(reply)["usage"])


@pytest.mark.parametrize("name", PAIRS)
def test_leg_one_is_what_the_gateway_builds_and_vllm_answers_null_params(name: str) -> None:
    leg, status, reply = exchange(f"{name}_prefill")
    client, _, _ = exchange(f"{name}_decode")
    assert leg == vllm_prefill_body(client)
    assert leg["kv_transfer_params"] == PREFILL_ONLY
    assert status == 200
    answer = orjson.loads(reply)
    assert "kv_transfer_params" in answer  # vLLM writes the key, null for a shared-storage connector
    assert vllm_handoff(reply) == ("null", None)
    assert answer["usage"]["completion_tokens"] == 1


@pytest.mark.parametrize("name", PAIRS)
def test_leg_two_is_the_clients_body_and_loads_the_aligned_blocks(name: str) -> None:
    client, status, reply = exchange(f"{name}_decode")
    assert status == 200
    assert client == vllm_decode_body(client, None)
    assert "kv_transfer_params" not in client
    facts = FACTS["legs"][name]
    usage = usage_of(reply)
    assert usage["prompt_tokens"] == facts["prompt_tokens"]
    loaded = (facts["prompt_tokens"] - 2) // 128 * 128  # ExampleConnector's block alignment
    assert loaded > 0
    assert facts["decode_external_kv_transfer_tokens"] == loaded
    assert facts["decode_local_compute_tokens"] == facts["prompt_tokens"] - loaded
    assert usage["prompt_tokens_details"]["cached_tokens"] == loaded


def test_a_decode_without_its_prefill_computes_the_whole_prompt() -> None:
    _, status, reply = exchange("chat_decode_without_prefill")
    assert status == 200
    usage = usage_of(reply)
    facts = FACTS["legs"]["chat_decode_without_prefill"]
    assert facts["decode_external_kv_transfer_tokens"] == 0
    assert facts["decode_local_compute_tokens"] == usage["prompt_tokens"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0


def test_the_shared_folder_holds_one_folder_per_prompt_one_file_per_layer() -> None:
    storage: dict[str, list[str]] = FACTS["storage"]
    assert len(storage) == len(PAIRS) + 1  # each pair's prompt once, and the decode-only prompt
    assert all(files == ["model.layers.0.self_attn.attn.safetensors", "model.layers.1.self_attn.attn.safetensors"]
               for files in storage.values())  # fmt: skip


def test_the_decodes_metrics_count_the_loaded_tokens() -> None:
    text = (CAPTURES / "decode_metrics.txt").read_text()
    loaded = sum(FACTS["legs"][name]["decode_external_kv_transfer_tokens"] for name in PAIRS)
    assert f'vllm:prompt_tokens_by_source_total{{engine="0",model_name="tiny-moe",source="external_kv_transfer"}} ' \
           f"{float(loaded)}" in text  # fmt: skip
    assert f'vllm:external_prefix_cache_hits_total{{engine="0",model_name="tiny-moe"}} {float(loaded)}' in text
