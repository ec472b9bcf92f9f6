"""Kubernetes discovery through kubernetes_asyncio against the stub API server (kube_stub.py) on
loopback: over plain HTTP with a kubeconfig, and over TLS with in-cluster service-account files.

The source sleeps only between failed attempts (through the test's StepSleep); a watch waits on the
stub, which the test drives. Assertions cover the endpoint sets yielded, the requests the source
made (list or watch, and from which resourceVersion) and the counters.
"""

from __future__ import annotations

import ssl
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from gateway.discovery import DiscoveryEntry
from gateway.discovery.kubernetes import KubernetesSource
from gateway.discovery.kubernetes_auth import Credentials
from tests.polling import until

from .harness import Follow, Follower, StepSleep, endpoints
from .kube_stub import KubeStub, endpoint_slice, pod

SOURCE = "sglang-pool"
PORT = 30000
StubFactory = Callable[..., KubeStub]


def entry(**kubernetes: Any) -> DiscoveryEntry:
    return DiscoveryEntry.model_validate(
        {"name": SOURCE, "runtime": "sglang", "model": "m", "kubernetes": kubernetes}
    )


def kubeconfig(path: Path, stub: KubeStub, *, token: str = "stub-token") -> Path:
    """Two contexts on one cluster; the test selects `stub` (namespace llm), not the current one."""
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "other",
        "clusters": [{"name": "stub", "cluster": {"server": stub.url}}],
        "users": [{"name": "tester", "user": {"token": token}}],
        "contexts": [
            {"name": "stub", "context": {"cluster": "stub", "user": "tester", "namespace": "llm"}},
            {"name": "other", "context": {"cluster": "stub", "user": "tester", "namespace": "elsewhere"}},
        ],
    }))
    return path


def total(follower: Follower, name: str, **labels: str) -> float:
    return follower.metric(f"gateway_discovery_{name}", SOURCE, **labels)


def history(stub: KubeStub) -> list[tuple[str, str | None]]:
    return [("watch" if r.watch else "list", r.resource_version) for r in stub.requests]


async def pods_source(stub: KubeStub, tmp_path: Path, follow: Follow) -> tuple[Follower, StepSleep]:
    await stub.start()
    config = entry(label_selector="app=sglang", port=PORT, kubeconfig=str(kubeconfig(tmp_path / "kc", stub)),
                   context="stub")
    return follow(config)


async def watching(kube_stub: StubFactory, follow: Follow, tmp_path: Path,
                   *addresses: str) -> tuple[KubeStub, Follower, StepSleep]:
    """A pods source over ready pods a, b, c ... at `addresses`: its first set is all of them, and
    its watch is open."""
    stub = kube_stub("pods")
    for n, address in enumerate(addresses):
        stub.add(pod(chr(ord("a") + n), address))
    follower, sleep = await pods_source(stub, tmp_path, follow)
    assert await follower.changed(1) == endpoints(PORT, *addresses)
    await until(lambda: stub.open_watches == 1)
    return stub, follower, sleep


