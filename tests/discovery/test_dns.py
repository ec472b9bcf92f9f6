"""DNS discovery against a real dnsmasq on loopback (A/AAAA from a hosts file it re-reads on SIGHUP,
SRV from its command line). Each `step()` lets the source resolve exactly once more. The entries
follow every answer literally (`leave_after_answers: 1, leave_after_s: 0`) unless a test is about
the hold."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from gateway.discovery import DiscoveryEntry, Endpoint, backends_of

from .harness import Dnsmasq, Follow, Follower, StepSleep, endpoints

INTERVAL_S = 5.0
SOURCE = "pool"


def entry(dnsmasq: Dnsmasq, **dns: Any) -> DiscoveryEntry:
    return DiscoveryEntry.model_validate({
        "name": SOURCE, "runtime": "vllm", "model": "m", "usd_per_hour": 12,
        "dns": {"resolver": dnsmasq.resolver, "interval_s": INTERVAL_S, "timeout_s": 0.3,
                "leave_after_answers": 1, "leave_after_s": 0, **dns},
    })


class Clock:
    """A clock the test moves."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def total(follower: Follower, name: str, **labels: str) -> float:
    return follower.metric(f"gateway_discovery_{name}", SOURCE, **labels)


async def following(dnsmasq: Dnsmasq, follow: Follow, hosts: dict[str, Iterable[str]], first: Iterable[Endpoint], *,
                    srv_records: Iterable[str] = (), clock: Clock | None = None,
                    **dns: Any) -> tuple[Follower, StepSleep]:
    """dnsmasq serving `hosts` (and `srv_records`), a source resolving `dns` from it, its first set `first`, and
    the source asleep until the next `step()`."""
    dnsmasq.write_hosts(hosts)
    dnsmasq.start(srv=srv_records)
    follower, sleep = follow(entry(dnsmasq, **dns), **({} if clock is None else {"clock": clock}))
    assert await follower.changed(1) == frozenset(first)
    await sleep.asleep()
    return follower, sleep


async def republish(dnsmasq: Dnsmasq, sleep: StepSleep, hosts: dict[str, Iterable[str]]) -> None:
    """dnsmasq serves `hosts` from now on (it re-reads the file on SIGHUP); the source resolves once more."""
    dnsmasq.write_hosts(hosts)
    dnsmasq.reload()
    await sleep.step()


async def test_a_records_join_and_leave(dnsmasq: Dnsmasq, follow: Follow) -> None:
    follower, sleep = await following(dnsmasq, follow, {"pool.test": ["127.0.0.2", "127.0.0.3"],
                                                        "other.test": ["127.0.0.9"]},
                                      endpoints(8000, "127.0.0.2", "127.0.0.3"), host="pool.test", port=8000)
    assert sleep.asked == [INTERVAL_S]  # start to start; the injected clock stands still

    await republish(dnsmasq, sleep, {"pool.test": ["127.0.0.2", "127.0.0.3", "127.0.0.4"]})
    assert await follower.changed(2) == endpoints(8000, "127.0.0.2", "127.0.0.3", "127.0.0.4")
    assert follower.seen[1].added == endpoints(8000, "127.0.0.4")

    await republish(dnsmasq, sleep, {"pool.test": ["127.0.0.3", "127.0.0.4"]})
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


