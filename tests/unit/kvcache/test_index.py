"""The event-built index: a real vLLM 0.32's events and the tiny model's tokenizer predict that vLLM's
`cached_tokens` exactly; lookups equal a linear walk whatever the order of stores and removals."""

from __future__ import annotations

import json
import re
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from backends.base import Endpoint
from backends.emulator.block_hashes import sglang_hashes, vllm_hashes
from gateway.kvcache.events import Batch, Removed, Stored, decode_frames
from gateway.kvcache.index import RankIndex
from gateway.routing.tokens import ROOT_KEY, TokenPrompt, block_keys, extend, pack
from gateway.tokenize import load
from tests.data import EMULATOR_CAPTURES

CAPTURES = EMULATOR_CAPTURES / "vllm-0.32.0-cpu"
TINY = str(EMULATOR_CAPTURES.parent / "tiny-moe-tokenizer")


def capture(name: str) -> tuple[dict[str, Any], str]:
    text = (CAPTURES / f"{name}.txt").read_text()
    req, resp = text.split("### response\n", 1)
    return json.loads(req.split("\n\n", 1)[1]), resp


def apply(index: RankIndex, batch: Batch) -> None:
    for ev in batch.events:
        if isinstance(ev, Stored):
            index.store(ev)
        elif isinstance(ev, Removed):
            index.remove(ev)


def test_a_real_vllms_events_predict_its_cached_tokens() -> None:
    """The capture's requests, in order, each after the batches published before it: the index
    built from the events predicts every reported `cached_tokens`, eviction included."""
    lines = [json.loads(x) for x in (CAPTURES / "kv_events.jsonl").read_text().splitlines()]
    batches = [decode_frames([x["topic"].encode(), x["seq"].to_bytes(8, "big"), bytes.fromhex(x["payload_hex"])])
               for x in lines]
    tok = load(TINY)
    index = RankIndex()
    # (request, batches published before it was sent)
    order = [("kv_chat_0", 0), ("kv_chat_1", 1), ("kv_chat_2", 1), ("kv_chat_evict", 1),
             ("kv_chat_after_evict", 2), ("kv_chat_after_evict_again", 3)]
    applied = 0
    for name, before in order:
        while applied < before:
            apply(index, batches[applied])
            applied += 1
        body, resp = capture(name)
        prompt = tok.prompt(body, Endpoint.CHAT)
        assert prompt is not None
        reported = int(re.search(r'"cached_tokens":(\d+)', resp).group(1))  # type: ignore[union-attr]
        assert index.match(prompt) == reported, name
    assert index.block_size == 128
    assert index.orphans == 0


def test_keys_do_not_depend_on_block_boundaries() -> None:
    ids = list(range(1000, 1100))
    data = pack(ids)
    by16 = block_keys(data, 96, 16)
    by32 = block_keys(data, 96, 32)
    assert by32 == by16[1::2]
    assert extend(extend(ROOT_KEY, pack(ids[:5])), pack(ids[5:16])) == by16[0]
    prompt = TokenPrompt(ids)
    assert prompt.keys(16) == block_keys(data, 99, 16)  # the last token is never cacheable


def stored(tokens: list[int], bs: int, hashes: list[int], first: int, parent: int | None) -> Stored:
    """Blocks `first`.. of `tokens` as one store event."""
    n = len(hashes)
    return Stored(tuple(hashes), parent, tuple(tokens[first * bs : (first + n) * bs]), bs)


def test_stores_under_a_parent_resolve_and_small_pages_refine() -> None:
    tokens = list(range(1, 70))
    engine = sglang_hashes(tokens, 1)  # per-token pages, as SGLang publishes by default
    index = RankIndex()
    index.store(stored(tokens, 1, engine[:20], 0, None))
    for i in range(20, 37):
        index.store(stored(tokens, 1, [engine[i]], i, engine[i - 1]))
    prompt = TokenPrompt(tokens)  # 69 tokens: 68 cacheable
    assert index.match(prompt) == 37  # two 16-token keys, then 5 single pages found by the refinement
    index.remove(Removed((engine[36],)))
    assert index.match(prompt) == 36
    index.remove(Removed((engine[10],)))  # a hole: its descendants are orphans now
    assert index.orphans == 1
    assert index.match(prompt) == 10
    index.store(stored(tokens, 1, [engine[10]], 10, engine[9]))  # re-stored (same hash): whole again
    assert index.orphans == 0
    assert index.match(prompt) == 36


