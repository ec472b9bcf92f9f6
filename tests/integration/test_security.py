"""Client keys (hashed at rest), per-key models and rate limits, the admin token, the metrics port and
upstream credentials, against a real gateway process."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from gateway.access.secrets import hash_key

from .fakes import RecordingBackend, start_recording_backend
from .harness import AS_JSON, ROOT, Emulators, GatewayProcess, LoopThread, backend_entry
from .test_errors import assert_openai_error

StartGateway = Callable[..., GatewayProcess]
CHAT = {"model": "moe", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
KEY_A, KEY_B, ADMIN = "sk-alpha-123", "sk-beta-456", "admin-token-789"


@pytest.fixture
def fleet(emulators: Emulators, gateway: StartGateway) -> GatewayProcess:
    emu = emulators.start("vllm")
    return gateway(
        [backend_entry("v", emu, "vllm")],
        routes=[{"model": "moe", "backends": ["v"]}, {"model": "other", "backends": ["v"]}],
        auth={
            "api_keys": [
                {"id": "alpha", "key": hash_key(KEY_A)},
                {"id": "beta", "key": hash_key(KEY_B), "models": ["other"], "requests_per_minute": 3},
                {"id": "gamma", "key": hash_key("sk-gamma"), "tokens_per_minute": 5},
            ],
            "admin_token_sha256": hash_key(ADMIN),
        },
    )


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_generation_requires_a_valid_key(fleet: GatewayProcess) -> None:
    for headers in ({}, bearer("sk-wrong"), {"Authorization": KEY_A}):
        resp = fleet.post("/v1/chat/completions", json=CHAT, headers=headers)
        assert resp.status_code == 401
        err = assert_openai_error(resp.json())
        assert (err["type"], err["code"]) == ("invalid_request_error", "invalid_api_key")
    assert fleet.get("/v1/models").status_code == 401
    reply = openai.OpenAI(base_url=fleet.base_url, api_key=KEY_A, max_retries=0).chat.completions.create(
        model="moe", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert reply.choices[0].message.content
    assert fleet.get("/health").status_code == 200
    assert fleet.metric("gateway_requests_total", status="401") == 3  # rejected requests are counted too


def test_a_key_sees_only_its_models_and_others_are_not_found(fleet: GatewayProcess) -> None:
    resp = fleet.post("/v1/chat/completions", json=CHAT, headers=bearer(KEY_B))
    assert resp.status_code == 404
    assert assert_openai_error(resp.json())["code"] == "model_not_found"
    assert [m["id"] for m in fleet.get("/v1/models", headers=bearer(KEY_B)).json()["data"]] == ["other"]
    assert {m["id"] for m in fleet.get("/v1/models", headers=bearer(KEY_A)).json()["data"]} == {"moe", "other"}
    ok = fleet.post("/v1/chat/completions", json={**CHAT, "model": "other"}, headers=bearer(KEY_B))
    assert ok.status_code == 200


def test_requests_per_minute_answer_429_with_retry_after(fleet: GatewayProcess) -> None:
    statuses = [
        fleet.post("/v1/chat/completions", json={**CHAT, "model": "other"}, headers=bearer(KEY_B)).status_code
        for _ in range(3)
    ]
    assert statuses == [200, 200, 200]
    resp = fleet.post("/v1/chat/completions", json={**CHAT, "model": "other"}, headers=bearer(KEY_B))
    assert resp.status_code == 429
    assert int(resp.headers["Retry-After"]) >= 1
    err = assert_openai_error(resp.json())
    assert (err["type"], err["code"]) == ("requests", "rate_limit_exceeded")
    assert fleet.post("/v1/chat/completions", json=CHAT, headers=bearer(KEY_A)).status_code == 200  # other keys
    assert fleet.metric("gateway_key_requests_total", key="beta", status="429") == 1


def test_tokens_per_minute_are_charged_from_usage(fleet: GatewayProcess) -> None:
    first = fleet.post("/v1/chat/completions", json={**CHAT, "max_tokens": 8}, headers=bearer("sk-gamma"))
    assert first.status_code == 200
    used = first.json()["usage"]["total_tokens"]
    assert used > 5
    assert fleet.metric("gateway_key_tokens_total", key="gamma") == used
    resp = fleet.post("/v1/chat/completions", json=CHAT, headers=bearer("sk-gamma"))
    assert resp.status_code == 429
    assert assert_openai_error(resp.json())["type"] == "tokens"
    assert int(resp.headers["Retry-After"]) >= 1


def test_admin_and_dashboard_need_the_admin_token(fleet: GatewayProcess) -> None:
    for path in ("/admin/backends", "/admin/compare", "/dashboard"):
        for headers in ({}, bearer(KEY_A)):
            resp = fleet.get(path, headers=headers)
            assert resp.status_code == 401, path
            assert assert_openai_error(resp.json())["code"] == "invalid_admin_token"
        assert fleet.get(path, headers=bearer(ADMIN)).status_code == 200
    assert fleet.post("/admin/reload", headers=bearer(KEY_A)).status_code == 401


def test_a_browser_can_open_the_dashboard_with_basic_auth(fleet: GatewayProcess) -> None:
    challenge = fleet.get("/dashboard")
    assert challenge.status_code == 401
    assert challenge.headers["WWW-Authenticate"].startswith("Basic")  # the browser prompts
    assert fleet.get("/dashboard", auth=("admin", ADMIN)).status_code == 200
    assert fleet.get("/admin/compare", auth=("admin", ADMIN)).status_code == 200  # the page's polls
    assert fleet.get("/dashboard", auth=("admin", "wrong")).status_code == 401


def test_plain_keys_in_config_are_refused(tmp_path: Path) -> None:
    config = {"backends": [{"name": "v", "runtime": "vllm", "url": "http://127.0.0.1:1", "model": "m"}],
              "routes": [{"model": "m", "backends": ["v"]}],
              "auth": {"api_keys": [{"id": "a", "key": "sk-plain"}]}}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config))
    out = subprocess.run([sys.executable, "-m", "gateway", "check-config", str(path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert "auth.api_keys.0.key" in out.stderr
    assert "sk-plain" not in out.stderr
    digest = subprocess.run([sys.executable, "-m", "gateway", "hash-key", "sk-plain"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60).stdout.strip()
    assert digest == hash_key("sk-plain")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_metrics_can_live_on_their_own_port(emulators: Emulators, gateway: StartGateway) -> None:
    port = free_port()
    gw = gateway([backend_entry("v", emulators.start("vllm"), "vllm")], listen={"metrics_port": port})
    assert gw.get("/metrics").status_code == 404
    resp = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10)
    assert resp.status_code == 200
    assert "gateway_backend_up" in resp.text


@pytest.fixture
def recorders(loop_thread: LoopThread) -> Iterator[list[RecordingBackend]]:
    backends = [loop_thread.run(start_recording_backend()) for _ in range(3)]
    yield backends
    for b in backends:
        loop_thread.run(b.runner.cleanup())


def test_upstream_credentials_reach_only_their_backend_and_nowhere_else(
    recorders: list[RecordingBackend], gateway: StartGateway, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    secret, file_secret = "upstream-secret-XYZ", "file-secret-QRS"
    monkeypatch.setenv("IGW_TEST_UPSTREAM_KEY", secret)
    key_file = tmp_path / "b.key"
    key_file.write_text(file_secret + "\n")
    a, b, c = recorders
    c_url = c.url.replace("http://", "http://user:pw-in-url@")
    gw = gateway(
        [{"name": "a", "runtime": "vllm", "url": a.url, "model": "tiny-moe", "api_key_env": "IGW_TEST_UPSTREAM_KEY"},
         {"name": "b", "runtime": "vllm", "url": b.url, "model": "tiny-moe", "api_key_file": str(key_file)},
         {"name": "c", "runtime": "vllm", "url": c_url, "model": "tiny-moe"}],
        auth={"api_keys": [{"id": "c", "key": hash_key("client-key")}]},
    )
    for _ in range(6):
        resp = gw.post("/v1/chat/completions", json=CHAT, headers=bearer("client-key"))
        assert resp.status_code == 200
    assert a.headers
    assert b.headers
    assert {h.get("Authorization") for h in a.headers} == {f"Bearer {secret}"}
    assert {h.get("Authorization") for h in b.headers} == {f"Bearer {file_secret}"}
    assert all("client-key" not in h.get("Authorization", "") for h in c.headers)  # never forwarded
    admin = gw.get("/admin/backends").text
    assert "pw-in-url" not in admin
    assert "user" not in yaml.safe_load(admin)["backends"][2]["url"]
    for text in (admin, gw.get("/metrics").text, gw.log_path.read_text()):
        assert secret not in text
        assert file_secret not in text
        assert "client-key" not in text


def test_a_missing_upstream_secret_is_a_config_error_naming_the_field(tmp_path: Path) -> None:
    config = {"backends": [{"name": "v", "runtime": "vllm", "url": "http://127.0.0.1:1", "model": "m",
                            "api_key_env": "IGW_SURELY_UNSET_VAR"}],
              "routes": [{"model": "m", "backends": ["v"]}]}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config))
    out = subprocess.run([sys.executable, "-m", "gateway", "check-config", str(path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert "backends.0.api_key_env" in out.stderr


def test_settings_repr_holds_no_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    from gateway.access.secrets import resolve_secrets
    from gateway.settings import parse_settings

    monkeypatch.setenv("IGW_TEST_REPR_KEY", "repr-secret")
    settings = parse_settings({
        "backends": [{"name": "v", "runtime": "vllm", "url": "http://127.0.0.1:1", "model": "m",
                      "api_key_env": "IGW_TEST_REPR_KEY"}],
        "routes": [{"model": "m", "backends": ["v"]}],
    })
    secrets = resolve_secrets(settings)
    assert "repr-secret" not in repr(settings) + repr(secrets) + str(secrets)
    assert secrets.backend_keys["v"].get_secret_value() == "repr-secret"


ADMIN_WRITES = [("POST", "/admin/reload"), ("PUT", "/admin/routes/moe/weights"),
                ("POST", "/admin/routes/moe/weights"), ("DELETE", "/admin/backends"), ("PATCH", "/admin/anything")]


def test_without_an_admin_token_admin_writes_are_refused_off_loopback(
    emulators: Emulators, gateway: StartGateway
) -> None:
    """Listening on every interface (the container image's `--host 0.0.0.0`) with no admin token:
    reading stays open, writing does not."""
    gw = gateway([backend_entry("v", emulators.start("vllm"), "vllm")], host="0.0.0.0")
    for method, path in ADMIN_WRITES:
        resp = httpx.request(method, gw.url + path, json={"weights": {"v": 1}}, timeout=10)
        assert resp.status_code == 403, (method, path)
        err = assert_openai_error(resp.json())
        assert (err["type"], err["code"]) == ("permission_error", "admin_token_required")
        assert "auth.admin_token_sha256" in str(err["message"])
        assert "loopback" in str(err["message"])
    assert gw.get("/admin/backends").status_code == 200
    assert gw.get("/admin/compare").status_code == 200
    assert gw.get("/dashboard").status_code == 200
    assert gw.post("/v1/chat/completions", json=CHAT).status_code == 200  # clients are not admins


def test_without_an_admin_token_admin_writes_are_open_on_loopback(
    emulators: Emulators, gateway: StartGateway
) -> None:
    gw = gateway([backend_entry("v", emulators.start("vllm"), "vllm")])  # 127.0.0.1
    resp = gw.post("/admin/reload")
    assert resp.status_code == 200, resp.text
    assert resp.json()["restart_required"] == []


def test_with_an_admin_token_writes_off_loopback_need_it(emulators: Emulators, gateway: StartGateway) -> None:
    gw = gateway([backend_entry("v", emulators.start("vllm"), "vllm")], host="0.0.0.0",
                 auth={"admin_token_sha256": hash_key(ADMIN)})
    assert gw.post("/admin/reload").status_code == 401
    assert gw.post("/admin/reload", headers=bearer(ADMIN)).status_code == 200


def generation(gw: GatewayProcess) -> int:
    return int(gw.get("/admin/backends").json()["generation"])


def test_a_cross_site_page_cannot_write_to_a_loopback_admin(emulators: Emulators, gateway: StartGateway) -> None:
    """What a page in the operator's browser could send without a CORS preflight (`text/plain`, or
    no body at all) and what carries another site's Origin is refused, and nothing changes; curl's
    `-H 'Content-Type: application/json'` (a body-less POST too) and the gateway's own Origin pass."""
    gw = gateway([backend_entry("v", emulators.start("vllm"), "vllm")],
                 routes=[{"model": "moe", "split": {"arms": [{"name": "a", "weight": 1, "backends": ["v"]},
                                                            {"name": "b", "weight": 1, "backends": ["v"]}]}}])
    weights = gw.url + "/admin/routes/moe/weights"
    body = '{"weights": {"a": 0, "b": 1}}'
    for method, url, headers in [
        ("POST", gw.url + "/admin/reload", {"Content-Type": "text/plain"}),
        ("POST", gw.url + "/admin/reload", {}),
        ("PUT", weights, {"Content-Type": "text/plain;charset=UTF-8"}),
        ("POST", weights, {"Content-Type": "application/x-www-form-urlencoded"}),
    ]:
        resp = httpx.request(method, url, content=body if "weights" in url else None, headers=headers, timeout=30)
        assert resp.status_code == 415, (method, url, headers)
        err = assert_openai_error(resp.json())
        assert (err["type"], err["code"], err["param"]) == ("invalid_request_error", "unsupported_media_type",
                                                           "content-type")
    own = gw.url  # http://127.0.0.1:PORT
    for origin in ("http://evil.example", "null", own.replace("127.0.0.1", "localhost"), own + "1"):
        resp = httpx.put(weights, content=body, headers={**AS_JSON, "Origin": origin}, timeout=30)
        assert resp.status_code == 403, origin
        err = assert_openai_error(resp.json())
        assert (err["type"], err["code"]) == ("permission_error", "foreign_origin")
    assert gw.get("/admin/routes/moe/weights").json()["weights"] == {"a": 1.0, "b": 1.0}
    assert generation(gw) == 1
    assert httpx.post(gw.url + "/admin/reload", headers=AS_JSON, timeout=30).status_code == 200  # curl's
    assert generation(gw) == 2
    put = httpx.put(weights, content=body, headers={**AS_JSON, "Origin": own}, timeout=30)
    assert put.status_code == 200, put.text
    assert put.json()["weights"] == {"a": 0.0, "b": 1.0}


