"""The outlier guards are judged per candidate set (a route's backends, an A/B arm's), never over the
whole pool: properties of the pure rule and of the pool that applies it (no event loop, time is an
argument)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from backends.base import Runtime
from backends.registry import adapter_for
from gateway.settings import Backend, Route
from gateway.state.outliers import OutlierRules, may_eject
from gateway.state.pool import BackendState, CandidateSet, Pool, candidate_sets

NAMES = [f"b{i}" for i in range(6)]


def state(name: str, *, source: str = "static") -> BackendState:
    config = Backend(name=name, runtime=Runtime.VLLM, url="http://127.0.0.1:9", model="m")
    return BackendState(config, adapter_for(Runtime.VLLM), source=source)


def pool(names: list[str], sets: list[CandidateSet] | None, **rules: float) -> Pool:
    return Pool([state(n) for n in names], rules=OutlierRules(**rules), sets=sets)  # type: ignore[arg-type]


@given(members=st.integers(1, 50), ejected=st.integers(0, 50), routable=st.integers(0, 50),
       share=st.floats(0.01, 1.0))
def test_the_rule_keeps_a_routable_backend_and_the_share_of_the_set(
    members: int, ejected: int, routable: int, share: float
) -> None:
    allowed = may_eject(members, ejected_others=ejected, routable_others=routable, max_ejected_share=share)
    if allowed:
        assert routable >= 1
        assert ejected + 1 <= share * members + 1e-6
    if members == 1:
        assert not may_eject(1, ejected_others=0, routable_others=0, max_ejected_share=share)
    # one more ejected or one fewer routable never turns a refusal into a permission
    if not allowed:
        assert not may_eject(members, ejected_others=ejected + 1, routable_others=routable, max_ejected_share=share)
        assert not may_eject(members, ejected_others=ejected, routable_others=max(0, routable - 1),
                             max_ejected_share=share)


def test_the_share_is_of_the_set_and_exact_shares_are_not_lost_to_rounding() -> None:
    assert may_eject(2, ejected_others=0, routable_others=1, max_ejected_share=0.5)  # one of two
    assert not may_eject(3, ejected_others=1, routable_others=1, max_ejected_share=0.5)  # two of three
    assert may_eject(100, ejected_others=28, routable_others=71, max_ejected_share=0.29)  # 29 of 100 (0.29*100 < 29)
    assert not may_eject(100, ejected_others=29, routable_others=70, max_ejected_share=0.29)


SETS = st.lists(st.lists(st.sampled_from(NAMES), min_size=1, max_size=4, unique=True), min_size=1, max_size=5)
EVENTS = st.lists(st.tuples(st.sampled_from(["fail", "ok", "probe"]), st.sampled_from(NAMES)), max_size=80)


@settings(max_examples=200, deadline=None)
@given(raw=SETS, events=EVENTS, share=st.sampled_from([0.2, 0.5, 0.75, 1.0]))
def test_no_candidate_set_ever_loses_its_last_backend_or_more_than_its_share(
    raw: list[list[str]], events: list[tuple[str, str]], share: float
) -> None:
    """Whatever fails in whatever order (probes passing, so only ejection takes backends out), every
    route and arm keeps a routable backend and at most `max_ejected_share` of it is ejected; the
    only backend of a set is never ejected."""
    sets = [CandidateSet(f"route `r{i}`", tuple(names)) for i, names in enumerate(raw)]
    p = pool(NAMES, sets, consecutive=1, base_ejection_s=3.0, max_ejected_share=share)
    alone = {s.names[0] for s in sets if len(s.names) == 1}
    for now, (kind, name) in enumerate(events):
        if kind == "probe":
            p.record_probe(name, True, float(now))
            continue
        verdict = p.judge(name, kind == "ok", float(now), "status 500")
        if verdict.spared:
            assert any(s.label in verdict.reason and name in s.names for s in sets)
        for s in sets:
            assert any(p[n].healthy for n in s.names), (s, events[: now + 1])
            assert sum(p[n].ejected for n in s.names) <= share * len(s.names) + 1e-9
        assert not any(p[n].ejected for n in alone)


def test_two_routes_of_one_backend_each_eject_neither() -> None:
    """The reproduction: half the pool may be ejected, but each backend is its route's only one."""
    p = pool(["a", "b"], [CandidateSet("route `one`", ("a",)), CandidateSet("route `two`", ("b",))], consecutive=5)
    verdicts = [p.judge("a", False, float(t), "status 500") for t in range(6)]
    assert [v.spared for v in verdicts] == [False] * 4 + [True, True]  # and so on, while it keeps failing
    assert verdicts[4].reason == "5 consecutive failures, but route `one` would have no routable backend left"
    assert p["a"].healthy
    whole = pool(["a", "b"], None, consecutive=5)  # without sets: the whole pool is one (today's rule)
    assert [whole.judge("a", False, float(t)).eject_for_s for t in range(5)][-1] == 5.0


