"""`GET /admin/compare?scope=fleet` (and `gateway compare --scope fleet`, and the dashboard's toggle)
merges every live replica's windows; each replica's own view stays the default."""

from __future__ import annotations

import functools
import subprocess
import sys
from typing import Any

import httpx

from tests.integration.harness import ROOT, Emulators, GatewayProcess, backend_entry, wait_for

from .conftest import Replicas
from .redis_server import RedisServer


def fleet_config(emulators: Emulators) -> dict[str, Any]:
    v, s = emulators.start("vllm"), emulators.start("sglang")
    return {
        "backends": [backend_entry("v", v, "vllm", usd_per_hour=10.0), backend_entry("s", s, "sglang")],
        "routes": [{"model": "moe", "backends": ["v", "s"], "policy": "round_robin"}],
        "health": {"interval_s": 0.5},
    }


def chat(gw: GatewayProcess) -> None:
    with httpx.Client(timeout=30) as client:
        r = client.post(gw.url + "/v1/chat/completions",
                        json={"model": "moe", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        assert r.status_code == 200


def compare(gw: GatewayProcess, scope: str | None = None, window: int = 60) -> dict[str, Any]:
    query = f"?window={window}" + (f"&scope={scope}" if scope else "")
    with httpx.Client(timeout=30) as client:
        doc: dict[str, Any] = client.get(gw.url + "/admin/compare" + query).json()
        return doc


def test_the_fleet_view_merges_every_replica_and_the_default_stays_local(
    emulators: Emulators, redis: RedisServer, replicas: Replicas,
) -> None:
    cfg = fleet_config(emulators)
    a, b = replicas(cfg, 2, redis=redis, publish_interval_s=0.5)
    (c,) = replicas(cfg, 1, redis=redis, publish_interval_s=0.5, workers=2)
    sent = {a.url: 5, b.url: 7, c.url: 9}
    for gw in (a, b, c):
        for _ in range(sent[gw.url]):
            chat(gw)
    own = wait_for(lambda: compare(c), lambda d: d["total"]["requests"] == 9, what="c's own 9 requests")
    assert own["scope"] == "replica"
    assert own["workers"] == 2
    fleet = wait_for(lambda: compare(a, "fleet"), lambda d: d["total"]["requests"] == 21, timeout=20,
                     what="all 21 requests in the fleet view")
    assert fleet["scope"] == "fleet"
    assert sorted(r["replica"] for r in fleet["replicas"]) == ["replica-0", "replica-1", "replica-2"]
    assert {r["replica"]: r["workers"] for r in fleet["replicas"]}["replica-2"] == 2
    v = next(row for row in fleet["backends"] if row["name"] == "v")
    tps = v["output_tokens_per_s"]
    assert v["cost"]["usd_per_million_output_tokens"] == (10.0 / (3600 * tps) * 1e6 if tps else None)
    assert compare(a)["total"]["requests"] == 5  # each replica's own view is still its own
    assert compare(a, "everything")["error"]["param"] == "scope"
    for window in (300, 3600):  # another replica's view: its data on the others is up to an interval old
        wait_for(functools.partial(compare, b, "fleet", window), lambda d: d["total"]["requests"] == 21,
                 timeout=20, what=f"all 21 requests in b's fleet view over {window} s")
    # the CLI: the same document as tables
    cli = subprocess.run([sys.executable, "-m", "gateway", "compare", "--url", b.url, "--scope", "fleet"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert cli.returncode == 0, cli.stderr
    assert "fleet of 3 replicas" in cli.stdout
    # the dashboard offers the toggle
    with httpx.Client(timeout=10) as client:
        page = client.get(a.url + "/dashboard").text
        script = client.get(a.url + "/dashboard/static/dashboard.js").text
    assert 'id="scope"' in page
    assert '"&scope=" + scope' in script


def test_a_stopped_replica_drops_out_of_the_fleet(
    emulators: Emulators, redis: RedisServer, replicas: Replicas,
) -> None:
    cfg = fleet_config(emulators)
    a, b = replicas(cfg, 2, redis=redis, publish_interval_s=0.5)
    wait_for(lambda: compare(a, "fleet"), lambda d: len(d["replicas"]) == 2, what="both replicas listed")
    b.stop()  # its data expires after three publishing intervals (at least 5 s)
    gone = wait_for(lambda: compare(a, "fleet"), lambda d: len(d["replicas"]) == 1, timeout=20,
                    what="b to drop out")
    assert gone["replicas"][0]["replica"] == "replica-0"

