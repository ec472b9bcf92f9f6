"""`/v1/embeddings` on emulators started as embedding models, and the tokenizer endpoints, on the
vLLM, SGLang and trtllm-serve faces (issue 16)."""

from __future__ import annotations

import math
from typing import Any

import aiohttp
import openai
import pytest

from backends.emulator import embeddings as E
from backends.emulator import tokenizer
from tests.emulator.conftest import MakeEmulator

RUNTIMES = ["vllm", "sglang", "trtllm"]
DIM = 48


async def post(url: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.post(url + path, json=body) as r:
        return r.status, await r.json(content_type=None)


def test_vectors_are_deterministic_unit_vectors_of_the_dimension() -> None:
    a = E.vector(tokenizer.encode("Hello world"), DIM)
    assert len(a) == DIM
    assert math.isclose(sum(x * x for x in a), 1.0, rel_tol=1e-5)
    assert a == E.vector(tokenizer.encode("Hello world"), DIM)
    b = E.vector(tokenizer.encode("The sea"), DIM)
    assert a != b
    assert E.encode(a, "float") == a
    assert isinstance(E.encode(a, "base64"), str)


@pytest.mark.parametrize("runtime", RUNTIMES)
async def test_sdk_embeddings_float_base64_and_lists(emulator: MakeEmulator, runtime: str) -> None:
    emu = await emulator(runtime, embedding_dim=DIM)
    client = openai.AsyncOpenAI(base_url=emu.url + "/v1", api_key="k", max_retries=0)
    one = await client.embeddings.create(model="tiny-moe", input="Hello world", encoding_format="float")
    assert len(one.data) == 1
    assert len(one.data[0].embedding) == DIM
    assert one.usage.prompt_tokens == len(tokenizer.encode("Hello world"))
    assert one.usage.total_tokens == one.usage.prompt_tokens
    # The SDK asks for base64 by default and decodes it: the same vector, to float32 precision.
    b64 = await client.embeddings.create(model="tiny-moe", input="Hello world")
    assert all(math.isclose(x, y, rel_tol=1e-6, abs_tol=1e-7)
               for x, y in zip(b64.data[0].embedding, one.data[0].embedding, strict=True))
    many = await client.embeddings.create(model="tiny-moe", input=["Hello world", "The sea", "Hello world"],
                                          encoding_format="float")
    assert [d.index for d in many.data] == [0, 1, 2]
    assert many.data[0].embedding == many.data[2].embedding == one.data[0].embedding
    assert many.data[1].embedding != many.data[0].embedding
    assert many.usage.prompt_tokens == 2 * len(tokenizer.encode("Hello world")) + len(tokenizer.encode("The sea"))
    ids = await client.embeddings.create(model="tiny-moe", input=[5, 6, 7], encoding_format="float")
    assert ids.usage.prompt_tokens == 3
    with pytest.raises(openai.BadRequestError):
        await client.embeddings.create(model="tiny-moe", input="x", dimensions=8)
    await client.close()


@pytest.mark.parametrize("runtime", RUNTIMES)
async def test_embedding_model_does_not_generate(emulator: MakeEmulator, runtime: str) -> None:
    emu = await emulator(runtime, embedding_dim=DIM)
    status, body = await post(emu.url, "/v1/chat/completions",
                              {"model": "tiny-moe", "messages": [{"role": "user", "content": "hi"}]})
    if runtime == "sglang":  # SGLang serves the route and refuses the request
        assert status == 400
        assert "message" in body
    else:  # vLLM (captured: embeddings_chat_on_pooling) and trtllm-serve do not register the route
        assert status == 404
    status, _ = await post(emu.url, "/v1/responses", {"model": "tiny-moe", "input": "x"})
    assert status in (400, 404)


@pytest.mark.parametrize("runtime", RUNTIMES)
async def test_generative_model_has_no_embeddings(emulator: MakeEmulator, runtime: str) -> None:
    emu = await emulator(runtime)
    status, body = await post(emu.url, "/v1/embeddings", {"model": "tiny-moe", "input": "hello"})
    if runtime == "vllm":
        assert (status, body) == (404, {"detail": "Not Found"})  # captured: embeddings_on_generate_model
    elif runtime == "sglang":
        assert status == 400
        assert "--is-embedding" in body["message"]
    else:
        assert status == 404


async def test_embeddings_go_through_the_engine(emulator: MakeEmulator) -> None:
    emu = await emulator("vllm", embedding_dim=DIM)
    client = openai.AsyncOpenAI(base_url=emu.url + "/v1", api_key="k", max_retries=0)
    await client.embeddings.create(model="tiny-moe", input=["a b c", "d e f"], encoding_format="float")
    assert emu.stats.completed == 2
    await client.close()


async def test_vllm_models_advertise_max_model_len(emulator: MakeEmulator) -> None:
    emu = await emulator("vllm", max_model_len=1024)
    client = openai.AsyncOpenAI(base_url=emu.url + "/v1", api_key="k", max_retries=0)
    models = await client.models.list()
    assert [m.id for m in models.data] == ["tiny-moe"]
    assert (models.data[0].model_extra or {}).get("max_model_len") == 1024
    await client.close()


async def test_vllm_tokenize_and_detokenize(emulator: MakeEmulator) -> None:
    emu = await emulator("vllm", max_model_len=1024)
    status, body = await post(emu.url, "/tokenize", {"model": "tiny-moe", "prompt": "Hello world",
                                                     "return_token_strs": True})
    assert status == 200
    assert list(body) == ["count", "max_model_len", "tokens", "token_strs"]  # as captured (tokenize_strs)
    assert body["tokens"] == tokenizer.encode("Hello world")
    assert body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 1024
    assert "".join(body["token_strs"]) == "Hello world"
    messages = [{"role": "user", "content": "Hi there"}]
    status, chat_tok = await post(emu.url, "/tokenize", {"model": "tiny-moe", "messages": messages})
    client = openai.AsyncOpenAI(base_url=emu.url + "/v1", api_key="k", max_retries=0)
    reply = await client.chat.completions.create(model="tiny-moe", messages=[{"role": "user", "content": "Hi there"}],
                                                 max_tokens=1)
    assert reply.usage is not None
    assert chat_tok["count"] == reply.usage.prompt_tokens
    assert chat_tok["token_strs"] is None
    status, text = await post(emu.url, "/detokenize", {"model": "tiny-moe", "tokens": body["tokens"]})
    assert (status, text) == (200, {"prompt": "Hello world"})
    await client.close()


async def test_sglang_tokenize_and_detokenize(emulator: MakeEmulator) -> None:
    emu = await emulator("sglang", max_model_len=1024)
    for prefix in ("", "/v1"):
        status, body = await post(emu.url, prefix + "/tokenize", {"prompt": "Hello world"})
        assert status == 200
        assert body == {"tokens": tokenizer.encode("Hello world"), "count": len(tokenizer.encode("Hello world")),
                        "max_model_len": 1024}
        status, many = await post(emu.url, prefix + "/tokenize", {"prompt": ["Hello", "The sea"]})
        assert many["count"] == [len(t) for t in many["tokens"]]
        assert len(many["tokens"]) == 2
        status, text = await post(emu.url, prefix + "/detokenize", {"tokens": body["tokens"]})
        assert (status, text) == (200, {"text": "Hello world"})
        status, texts = await post(emu.url, prefix + "/detokenize", {"tokens": many["tokens"]})
        assert texts == {"text": ["Hello", "The sea"]}
    status, err = await post(emu.url, "/tokenize", {"prompt": "x", "messages": []})
    assert status == 400
    assert "Exactly one of" in err["message"]


async def test_trtllm_serves_no_tokenizer_endpoints(emulator: MakeEmulator) -> None:
    emu = await emulator("trtllm")
    for path in ("/tokenize", "/detokenize", "/v1/tokenize"):
        status, _ = await post(emu.url, path, {"prompt": "x"})
        assert status == 404
