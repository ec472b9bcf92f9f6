"""The gateway tokenizes like the engine: the tiny model's own tokenizer (vendored from the real-vLLM
tier's generator) gives exactly the ids transformers' `apply_chat_template` and a real vLLM 0.32
gave (tests/data), segments are tokenized once, and what cannot be reproduced is refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from backends.base import Endpoint
from backends.emulator import tokenizer as emu
from gateway.settings import ConfigError, parse_settings
from gateway.tokenize import TokenizerError, load, resolve_tokenizers
from gateway.tokenize.chat import ChatTemplate, Unrenderable, normalise
from gateway.tokenize.loader import resolve
from gateway.tokenize.prompt import HfPromptTokenizer
from tests.data import EMULATOR_CAPTURES

DATA = Path(__file__).resolve().parents[2] / "data"
TINY = str(DATA / "tiny-moe-tokenizer")
REFERENCE = json.loads((DATA / "tokenize_reference.json").read_text(encoding="utf-8"))


def captured(name: str) -> tuple[Any, Any]:
    text = (EMULATOR_CAPTURES / "vllm-0.32.0-cpu" / f"{name}.txt").read_text()
    req, resp = text.split("### response\n", 1)
    return json.loads(req.split("\n\n", 1)[1]), json.loads(resp.split("\n\n", 1)[1])


def endpoint(body: dict[str, Any]) -> Endpoint:
    return Endpoint.CHAT if "messages" in body else Endpoint.COMPLETIONS


@pytest.mark.parametrize("case", REFERENCE["cases"], ids=lambda c: str(len(c["ids"])))
def test_equals_transformers_apply_chat_template(case: dict[str, Any]) -> None:
    prompt = load(TINY).prompt(case["body"], endpoint(case["body"]))
    assert prompt is not None
    assert prompt.ids() == case["ids"]
    assert prompt.count == len(case["ids"])


def test_equals_a_real_vllms_tokenize() -> None:
    body, answer = captured("kv_tokenize_0")  # a chat body sent to vLLM's /tokenize
    prompt = load(TINY).prompt(body, Endpoint.CHAT)
    assert prompt is not None
    assert prompt.ids() == answer["tokens"]
    body, answer = captured("tokenize_strs")  # {"prompt": "Hello world"}
    prompt = load(TINY).prompt(body, Endpoint.COMPLETIONS)
    assert prompt is not None
    assert prompt.ids() == answer["tokens"]


def test_history_is_tokenized_once() -> None:
    tok = load(TINY)
    assert isinstance(tok, HfPromptTokenizer)
    assert tok.segment_safe
    history: list[dict[str, str]] = [{"role": "system", "content": "A system prompt for the cache test. " * 20}]
    for turn in range(4):
        history.append({"role": "user", "content": f"question {turn} about tokens"})
        before = tok.segments.misses
        prompt = tok.prompt({"messages": history}, Endpoint.CHAT)
        assert prompt is not None
        # new segments: the last answer and the new question ("system\n...", "\n", "assistant\n" once)
        assert tok.segments.misses - before <= (4 if turn == 0 else 2)
        history.append({"role": "assistant", "content": f"answer {turn}"})
    assert prompt is not None
    whole = Tokenizer.from_file(str(Path(TINY) / "tokenizer.json"))
    assert prompt.ids() == whole.encode(_render(history[:-1]), add_special_tokens=False).ids


def _render(messages: list[dict[str, str]]) -> str:
    body = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return body + "<|im_start|>assistant\n"


def test_segment_cache_is_bounded_by_bytes() -> None:
    tok = load(TINY)
    assert isinstance(tok, HfPromptTokenizer)
    tok.segments.cap_bytes, saved = 4096, tok.segments.cap_bytes
    try:
        for i in range(200):
            tok.prompt({"messages": [{"role": "user", "content": f"message number {i} " * 10}]}, Endpoint.CHAT)
        assert tok.segments.bytes <= 4096
        assert len(tok.segments) < 200
    finally:
        tok.segments.cap_bytes = saved


def test_a_tokenizer_whose_segments_depend_on_their_neighbours_tokenizes_whole_prompts() -> None:
    """Metaspace with prepend_scheme "first" marks only the first word of the whole input: a
    segment-wise encoding would mark every segment, so the gateway encodes whole texts instead."""
    vocab = {"[UNK]": 0, "<s>": 1, "▁a": 2, "a": 3, "▁b": 4, "b": 5, "▁": 6}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    raw.add_special_tokens(["<s>"])
    tok = HfPromptTokenizer("metaspace", raw, None)
    assert not tok.segment_safe
    text = "a b<s>a b"
    assert TokenPromptIds(tok.encode(text, add_special_tokens=False)) == raw.encode(text, add_special_tokens=False).ids


def TokenPromptIds(packed: bytes) -> list[int]:
    from gateway.routing.tokens import TokenPrompt

    return TokenPrompt(packed=packed).ids()


@pytest.mark.parametrize("body", [
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:x"}}]}]},
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "par"}],
     "continue_final_message": True, "add_generation_prompt": False},
    {"messages": []},
    {"messages": "not a list"},
    {"messages": [{"content": "no role"}]},
])
def test_what_cannot_be_reproduced_exactly_is_refused(body: dict[str, Any]) -> None:
    assert load(TINY).prompt(body, Endpoint.CHAT) is None


def test_completions_token_ids_and_batches() -> None:
    tok = load(TINY)
    got = tok.prompt({"prompt": [5, 6, 7]}, Endpoint.COMPLETIONS)
    assert got is not None
    assert got.ids() == [5, 6, 7]
    batch = tok.prompt({"prompt": ["Hello world", "another"]}, Endpoint.COMPLETIONS)
    assert batch is not None
    assert batch.ids() == [43, 405, 82, 749]
    assert tok.prompt({"prompt": {"x": 1}}, Endpoint.COMPLETIONS) is None


def test_template_features_transformers_provides() -> None:
    source = (
        "{% for m in messages %}{% generation %}{{ m['role'] | upper }}:{{ m['content'] }}{% endgeneration %}"
        "{% if loop.index > 5 %}{% break %}{% endif %}{% endfor %}"
        "{{ tools | tojson }}{{ bos_token }}{{ flavour | default('') }}"
        "{% if messages | length > 9 %}{{ raise_exception('too many') }}{% endif %}"
    )
    t = ChatTemplate(source, special_tokens={"bos_token": "<s>"})
    text = t.render({"messages": [{"role": "user", "content": "<b>"}], "tools": [{"x": "é<"}],
                     "chat_template_kwargs": {"flavour": "!", "messages": "ignored"}})
    assert text == 'USER:<b>[{"x": "é<"}]<s>!'
    with pytest.raises(Unrenderable, match="too many"):
        t.render({"messages": [{"role": "user", "content": "x"}] * 10})


def test_messages_are_normalised_as_vllm_does() -> None:
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "name": "n"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "not json"}}]},
        {"role": "tool", "tool_call_id": "c1",
         "content": [{"type": "text", "text": "r1"}, {"type": "text", "text": "r2"}]},
    ]
    out = normalise(messages, openai_content=False)
    assert out[0] == {"role": "user", "content": "a\nb", "name": "n"}
    assert out[1]["content"] == ""
    assert [c["function"]["arguments"] for c in out[1]["tool_calls"]] == [{"x": 1}, {}]
    assert out[2] == {"role": "tool", "content": "r1\nr2", "tool_call_id": "c1"}
    parts = normalise(messages[:1], openai_content=True)
    assert parts[0]["content"] == [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]


def test_the_emulator_spec_tokenizes_like_the_emulators() -> None:
    tok = load("emulator")
    messages = [{"role": "system", "content": "You are a tester. " * 30}, {"role": "user", "content": "Go, now!"}]
    prompt = tok.prompt({"messages": messages}, Endpoint.CHAT)
    assert prompt is not None
    assert prompt.ids() == emu.encode(emu.render_chat(messages))
    # a trailing space before <|im_end|> makes the emulator's pieces swallow its "<": still equal
    assert messages[0]["content"].endswith(" ")
    for raw in ("plain text prompt", "a <|im_start|>b\n<|im_start|>c <|im_end|>\n"):
        text = tok.prompt({"prompt": raw}, Endpoint.COMPLETIONS)
        assert text is not None
        assert text.ids() == emu.encode(raw)


def test_hugging_face_names_resolve_from_the_local_cache_only(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    snapshot = tmp_path / "hub" / "models--acme--tiny" / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (snapshot / name).write_bytes((Path(TINY) / name).read_bytes())
    refs = tmp_path / "hub" / "models--acme--tiny" / "refs"
    refs.mkdir()
    (refs / "main").write_text("0123abcd")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve("acme/tiny") == snapshot
    with pytest.raises(TokenizerError, match="not in the local Hugging Face cache"):
        resolve("acme/absent")


@pytest.mark.parametrize(("spec", "needle"), [
    ("/nonexistent/dir/x", "not a directory"),
    (str(DATA), "no tokenizer.json"),
])
def test_bad_specs_say_why(spec: str, needle: str) -> None:
    with pytest.raises(TokenizerError, match=needle):
        load(spec)


def test_config_errors_name_the_field() -> None:
    a = {"name": "a", "runtime": "vllm", "url": "http://127.0.0.1:1", "model": "m"}
    b = {"name": "b", "runtime": "vllm", "url": "http://127.0.0.1:2", "model": "m", "tokenizer": "/nope/b"}
    base: dict[str, Any] = {"backends": [a, b], "routes": [{"model": "r1", "backends": ["a"], "tokenizer": "/nope/r1"},
                                                           {"model": "r2", "backends": ["b"]}]}
    with pytest.raises(ConfigError) as err:
        resolve_tokenizers(parse_settings(base))
    assert [e.split(":")[0] for e in err.value.errors] == ["routes.0.tokenizer", "backends.1.tokenizer"]
    ok = {"backends": [a], "routes": [{"model": "r1", "backends": ["a"], "tokenizer": TINY}]}
    assert list(resolve_tokenizers(parse_settings(ok))) == ["r1"]
    mixed = {**base, "routes": [{"model": "r", "backends": ["a", "b"]}]}
    with pytest.raises(ConfigError, match=r"routes\.0: its backends tokenize differently"):
        parse_settings(mixed)
