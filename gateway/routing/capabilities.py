"""What a request needs from a backend, derived once per request, and whether a backend has it. Pure.

`needs` reads the body the proxy parsed: the endpoint itself, `tools`/`tool_choice` (and the legacy
`functions`), JSON modes (`response_format`, Responses `text.format`), logprobs, more than one
choice, image or audio content parts, and, for Responses, whether a chat backend could serve it
through the gateway's translation (`backends.responses_chat`) or it needs a runtime that serves
`/v1/responses` itself (stored responses, built-in tools, input items chat cannot express).

Routing, A/B arms and retries then consider only the backends `missing` finds nothing lacking in.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from backends.base import Endpoint
from backends.capabilities import ENDPOINT_FEATURE, Feature
from backends.responses_chat import untranslatable

_IMAGE_PARTS: Final = frozenset({"image_url", "input_image", "image_embeds", "video_url"})
_AUDIO_PARTS: Final = frozenset({"input_audio", "audio_url"})
_TEXT_FORMATS: Final = frozenset({None, "text"})


_NOTHING: frozenset[Feature] = frozenset()


@dataclass(slots=True, unsafe_hash=True)
class Needs:
    """What serving a request takes. `serves`: endpoint features any one of which will do, preferred
    first (a Responses request chat can express: `(responses, chat)`); `features`: everything else.
    Built per request: a value class with its `__init__` written out (`backends/values.py`)."""

    endpoint: Final[Endpoint]
    serves: Final[tuple[Feature, ...]]
    features: Final[frozenset[Feature]]
    untranslatable: Final[str | None]  # Responses: the field chat cannot express (needs native Responses)

    def __init__(self, endpoint: Endpoint, serves: tuple[Feature, ...], features: frozenset[Feature] = _NOTHING,
                 untranslatable: str | None = None) -> None:
        self.endpoint = endpoint
        self.serves = serves
        self.features = features
        self.untranslatable = untranslatable


_PLAIN_CHAT: Final = Needs(Endpoint.CHAT, (Feature.CHAT,))

# the request parameter that asks for each feature, for the error's `param`
PARAMS: Mapping[Feature, str] = {
    Feature.TOOLS: "tools",
    Feature.RESPONSE_FORMAT: "response_format",
    Feature.LOGPROBS: "logprobs",
    Feature.N: "n",
    Feature.IMAGES: "messages",
    Feature.AUDIO: "messages",
    Feature.STORED_RESPONSES: "previous_response_id",
}
_RESPONSES_PARAMS: Mapping[Feature, str] = {
    **PARAMS, Feature.RESPONSE_FORMAT: "text.format", Feature.LOGPROBS: "top_logprobs", Feature.IMAGES: "input",
    Feature.AUDIO: "input",
}


def param_for(feature: Feature, endpoint: Endpoint) -> str:
    """The request field that asks for `feature` (`model` when it is the endpoint itself)."""
    table = _RESPONSES_PARAMS if endpoint is Endpoint.RESPONSES else PARAMS
    return table.get(feature, "model")


def _parts(messages: object) -> tuple[bool, bool]:
    """Whether any of these messages' contents holds image (or video) parts, and audio parts. A
    plain loop: this runs on every chat request, and most contents are strings."""
    images = audio = False
    if not isinstance(messages, list):
        return images, audio
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind in _IMAGE_PARTS:
                    images = True
                elif kind in _AUDIO_PARTS:
                    audio = True
    return images, audio


def _positive(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _more_than_one(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 1


def _chat(body: Mapping[str, Any]) -> frozenset[Feature]:
    get = body.get
    out: list[Feature] = []
    choice = get("tool_choice")
    if get("tools") or get("functions") or choice == "required" or isinstance(choice, dict):
        out.append(Feature.TOOLS)
    fmt = get("response_format")
    if fmt is not None and isinstance(fmt, dict) and fmt.get("type") not in _TEXT_FORMATS:
        out.append(Feature.RESPONSE_FORMAT)
    top = get("top_logprobs")
    if get("logprobs") is True or (top is not None and _positive(top)):
        out.append(Feature.LOGPROBS)
    n = get("n")
    if n is not None and _more_than_one(n):
        out.append(Feature.N)
    images, audio = _parts(get("messages"))
    if images:
        out.append(Feature.IMAGES)
    if audio:
        out.append(Feature.AUDIO)
    return frozenset(out) if out else _NOTHING


def _completions(body: Mapping[str, Any]) -> set[Feature]:
    out: set[Feature] = set()
    logprobs = body.get("logprobs")
    if logprobs is not None and logprobs is not False:
        out.add(Feature.LOGPROBS)
    if _more_than_one(body.get("n")) or _more_than_one(body.get("best_of")):
        out.add(Feature.N)
    return out


def _responses(body: Mapping[str, Any]) -> set[Feature]:
    out: set[Feature] = set()
    if body.get("tools") or isinstance(body.get("tool_choice"), dict) or body.get("tool_choice") == "required":
        out.add(Feature.TOOLS)
    text = body.get("text")
    fmt = text.get("format") if isinstance(text, dict) else None
    if isinstance(fmt, dict) and fmt.get("type") not in _TEXT_FORMATS:
        out.add(Feature.RESPONSE_FORMAT)
    include = body.get("include")
    if _positive(body.get("top_logprobs")) or (isinstance(include, list) and "message.output_text.logprobs" in include):
        out.add(Feature.LOGPROBS)
    if body.get("previous_response_id") is not None or body.get("conversation") is not None:
        out.add(Feature.STORED_RESPONSES)
    images, audio = _parts(body.get("input"))
    if images:
        out.add(Feature.IMAGES)
    if audio:
        out.add(Feature.AUDIO)
    return out


def needs(body: Mapping[str, Any], endpoint: Endpoint) -> Needs:
    """What `body` (already parsed and shape-checked for `endpoint`) needs from a backend."""
    if endpoint is Endpoint.CHAT:
        features = _chat(body)
        return _PLAIN_CHAT if not features else Needs(endpoint, (Feature.CHAT,), features)
    if endpoint is Endpoint.COMPLETIONS:
        return Needs(endpoint, (Feature.COMPLETIONS,), frozenset(_completions(body)))
    if endpoint is Endpoint.RESPONSES:
        reason = untranslatable(body)
        serves = (Feature.RESPONSES,) if reason else (Feature.RESPONSES, Feature.CHAT)
        return Needs(endpoint, serves, frozenset(_responses(body)), reason)
    return Needs(endpoint, (ENDPOINT_FEATURE[endpoint],))


_ORDER: Final = tuple(Feature)


def lacking(capabilities: frozenset[Feature], need: Needs) -> tuple[Feature, ...]:
    """What a backend with `capabilities` lacks to serve `need` (empty: it can), in a fixed order:
    the endpoint first."""
    out: list[Feature] = []
    if not any(s in capabilities for s in need.serves):
        out.append(need.serves[0])
    out.extend(f for f in _ORDER if f in need.features and f not in capabilities)
    return tuple(out)


def bridged(capabilities: frozenset[Feature], need: Needs) -> bool:
    """Whether a capable backend serves `need` through the gateway's translation (a Responses
    request to a backend without `/v1/responses`)."""
    return need.serves[0] not in capabilities


def blocking(gaps: Sequence[tuple[Feature, ...]]) -> Feature:
    """The feature to name when no backend can serve a request: one every backend lacks if there is
    one, else the first one the first backend lacks."""
    common = set(gaps[0]).intersection(*gaps[1:])
    return next((f for f in gaps[0] if f in common), gaps[0][0])
