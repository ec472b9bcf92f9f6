"""The PNG plots of `bench overhead`: the three issue-13 measurements by target, and non-streaming
throughput and p99 against concurrency. Medians over rounds; each round's value as a dot."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.targets import ORDER

if TYPE_CHECKING:
    from bench.report_stats import Points

PANELS = (("a", "cpu_us_per_req", "a. non-streaming\nCPU µs per request"),
          ("b", "cpu_us_per_req", "b. 20 events in one write\nCPU µs per request"),
          ("c", "cpu_us_per_chunk", "c. one event per write\nCPU µs per relayed chunk"))


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


CONCURRENCY = ("throughput-vs-concurrency.png", "p99-vs-concurrency.png")


def targets(p: Points, path: Path) -> bool:
    """targets.png; False (and no file) when the run measured none of a, b, c."""
    panels = [(s, key, title) for s, key, title in PANELS if p.targets(s)]
    if not panels:
        return False
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 4.2), squeeze=False)
    for ax, (section, key, title) in zip(axes[0], panels, strict=True):
        names = [n for n in p.targets(section) if n != "litellm"]  # ~100x the others: it would flatten the bars
        values = [statistics.median(v) if (v := [r[key] for r in p.of(section, n) if r.get(key) is not None])
                  else 0.0 for n in names]
        colors = ["tab:blue" if n in ("gateway", "pure") else "tab:gray" if n in ("lean", "naive", "direct")
                  else "tab:orange" for n in names]
        ax.bar(range(len(names)), values, color=colors)
        for i, n in enumerate(names):
            dots = [r[key] for r in p.of(section, n) if r.get(key) is not None]
            ax.plot([i] * len(dots), dots, "k.", markersize=4)
            ax.annotate(f"{values[i]:.1f}" if key == "cpu_us_per_chunk" else f"{values[i]:.0f}", (i, values[i]),
                        ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(names)), names, rotation=35, ha="right")
        ax.set_title(title, fontsize=10)
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle("bench overhead: medians of rounds (dots: each round); litellm left out of the bars", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def concurrency(rows: list[dict[str, Any]], out: Path) -> bool:
    """The CONCURRENCY plots; False (and no files) without the sweep."""
    cs = sorted({r["c"] for r in rows})
    if len(cs) < 2:
        return False
    plt = _pyplot()
    names = sorted({r["target"] for r in rows}, key=lambda n: ORDER.index(n) if n in ORDER else len(ORDER))
    for key, fname, ylabel in (("rps", CONCURRENCY[0], "requests/s (median, log scale)"),
                               ("p99_ms", CONCURRENCY[1], "p99 latency, ms (median, log scale)")):
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for name in names:
            xs = [c for c in cs if any(r["target"] == name and r["c"] == c for r in rows)]
            ys = [statistics.median(r[key] for r in rows if r["target"] == name and r["c"] == c) for c in xs]
            ax.plot(xs, ys, "o-" if name in ("gateway", "pure") else "s--", label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(cs, [str(c) for c in cs])
        ax.set_xlabel("concurrent connections (wrk)")
        ax.set_ylabel(ylabel)
        ax.set_title(f"non-streaming chat completions: {ylabel.split(' (')[0]}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / fname, dpi=110)
        plt.close(fig)
    return True
