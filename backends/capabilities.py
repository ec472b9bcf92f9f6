"""What each runtime's HTTP API can serve: the endpoints and the request features it accepts.

These are the runtimes' own facts (their sources, see below), so the gateway can route a request only
where it can be served instead of learning it from a 400 that would count against the backend.
Deployment flags change some of them (vLLM needs `--enable-auto-tool-choice --tool-call-parser X`
for `tool_choice: "auto"`, trtllm-serve `--tool_parser` and a `guided_decoding_backend`, vLLM stores
Responses only with `VLLM_ENABLE_RESPONSES_API_STORE=1`), and a model may not take images or audio
at all: `backends[].capabilities` in the config overrides any of them.

Sources: vLLM 0.32 `vllm/entrypoints/**` (chat, completions, Responses, tokenize; tools, JSON
outputs, logprobs, n, image/audio parts; embeddings with `--runner pooling` only), SGLang 0.5.23
`srt/entrypoints/openai/protocol.py` and `http_server.py` (the same, Responses stored by default,
`audio_url` parts; embeddings with `--is-embedding`), TensorRT-LLM `tensorrt_llm/serve/openai_server.py`
and `chat_utils.py` (chat, completions, Responses stored unless `TRTLLM_RESPONSES_API_DISABLE_STORE`,
`image_url`/`video_url`/`audio_url`/`input_audio` parts, no tokenize; its embedding role serves only
`/v1/embeddings`), and Triton's generate extension (`src/http_server.cc`: scalar parameters only, so
no tools, JSON modes, logprobs, `n > 1` or media; chat goes through the gateway's chat template).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

from .base import Endpoint, Runtime


class Feature(enum.StrEnum):
    # endpoints
    CHAT = "chat"
    COMPLETIONS = "completions"
    RESPONSES = "responses"  # `/v1/responses` served natively (else the gateway translates to chat)
    STORED_RESPONSES = "stored_responses"  # keeps responses: `previous_response_id` works there
    EMBEDDINGS = "embeddings"
    TOKENIZE = "tokenize"  # `/tokenize` and `/detokenize`
    # request features
    TOOLS = "tools"  # `tools` / `tool_choice` (functions)
    RESPONSE_FORMAT = "response_format"  # JSON modes: `response_format` / Responses `text.format`
    LOGPROBS = "logprobs"
    N = "n"  # more than one choice per request (`n`, `best_of`)
    IMAGES = "images"  # image (and video) content parts
    AUDIO = "audio"  # audio content parts


ENDPOINT_FEATURE: Mapping[Endpoint, Feature] = {
    Endpoint.CHAT: Feature.CHAT,
    Endpoint.COMPLETIONS: Feature.COMPLETIONS,
    Endpoint.RESPONSES: Feature.RESPONSES,
    Endpoint.EMBEDDINGS: Feature.EMBEDDINGS,
    Endpoint.TOKENIZE: Feature.TOKENIZE,
    Endpoint.DETOKENIZE: Feature.TOKENIZE,
}

_GENERATE = frozenset({
    Feature.CHAT, Feature.COMPLETIONS, Feature.RESPONSES, Feature.TOOLS, Feature.RESPONSE_FORMAT,
    Feature.LOGPROBS, Feature.N, Feature.IMAGES, Feature.AUDIO,
})

# What a backend of each runtime serves when its model generates text (`routes[].kind: generate`).
GENERATE_DEFAULTS: Mapping[Runtime, frozenset[Feature]] = {
    Runtime.VLLM: _GENERATE | {Feature.TOKENIZE},
    Runtime.SGLANG: _GENERATE | {Feature.TOKENIZE, Feature.STORED_RESPONSES},
    Runtime.TRTLLM: _GENERATE | {Feature.STORED_RESPONSES},
    Runtime.TRITON: frozenset({Feature.CHAT, Feature.COMPLETIONS}),
}
# ... and when it serves an embedding model (`routes[].kind: embeddings`).
EMBEDDING_DEFAULTS: Mapping[Runtime, frozenset[Feature]] = {
    Runtime.VLLM: frozenset({Feature.EMBEDDINGS, Feature.TOKENIZE}),
    Runtime.SGLANG: frozenset({Feature.EMBEDDINGS, Feature.TOKENIZE}),
    Runtime.TRTLLM: frozenset({Feature.EMBEDDINGS}),
    Runtime.TRITON: frozenset(),
}
# What the gateway's adapter for the runtime can express at all: a config may turn these on.
POSSIBLE: Mapping[Runtime, frozenset[Feature]] = {
    Runtime.VLLM: frozenset(Feature),
    Runtime.SGLANG: frozenset(Feature),
    Runtime.TRTLLM: frozenset(Feature),
    Runtime.TRITON: frozenset({Feature.CHAT, Feature.COMPLETIONS}),
}


class CapabilityError(ValueError):
    """A capability override the runtime's adapter cannot honour (the config names the field)."""


def resolve(runtime: Runtime, *, embeddings: bool, overrides: Mapping[Feature, bool]) -> frozenset[Feature]:
    """The features a backend serves: its runtime's defaults for the kind of model it serves, with
    the config's overrides applied. Raises CapabilityError for an override the adapter cannot honour."""
    base = (EMBEDDING_DEFAULTS if embeddings else GENERATE_DEFAULTS)[Runtime(runtime)]
    on = {f for f, v in overrides.items() if v}
    impossible = sorted(on - POSSIBLE[Runtime(runtime)])
    if impossible:
        raise CapabilityError(f"the {runtime} adapter cannot serve {', '.join(impossible)}")
    return frozenset((base | on) - {f for f, v in overrides.items() if not v})
