"""DNS discovery against a real dnsmasq on loopback (A/AAAA from a hosts file it re-reads on SIGHUP,
SRV from its command line). Each `step()` lets the source resolve exactly once more."""

from __future__ import annotations

from typing import Any

from gateway.discovery import DiscoveryEntry, backends_of

from .harness import Dnsmasq, Follow, Follower, endpoints

INTERVAL_S = 5.0
SOURCE = "pool"


def entry(dnsmasq: Dnsmasq, **dns: Any) -> DiscoveryEntry:
    return DiscoveryEntry.model_validate({
        "name": SOURCE, "runtime": "vllm", "model": "m", "usd_per_hour": 12,
        "dns": {"resolver": dnsmasq.resolver, "interval_s": INTERVAL_S, "timeout_s": 0.3, **dns},
    })


def total(follower: Follower, name: str, **labels: str) -> float:
    return follower.metric(f"gateway_discovery_{name}", SOURCE, **labels)


async def test_a_records_join_and_leave(dnsmasq: Dnsmasq, follow: Follow) -> None:
    dnsmasq.write_hosts({"pool.test": ["127.0.0.2", "127.0.0.3"], "other.test": ["127.0.0.9"]})
    dnsmasq.start()
    follower, sleep = follow(entry(dnsmasq, host="pool.test", port=8000))

    assert await follower.changed(1) == endpoints(8000, "127.0.0.2", "127.0.0.3")
    await sleep.asleep()
    assert sleep.asked == [INTERVAL_S]  # start to start; the injected clock stands still

    dnsmasq.write_hosts({"pool.test": ["127.0.0.2", "127.0.0.3", "127.0.0.4"]})
    dnsmasq.reload()
    await sleep.step()
    assert await follower.changed(2) == endpoints(8000, "127.0.0.2", "127.0.0.3", "127.0.0.4")
    assert follower.seen[1].added == endpoints(8000, "127.0.0.4")

    dnsmasq.write_hosts({"pool.test": ["127.0.0.3", "127.0.0.4"]})
    dnsmasq.reload()
    await sleep.step()
    assert await follower.changed(3) == endpoints(8000, "127.0.0.3", "127.0.0.4")
    assert follower.seen[2].removed == endpoints(8000, "127.0.0.2")

    await sleep.step()  # nothing changed: counted, not yielded
    assert len(follower.seen) == 3
    assert total(follower, "resolutions_total") == 4
    assert total(follower, "changes_total", change="added") == 3
    assert total(follower, "changes_total", change="removed") == 1
    assert total(follower, "endpoints") == 2
    assert total(follower, "errors_total") == 0
    names = [b.name for b in backends_of(entry(dnsmasq, host="pool.test", port=8000), follower.sets[-1])]
    assert names == ["pool-127.0.0.3:8000", "pool-127.0.0.4:8000"]


async def test_a_stopped_server_keeps_the_last_set_and_a_restarted_one_is_followed_again(
    dnsmasq: Dnsmasq, follow: Follow,
) -> None:
    dnsmasq.write_hosts({"pool.test": ["127.0.0.2", "127.0.0.3"]})
    dnsmasq.start()
    follower, sleep = follow(entry(dnsmasq, host="pool.test", port=8000))
    assert await follower.changed(1) == endpoints(8000, "127.0.0.2", "127.0.0.3")
    await sleep.asleep()

    dnsmasq.stop()
    for _ in range(3):
        await sleep.step()
    assert total(follower, "errors_total") == 3
    assert follower.sets == [endpoints(8000, "127.0.0.2", "127.0.0.3")]  # kept: nothing yielded
    assert total(follower, "endpoints") == 2
    retries = sleep.asked[1:]
    assert retries == sorted(retries)
    assert retries[0] < retries[-1] <= INTERVAL_S  # backoff grows, never beyond the interval

    dnsmasq.write_hosts({"pool.test": ["127.0.0.3", "127.0.0.5"]})
    dnsmasq.start()
    await sleep.step()
    assert await follower.changed(2) == endpoints(8000, "127.0.0.3", "127.0.0.5")
    assert total(follower, "errors_total") == 3
    assert sleep.asked[-1] == INTERVAL_S  # back to the normal pace


