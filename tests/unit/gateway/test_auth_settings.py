from __future__ import annotations

from typing import Any

import pytest

from gateway.access.auth import find_key
from gateway.access.secrets import hash_key
from gateway.settings import ApiKey, ConfigError, parse_settings

BASE: dict[str, Any] = {
    "backends": [{"name": "v", "runtime": "vllm", "url": "http://127.0.0.1:1", "model": "m"}],
    "routes": [{"model": "m", "backends": ["v"]}],
}
VLLM = BASE["backends"][0]


@pytest.mark.parametrize(("patch", "needle"), [
    ({"auth": {"api_keys": [{"id": "a", "key": "sk-plain"}]}}, "auth.api_keys.0.key"),
    ({"auth": {"api_keys": [{"id": "a", "key": hash_key("x"), "models": ["zz"]}]}}, "auth.api_keys.0.models"),
    ({"auth": {"api_keys": [{"id": "a", "key": hash_key("x")}, {"id": "a", "key": hash_key("y")}]}}, "duplicate"),
    ({"auth": {"admin_token_sha256": "letmein"}}, "auth.admin_token_sha256"),
    ({"backends": [{**VLLM, "api_key_env": "A", "api_key_file": "/x"}]}, "backends.0"),
    ({"backends": [{**VLLM, "url": "http://u:p@h:1", "api_key_env": "A"}]}, "backends.0"),
    ({"limits": {"header_timeout_s": 0}}, "limits.header_timeout_s"),
    ({"listen": {"metrics_port": 70000}}, "listen.metrics_port"),
])
def test_bad_security_config_fails_loudly(patch: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_settings(BASE | patch)
    assert any(needle in line for line in info.value.errors), info.value.errors
    assert "sk-plain" not in str(info.value)


def test_digests_are_normalised_and_keys_found_in_constant_time() -> None:
    keys = (ApiKey(id="a", key=hash_key("alpha").upper().replace("SHA256:", "sha256:")),
            ApiKey(id="b", key=hash_key("beta")))
    assert keys[0].key == hash_key("alpha")
    found = find_key(keys, "beta")
    assert found is not None
    assert found.id == "b"
    assert find_key(keys, "gamma") is None
    assert find_key(keys, "") is None


def test_a_discovery_entry_key_is_resolved_once_for_all_its_backends(monkeypatch: pytest.MonkeyPatch) -> None:
    from backends.base import ClientRequest, Endpoint
    from gateway.access.secrets import resolve_secrets
    from gateway.app import backend_state
    from gateway.settings import Backend

    config = parse_settings({
        "discovery": [{"name": "pool", "runtime": "vllm", "model": "m", "api_key_env": "POOL_KEY",
                       "dns": {"host": "pool.test", "port": 8000}}],
        "routes": [{"model": "m", "backends": ["pool"]}],
    })
    monkeypatch.delenv("POOL_KEY", raising=False)
    with pytest.raises(ConfigError) as missing:
        resolve_secrets(config)
    assert missing.value.errors == ["discovery.0.api_key_env: environment variable POOL_KEY is not set"]
    monkeypatch.setenv("POOL_KEY", "upstream-secret")
    secrets = resolve_secrets(config)
    found = Backend(name="pool-127.0.0.2:8000", runtime="vllm", url="http://127.0.0.2:8000", model="m")
    state = backend_state(found, secrets, source="pool")
    assert (state.source, state.probe_ok) == ("pool", False)  # not ready until its first probe
    request = ClientRequest(Endpoint.CHAT, {"model": "m", "messages": []}, stream=False, include_usage=False)
    sent = state.adapter.build_request(request, model="m", request_id="r")
    assert sent.headers["Authorization"] == "Bearer upstream-secret"
    assert "upstream-secret" not in repr(state.adapter)
