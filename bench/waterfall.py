"""One trace's spans as a Jaeger/Tempo-style waterfall (PNG, matplotlib): a row per span, parents
above their children, bars on the trace's time axis, coloured by the process that recorded them.

The README's picture is made by the real-vLLM tier from the spans an OTLP receiver got for one
request through the gateway to vLLM (`tests/real/test_real_tracing.py`, with `IGW_TRACE_PNG=path`;
the spans are written beside it as JSON, which `python -m bench.waterfall SPANS.json OUT.png [TITLE]` draws
again).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import orjson

COLOURS = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948")
SHOWN = ("gateway.backend", "gateway.attempt", "error.type", "gateway.routing.reason", "gen_ai.usage.output_tokens",
         "gen_ai.response.time_to_first_chunk", "gen_ai.latency.time_to_first_token")


@dataclass(frozen=True)
class Row:
    service: str
    name: str
    kind: str
    span_id: str
    parent_span_id: str
    start_ns: int
    end_ns: int
    attributes: Mapping[str, Any]


def ordered(rows: Sequence[Row]) -> list[tuple[int, Row]]:
    """(depth, row), depth-first from the roots, children by start time."""
    ids = {r.span_id for r in rows}
    children: dict[str, list[Row]] = {}
    for r in rows:
        children.setdefault(r.parent_span_id if r.parent_span_id in ids else "", []).append(r)
    out: list[tuple[int, Row]] = []

    def walk(parent: str, depth: int) -> None:
        for r in sorted(children.get(parent, []), key=lambda x: x.start_ns):
            out.append((depth, r))
            walk(r.span_id, depth + 1)

    walk("", 0)
    return out


PHASES = {"queue": "#bab0ac", "prefill": "#b07aa1", "decode": "#ff9da7"}
_PHASE_KEYS = (("queue", "gen_ai.latency.time_in_queue"), ("prefill", "gen_ai.latency.time_in_model_prefill"),
               ("decode", "gen_ai.latency.time_in_model_decode"))


def _phases(r: Row) -> list[tuple[str, float]]:
    """An engine span's phases, in order, from the latencies vLLM records on it (seconds)."""
    return [(name, float(r.attributes[key])) for name, key in _PHASE_KEYS
            if isinstance(r.attributes.get(key), int | float) and r.attributes[key] > 0]


def _detail(r: Row) -> str:
    parts = []
    for key in SHOWN:
        if key in r.attributes:
            value = r.attributes[key]
            parts.append(f"{key.rsplit('.', 1)[-1]}={value:.3g}" if isinstance(value, float) else f"{key}={value}")
    return "  ".join(parts)


def render(rows: Sequence[Row], out: Path, *, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    tree = ordered(rows)
    t0 = min(r.start_ns for r in rows)
    total_ms = max((max(r.end_ns for r in rows) - t0) / 1e6, 1e-3)
    services = sorted({r.service for r in rows}, key=lambda s: min(x.start_ns for x in rows if x.service == s))
    colour = {s: COLOURS[i % len(COLOURS)] for i, s in enumerate(services)}
    fig, ax = plt.subplots(figsize=(12, 0.55 * len(tree) + 1.4), dpi=110)
    for i, (depth, r) in enumerate(tree):
        start = (r.start_ns - t0) / 1e6
        width = max((r.end_ns - r.start_ns) / 1e6, total_ms * 0.002)
        error = "error.type" in r.attributes
        ax.barh(i, width, left=start, height=0.6, color=colour[r.service], edgecolor="#c0392b" if error else "none",
                linewidth=2 if error else 0)
        ax.text(-total_ms * 0.01, i, f"{r.service}: {r.name}  ({r.kind.lower()}){'  ·' * depth}", ha="right",
                va="center", fontsize=8.5)
        ax.text(start + width + total_ms * 0.006, i, f"{(r.end_ns - r.start_ns) / 1e6:.1f} ms", va="center",
                fontsize=8)
        end = (r.end_ns - t0) / 1e6
        for phase, seconds in reversed(_phases(r)):  # vLLM's queue, prefill and decode, back from its end
            ax.barh(i, seconds * 1000, left=end - seconds * 1000, height=0.22, color=PHASES[phase])
            end -= seconds * 1000
        detail = _detail(r)
        if detail:
            ax.text(start, i + 0.42, detail, va="center", fontsize=6.5, color="#555555")
    ax.set_ylim(len(tree) - 0.3, -0.8)
    ax.set_xlim(0, total_ms * 1.12)
    ax.set_yticks([])
    ax.set_xlabel("ms since the request arrived")
    ax.set_title(title, fontsize=10, loc="left", pad=22)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.grid(axis="x", color="#eeeeee")
    handles = [Rectangle((0, 0), 1, 1, color=colour[s]) for s in services]
    ax.legend([*handles, *(Rectangle((0, 0), 1, 1, color=c) for c in PHASES.values())],
              [*services, *(f"engine {p}" for p in PHASES)], loc="lower right", bbox_to_anchor=(1.0, 1.0),
              ncol=len(services) + len(PHASES), fontsize=7.5, frameon=False)
    fig.subplots_adjust(left=0.27, right=0.98, top=1 - 0.75 / fig.get_figheight(), bottom=0.14)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)


def save(rows: Sequence[Row], path: Path) -> None:
    path.write_bytes(orjson.dumps([asdict(r) for r in rows], option=orjson.OPT_INDENT_2))


def main(argv: Sequence[str]) -> int:
    if len(argv) not in (2, 3):
        print("usage: python -m bench.waterfall SPANS.json OUT.png [TITLE]", file=sys.stderr)
        return 2
    rows = [Row(**r) for r in orjson.loads(Path(argv[0]).read_bytes())]
    services = ", ".join(sorted({r.service for r in rows}))
    render(rows, Path(argv[1]), title=argv[2] if len(argv) == 3 else f"one trace: {len(rows)} spans from {services}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