async def test_pods_are_listed_then_watched_and_follow_readiness(
    kube_stub: StubFactory, follow: Follow, tmp_path: Path,
) -> None:
    stub = kube_stub("pods", token="stub-token")
    stub.add(pod("a", "127.0.0.2"))
    stub.add(pod("b", "127.0.0.3"))
    stub.add(pod("other", "127.0.0.9", app="vllm"))  # outside the selector
    follower, _ = await pods_source(stub, tmp_path, follow)

    assert await follower.changed(1) == endpoints(PORT, "127.0.0.2", "127.0.0.3")
    await until(lambda: stub.open_watches == 1)
    listed, watched = stub.requests
    assert listed.path == "/api/v1/namespaces/llm/pods"  # the context's namespace
    assert listed.params["labelSelector"] == "app=sglang"
    assert listed.authorization == "Bearer stub-token"
    assert watched.resource_version == "103"  # the list's version
    assert watched.params["allowWatchBookmarks"].lower() == "true"
    assert 300 <= int(watched.params["timeoutSeconds"]) < 600

    stub.add(pod("c", "127.0.0.4"))
    assert await follower.changed(2) == endpoints(PORT, "127.0.0.2", "127.0.0.3", "127.0.0.4")
    stub.modify(pod("a", "127.0.0.2", ready=False))  # readiness lost: it leaves
    assert await follower.changed(3) == endpoints(PORT, "127.0.0.3", "127.0.0.4")
    stub.add(pod("d", "127.0.0.5", phase="Pending", ready=False))  # not running yet: counted, no change
    await until(lambda: total(follower, "resolutions_total") == 4)
    stub.modify(pod("d", "127.0.0.5"))
    assert await follower.changed(4) == endpoints(PORT, "127.0.0.3", "127.0.0.4", "127.0.0.5")
    stub.delete("b")
    assert await follower.changed(5) == endpoints(PORT, "127.0.0.4", "127.0.0.5")

    # A bookmark moves the version on; when the watch ends (the server's timeout), the next watch
    # starts from the bookmark's version.
    bookmark = stub.bookmark()
    stub.end()  # after the bookmark, on the same stream
    await until(lambda: len(stub.watches) == 2)
    assert stub.watches[-1].resource_version == bookmark
    stub.add(pod("e", "127.0.0.6"))
    assert await follower.changed(6) == endpoints(PORT, "127.0.0.4", "127.0.0.5", "127.0.0.6")

    assert history(stub) == [("list", None), ("watch", "103"), ("watch", bookmark)]
    assert total(follower, "errors_total") == 0
    assert total(follower, "resolutions_total") == 7  # the list and six events, not the bookmark
    assert total(follower, "endpoints") == 3


async def test_410_as_an_error_event_relists_at_once_and_the_relist_closes_the_gap(
    kube_stub: StubFactory, follow: Follow, tmp_path: Path,
) -> None:
    stub, follower, sleep = await watching(kube_stub, follow, tmp_path, "127.0.0.2", "127.0.0.3")

    stub.delete("a", notify=False)  # a change this watcher never hears of...
    stub.add(pod("c", "127.0.0.4"), notify=False)
    stub.expire()  # ...then its history is compacted: ERROR 410 on the open watch
    assert await follower.changed(2) == endpoints(PORT, "127.0.0.3", "127.0.0.4")
    await until(lambda: stub.open_watches == 1)
    assert history(stub) == [("list", None), ("watch", "102"), ("list", None), ("watch", "104")]
    assert total(follower, "errors_total") == 0  # 410 is the protocol, not a failure
    assert sleep.asked == []  # relisted without waiting


async def test_410_again_and_again_backs_off(kube_stub: StubFactory, follow: Follow, tmp_path: Path) -> None:
    stub = kube_stub("pods")
    stub.add(pod("a", "127.0.0.2"))
    stub.compacted = 10**9  # every watch is too old, even from a fresh list
    follower, sleep = await pods_source(stub, tmp_path, follow)
    assert await follower.changed(1) == endpoints(PORT, "127.0.0.2")
    await sleep.asleep(1)  # the first 410 relists at once; the second relists, then backs off
    assert history(stub) == [("list", None), ("watch", "101"), ("list", None), ("watch", "101"), ("list", None)]
    await sleep.step()
    assert history(stub)[5:] == [("watch", "101"), ("list", None)]
    await sleep.step()
    assert len(stub.requests) == 9
    assert sleep.asked == sorted(sleep.asked)
    assert sleep.asked[2] > sleep.asked[1] > sleep.asked[0]  # the streak goes on across the relists
    assert total(follower, "errors_total") == 0


async def test_a_dropped_watch_resumes_from_the_last_version_and_http_410_relists(
    kube_stub: StubFactory, follow: Follow, tmp_path: Path,
) -> None:
    stub, follower, sleep = await watching(kube_stub, follow, tmp_path, "127.0.0.2", "127.0.0.3", "127.0.0.4")
    stub.modify(pod("c", "127.0.0.4", ready=False))
    assert await follower.changed(2) == endpoints(PORT, "127.0.0.2", "127.0.0.3")

    # The connection is cut mid-stream: an error, a backoff, then a watch from the last version seen,
    # which replays what happened meanwhile.
    stub.drop()
    await sleep.asleep(1)
    assert total(follower, "errors_total") == 1
    stub.delete("b")  # while disconnected
    sleep.wake()
    assert await follower.changed(3) == endpoints(PORT, "127.0.0.2")
    assert history(stub)[-1] == ("watch", "104")

    # Cut again, and this time the history is compacted meanwhile: the watch gets HTTP 410 and the
    # source lists again, which also brings what it missed.
    stub.drop()
    await sleep.asleep(2)
    stub.modify(pod("c", "127.0.0.4"))
    stub.add(pod("d", "127.0.0.5"))
    stub.compact()
    sleep.wake()
    assert await follower.changed(4) == endpoints(PORT, "127.0.0.2", "127.0.0.4", "127.0.0.5")
    await until(lambda: stub.open_watches == 1)
    assert history(stub) == [
        ("list", None), ("watch", "103"), ("watch", "104"), ("watch", "105"), ("list", None), ("watch", "107"),
    ]
    assert total(follower, "errors_total") == 2
    assert len(sleep.asked) == 2


