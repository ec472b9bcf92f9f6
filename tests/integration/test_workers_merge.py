"""`gateway serve --workers 2` reads as one gateway on /metrics and in the comparison, whatever the
workers do: gauges of one shared thing (an engine's KV cache, a discovery source) read what one
gateway has, not a sum per worker; counters never go backwards across a reload that makes their
state anew, nor count an event twice when a worker starts again; and a worker that is killed keeps
its share of the comparison (issue 22, items 9 and 10).

Every request here opens its own connection, so that either worker may answer it."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from backends.emulator import RunningEmulator
from tests.discovery.harness import Dnsmasq

from .harness import Emulators, GatewayProcess, backend_entry, kill_and_wait_gone, wait_for
from .test_kv_events import ask_fresh, conversations, kv_state, publishing, subscribed
from .test_workers import chat, fresh, scrape, total

Gateway = Callable[..., GatewayProcess]
Page = dict[tuple[str, tuple[tuple[str, str], ...]], float]
AS_JSON = {"Content-Type": "application/json"}  # what an admin write sends (a body-less POST too)


@pytest.fixture
def dnsmasq(tmp_path: Path) -> Iterator[Dnsmasq]:
    directory = tmp_path / "dns"
    directory.mkdir()
    server = Dnsmasq(directory)
    yield server
    server.stop()


def port_of(emu: RunningEmulator) -> int:
    return int(emu.url.rsplit(":", 1)[1])


def counters(page: Page) -> Page:
    return {k: v for k, v in page.items() if k[0].endswith(("_total", "_count", "_bucket"))
            and not k[0].startswith("process_")}


def never_backwards(before: Page, after: Page) -> list[tuple[str, Any, float, float]]:
    return [(name, labels, v, after.get((name, labels), 0.0)) for (name, labels), v in counters(before).items()
            if after.get((name, labels), 0.0) < v]


def worker_pids(gw: GatewayProcess) -> list[int]:
    return sorted(int(row["pid"]) for row in fresh("GET", gw.url + "/admin/workers").json()["workers"])


KV_BACKEND = (("backend", "kv"),)
POOL = (("source", "pool"),)
LIVE = ("gateway_kv_events_live", KV_BACKEND)
BLOCKS = ("gateway_kv_index_blocks", KV_BACKEND)
BATCHES = ("gateway_kv_events_batches_total", KV_BACKEND)
ENDPOINTS = ("gateway_discovery_endpoints", POOL)
ADDED = ("gateway_discovery_changes_total", (("change", "added"), *POOL))


def kv_and_dns(dnsmasq: Dnsmasq, emulators: Emulators, gateway: Gateway) -> GatewayProcess:
    """Two workers, an engine publishing KV events (the supervisor binds and relays them to both) and
    a DNS discovery source with two records (every worker follows it itself)."""
    pool = [emulators.start("vllm", host="127.0.0.2", speed=5.0)]
    pool.append(emulators.start("vllm", host="127.0.0.3", port=port_of(pool[0]), speed=5.0))
    dnsmasq.write_hosts({"pool.test": ["127.0.0.2", "127.0.0.3"]})
    dnsmasq.start()
    engine, kv = publishing(emulators, "vllm")
    entry = {"name": "pool", "runtime": "vllm", "model": "tiny-moe",
             "dns": {"host": "pool.test", "port": port_of(pool[0]), "resolver": dnsmasq.resolver,
                     "interval_s": 0.2, "timeout_s": 1.0}}
    gw = gateway([backend_entry("kv", engine, "vllm", **kv)], routes=[
        {"model": "moe", "backends": ["kv"], "policy": "prefix_affinity", "tokenizer": "emulator"},
        {"model": "pooled", "backends": ["pool"]},
    ], discovery=[entry], workers=2)
    subscribed(engine)
    return gw


REQUESTS = conversations(seed=5, n=40)


def test_gauges_of_one_shared_thing_read_what_one_gateway_has(
    dnsmasq: Dnsmasq, emulators: Emulators, gateway: Gateway,
) -> None:
    gw = kv_and_dns(dnsmasq, emulators, gateway)
    url = gw.url + "/metrics"
    # live on every worker (`min`): a worker that joined late is verified by answers on it
    deadline, i = time.monotonic() + 60, 0
    while (now := scrape(url).get(LIVE)) != 1 or i < 8:
        ask_fresh(gw, REQUESTS[i % len(REQUESTS)], "moe")
        i += 1
        assert time.monotonic() < deadline, f"gateway_kv_events_live reads {now}, not 1; {kv_state(gw, 'kv')}"

    def one_gateway(page: Page) -> bool:
        state = kv_state(gw, "kv")  # one worker's index (both heard every batch: the same)
        return (page.get(LIVE) == 1 and page.get(BLOCKS) == sum(r["blocks"] for r in state["ranks"].values()) > 0
                and page.get(BATCHES) == state["batches"] > 0 and page.get(ENDPOINTS) == 2 and page.get(ADDED) == 2)

    page = wait_for(lambda: scrape(url), one_gateway, timeout=30, what="one gateway's KV index and endpoints")
    assert total(page, "gateway_workers") == 2


def test_counters_never_go_backwards_across_a_reload_nor_count_twice_across_a_restart(
    dnsmasq: Dnsmasq, emulators: Emulators, gateway: Gateway,
) -> None:
    gw = kv_and_dns(dnsmasq, emulators, gateway)
    url = gw.url + "/metrics"
    for messages in REQUESTS[:12]:
        ask_fresh(gw, messages, "moe")
    settled = wait_for(lambda: scrape(url), lambda p: p.get(BATCHES, 0) > 0 and p.get(ENDPOINTS, 0) >= 2,
                       timeout=30, what="KV batches and both endpoints")

    # a reload that makes the backend's KV cache anew (how its events are heard changed): its
    # counters continue from what the old caches had counted
    config = yaml.safe_load(gw.config_path.read_text())
    config["backends"][0]["kv_events"]["silent_after_s"] = 7.5
    gw.config_path.write_text(yaml.safe_dump(config))
    assert fresh("POST", gw.url + "/admin/reload", headers=AS_JSON).status_code == 200
    reloaded = scrape(url)
    assert never_backwards(settled, reloaded) == []

    # a killed worker is replaced: the replacement discovers both endpoints itself, which the
    # gateway had already counted; nothing goes backwards
    victim = worker_pids(gw)[0]
    kill_and_wait_gone(victim)
    wait_for(lambda: worker_pids(gw), lambda pids: len(pids) == 2 and victim not in pids, timeout=60,
             what="a replacement worker")
    for messages in REQUESTS[12:18]:
        ask_fresh(gw, messages, "moe")
    after = wait_for(lambda: scrape(url), lambda p: p.get(ENDPOINTS) == reloaded[ENDPOINTS], timeout=30,
                     what="the replacement's discovery")
    assert never_backwards(reloaded, after) == []
    assert after[ADDED] == reloaded[ADDED]  # the replacement's joins were the gateway's already
    assert after.get(LIVE, 0) <= 1


def test_a_killed_workers_share_of_the_comparison_stays(emulators: Emulators, gateway: Gateway) -> None:
    emu = emulators.start("vllm")
    gw = gateway([backend_entry("v", emu, "vllm", usd_per_hour=10.0)], workers=2)
    for _ in range(40):
        assert chat(gw).status_code == 200
    served = {int(row["pid"]): row["requests"] for row in fresh("GET", gw.url + "/admin/workers").json()["workers"]}
    assert sum(served.values()) == 40
    assert all(n > 0 for n in served.values()), served  # both served a share

    def compare(window: int) -> dict[str, Any]:
        doc: dict[str, Any] = fresh("GET", gw.url + f"/admin/compare?window={window}").json()
        return doc

    before = wait_for(lambda: compare(300), lambda d: d["total"]["requests"] == 40, what="40 in the comparison")
    tokens = next(b for b in before["backends"] if b["name"] == "v")["output_tokens"]
    assert total(scrape(gw.url + "/metrics"), "gateway_requests_total") == 40
    victim = max(served, key=lambda pid: served[pid])  # the one that served more
    kill_and_wait_gone(victim)
    wait_for(lambda: worker_pids(gw), lambda pids: len(pids) == 2 and victim not in pids, timeout=60,
             what="a replacement worker")
    for window in (300, 3600):
        doc = compare(window)
        assert doc["total"]["requests"] == 40, (window, doc["total"]["requests"], served)
        assert next(b for b in doc["backends"] if b["name"] == "v")["output_tokens"] == tokens
        assert (doc["workers"], doc["retired_workers"]) == (2, 1)
    assert total(scrape(gw.url + "/metrics"), "gateway_requests_total") == 40
