"""A discovered fleet serving steady traffic while it changes, in a real gateway process: backends
found in a real dnsmasq (A records on 127.0.0.2, 127.0.0.3, ... where emulators listen, all on one
port) and in the Kubernetes stub (pods by label selector; no API server can run here). Load comes
from threads through the OpenAI SDK; no client may see an error while backends join (after their
probe) and drain."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from backends.emulator import RunningEmulator
from tests.discovery.harness import Dnsmasq
from tests.discovery.kube_stub import KubeStub, pod
from tests.discovery.test_kubernetes import kubeconfig

from .harness import Emulators, GatewayProcess, LoopThread, eventually, wait_for

StartGateway = Callable[..., GatewayProcess]
POLL = {"interval_s": 0.2, "failure_threshold": 2, "cooldown_s": 0.5}


@dataclass
class Load:
    """Steady traffic from `threads` threads through the official SDK: a stream and a plain request
    in turn, each checked to its end. Counts who served what, and every client-side error."""

    gw: GatewayProcess
    threads: int = 2
    served: Counter[str] = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)
    done: int = 0

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._workers = [threading.Thread(target=self._run, daemon=True) for _ in range(self.threads)]
        for worker in self._workers:
            worker.start()

    def _run(self) -> None:
        client = self.gw.client()
        turn = 0
        while not self._stop.is_set():
            turn += 1
            try:
                backend = self._stream(client) if turn % 2 else self._plain(client)
            except Exception as exc:  # any client-side failure is what the test forbids
                with self._lock:
                    self.errors.append(f"{type(exc).__name__}: {exc}")
                continue
            with self._lock:
                self.served[backend] += 1
                self.done += 1

    @staticmethod
    def _stream(client: Any) -> str:
        raw = client.chat.completions.with_raw_response.create(
            model="moe", messages=[{"role": "user", "content": "stream"}], max_tokens=24, stream=True,
            extra_body={"ignore_eos": True})
        finish = [c.choices[0].finish_reason for c in raw.parse() if c.choices and c.choices[0].finish_reason]
        if finish != ["length"]:
            raise AssertionError(f"stream ended with {finish}")
        return str(raw.headers["x-gateway-backend"])

    @staticmethod
    def _plain(client: Any) -> str:
        raw = client.chat.completions.with_raw_response.create(
            model="moe", messages=[{"role": "user", "content": "plain"}], max_tokens=4)
        if not raw.parse().choices[0].message.content:
            raise AssertionError("empty answer")
        return str(raw.headers["x-gateway-backend"])

    def more(self, count: int = 20, timeout: float = 30.0) -> None:
        """Wait until `count` more requests have completed."""
        target = self.done + count
        eventually(lambda: self.done >= target, timeout)

    def stop(self) -> None:
        self._stop.set()
        for worker in self._workers:
            worker.join(30)


def backends(gw: GatewayProcess) -> dict[str, dict[str, Any]]:
    return {b["name"]: b for b in gw.get("/admin/backends").json()["backends"]}


def healthy(gw: GatewayProcess, *names: str) -> dict[str, dict[str, Any]]:
    return wait_for(lambda: backends(gw), lambda rows: all(rows.get(n, {}).get("healthy") for n in names),
                    what=f"{names} healthy")


def port_of(emu: RunningEmulator) -> int:
    return int(emu.url.rsplit(":", 1)[1])


def fleet(emulators: Emulators, runtime: str, count: int, **faults: Any) -> list[RunningEmulator]:
    """`count` emulators on 127.0.0.2, 127.0.0.3, ..., all on the first one's port (DNS A records and
    pod IPs carry no port: the discovery entry gives one port for the whole pool)."""
    first = emulators.start(runtime, host="127.0.0.2", speed=5.0)
    return [first, *(emulators.start(runtime, host=f"127.0.0.{i + 3}", port=port_of(first), speed=5.0, **faults)
                     for i in range(count - 1))]


@pytest.fixture
def dnsmasq(tmp_path: Path) -> Iterator[Dnsmasq]:
    directory = tmp_path / "dns"
    directory.mkdir()
    server = Dnsmasq(directory)
    yield server
    server.stop()


def test_a_dns_discovered_fleet_changes_under_load_without_a_client_error(
    dnsmasq: Dnsmasq, emulators: Emulators, gateway: StartGateway,
) -> None:
    a, b = fleet(emulators, "vllm", 2)
    port = port_of(a)
    dnsmasq.write_hosts({"pool.test": ["127.0.0.2", "127.0.0.3"]})
    dnsmasq.start()
    entry = {"name": "pool", "runtime": "vllm", "model": "tiny-moe", "usd_per_hour": 12.0,
             "dns": {"host": "pool.test", "port": port, "resolver": dnsmasq.resolver, "interval_s": 0.2,
                     "timeout_s": 1.0, "leave_after_answers": 2, "leave_after_s": 1.0}}
    routes = [{"model": "moe", "backends": ["pool"], "policy": "round_robin"}]
    gw = gateway([], routes=routes, discovery=[entry], health=POLL)  # no static backends at all
    name = {e: f"pool-{e.url.removeprefix('http://')}" for e in (a, b)}
    rows = healthy(gw, name[a], name[b])
    assert {r["source"] for r in rows.values()} == {"pool"}
    assert rows[name[a]]["url"] == f"http://127.0.0.2:{port}"

    load = Load(gw)
    try:
        load.more()
        # a third record: the backend joins after its readiness probe passes (it fails for 2 s)
        c = emulators.start("vllm", host="127.0.0.4", port=port, speed=5.0, not_ready_for_s=2.0)
        name[c] = f"pool-127.0.0.4:{port}"
        dnsmasq.write_hosts({"pool.test": ["127.0.0.2", "127.0.0.3", "127.0.0.4"]})
        dnsmasq.reload()
        wait_for(lambda: backends(gw), lambda rows: name[c] in rows, what="the new record listed")
        eventually(lambda: load.served[name[c]] > 0, 20)
        assert c.stats.rejected_not_ready == 0  # no request reached it before its probe passed

        # a record removed: it drains (requests keep succeeding) and leaves
        dnsmasq.write_hosts({"pool.test": ["127.0.0.3", "127.0.0.4"]})
        dnsmasq.reload()
        wait_for(lambda: backends(gw), lambda rows: name[a] not in rows, what="the removed record gone")
        received = a.stats.requests_received
        load.more(30)
        assert a.stats.requests_received == received  # nothing new reached it once it left

        # a reload keeps the discovered backends (built into the new generation, already probed)
        write_config(gw, {"discovery": [entry], "routes": [{**routes[0], "policy": "least_load"}], "health": POLL})
        assert gw.post("/admin/reload").status_code == 200
        after = backends(gw)
        assert {n: r["healthy"] for n, r in after.items()} == {name[b]: True, name[c]: True}
        load.more(20)
    finally:
        load.stop()
    assert load.errors == []
    assert {n for n, count in load.served.items() if count} == {name[a], name[b], name[c]}
    assert gw.metric("gateway_discovery_changes_total", source="pool", change="added") == 3
    assert gw.metric("gateway_discovery_changes_total", source="pool", change="removed") == 1
    assert gw.metric("gateway_discovery_endpoints", source="pool") == 2
    assert gw.metric("gateway_discovery_errors_total", source="pool") == 0
    assert gw.metric("gateway_requests_total", backend=name[c], status="200") > 0


def publish(dnsmasq: Dnsmasq, addresses: list[str]) -> None:
    dnsmasq.write_hosts({"pool.test": addresses})
    dnsmasq.reload()


def compared(gw: GatewayProcess) -> dict[str, int]:
    """Requests per backend in the live comparison's 60-minute window (the document is cached per
    clock second: poll it)."""
    rows = gw.get("/admin/compare", params={"window": 3600}).json()["backends"]
    return {row["name"]: int(row["requests"]) for row in rows}


def test_dns_answers_naming_rotating_subsets_drain_nothing_and_keep_the_comparison(
    dnsmasq: Dnsmasq, emulators: Emulators, gateway: StartGateway,
) -> None:
    """Issue 22, item 11: a name server that names 3 of the 4 records per answer, a different 3 each
    time (capped or rotating answers; Route 53 multivalue answers pick at random). With the hold,
    no backend drains while each keeps appearing, and every request stays in the comparison; one
    that truly disappears drains once missing for `leave_after_s`, and gets its history back when
    it returns within `remember_s`."""
    emus = fleet(emulators, "vllm", 4)  # on 127.0.0.2 ... 127.0.0.5
    port = port_of(emus[0])
    addresses = [f"127.0.0.{i}" for i in range(2, 6)]
    name = {a: f"pool-{a}:{port}" for a in addresses}
    hold_s = 10.0
    dnsmasq.write_hosts({"pool.test": addresses[:3]})
    dnsmasq.start()
    entry = {"name": "pool", "runtime": "vllm", "model": "tiny-moe",
             "dns": {"host": "pool.test", "port": port, "resolver": dnsmasq.resolver, "interval_s": 0.2,
                     "timeout_s": 1.0, "leave_after_answers": 3, "leave_after_s": hold_s}}
    gw = gateway([], routes=[{"model": "moe", "backends": ["pool"], "policy": "round_robin"}],
                 discovery=[entry], health=POLL)
    healthy(gw, *(name[a] for a in addresses[:3]))

    def resolutions() -> float:
        return gw.metric("gateway_discovery_resolutions_total", source="pool")

    def answered_since(count: float) -> Callable[[], bool]:
        return lambda: resolutions() >= count + 2  # the gateway has had the new answer twice

    load = Load(gw)
    try:
        for turn in range(12):  # each subset leaves one address out, in turn
            publish(dnsmasq, [addresses[(turn + k) % 4] for k in range(3)])
            eventually(answered_since(resolutions()))
            rows = backends(gw)
            assert not [n for n, r in rows.items() if r["draining"]], rows
        assert gw.metric("gateway_discovery_changes_total", source="pool", change="removed") == 0  # no drain
        healthy(gw, *name.values())
        load.more(20)
    finally:
        load.stop()
    assert load.errors == []
    assert gw.metric("gateway_discovery_endpoints", source="pool") == 4
    assert set(backends(gw)) == set(name.values())
    assert {n for n, count in load.served.items() if count} == set(name.values())

    def served() -> dict[str, int]:
        return {n: int(gw.metric("gateway_requests_total", backend=n)) for n in name.values()}

    # Every request is in the 60-minute window, in its backend's row (the window counts completed seconds).
    wait_for(lambda: (compared(gw), served()), lambda got: got[0] == got[1], what="the comparison = /metrics")

    # 127.0.0.5 is gone for good: held for `leave_after_s` after the last answer that named it, then drained.
    gone = name[addresses[3]]
    before = served()[gone]
    published = time.monotonic()
    publish(dnsmasq, addresses[:3])
    eventually(lambda: gw.metric("gateway_discovery_endpoints_missing", source="pool") == 1)
    wait_for(lambda: backends(gw), lambda rows: gone not in rows or rows[gone]["draining"], timeout=hold_s + 30,
             what=f"{gone} drained")
    assert time.monotonic() - published >= hold_s - 0.5  # not before the hold (less the answer in flight)
    wait_for(lambda: backends(gw), lambda rows: gone not in rows, what=f"{gone} gone")
    wait_for(lambda: compared(gw), lambda rows: gone not in rows, what=f"{gone} out of the comparison")
    assert gw.metric("gateway_discovery_changes_total", source="pool", change="removed") == 1

    # It comes back within `remember_s` (an hour by default): its history is back.
    publish(dnsmasq, addresses)
    healthy(gw, gone)
    wait_for(lambda: compared(gw).get(gone), lambda got: got == before, what=f"{gone}'s {before} requests back")


def write_config(gw: GatewayProcess, config: dict[str, Any]) -> None:
    (gw.log_path.parent / "gateway.yaml").write_text(yaml.safe_dump(config))


async def _call(change: Callable[[], None]) -> None:
    change()


def test_a_kubernetes_discovered_fleet_changes_under_load_without_a_client_error(
    loop_thread: LoopThread, emulators: Emulators, gateway: StartGateway, tmp_path: Path,
) -> None:
    a, b, c = fleet(emulators, "sglang", 3)
    port = port_of(a)
    stub = KubeStub("pods", token="stub-token")

    def change(what: Callable[[], None]) -> None:  # the stub lives on the loop thread
        loop_thread.run(_call(what))

    loop_thread.run(stub.start())
    try:
        change(lambda: stub.add(pod("a", "127.0.0.2")))
        change(lambda: stub.add(pod("b", "127.0.0.3")))
        change(lambda: stub.add(pod("c", "127.0.0.4", ready=False)))  # not Ready: not a backend yet
        entry = {"name": "sglang-pool", "runtime": "sglang", "model": "tiny-moe",
                 "kubernetes": {"label_selector": "app=sglang", "port": port,
                                "kubeconfig": str(kubeconfig(tmp_path / "kubeconfig", stub)), "context": "stub"}}
        gw = gateway([], routes=[{"model": "moe", "backends": ["sglang-pool"], "policy": "round_robin"}],
                     discovery=[entry], health=POLL)
        name = {e: f"sglang-pool-{e.url.removeprefix('http://')}" for e in (a, b, c)}
        rows = healthy(gw, name[a], name[b])
        assert set(rows) == {name[a], name[b]}

        load = Load(gw)
        try:
            load.more()
            change(lambda: stub.modify(pod("c", "127.0.0.4")))  # Ready now: it joins
            eventually(lambda: load.served[name[c]] > 0, 20)
            change(lambda: stub.modify(pod("a", "127.0.0.2", ready=False)))  # no longer Ready: drains
            change(lambda: stub.delete("b"))  # deleted: drains
            wait_for(lambda: backends(gw), lambda rows: set(rows) == {name[c]}, what="only c left")
            gone = (a.stats.requests_received, b.stats.requests_received)
            load.more(30)
            assert (a.stats.requests_received, b.stats.requests_received) == gone
        finally:
            load.stop()
        assert load.errors == []
        assert set(load.served) == {name[a], name[b], name[c]}
        assert gw.metric("gateway_discovery_changes_total", source="sglang-pool", change="added") == 3
        assert gw.metric("gateway_discovery_changes_total", source="sglang-pool", change="removed") == 2
        assert gw.metric("gateway_discovery_errors_total", source="sglang-pool") == 0
        watches = [r for r in stub.requests if r.watch]
        assert watches  # listed, then watched
        assert {r.authorization for r in stub.requests} == {"Bearer stub-token"}
    finally:
        loop_thread.run(stub.stop())


def test_a_pod_that_flaps_ready_gets_its_history_back(
    loop_thread: LoopThread, emulators: Emulators, gateway: StartGateway, tmp_path: Path,
) -> None:
    """A watch's answers are whole: a pod no longer Ready drains at once (no hold). It is remembered
    for `remember_s`, so when it is Ready again it has its live-comparison history back."""
    a, _ = fleet(emulators, "sglang", 2)
    port = port_of(a)
    stub = KubeStub("pods", token="stub-token")

    def change(what: Callable[[], None]) -> None:
        loop_thread.run(_call(what))

    loop_thread.run(stub.start())
    try:
        change(lambda: stub.add(pod("a", "127.0.0.2")))
        change(lambda: stub.add(pod("b", "127.0.0.3")))
        entry = {"name": "sglang-pool", "runtime": "sglang", "model": "tiny-moe",
                 "kubernetes": {"label_selector": "app=sglang", "port": port,
                                "kubeconfig": str(kubeconfig(tmp_path / "kubeconfig", stub)), "context": "stub"}}
        gw = gateway([], routes=[{"model": "moe", "backends": ["sglang-pool"], "policy": "round_robin"}],
                     discovery=[entry], health=POLL)
        name_a = f"sglang-pool-127.0.0.2:{port}"
        healthy(gw, name_a, f"sglang-pool-127.0.0.3:{port}")
        client = gw.client()
        for _ in range(6):
            client.chat.completions.create(model="moe", messages=[{"role": "user", "content": "x"}], max_tokens=4)
        before = int(gw.metric("gateway_requests_total", backend=name_a))
        assert before == 3  # round robin
        wait_for(lambda: compared(gw).get(name_a), lambda got: got == before, what="a's requests compared")

        change(lambda: stub.modify(pod("a", "127.0.0.2", ready=False)))
        wait_for(lambda: backends(gw), lambda rows: name_a not in rows, what="a gone")
        wait_for(lambda: compared(gw), lambda rows: name_a not in rows, what="a out of the comparison")
        change(lambda: stub.modify(pod("a", "127.0.0.2")))
        healthy(gw, name_a)
        wait_for(lambda: compared(gw).get(name_a), lambda got: got == before, what="a's history back")
        assert gw.metric("gateway_discovery_changes_total", source="sglang-pool", change="removed") == 1
    finally:
        loop_thread.run(stub.stop())


def test_a_discovery_only_config_waits_unready_until_a_backend_is_found(
    dnsmasq: Dnsmasq, emulators: Emulators, gateway: StartGateway,
) -> None:
    """Nothing found yet (NXDOMAIN): the gateway runs, `/ready` says 503 and requests get 503 in
    OpenAI's shape; the first record makes it ready."""
    dnsmasq.start()
    emu = emulators.start("vllm", host="127.0.0.2", speed=5.0)
    entry = {"name": "pool", "runtime": "vllm", "model": "tiny-moe",
             "dns": {"host": "pool.test", "port": port_of(emu), "resolver": dnsmasq.resolver, "interval_s": 0.2}}
    gw = gateway([], routes=[{"model": "moe", "backends": ["pool"]}], discovery=[entry], health=POLL)
    eventually(lambda: gw.metric("gateway_discovery_resolutions_total", source="pool") >= 1)
    assert gw.get("/ready").status_code == 503
    refused = gw.post("/v1/chat/completions", json={"model": "moe", "messages": [{"role": "user", "content": "x"}]})
    assert refused.status_code == 503
    assert set(refused.json()["error"]) == {"message", "type", "param", "code"}
    dnsmasq.write_hosts({"pool.test": ["127.0.0.2"]})
    dnsmasq.reload()
    eventually(lambda: gw.get("/ready").status_code == 200)
    reply = gw.client().chat.completions.create(model="moe", messages=[{"role": "user", "content": "x"}], max_tokens=4)
    assert reply.choices[0].message.content
