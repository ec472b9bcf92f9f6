from __future__ import annotations

import pytest

from backends.base import TranslationError
from backends.chat_templates import render

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": [{"type": "text", "text": "Capital of "}, {"type": "text", "text": "France?"}]},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And Spain?"},
]


def test_chatml() -> None:
    assert render(MESSAGES) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nCapital of France?<|im_end|>\n"
        "<|im_start|>assistant\nParis.<|im_end|>\n"
        "<|im_start|>user\nAnd Spain?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_llama3_without_bos() -> None:
    assert render([{"role": "developer", "content": " Be brief. "}, {"role": "user", "content": "Hi"}], "llama3") == (
        "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_plain() -> None:
    assert render([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None}], "plain") == (
        "User: Hi\nAssistant: \nAssistant:"
    )


@pytest.mark.parametrize(
    ("messages", "needle"),
    [
        ([], "non-empty list"),
        ("hello", "non-empty list"),
        ([{"content": "no role"}], r"messages\[0\]"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "image_url"),
        ([{"role": "user", "content": 5}], r"messages\[0\].content"),
    ],
)
def test_unrenderable_messages_raise_translation_error(messages: object, needle: str) -> None:
    with pytest.raises(TranslationError, match=needle):
        render(messages)


def test_unknown_template_is_a_config_error() -> None:
    with pytest.raises(ValueError, match="unknown chat template"):
        render(MESSAGES, "jinja")
