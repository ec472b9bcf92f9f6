"""A backend's context length read from its own `/v1/models` (captured from vLLM 0.32)."""

from __future__ import annotations

from backends.base import Runtime
from backends.model_card import card_path, max_model_len

from .captures import response


def test_vllm_card_carries_max_model_len() -> None:
    body = response("models.txt").body
    assert max_model_len(body, "tiny-moe") == 2048
    assert max_model_len(body, "other") == 2048  # the only card


def test_cards_without_a_length_or_garbage_say_nothing() -> None:
    trtllm = b'{"object":"list","data":[{"id":"m","object":"model","created":1,"owned_by":"tensorrt_llm"}]}'
    assert max_model_len(trtllm, "m") is None
    assert max_model_len(b"<html>", "m") is None
    two = b'{"data":[{"id":"a","max_model_len":10},{"id":"b","max_model_len":20}]}'
    assert max_model_len(two, "b") == 20
    assert max_model_len(two, "c") is None
    assert max_model_len(b'{"data":[{"id":"a","max_model_len":true}]}', "a") is None
    assert card_path(Runtime.TRITON) is None
    assert card_path(Runtime.SGLANG) == "/v1/models"
