"""The client requests of `bench overhead`: issue 13's "1.2 KB chat request carrying a ~1 KB system
prompt", non-streaming and streaming. Deterministic text, so every run sends the same bytes.

The size matters: a proxy that parses the body (the gateway, vllm-router, sglang-router) pays for
every byte of it, one that relays bytes does not, so a short question would flatter the parsers.
"""

from __future__ import annotations

from typing import Any

import orjson

SYSTEM_BYTES = 1024
RULES = (
    "Answer in plain words and keep each answer short.",
    "Quote the manual section a claim comes from.",
    "Say so when the manual does not cover a question.",
    "Never guess a part number, a price or a date.",
    "Use metric units and give tolerances with every measurement.",
    "Ask one clarifying question when a request is ambiguous.",
    "List safety warnings before any procedure.",
    "Prefer the procedure with the fewest tools.",
)


def system_prompt(size: int = SYSTEM_BYTES) -> str:
    """Numbered house rules of a fictional support desk, cut at a word boundary to at most `size` ASCII
    bytes (so ~1 KB by default)."""
    text, i = "You are the support assistant of a marine engine workshop.", 0
    while True:
        rule = f" Rule {i + 1}: {RULES[i % len(RULES)]}"
        if len(text) + len(rule) > size:
            return text
        text += rule
        i += 1


def _messages() -> list[dict[str, str]]:
    return [{"role": "system", "content": system_prompt()},
            {"role": "user", "content": "Which book should I read first about servicing the raw-water pump "
                                        "of an old sailing boat's diesel?"}]


def chat(*, max_tokens: int = 12) -> dict[str, Any]:
    """The non-streaming request: ~1.2 KB of JSON."""
    return {"model": "moe", "messages": _messages(), "max_tokens": max_tokens, "temperature": 0}


def stream(*, max_tokens: int) -> dict[str, Any]:
    """The streaming request, usage asked for (so the usage chunk is part of every answer)."""
    return {**chat(max_tokens=max_tokens), "stream": True, "stream_options": {"include_usage": True}}


def size(body: dict[str, Any]) -> int:
    return len(orjson.dumps(body))