async def test_answers_naming_subsets_drain_nothing_until_an_address_is_missing_for_the_hold(
    dnsmasq: Dnsmasq, follow: Follow,
) -> None:
    """A name server that names 2 of 3 records per answer, in turn (capped or rotating answers,
    Route 53 multivalue answers): with the hold, the set in force is all three, and stays so."""
    clock = Clock(100.0)
    follower, sleep = await following(dnsmasq, follow, {"pool.test": ["127.0.0.2", "127.0.0.3"]},
                                      endpoints(8000, "127.0.0.2", "127.0.0.3"), clock=clock,
                                      host="pool.test", port=8000, leave_after_answers=3, leave_after_s=10)
    rotation = [["127.0.0.3", "127.0.0.4"], ["127.0.0.4", "127.0.0.2"], ["127.0.0.2", "127.0.0.3"]] * 4
    for subset in rotation:  # one answer every 5 s, each missing one of the three
        clock.now += INTERVAL_S
        await republish(dnsmasq, sleep, {"pool.test": subset})
    everyone = endpoints(8000, "127.0.0.2", "127.0.0.3", "127.0.0.4")
    assert follower.sets == [endpoints(8000, "127.0.0.2", "127.0.0.3"), everyone]  # .4 joined; none left
    assert total(follower, "changes_total", change="removed") == 0
    assert total(follower, "endpoints_missing") == 1
    assert total(follower, "resolutions_total") == 1 + len(rotation)

    # .2 is gone for good: it leaves at the third answer without it (by then 15 s since it was named)
    for n in range(3):
        clock.now += INTERVAL_S
        await republish(dnsmasq, sleep, {"pool.test": ["127.0.0.3", "127.0.0.4"]})
        assert len(follower.seen) == (2 if n < 2 else 3)
    assert await follower.changed(3) == endpoints(8000, "127.0.0.3", "127.0.0.4")
    assert follower.seen[2].removed == endpoints(8000, "127.0.0.2")
    assert total(follower, "endpoints_missing") == 0

    # A spell of failures runs the seconds but not the answers: one partial answer after it drains nothing.
    dnsmasq.stop()
    for _ in range(3):
        clock.now += INTERVAL_S
        await sleep.step()
    dnsmasq.write_hosts({"pool.test": ["127.0.0.3"]})
    dnsmasq.start()
    await sleep.step()
    assert total(follower, "errors_total") == 3
    assert len(follower.seen) == 3
    assert total(follower, "endpoints_missing") == 1


async def test_a_stopped_server_keeps_the_last_set_and_a_restarted_one_is_followed_again(
    dnsmasq: Dnsmasq, follow: Follow,
) -> None:
    follower, sleep = await following(dnsmasq, follow, {"pool.test": ["127.0.0.2", "127.0.0.3"]},
                                      endpoints(8000, "127.0.0.2", "127.0.0.3"), host="pool.test", port=8000)

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
    follower, sleep = await following(dnsmasq, follow, {"pool.test": ["127.0.0.2"], "other.test": ["127.0.0.9"]},
                                      endpoints(8000, "127.0.0.2"), host="pool.test", port=8000)

    await republish(dnsmasq, sleep, {"other.test": ["127.0.0.9"]})  # pool.test is NXDOMAIN now: an answer, not an error
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
    follower, sleep = await following(
        dnsmasq, follow, {"a.pool.test": ["127.0.0.2"], "b.pool.test": ["127.0.0.3", "127.0.0.4"]},
        {*endpoints(8001, "127.0.0.2"), *endpoints(8002, "127.0.0.3", "127.0.0.4")},
        srv_records=["_http._tcp.pool.test,a.pool.test,8001", "_http._tcp.pool.test,b.pool.test,8002,10,5"],
        srv="_http._tcp.pool.test")

    # A target's address moves: the hosts file is re-read on SIGHUP.
    await republish(dnsmasq, sleep, {"a.pool.test": ["127.0.0.5"], "b.pool.test": ["127.0.0.3", "127.0.0.4"]})
    assert await follower.changed(2) == {*endpoints(8001, "127.0.0.5"), *endpoints(8002, "127.0.0.3", "127.0.0.4")}

    # The SRV records themselves change: dnsmasq reads --srv-host only at start.
    dnsmasq.write_hosts({"b.pool.test": ["127.0.0.3"], "c.pool.test": ["127.0.0.6"]})
    dnsmasq.restart(srv=["_http._tcp.pool.test,b.pool.test,8002", "_http._tcp.pool.test,c.pool.test,8003"])
    await sleep.step()
    assert await follower.changed(3) == {*endpoints(8002, "127.0.0.3"), *endpoints(8003, "127.0.0.6")}

    # A target without addresses contributes nothing; the others stay.
    await republish(dnsmasq, sleep, {"b.pool.test": ["127.0.0.3"]})
    assert await follower.changed(4) == endpoints(8002, "127.0.0.3")
    assert total(follower, "errors_total") == 0
