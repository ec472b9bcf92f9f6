"""A backend's own model card (`GET /v1/models`): the context length it serves, for the gateway's
`/v1/models`. Pure: where to ask, and how to read the answer.

vLLM and SGLang put `max_model_len` on the card; trtllm-serve's card has no such field, and Triton has
no OpenAI model list (configure `backends[].max_model_len` for them).
"""

from __future__ import annotations

import orjson

from .base import Runtime

CARD_PATHS = {Runtime.VLLM: "/v1/models", Runtime.SGLANG: "/v1/models", Runtime.TRTLLM: "/v1/models"}


def card_path(runtime: Runtime) -> str | None:
    return CARD_PATHS.get(Runtime(runtime))


def max_model_len(body: bytes, model: str) -> int | None:
    """The `max_model_len` of `model`'s card (or of the only card), None when it is not reported."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    data = obj.get("data") if isinstance(obj, dict) else None
    if not isinstance(data, list):
        return None
    cards = [c for c in data if isinstance(c, dict)]
    card = next((c for c in cards if c.get("id") == model), cards[0] if len(cards) == 1 else None)
    value = card.get("max_model_len") if card is not None else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None