async def test_a_name_that_disappears_empties_the_pool(
    dnsmasq: Dnsmasq, follow: Follow,
) -> None:
    dnsmasq.write_hosts({"pool.test": ["127.0.0.2"], "other.test": ["127.0.0.9"]})
    dnsmasq.start()
    follower, sleep = follow(entry(dnsmasq, host="pool.test", port=8000))
    assert await follower.changed(1) == endpoints(8000, "127.0.0.2")
    await sleep.asleep()

    dnsmasq.write_hosts({"other.test": ["127.0.0.9"]})  # pool.test is NXDOMAIN now: an answer, not an error
    dnsmasq.reload()
    await sleep.step()
    assert await follower.changed(2) == frozenset()
    assert total(follower, "errors_total") == 0
    assert total(follower, "endpoints") == 0


async def test_aaaa_records_join_with_bracketed_names(
    dnsmasq: Dnsmasq, follow: Follow,
) -> None:
    dnsmasq.write_hosts({"dual.test": ["127.0.0.2", "::1"]})
    dnsmasq.start()
    follower, _ = follow(entry(dnsmasq, host="dual.test", port=8000))
    found = await follower.changed(1)
    assert found == endpoints(8000, "127.0.0.2", "::1")
    backends = backends_of(entry(dnsmasq, host="dual.test", port=8000), found)
    assert sorted(b.url for b in backends) == ["http://127.0.0.2:8000", "http://[::1]:8000"]
    assert sorted(b.name for b in backends) == ["pool-127.0.0.2:8000", "pool-[::1]:8000"]


async def test_srv_records_give_each_target_its_port(
    dnsmasq: Dnsmasq, follow: Follow,
) -> None:
    dnsmasq.write_hosts({"a.pool.test": ["127.0.0.2"], "b.pool.test": ["127.0.0.3", "127.0.0.4"]})
    dnsmasq.start(srv=["_http._tcp.pool.test,a.pool.test,8001", "_http._tcp.pool.test,b.pool.test,8002,10,5"])
    follower, sleep = follow(entry(dnsmasq, srv="_http._tcp.pool.test"))
    assert await follower.changed(1) == {*endpoints(8001, "127.0.0.2"), *endpoints(8002, "127.0.0.3", "127.0.0.4")}
    await sleep.asleep()

    # A target's address moves: the hosts file is re-read on SIGHUP.
    dnsmasq.write_hosts({"a.pool.test": ["127.0.0.5"], "b.pool.test": ["127.0.0.3", "127.0.0.4"]})
    dnsmasq.reload()
    await sleep.step()
    assert await follower.changed(2) == {*endpoints(8001, "127.0.0.5"), *endpoints(8002, "127.0.0.3", "127.0.0.4")}

    # The SRV records themselves change: dnsmasq reads --srv-host only at start.
    dnsmasq.write_hosts({"b.pool.test": ["127.0.0.3"], "c.pool.test": ["127.0.0.6"]})
    dnsmasq.restart(srv=["_http._tcp.pool.test,b.pool.test,8002", "_http._tcp.pool.test,c.pool.test,8003"])
    await sleep.step()
    assert await follower.changed(3) == {*endpoints(8002, "127.0.0.3"), *endpoints(8003, "127.0.0.6")}

    # A target without addresses contributes nothing; the others stay.
    dnsmasq.write_hosts({"b.pool.test": ["127.0.0.3"]})
    dnsmasq.reload()
    await sleep.step()
    assert await follower.changed(4) == endpoints(8002, "127.0.0.3")
    assert total(follower, "errors_total") == 0
