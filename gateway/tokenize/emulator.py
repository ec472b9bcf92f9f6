"""`tokenizer: emulator`: the emulators' own tokenizer (`backends/emulator/tokenizer.py`).

The emulated runtimes do not run a model tokenizer: they render chat messages with a fixed
ChatML-like template and split text into word-ish pieces of at most four characters, each id a
stable hash. Routing predictions against emulators are exact only when the gateway tokenizes the
same way, so this is exposed as a tokenizer spec rather than asking each emulator (`/tokenize`
would cost a round trip per request and does not exist on trtllm-serve). Pieces never span a
special token, so segments between specials are tokenized once and cached, as for real tokenizers.
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
_SPECIALS = re.compile(r"(<\|im_start\|>|<\|im_end\|>)")
_SPECIAL_IDS = {"<|im_start|>": pack([emu.IM_START]), "<|im_end|>": pack([emu.IM_END])}


class EmulatorPromptTokenizer:
    name = NAME

    def __init__(self) -> None:
        self.segments = Lru(SEGMENT_CACHE_BYTES)

    def encode(self, text: str) -> bytes:
        out: list[bytes] = []
        segments = self.segments
        for piece in _SPECIALS.split(text):
            if not piece:
                continue
            special = _SPECIAL_IDS.get(piece)
            if special is not None:
                out.append(special)
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