def test_a_backend_is_ejected_only_if_every_set_it_belongs_to_allows_it() -> None:
    sets = [CandidateSet("route `wide`", ("a", "b", "c", "d")), CandidateSet("arm `x` of route `ab`", ("a",)),
            CandidateSet("arm `y` of route `ab`", ("b", "c"))]
    p = pool(["a", "b", "c", "d"], sets, consecutive=1)
    assert p.judge("a", False, 0.0).spared  # the wide route could lose it; its arm could not
    assert p.judge("b", False, 0.0).eject_for_s is not None
    c = p.judge("c", False, 0.0)
    assert c.spared
    assert "arm `y` of route `ab` would have no routable backend left" in c.reason
    d = p.judge("d", False, 0.0)
    assert d.eject_for_s is not None  # two of the wide route's four: within half of it
    assert "route `wide` would have more than 50% of its 4 backends ejected" in p.judge("c", False, 1.0).reason


def test_a_set_naming_a_discovery_pool_follows_its_members() -> None:
    p = Pool([state("pool-1", source="pool")], rules=OutlierRules(consecutive=1), groups=["pool"],
             sets=[CandidateSet("route `m`", ("pool",))])
    assert p.judge("pool-1", False, 0.0).spared  # the pool's only member
    p.join(state("pool-2", source="pool"))
    p.record_probe("pool-2", True, 1.0)
    assert p.judge("pool-1", False, 2.0).eject_for_s is not None  # now one of two
    assert p.judge("pool-2", False, 2.0).spared


def test_every_route_and_every_arm_is_a_candidate_set() -> None:
    plain = Route(model="m", backends=["a", "b"])
    split = Route.model_validate({"model": "ab", "split": {"arms": [
        {"name": "x", "weight": 1, "backends": ["a"]}, {"name": "y", "weight": 1, "backends": ["b", "pool"]}]}})
    assert candidate_sets([plain, split]) == [
        CandidateSet("route `m`", ("a", "b")), CandidateSet("route `ab`", ("a", "b", "pool")),
        CandidateSet("arm `x` of route `ab`", ("a",)), CandidateSet("arm `y` of route `ab`", ("b", "pool")),
    ]


def test_why_no_backend_is_available_names_each_one_and_what_ejected_it() -> None:
    p = pool(["a", "b", "c"], [CandidateSet("route `m`", ("a", "b", "c"))], consecutive=2, base_ejection_s=30.0)
    for t in (0.0, 1.0):
        p.judge("a", False, t, "status 500")
    p.record_probe("b", False, 2.0, "connection refused")
    p.record_probe("c", True, 2.0)
    text, retry_s = p.unavailable(["a", "b"], 10.0)
    assert text == ("`a` is ejected (2 consecutive failures; last failure: status 500) for 21 s more; "
                    "`b` fails its health probe (connection refused)")
    assert retry_s == 1.0  # b may pass its next probe
    assert p.unavailable(["a"], 10.0) == (
        "`a` is ejected (2 consecutive failures; last failure: status 500) for 21 s more", 21.0)
    assert p.unavailable(["a"], 40.0)[0].endswith("until its next passing health probe")
