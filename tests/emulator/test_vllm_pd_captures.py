"""Replay the real ExampleConnector pair's legs (tests/data/vllm-0.32.0-cpu-pd) against two vLLM
emulators sharing a folder the same way: each answer has the real one's shape (key order, nulls,
`kv_transfer_params: null`, SSE events), and the decode loads what the real decode loaded, whole
128-token blocks of the prompt ((L-2)//128*128), or nothing without its prefill."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import orjson
import pytest

from backends.emulator.config import DisaggConfig
from tests.data import VLLM_PD_CAPTURES
from tests.emulator.conftest import MakeEmulator
from tests.emulator.test_vllm_captures import check_head, check_json, load, replay, shape, sse_events

BLOCK = 128  # vLLM's block size on CPU, where the captures come from
PAIRS = ("chat", "chat_stream", "completions")


def usage_of(body: bytes) -> dict[str, object]:
    if body.startswith(b"data: "):
        chunks = [orjson.loads(e.removeprefix(b"data: ")) for e in sse_events(body)[:-1]]
        [usage] = [c["usage"] for c in chunks if c.get("usage")]
        return dict(usage)
    return dict(orjson.loads(body)["usage"])


def same_stream_shape(got: bytes, want: bytes) -> None:
    got_events, want_events = sse_events(got), sse_events(want.rstrip(b"\n") + b"\n\n")
    assert len(got_events) == len(want_events)
    assert got_events[-1] == want_events[-1] == b"data: [DONE]"

    def shapes(events: list[bytes]) -> list[str]:
        return sorted(repr(shape(orjson.loads(e.removeprefix(b"data: ")))) for e in events[:-1])

    assert shapes(got_events) == shapes(want_events)


@pytest.mark.parametrize("name", PAIRS)
async def test_the_pairs_legs_replay_with_the_real_shapes_and_load(emulator: MakeEmulator, tmp_path: Path,
                                                                   name: str) -> None:
    shared = DisaggConfig(connector="ExampleConnector", shared_storage_path=str(tmp_path))
    p = await emulator("vllm", block_size=BLOCK, disagg=replace(shared, role="prefill"))
    d = await emulator("vllm", block_size=BLOCK, disagg=replace(shared, role="decode"))
    leg1, leg2 = load(f"{name}_prefill", VLLM_PD_CAPTURES), load(f"{name}_decode", VLLM_PD_CAPTURES)

    status, ctype, body = await replay(p, leg1)
    check_head(leg1, status, ctype, body)
    answer = check_json(leg1, body, exact=False)
    assert answer["kv_transfer_params"] is None

    status, ctype, body = await replay(d, leg2)
    want_ctype = check_head(leg2, status, ctype, body)
    if want_ctype == "text/event-stream; charset=utf-8":
        same_stream_shape(body, leg2.resp_body)
    else:
        check_json(leg2, body, exact=False)
    # The real decode and the emulated one, each on its own prompt length (the tokenizers differ).
    for usage in (usage_of(leg2.resp_body), usage_of(body)):
        prompt = usage["prompt_tokens"]
        assert isinstance(prompt, int)
        assert accounted(usage) == (prompt - 2) // BLOCK * BLOCK > 0


def accounted(usage: dict[str, object]) -> int:
    """The loaded tokens a decode's usage reports: its cached tokens, with its newly created blocks
    being the prompt's whole blocks beyond them (as the real decode and prefill report them;
    /v1/completions says null)."""
    prompt, details = usage["prompt_tokens"], usage["prompt_tokens_details"]
    assert isinstance(prompt, int)
    assert isinstance(details, dict)
    cached: int = details["cached_tokens"]
    if details["created_cache_tokens"] is not None:  # null on /v1/completions (the shapes say so too)
        assert details["created_cache_tokens"] == prompt // BLOCK * BLOCK - cached
    return cached


async def test_a_decode_alone_replays_with_nothing_loaded(emulator: MakeEmulator, tmp_path: Path) -> None:
    shared = DisaggConfig(connector="ExampleConnector", shared_storage_path=str(tmp_path), role="decode")
    d = await emulator("vllm", block_size=BLOCK, disagg=shared)
    cap = load("chat_decode_without_prefill", VLLM_PD_CAPTURES)
    status, ctype, body = await replay(d, cap)
    check_head(cap, status, ctype, body)
    check_json(cap, body, exact=False)
    assert usage_of(body)["prompt_tokens_details"] == usage_of(cap.resp_body)["prompt_tokens_details"]