def test_without_a_token_admin_answers_only_loopback_names_and_addresses(
    emulators: Emulators, gateway: StartGateway
) -> None:
    """DNS rebinding: a page at evil.example re-pointed at 127.0.0.1 sends `Host: evil.example`."""
    gw = gateway([backend_entry("v", emulators.start("vllm"), "vllm")])
    port = gw.url.rsplit(":", 1)[1]
    for path in ("/admin/backends", "/admin/compare", "/dashboard"):
        for host in ("evil.example", f"evil.example:{port}", f"localhost.evil.example:{port}",
                     f"127.0.0.1.nip.io:{port}"):
            resp = httpx.get(gw.url + path, headers={"Host": host}, timeout=10)
            assert resp.status_code == 403, (path, host)
            err = assert_openai_error(resp.json())
            assert (err["type"], err["code"]) == ("permission_error", "untrusted_host")
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}", f"gw.localhost:{port}"):
            assert httpx.get(gw.url + path, headers={"Host": host}, timeout=10).status_code == 200, (path, host)
    refused = httpx.post(gw.url + "/admin/reload", headers={**AS_JSON, "Host": "evil.example"}, timeout=30)
    assert refused.status_code == 403
    assert generation(gw) == 1
    assert httpx.get(gw.url + "/v1/models", headers={"Host": "evil.example"}, timeout=10).status_code == 200  # clients


