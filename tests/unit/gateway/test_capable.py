"""Which of a route's backends can serve a request (`proxy.capable`), and the 400 when none can."""

from __future__ import annotations

from typing import Any

import pytest

from backends.base import Endpoint
from gateway.proxy.capable import Capabilities, CapabilityError
from gateway.routing.capabilities import needs
from gateway.settings import ConfigError, Settings, parse_settings

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
USER = [{"role": "user", "content": "hi"}]


def settings(**vllm: Any) -> Settings:
    return parse_settings({
        "backends": [
            {"name": "v", "runtime": "vllm", "url": "http://127.0.0.1:1", "model": "m", **vllm},
            {"name": "s", "runtime": "sglang", "url": "http://127.0.0.1:2", "model": "m"},
            {"name": "t", "runtime": "triton", "url": "http://127.0.0.1:3", "model": "m"},
            {"name": "e", "runtime": "vllm", "url": "http://127.0.0.1:4", "model": "emb"},
        ],
        "routes": [
            {"model": "moe", "backends": ["v", "s", "t"]},
            {"model": "tri", "backends": ["t"]},
            {"model": "emb", "kind": "embeddings", "backends": ["e"]},
        ],
    })


def capable(cfg: Settings, model: str, body: dict[str, Any], endpoint: Endpoint) -> tuple[tuple[str, ...], set[str]]:
    caps = Capabilities(cfg, cfg.backend)
    route = next(r for r in cfg.routes if r.model == model)
    found = caps.capable(route, route.candidates, needs({"model": model, **body}, endpoint))
    return found.backends, set(found.bridged)


def refusal(cfg: Settings, model: str, body: dict[str, Any], endpoint: Endpoint) -> CapabilityError:
    with pytest.raises(CapabilityError) as info:
        capable(cfg, model, body, endpoint)
    return info.value


def test_plain_chat_goes_everywhere_and_tools_never_to_triton() -> None:
    cfg = settings()
    assert capable(cfg, "moe", {"messages": USER}, Endpoint.CHAT) == (("v", "s", "t"), set())
    assert capable(cfg, "moe", {"messages": USER, "tools": [TOOL]}, Endpoint.CHAT) == (("v", "s"), set())
    assert capable(cfg, "moe", {"messages": USER, "n": 2, "logprobs": True}, Endpoint.CHAT) == (("v", "s"), set())


def test_responses_go_everywhere_and_through_the_bridge_on_triton() -> None:
    assert capable(settings(), "moe", {"input": "hi"}, Endpoint.RESPONSES) == (("v", "s", "t"), {"t"})
    stored = {"input": "hi", "previous_response_id": "resp_1"}
    assert capable(settings(), "moe", stored, Endpoint.RESPONSES) == (("s",), set())  # only SGLang keeps them
    storing_vllm = settings(capabilities={"stored_responses": True})
    assert capable(storing_vllm, "moe", stored, Endpoint.RESPONSES) == (("v", "s"), set())


def test_no_capable_backend_is_a_400_naming_the_feature_and_who_lacks_it() -> None:
    err = refusal(settings(), "tri", {"messages": USER, "tools": [TOOL]}, Endpoint.CHAT)
    assert (err.status, err.type, err.param) == (400, "invalid_request_error", "tools")
    assert err.code == "unsupported_parameter"
    assert "t (triton) lacks tools" in err.message
    err = refusal(settings(), "tri", {"messages": USER, "response_format": {"type": "json_object"}}, Endpoint.CHAT)
    assert err.param == "response_format"
    err = refusal(settings(), "tri", {"input": "hi", "text": {"format": {"type": "json_object"}}}, Endpoint.RESPONSES)
    assert err.param == "text.format"
    err = refusal(settings(), "tri", {"input": "hi", "previous_response_id": "r"}, Endpoint.RESPONSES)
    assert err.param == "previous_response_id"
    assert "/v1/responses itself" in err.message
    err = refusal(settings(), "moe", {"input": "x"}, Endpoint.EMBEDDINGS)
    assert err.param == "model"
    assert err.message.startswith("The model `moe` does not serve /v1/embeddings")
    err = refusal(settings(), "emb", {"messages": USER}, Endpoint.CHAT)
    assert "e (vllm) lacks chat" in err.message


def test_a_config_override_takes_a_feature_away() -> None:
    cfg = settings(capabilities={"tools": False})
    assert capable(cfg, "moe", {"messages": USER, "tools": [TOOL]}, Endpoint.CHAT) == (("s",), set())


def test_embedding_routes_serve_embeddings_and_tokenize() -> None:
    assert capable(settings(), "emb", {"input": "x"}, Endpoint.EMBEDDINGS) == (("e",), set())
    assert capable(settings(), "emb", {"prompt": "x"}, Endpoint.TOKENIZE) == (("e",), set())
    assert capable(settings(), "moe", {"prompt": "x"}, Endpoint.TOKENIZE) == (("v", "s"), set())


@pytest.mark.parametrize(("patch", "needle"), [
    ({"backends": [{"name": "t", "runtime": "triton", "url": "http://x", "model": "m",
                    "capabilities": {"tools": True}}]}, "capabilities.tools"),
    ({"backends": [{"name": "t", "runtime": "vllm", "url": "http://x", "model": "m",
                    "capabilities": {"tool": True}}]}, "capabilities.tool"),
    ({"routes": [{"model": "a", "backends": ["t"]}, {"model": "b", "kind": "embeddings", "backends": ["t"]}]},
     "routes.1.kind"),
])
def test_bad_capability_config_fails_loudly(patch: dict[str, Any], needle: str) -> None:
    base: dict[str, Any] = {"backends": [{"name": "t", "runtime": "vllm", "url": "http://x", "model": "m"}],
                            "routes": [{"model": "a", "backends": ["t"]}]}
    with pytest.raises(ConfigError, match=needle):
        parse_settings(base | patch)


def test_triton_cannot_be_in_an_embeddings_route() -> None:
    with pytest.raises(ConfigError, match="cannot serve embeddings"):
        parse_settings({"backends": [{"name": "t", "runtime": "triton", "url": "http://x", "model": "m"}],
                        "routes": [{"model": "a", "kind": "embeddings", "backends": ["t"]}]})
