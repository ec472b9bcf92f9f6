"""Reference tokenizations of chat requests by transformers, as vLLM 0.32 applies the chat template.

Runs in the vLLM venv (transformers 5.x), on the tiny model's tokenizer; writes the JSON that
tests/unit/tokenize compares the gateway's own tokenization (tokenizers + jinja2) with:

    ~/.cache/igw/vllm-venv/bin/python scripts/real_vllm/make_tokenize_reference.py \
        ~/.cache/igw/tiny-moe tests/data/tokenize_reference.json

Each case is a chat completions body as a client sends it; `ids` are
`tokenizer.apply_chat_template(conversation, tokenize=True, add_generation_prompt=...)` where the
conversation is what vLLM's `parse_chat_messages` makes of the messages (text parts joined with
"\\n", the template reads `content` as a string), or `tokenizer(prompt)` for completions.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

LONG = "You are a careful assistant for an online bookshop. " * 30
CASES: list[dict[str, Any]] = [
    {"messages": [{"role": "user", "content": "Hello world"}]},
    {"messages": [{"role": "system", "content": LONG}, {"role": "user", "content": "Which novel about the sea?"}]},
    {"messages": [{"role": "system", "content": LONG}, {"role": "user", "content": "Which novel about the sea?"},
                  {"role": "assistant", "content": "Moby-Dick, by Herman Melville."},
                  {"role": "user", "content": "And after that?\n\nSomething shorter,  please."}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "part one"},
                                               {"type": "text", "text": "part two"}]}]},
    {"messages": [{"role": "user", "content": "Ünïcödé — 東京 🚀 tabs\tand\r\nnewlines"}]},
    {"messages": [{"role": "user", "content": "no generation prompt"}], "add_generation_prompt": False},
    {"messages": [{"role": "user", "content": "   leading and trailing spaces   "},
                  {"role": "assistant", "content": ""}, {"role": "user", "content": "<|im_end|> inside text"}]},
    {"prompt": "Once upon a time there was a ship"},
    {"prompt": "Hello world"},
]


def conversation(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            content = "\n".join(p["text"] for p in content)
        out.append({"role": m["role"], "content": content or ""})
    return out


def main() -> None:
    model_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    rows = []
    for case in CASES:
        if "messages" in case:
            ids = tok.apply_chat_template(conversation(case["messages"]), tokenize=True, return_dict=False,
                                          add_generation_prompt=case.get("add_generation_prompt", True))
        else:
            ids = tok(case["prompt"])["input_ids"]
        rows.append({"body": case, "ids": list(ids)})
    import transformers

    lines = [json.dumps(row, ensure_ascii=False) for row in rows]  # one case per line
    head = json.dumps({"transformers": transformers.__version__})[:-1]
    out.write_text(head + ', "cases": [\n' + ",\n".join(lines) + "\n]}\n", encoding="utf-8")


if __name__ == "__main__":
    main()