def test_with_a_token_any_host_may_reach_admin_but_browser_writes_are_still_refused(
    emulators: Emulators, gateway: StartGateway
) -> None:
    """A name in front of the gateway works once a token guards it; the browser's remembered Basic
    credentials (the dashboard's) do not let another site write."""
    gw = gateway([backend_entry("v", emulators.start("vllm"), "vllm")], auth={"admin_token_sha256": hash_key(ADMIN)})
    foreign = {"Host": "gateway.example.com"}
    assert httpx.get(gw.url + "/admin/backends", headers=foreign, timeout=10).status_code == 401
    assert httpx.get(gw.url + "/admin/backends", headers={**foreign, **bearer(ADMIN)}, timeout=10).status_code == 200
    basic = httpx.BasicAuth("admin", ADMIN)
    text = httpx.post(gw.url + "/admin/reload", auth=basic, headers={"Content-Type": "text/plain"}, timeout=30)
    assert text.status_code == 415
    cross = httpx.post(gw.url + "/admin/reload", auth=basic, headers={**AS_JSON, "Origin": "http://evil.example"},
                       timeout=30)
    assert cross.status_code == 403
    assert generation_with(gw, ADMIN) == 1
    assert httpx.post(gw.url + "/admin/reload", auth=basic, headers=AS_JSON, timeout=30).status_code == 200
    assert generation_with(gw, ADMIN) == 2


def generation_with(gw: GatewayProcess, token: str) -> int:
    return int(gw.get("/admin/backends", headers=bearer(token)).json()["generation"])
