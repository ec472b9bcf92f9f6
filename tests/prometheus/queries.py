"""Every PromQL expression the deploy/ files ship, collected once, and Grafana's substitutions."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from gateway import json_codec

from .tools import DEPLOY, rule_groups

DASHBOARD = DEPLOY / "grafana" / "gateway-dashboard.json"

# What Grafana puts in for its built-in intervals: windows that cover the tier's load when the
# queries run a few seconds after it.
GRAFANA_INTERVALS = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "5m"}

NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


@dataclass(frozen=True)
class Query:
    where: str  # "panel title / refId" or "record name {labels}"
    expr: str


def dashboard() -> dict[str, object]:
    doc: dict[str, object] = json_codec.loads(DASHBOARD.read_bytes())
    return doc


def dashboard_queries() -> list[Query]:
    panels = dashboard()["panels"]
    assert isinstance(panels, list)
    return [Query(f"{p['title']} / {t['refId']}", t["expr"]) for p in panels for t in p.get("targets", [])]


def template_variables() -> list[dict[str, object]]:
    templating = dashboard()["templating"]
    assert isinstance(templating, dict)
    return [v for v in templating["list"] if v["type"] == "query"]


def recording_rules() -> list[tuple[str, dict[str, str], str]]:
    """(record, its static labels, expr) of every recording rule, in file order."""
    return [(r["record"], r.get("labels", {}), r["expr"])
            for g in rule_groups("gateway-recording.yml") for r in g["rules"]]


def alerting_rules() -> list[tuple[str, str]]:
    return [(r["alert"], r["expr"]) for g in rule_groups("gateway-alerts.yml") for r in g["rules"]]


def regex_escape(value: str) -> str:
    """How Grafana escapes a value for a Prometheus regex matcher."""
    return re.sub(r"([\\^$*+?.()|{}\[\]])", r"\\\1", value)


def substitute(expr: str, variables: dict[str, str]) -> str:
    for name, value in sorted(variables.items(), key=lambda kv: -len(kv[0])):
        expr = expr.replace("${" + name + "}", value).replace("$" + name, value)
    for name, value in GRAFANA_INTERVALS.items():
        expr = expr.replace(name, value)
    assert "$" not in expr.replace("$1", ""), f"unsubstituted variable in {expr}"
    return expr


LABEL_VALUES = re.compile(r"^label_values\((?:(?P<selector>.+),\s*)?(?P<label>\w+)\)$")


def resolve_variables(label_values: Callable[[str, str | None], list[str]], *, pick: str) -> dict[str, str]:
    """The dashboard's query variables resolved in order, as Grafana does, from real label values
    (`label_values(label, selector)`). `pick="all"`: every value, as Grafana expands "All" of a
    multi-value variable (`(a|b)`); `pick="first"`: the first value alone."""
    resolved: dict[str, str] = {}
    for v in template_variables():
        query = v["query"]
        text = query["query"] if isinstance(query, dict) else str(query)
        m = LABEL_VALUES.match(text)
        assert m, f"variable {v['name']}: unsupported query {text}"
        selector = substitute(m["selector"], resolved) if m["selector"] else None
        values = label_values(m["label"], selector)
        regex = str(v.get("regex") or "")
        if regex:
            pattern = re.compile(regex.strip("/"))
            values = [x for x in values if pattern.search(x)]
        assert values, f"variable {v['name']} has no values ({text})"
        chosen = values if pick == "all" else values[:1]
        resolved[str(v["name"])] = "(" + "|".join(regex_escape(x) for x in chosen) + ")"
    return resolved
