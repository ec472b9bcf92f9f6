"""`tokenizer: emulator`: the emulators' own tokenizer (`backends/emulator/tokenizer.py`).

The emulated runtimes do not run a model tokenizer: they render chat messages with a fixed
ChatML-like template and split text into word-ish pieces of at most four characters, each id a
stable hash. Routing predictions against emulators are exact only when the gateway tokenizes the
same way, so this is exposed as a tokenizer spec rather than asking each emulator (`/tokenize`
would cost a round trip per request and does not exist on trtllm-serve).

The emulator's piece pattern runs over the whole prompt, and a piece can swallow the `<` of a
special token after a space (" <"), so prompts are not split at every special token. They are split
where a message starts (`\n<|im_start|>`): a newline is always a piece of its own, so the whole
prompt's pieces break there too. Each message is tokenized once and cached.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from backends.base import Endpoint
from backends.emulator import tokenizer as emu

from ..routing.tokens import TokenPrompt, pack
from .prompt import SEGMENT_CACHE_BYTES, Lru, first_prompt, token_list

NAME = "emulator"
_MESSAGE_STARTS = re.compile(r"(?<=\n)(?=<\|im_start\|>)")


class EmulatorPromptTokenizer:
    name = NAME

    def __init__(self) -> None:
        self.segments = Lru(SEGMENT_CACHE_BYTES)

    def encode(self, text: str) -> bytes:
        out: list[bytes] = []
        segments = self.segments
        for piece in _MESSAGE_STARTS.split(text):
            if not piece:
                continue
            got = segments.get(piece)
            if got is None:
                # piece ids without `emu.encode`, which also fills the emulator's detokenize map
                got = pack([emu.piece_id(p) for p in emu.split(piece)])
                segments.put(piece, got)
            out.append(got)
        return b"".join(out)

    def prompt(self, body: Mapping[str, Any], endpoint: Endpoint) -> TokenPrompt | None:
        if endpoint is Endpoint.CHAT:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
                return None
            return TokenPrompt(packed=self.encode(emu.render_chat(messages)))
        prompt = first_prompt(body.get("prompt"))
        if isinstance(prompt, str):
            return TokenPrompt(packed=self.encode(prompt))
        ids = token_list(prompt)
        return TokenPrompt(ids) if ids is not None else None
