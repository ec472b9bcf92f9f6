"""Replay the captures of a real vLLM 0.32's Responses, tool-call, JSON-output, embedding, tokenizer
and KV-event endpoints (tests/data/emulator/vllm-0.32.0-cpu) against the vLLM emulator, and
compare what a client could tell apart: status, content type, JSON key structure and order, nulls,
SSE event names and payload structure (runs of deltas counted as one), and the deterministic error
bodies byte for byte after parsing."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from backends.emulator import KvEventsConfig
from tests.data import EMULATOR_CAPTURES as OWN_CAPTURES
from tests.emulator.conftest import MakeEmulator
from tests.emulator.kv_harness import Subscriber
from tests.emulator.test_vllm_captures import check_head, check_json, load, replay, shape

DIR = OWN_CAPTURES / "vllm-0.32.0-cpu"
EXACT = {
    "responses_err_max_output_tokens_too_big", "responses_err_missing_input", "responses_err_unknown_model",
    "embeddings_err_empty", "embeddings_err_unknown_model", "embeddings_dimensions", "embeddings_on_generate_model",
    "embeddings_chat_on_pooling", "embeddings_responses_on_pooling",
}
# Not replayed: the emulator serves vLLM's dev-mode /reset_prefix_cache (a real vLLM 404s it
# without VLLM_SERVER_DEV_MODE=1, as captured), so tests can clear the cache.
SKIP = {"kv_reset_prefix_cache"}


def names() -> list[str]:
    return sorted(p.stem for p in DIR.glob("*.txt") if p.stem not in SKIP)


def sse_shapes(body: bytes) -> list[tuple[str | None, Any]]:
    """(event name, payload shape) per SSE event; consecutive equal entries collapsed."""
    out: list[tuple[str | None, Any]] = []
    for block in body.strip(b"\n").split(b"\n\n"):
        name = None
        data = b""
        for line in block.split(b"\n"):
            if line.startswith(b"event: "):
                name = line.removeprefix(b"event: ").decode()
            elif line.startswith(b"data: "):
                data = line.removeprefix(b"data: ")
        entry = (name, "[DONE]" if data == b"[DONE]" else repr(shape(orjson.loads(data))))
        if not out or out[-1] != entry:
            out.append(entry)
    return out


def embedding_dim(name: str) -> int | None:
    return 128 if name.startswith("embeddings") and name != "embeddings_on_generate_model" else None


@pytest.mark.parametrize("name", names())
async def test_replay_matches_capture(emulator: MakeEmulator, name: str) -> None:
    cap = load(name, DIR)
    kv = None
    if name == "kv_event_sources":
        async with Subscriber() as sub:
            kv = KvEventsConfig(endpoint=sub.endpoint, topic="kv")
            emu = await emulator("vllm", kv_events=kv)
            status, ctype, body = await replay(emu, cap)
            assert orjson.loads(body)["0"]["endpoint"] == sub.endpoint
    else:
        emu = await emulator("vllm", embedding_dim=embedding_dim(name))
        status, ctype, body = await replay(emu, cap)
    if check_head(cap, status, ctype, body) == "text/event-stream; charset=utf-8":
        assert sse_shapes(body) == sse_shapes(cap.resp_body)
        return
    check_json(cap, body, exact=name in EXACT)
