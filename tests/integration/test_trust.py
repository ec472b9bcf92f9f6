"""The comparison's honesty, end to end: every request counted once whatever ends it, no generation
ever run twice, failing backends ejected on completed requests, A/B arms and shadows that do not skew
the figures. Real `gateway serve` processes, emulators on real sockets, the official SDK."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import Callable

import httpx
import openai
import orjson
import pytest
import yaml

from gateway.access.secrets import hash_key

from .harness import Emulators, GatewayProcess, LoopThread, backend_entry, eventually

StartGateway = Callable[..., GatewayProcess]
MESSAGES: list[openai.types.chat.ChatCompletionMessageParam] = [{"role": "user", "content": "hello there"}]
KEY = "sk-trust"


def chat(max_tokens: int = 4, *, stream: bool = False) -> dict[str, object]:
    return {"model": "moe", "messages": MESSAGES, "max_tokens": max_tokens, "stream": stream}


def post_and_reset(
    gw: GatewayProcess, body: dict[str, object], *, headers: dict[str, str], when: Callable[[], bool]
) -> None:
    """Send a request, wait until `when()`, then reset the connection (a client that is gone: a
    clean FIN is a half-close, after which a client may still read its answer)."""
    raw = orjson.dumps(body)
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    host, port = gw.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(raw)}\r\n{head}\r\n".encode() + raw)
        eventually(when)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


# -- one record per request ------------------------------------------------------------------------


def test_a_non_streaming_request_whose_client_leaves_is_counted_and_charged(
    emulators: Emulators, gateway: StartGateway
) -> None:
    """Hanging up on a non-streaming generation is no free way around tokens_per_minute: the request
    is counted once (client_closed) and its key is charged the prompt estimate."""
    slow = emulators.start("vllm", speed=1.0, profile="deepseek-v3-8xh200")
    gw = gateway([backend_entry("slow", slow, "vllm")],
                 auth={"api_keys": [{"id": "team", "key": hash_key(KEY), "tokens_per_minute": 1_000_000}]})
    post_and_reset(gw, chat(2000), headers={"Authorization": f"Bearer {KEY}"},
                   when=lambda: slow.stats.requests_received == 1)
    eventually(lambda: slow.stats.aborted >= 1)  # the engine stopped generating
    eventually(lambda: gw.metric("gateway_requests_total", backend="slow", status="client_closed") == 1)
    assert gw.metric("gateway_key_requests_total", key="team", status="client_closed") == 1
    assert gw.metric("gateway_tokens_total", backend="slow", kind="prompt") > 0  # the estimate
    assert gw.metric("gateway_key_tokens_total", key="team", kind="prompt") > 0
    assert gw.metric("gateway_requests_total") == 1


def test_refusals_by_auth_and_rate_limit_are_counted_once(emulators: Emulators, gateway: StartGateway) -> None:
    emu = emulators.start("vllm")
    gw = gateway([backend_entry("v", emu, "vllm")],
                 auth={"api_keys": [{"id": "team", "key": hash_key(KEY), "requests_per_minute": 2}]})
    assert gw.post("/v1/chat/completions", json=chat()).status_code == 401
    auth = {"Authorization": f"Bearer {KEY}"}
    codes = [gw.post("/v1/chat/completions", json=chat(), headers=auth).status_code for _ in range(3)]
    assert codes == [200, 200, 429]
    assert gw.metric("gateway_requests_total", status="401") == 1
    assert gw.metric("gateway_requests_total", status="429") == 1
    assert gw.metric("gateway_requests_total", status="200") == 2
    assert gw.metric("gateway_key_requests_total", key="team", status="429") == 1
    assert gw.metric("gateway_requests_total") == 4


def test_a_stream_cut_before_its_usage_is_charged_the_prompt_estimate_and_the_tokens_seen(
    emulators: Emulators, gateway: StartGateway
) -> None:
    dying = emulators.start("vllm", die_after_tokens=5)
    gw = gateway([backend_entry("dying", dying, "vllm")])
    with pytest.raises(openai.APIError):
        list(gw.client().chat.completions.create(model="moe", messages=MESSAGES, max_tokens=50, stream=True))
    eventually(lambda: gw.metric("gateway_requests_total", backend="dying", status="stream_error") == 1)
    assert gw.metric("gateway_tokens_total", backend="dying", kind="prompt") > 0
    assert gw.metric("gateway_tokens_total", backend="dying", kind="completion") == 5


# -- never twice ------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_a_backend_dying_mid_generation_runs_each_request_on_one_backend_only(
    emulators: Emulators, gateway: StartGateway, stream: bool
) -> None:
    dying = emulators.start("vllm", die_after_tokens=3)
    ok = emulators.start("vllm")
    gw = gateway([backend_entry("dying", dying, "vllm"), backend_entry("ok", ok, "vllm")],
                 health={"interval_s": 60.0, "failure_threshold": 100, "cooldown_s": 1.0})
    broken = 0
    for _ in range(4):
        resp = gw.post("/v1/chat/completions", json=chat(20, stream=stream))
        if stream:
            assert resp.status_code == 200  # the stream started: its failure is an error event
            broken += '"upstream_stream_error"' in resp.text
        else:
            assert resp.status_code in (200, 502)
            broken += resp.status_code == 502
    assert broken == 2  # round robin: every other request met the dying backend...
    assert dying.stats.requests_received == 2  # ...and each request reached exactly one engine
    assert ok.stats.requests_received == 2
    assert gw.metric("gateway_retries_total") == 0


def test_a_truncated_upstream_response_is_a_502_not_a_500(
    loop_thread: LoopThread, emulators: Emulators, gateway: StartGateway
) -> None:
    async def serve() -> asyncio.Server:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            with contextlib.suppress(Exception):
                line = await reader.readline()
                while (await reader.readline()) not in (b"\r\n", b""):
                    pass
                if line.startswith(b"GET"):
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
                else:  # promise 400 bytes, send 20, hang up
                    writer.write(b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 400\r\n\r\n'
                                 b'{"id":"x","choices":')
                await writer.drain()
            writer.close()

        return await asyncio.start_server(handle, "127.0.0.1", 0)

    server = loop_thread.run(serve())
    try:
        port = server.sockets[0].getsockname()[1]
        gw = gateway([{"name": "cut", "runtime": "vllm", "url": f"http://127.0.0.1:{port}", "model": "tiny-moe"}])
        resp = gw.post("/v1/chat/completions", json=chat())
        assert resp.status_code == 502
        assert resp.json()["error"]["code"] == "bad_gateway"
        assert set(resp.json()["error"]) == {"message", "type", "param", "code"}
        assert gw.metric("gateway_requests_total", backend="cut", status="502") == 1
        assert gw.metric("gateway_requests_total") == 1
    finally:
        loop_thread.run(_close(server))


async def _close(server: asyncio.Server) -> None:
    server.close()
    await server.wait_closed()


# -- outlier detection ------------------------------------------------------------------------------


def test_a_backend_that_kills_every_stream_is_ejected_while_the_others_keep_serving(
    emulators: Emulators, gateway: StartGateway
) -> None:
    """Every stream it serves starts well (a first byte, three tokens) and then dies: judged on
    completed requests, it is ejected; a breaker reset by first bytes would never open."""
    killer = emulators.start("vllm", die_after_tokens=3)
    good = [emulators.start("vllm") for _ in range(2)]
    gw = gateway(
        [backend_entry("killer", killer, "vllm"), *(backend_entry(f"good{i}", e, "vllm") for i, e in enumerate(good))],
        health={"interval_s": 0.2, "failure_threshold": 3, "cooldown_s": 30.0, "window_s": 30.0, "min_requests": 5},
    )
    c = gw.client()
    broken = 0
    served_after = []
    for i in range(15):
        try:
            chunks = list(c.chat.completions.create(model="moe", messages=MESSAGES, max_tokens=10, stream=True))
            assert chunks
        except openai.APIError:
            broken += 1
        if gw.metric("gateway_backend_ejections_total", backend="killer") >= 1:
            served_after.append(i)
    assert gw.metric("gateway_backend_ejections_total", backend="killer") == 1
    assert broken == 3  # its third broken stream ejected it; after that every stream completed
    assert served_after  # and the fleet kept serving
    killer_state = next(b for b in gw.get("/admin/backends").json()["backends"] if b["name"] == "killer")
    assert killer_state["ejected"] is True
    assert gw.metric("gateway_requests_total", status="stream_error") == 3
    assert gw.metric("gateway_requests_total", status="200") == 12


# -- A/B and shadow hygiene -------------------------------------------------------------------------


def test_a_single_key_without_sessions_is_split_between_both_arms(emulators: Emulators, gateway: StartGateway) -> None:
    """The OpenAI SDK always sends a key: with neither x-session-id nor `user`, each request draws
    its arm by weight (stickiness by API key only when `split.sticky: api_key`)."""
    a, b = emulators.start("vllm"), emulators.start("sglang")
    split = {"arms": [{"name": "vllm", "weight": 50, "backends": ["a"]},
                      {"name": "sglang", "weight": 50, "backends": ["b"]}]}
    gw = gateway([backend_entry("a", a, "vllm"), backend_entry("b", b, "sglang")],
                 routes=[{"model": "moe", "split": split}])
    sticky = gateway([backend_entry("a", a, "vllm"), backend_entry("b", b, "sglang")],
                     routes=[{"model": "moe", "split": {**split, "sticky": "api_key"}}])
    c = openai.OpenAI(base_url=gw.base_url, api_key="sk-one-key", max_retries=0)
    arms = [c.chat.completions.with_raw_response.create(model="moe", messages=MESSAGES, max_tokens=1)
            .headers["x-gateway-arm"] for _ in range(40)]
    assert 8 <= arms.count("vllm") <= 32  # both arms serve (p < 1e-4 of failing by chance)
    c2 = openai.OpenAI(base_url=sticky.base_url, api_key="sk-one-key", max_retries=0)
    sticky_arms = {c2.chat.completions.with_raw_response.create(model="moe", messages=MESSAGES, max_tokens=1)
                   .headers["x-gateway-arm"] for _ in range(10)}
    assert len(sticky_arms) == 1
    c.close()
    c2.close()


def test_live_weights_survive_a_reload_that_leaves_the_split_alone(
    emulators: Emulators, gateway: StartGateway
) -> None:
    a, b = emulators.start("vllm"), emulators.start("sglang")
    split = {"arms": [{"name": "vllm", "weight": 50, "backends": ["a"]},
                      {"name": "sglang", "weight": 50, "backends": ["b"]}]}
    config = {"backends": [backend_entry("a", a, "vllm"), backend_entry("b", b, "sglang")],
              "routes": [{"model": "moe", "split": split}]}
    gw = gateway(config["backends"], routes=config["routes"])
    put = httpx.put(gw.url + "/admin/routes/moe/weights", json={"weights": {"vllm": 90, "sglang": 10}})
    assert put.status_code == 200
    path = gw.log_path.parent / "gateway.yaml"
    changed = yaml.safe_load(path.read_text())
    changed["timeouts"] = {"total_s": 321.0}  # a reload that does not touch the split
    path.write_text(yaml.safe_dump(changed))
    assert gw.post("/admin/reload").status_code == 200
    assert gw.get("/admin/routes/moe/weights").json()["weights"] == {"vllm": 90.0, "sglang": 10.0}
    changed["routes"][0]["split"]["arms"][0]["weight"] = 70  # a reload that changes the split
    path.write_text(yaml.safe_dump(changed))
    assert gw.post("/admin/reload").status_code == 200
    assert gw.get("/admin/routes/moe/weights").json()["weights"] == {"vllm": 70.0, "sglang": 50.0}


@pytest.fixture
def hung_shadow(emulators: Emulators, gateway: StartGateway) -> GatewayProcess:
    live, hung = emulators.start("vllm"), emulators.start("sglang", hang=True)
    split = {"arms": [{"name": "vllm", "weight": 100, "backends": ["live"]},
                      {"name": "sglang", "weight": 0, "backends": ["hung"]}],
             "shadow": {"arm": "sglang", "fraction": 1.0}}
    gw = gateway([backend_entry("live", live, "vllm"), backend_entry("hung", hung, "sglang")],
                 routes=[{"model": "moe", "split": split}], timeouts={"first_token_s": 30.0, "total_s": 1.0})
    return gw


def test_a_hung_shadow_backend_releases_its_connection_and_stays_out_of_client_metrics(
    hung_shadow: GatewayProcess,
) -> None:
    gw = hung_shadow
    for _ in range(3):
        assert gw.post("/v1/chat/completions", json=chat()).status_code == 200
    eventually(lambda: gw.metric("gateway_shadow_requests_total", status="error") == 3)
    # its connections were closed (what stays open is the live backend's one keep-alive connection)
    eventually(lambda: gw.metric("gateway_open_connections", side="upstream") <= 1)
    backends = {b["name"]: b for b in gw.get("/admin/backends").json()["backends"]}
    assert backends["hung"]["in_flight"] == 0
    assert backends["hung"]["routing"]["backlog_tokens"] == 0.0  # no queued prefill left behind
    # client-facing: three decisions and three requests, all on the live arm
    assert gw.metric("gateway_routing_decisions_total") == 3
    assert gw.metric("gateway_requests_total") == 3
    assert gw.metric("gateway_requests_total", backend="hung") == 0