def test_unknown_parents_and_unusable_stores_are_skipped() -> None:
    tokens = list(range(64))
    engine = vllm_hashes(tokens, 16)
    index = RankIndex()
    index.store(stored(tokens, 16, engine[1:2], 1, 12345))  # parent never seen
    assert len(index) == 0
    assert index.unresolved == 1
    index.store(Stored((engine[0],), None, tuple(tokens[:16]), 16, usable=False))
    index.store(stored(tokens, 16, engine[1:2], 1, engine[0]))  # parent was not usable: unresolved too
    assert len(index) == 0
    index.store(stored(tokens, 16, engine[:3], 0, None))
    assert index.match(TokenPrompt(tokens)) == 48


def test_confirmations_are_suspects_until_an_event_names_them() -> None:
    tokens = list(range(200))
    engine = vllm_hashes(tokens, 16)
    index = RankIndex()
    index.store(stored(tokens, 16, engine[:2], 0, None))
    prompt = TokenPrompt(tokens)
    assert index.confirm(prompt, 96) == 4
    assert index.match(prompt) == 96
    assert len(index.ghosts) == 4
    index.store(stored(tokens, 16, engine[2:3], 2, engine[1]))  # an event confirms block 2
    assert len(index.ghosts) == 3
    assert index.unconfirm(prompt, 48) == 3  # the engine served 48: ghosts past them go, block 2 stays
    assert index.match(prompt) == 48


# --- property: binary search equals the linear walk, and orphans are counted right ---------------

TOKENS = list(range(5000, 5000 + 16 * 12 + 1))  # 12 blocks, and the last prompt token (never cached)
ENGINE = vllm_hashes(TOKENS, 16)
PAGES = list(range(7000, 7000 + 80))
PAGE_HASHES = sglang_hashes(PAGES, 1)
Ops = list[tuple[bool, int, int]]


def replayed(ops: Ops, tokens: list[int] = TOKENS, hashes: list[int] = ENGINE, bs: int = 16,
             ) -> tuple[RankIndex, set[int]]:
    """An index from store/remove ops on the blocks of `tokens` (`hashes` the engine's, `bs` tokens
    each), and the block positions the engine holds: a store resolves only under a block that an
    event named (or at the root)."""
    index = RankIndex()
    resident: set[int] = set()  # block positions the engine holds
    named: set[int] = set()  # ... and that an event ever named (a store under them resolves)
    for is_store, start, count in ops:
        blocks = list(range(start, min(start + count, len(hashes))))
        if is_store:
            parent = hashes[start - 1] if start else None
            index.store(stored(tokens, bs, [hashes[b] for b in blocks], start, parent))
            if start == 0 or start - 1 in named:
                resident.update(blocks)
                named.update(blocks)
        else:
            index.remove(Removed(tuple(hashes[b] for b in blocks)))
            resident.difference_update(blocks)
    return index, resident


def walked(resident: set[int], limit: int) -> int:
    """The linear walk: how many leading blocks, at most `limit`, the engine holds."""
    held = 0
    while held < limit and held in resident:
        held += 1
    return held


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 11), st.integers(1, 4)), max_size=40),
       st.integers(1, 12))
def test_lookup_equals_a_linear_walk(ops: Ops, prompt_blocks: int) -> None:
    index, resident = replayed(ops)
    keys = block_keys(pack(TOKENS), 16 * 12, 16)
    assert set(index.keys()) == {keys[b] for b in resident}
    assert index.orphans == sum(1 for b in resident if b > 0 and b - 1 not in resident)
    prompt = TokenPrompt(TOKENS[: prompt_blocks * 16 + 1])
    assert index.match(prompt) == walked(resident, prompt_blocks) * 16


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 79), st.integers(1, 24)), max_size=30),
       st.integers(2, 80))
def test_small_pages_equal_a_page_by_page_walk(ops: Ops, prompt_len: int) -> None:
    """SGLang's per-token pages are searched at 16-token keys and refined: the same answer as a walk."""
    index, resident = replayed(ops, PAGES, PAGE_HASHES, 1)
    assert index.match(TokenPrompt(PAGES[:prompt_len])) == walked(resident, prompt_len - 1)


OPS = st.lists(st.tuples(st.booleans(), st.integers(0, 11), st.integers(1, 4)), max_size=30)


@settings(max_examples=200, deadline=None)
@given(st.lists(OPS, min_size=2, max_size=4), st.integers(1, 12))
def test_one_prompt_matched_on_many_indexes_keeps_each_answer(fleet: list[Ops], prompt_blocks: int) -> None:
    """The search hint one index leaves on a prompt never changes another index's answer."""
    prompt = TokenPrompt(TOKENS[: prompt_blocks * 16 + 1])
    for _ in range(2):  # twice round: every index also sees the hints the others left
        for index, resident in map(replayed, fleet):
            assert index.match(prompt) == walked(resident, prompt_blocks) * 16