async def test_failures_keep_the_last_set_and_back_off(kube_stub: StubFactory, follow: Follow, tmp_path: Path) -> None:
    stub = kube_stub("pods")
    stub.add(pod("a", "127.0.0.2"))
    stub.fail_next(503, times=3)
    follower, sleep = await pods_source(stub, tmp_path, follow)
    for attempt in range(1, 4):
        await sleep.asleep(attempt)
        assert total(follower, "errors_total") == attempt
        assert follower.seen == []  # no answer yet: no endpoints
        if attempt < 3:
            await sleep.step()
    assert 0.4 <= sleep.asked[0] <= 0.5
    assert sleep.asked == sorted(sleep.asked)
    assert sleep.asked[2] > 3 * sleep.asked[0]
    sleep.wake()
    assert await follower.changed(1) == endpoints(PORT, "127.0.0.2")

    await until(lambda: stub.open_watches == 1)
    stub.fail_next(500)
    stub.drop()  # the watch is cut and the next one fails: the last set stays
    await sleep.asleep(4)
    await sleep.step()
    assert total(follower, "errors_total") == 5
    assert follower.sets == [endpoints(PORT, "127.0.0.2")]
    assert total(follower, "endpoints") == 1
    sleep.wake()
    await until(lambda: stub.open_watches == 1)
    stub.add(pod("b", "127.0.0.3"))
    assert await follower.changed(2) == endpoints(PORT, "127.0.0.2", "127.0.0.3")


async def test_a_watch_that_ends_at_once_without_events_backs_off(
    kube_stub: StubFactory, follow: Follow, tmp_path: Path,
) -> None:
    """A server (or a proxy) that closes every watch at once would otherwise be hammered."""
    stub, follower, sleep = await watching(kube_stub, follow, tmp_path, "127.0.0.2")
    stub.end()
    await sleep.asleep(1)
    assert total(follower, "errors_total") == 1
    sleep.wake()
    await until(lambda: stub.open_watches == 1)
    assert history(stub) == [("list", None), ("watch", "101"), ("watch", "101")]


async def test_a_list_in_pages_is_read_to_the_end(kube_stub: StubFactory, tmp_path: Path) -> None:
    stub = kube_stub("pods")
    for n in range(5):
        stub.add(pod(f"p{n}", f"127.0.0.{n + 2}"))
    await stub.start()
    source = KubernetesSource(
        SOURCE, credentials=Credentials(kubeconfig=kubeconfig(tmp_path / "kc", stub), context="stub"),
        label_selector="app=sglang", port=PORT, page_size=2,
    )
    follower = Follower(source)
    try:
        assert await follower.changed(1) == endpoints(PORT, *(f"127.0.0.{n + 2}" for n in range(5)))
        await until(lambda: stub.open_watches == 1)
    finally:
        await follower.close()
    pages = [(r.params.get("limit"), r.params.get("continue")) for r in stub.requests if not r.watch]
    assert pages == [("2", None), ("2", "2"), ("2", "4")]
    assert stub.watches[0].resource_version == "105"


async def test_a_missing_kubeconfig_is_an_error_retried(follow: Follow, tmp_path: Path) -> None:
    follower, sleep = follow(entry(label_selector="app=x", port=PORT, kubeconfig=str(tmp_path / "absent")))
    await sleep.asleep(1)
    await sleep.step()
    assert total(follower, "errors_total") == 2
    assert follower.seen == []


