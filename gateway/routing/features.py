"""`describe`: the one pass over a request that every routing policy needs, done once per request.

Prefix caches live in token space after the chat template, so we hash what the engine will see: the
messages rendered through a template (ChatML by default; any fixed template works, since only the
consistency of the byte stream matters), or the completions prompt. Without a tokenizer, a token is
approximated as 4 characters, so a 16-token hashing unit is 64 bytes; token-id prompts are hashed as
4 bytes per id, which is the same granularity exactly.

Hints override inference: `x-prefix-key` namespaces the block hashes and becomes the rendezvous key
(so a tenant's or document's requests land together even when their texts differ early),
`x-session-id` becomes the rendezvous key when there is no prefix key (a conversation sticks to one
backend). Header mappings must be case-insensitive (aiohttp's are) or use lower-case names.
"""

from __future__ import annotations

import hashlib
import math
import sys
from array import array
from collections.abc import Mapping
from typing import Any, Final

from backends.base import Endpoint, TranslationError
from backends.chat_templates import render

from .. import json_codec
from .base import CHARS_PER_TOKEN, UNIT_CHARS, RequestFeatures, SlaTarget
from .hashing import chain_hashes, stable_hash
from .tokens import TokenPrompt

SLA_TTFT: Final = "x-sla-ttft-ms"
SLA_TPOT: Final = "x-sla-tpot-ms"
SLA_STRICT: Final = "x-sla-strict"
SESSION: Final = "x-session-id"
PREFIX_KEY: Final = "x-prefix-key"
_TRUE: Final = frozenset({"1", "true", "yes", "on"})
_FALSE: Final = frozenset({"0", "false", "no", "off", ""})


class BadRoutingHeader(ValueError):
    """A routing header the gateway cannot read; the proxy should answer 400 naming `header`."""

    def __init__(self, header: str, detail: str) -> None:
        super().__init__(f"header {header!r}: {detail}")
        self.header = header


def _prompt_bytes(body: Mapping[str, Any], endpoint: Endpoint, template: str) -> tuple[bytes, int]:
    """The bytes to hash and the estimated prompt tokens."""
    if endpoint is Endpoint.CHAT:
        messages = body.get("messages")
        try:
            text = render(messages, template)
        except (TranslationError, ValueError):
            raw = json_codec.dumps(messages)  # images and the like: still a stable byte stream
            return raw, math.ceil(len(raw) / CHARS_PER_TOKEN)
        return text.encode("utf-8"), math.ceil(len(text) / CHARS_PER_TOKEN)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch is routed as one request: its first prompt is representative
    if isinstance(prompt, str):
        return prompt.encode("utf-8"), math.ceil(len(prompt) / CHARS_PER_TOKEN)
    if isinstance(prompt, list) and all(isinstance(t, int) and 0 <= t < 2**32 for t in prompt):
        ids = array("I", prompt)
        if sys.byteorder == "big":
            ids.byteswap()
        return ids.tobytes(), len(ids)
    return b"", 0


def _ms(headers: Mapping[str, str], name: str) -> float | None:
    raw = headers.get(name)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise BadRoutingHeader(name, f"expected milliseconds, got {raw!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise BadRoutingHeader(name, f"must be a positive number of milliseconds, got {raw!r}")
    return value / 1000.0


def _sla(headers: Mapping[str, str]) -> SlaTarget | None:
    ttft, tpot = _ms(headers, SLA_TTFT), _ms(headers, SLA_TPOT)
    strict_raw = (headers.get(SLA_STRICT) or "").strip().lower()
    if strict_raw not in _TRUE and strict_raw not in _FALSE:
        raise BadRoutingHeader(SLA_STRICT, f"expected true or false, got {strict_raw!r}")
    if ttft is None and tpot is None:
        return None
    return SlaTarget(ttft_s=ttft, tpot_s=tpot, strict=strict_raw in _TRUE)


def api_key_digest(headers: Mapping[str, str]) -> str | None:
    """A digest of the bearer token (A/B stickiness by API key, where a split asks for it)."""
    auth = headers.get("authorization")
    if not auth:
        return None
    token = auth.removeprefix("Bearer ").strip()
    # Never keep the secret itself, even in memory that could reach a log line.
    return hashlib.blake2b(token.encode("utf-8"), digest_size=12).hexdigest() if token else None


def describe(
    body: Mapping[str, Any],
    endpoint: Endpoint,
    headers: Mapping[str, str],
    *,
    template: str = "chatml",
    key_units: int = 1,
    tokens: TokenPrompt | None = None,
    hash_prompt: bool = True,
) -> RequestFeatures:
    """The routing features of one request. Pure; raises BadRoutingHeader for unreadable hints.

    `key_units` is how many 16-token units of the prompt form the inferred rendezvous key (the
    FIRST block by default); raise it when many tenants share a long boilerplate opening. Without
    `hash_prompt` (no route's policy reads the prefix index) the block hashes are left out: the
    chain is empty, and the prompt is only measured. `tokens` are the engine's prompt tokens when
    the route has a tokenizer: they then count the prompt and let routing use the engines' exact
    caches (the byte chain stays the fallback).
    """
    data, estimate = _prompt_bytes(body, endpoint, template)
    prefix_key = headers.get(PREFIX_KEY) or None
    session = headers.get(SESSION) or None
    seed = stable_hash("p:" + prefix_key) if prefix_key else 0
    chain = chain_hashes(data, UNIT_CHARS, seed) if hash_prompt else ()
    if prefix_key:
        key: int | None = seed
    elif session:
        key = stable_hash("s:" + session)
    elif chain:
        key = chain[min(key_units, len(chain)) - 1]
    else:
        key = None
    user = body.get("user")
    if session:
        sticky: str | None = "s:" + session
    elif isinstance(user, str) and user:
        sticky = "u:" + user
    else:
        sticky = None
    return RequestFeatures(
        chain=chain,
        prompt_bytes=len(data),
        prompt_tokens=estimate if tokens is None else tokens.count,
        affinity_key=key,
        prefix_key=prefix_key,
        session_key=session,
        sticky_key=sticky,
        sla=_sla(headers),
        tokens=tokens,
    )