async def test_endpoint_slices_of_a_service(kube_stub: StubFactory, follow: Follow, tmp_path: Path) -> None:
    stub = kube_stub("endpointslices")
    stub.add(endpoint_slice("vllm-abc", "vllm", ("127.0.0.2", True), ("127.0.0.3", False)))
    stub.add(endpoint_slice("vllm-def", "vllm", ("127.0.0.4", True)))
    stub.add(endpoint_slice("other-xyz", "other", ("127.0.0.9", True)))
    await stub.start()
    config = entry(service="vllm", port="http", kubeconfig=str(kubeconfig(tmp_path / "kc", stub)), context="stub")
    follower, _ = follow(config)

    assert await follower.changed(1) == endpoints(8000, "127.0.0.2", "127.0.0.4")
    listed = stub.requests[0]
    assert listed.path == "/apis/discovery.k8s.io/v1/namespaces/llm/endpointslices"
    assert listed.params["labelSelector"] == "kubernetes.io/service-name=vllm"
    await until(lambda: stub.open_watches == 1)

    stub.modify(endpoint_slice("vllm-abc", "vllm", ("127.0.0.2", False), ("127.0.0.3", True)))
    assert await follower.changed(2) == endpoints(8000, "127.0.0.3", "127.0.0.4")
    stub.delete("vllm-def")
    assert await follower.changed(3) == endpoints(8000, "127.0.0.3")
    stub.add(endpoint_slice("vllm-ghi", "vllm", ("127.0.0.5", True)))
    assert await follower.changed(4) == endpoints(8000, "127.0.0.3", "127.0.0.5")
    assert history(stub) == [("list", None), ("watch", "103")]


def certificates(directory: Path) -> tuple[Path, Path, Path]:
    """A CA and a server certificate for 127.0.0.1 signed by it (openssl, as a cluster's CA would)."""
    ca_key, ca, key, csr, cert = (directory / n for n in ("ca.key", "ca.crt", "tls.key", "tls.csr", "tls.crt"))
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run = ["openssl", "req", "-x509", *ec, "-keyout", str(ca_key), "-out", str(ca), "-days", "1", "-subj",
           "/CN=stub-ca", "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign"]
    subprocess.run(run, check=True, capture_output=True)
    subprocess.run(["openssl", "req", *ec, "-keyout", str(key), "-out", str(csr), "-subj", "/CN=127.0.0.1"],
                   check=True, capture_output=True)
    ext = directory / "san.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n")
    subprocess.run(["openssl", "x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key),
                    "-CAcreateserial", "-out", str(cert), "-days", "1", "-extfile", str(ext)],
                   check=True, capture_output=True)
    return ca, cert, key


async def test_in_cluster_credentials_over_tls_and_a_rotated_token(
    kube_stub: StubFactory, follow: Follow, tmp_path: Path,
) -> None:
    ca, cert, key = certificates(tmp_path)
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(cert, key)
    stub = kube_stub("pods", token="token-1")
    stub.add(pod("a", "127.0.0.2"))
    await stub.start(tls=tls)
    account = tmp_path / "serviceaccount"
    account.mkdir()
    (account / "token").write_text("token-1")
    (account / "ca.crt").write_bytes(ca.read_bytes())
    (account / "namespace").write_text("llm\n")
    port = stub.url.rsplit(":", 1)[1]
    environ = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": port}
    follower, sleep = follow(entry(label_selector="app=sglang", port=PORT), service_account=account, environ=environ)

    assert await follower.changed(1) == endpoints(PORT, "127.0.0.2")
    assert stub.requests[0].path == "/api/v1/namespaces/llm/pods"  # the service account's namespace
    assert stub.requests[0].authorization == "Bearer token-1"

    # The token rotates: the old one is refused (401, an error); the source re-reads the file.
    await until(lambda: stub.open_watches == 1)
    stub.token = "token-2"
    stub.drop()
    await sleep.asleep(1)
    await sleep.step()
    assert total(follower, "errors_total") == 2
    assert stub.requests[-1].authorization == "Bearer token-1"
    (account / "token").write_text("token-2")
    sleep.wake()
    await until(lambda: stub.open_watches == 1)
    assert stub.requests[-1].authorization == "Bearer token-2"
    stub.add(pod("b", "127.0.0.3"))
    assert await follower.changed(2) == endpoints(PORT, "127.0.0.2", "127.0.0.3")
    assert follower.sets[0] == endpoints(PORT, "127.0.0.2")
