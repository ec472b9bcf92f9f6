"""The processes `bench overhead` measures side by side, each in front of one upstream.

For every upstream (nginx's JSON port, nginx's SSE port, the dripping SSE server) one set of targets:
**direct** (the upstream itself), **gateway** (`python -m gateway serve` as `make install` built it),
**trace-1%** and **trace-100%** (the same with tracing on, sampling 1% and all requests, exporting
to `bench/otlp_sink.py`), **pure** (the same sources without the modules `make native` compiled, when any are), **lean**
(bench/lean_proxy.py: the gateway's HTTP layers and nothing else, the plain byte relay), **naive**
(bench/naive_proxy.py, a bare aiohttp proxy), with `--baseline REV` **baseline** (the gateway at an
earlier commit, built the same way: issue 12's "no regression against the previous commit") and,
with `--peers`, the pinned Rust routers (and with `--litellm` the LiteLLM proxy). Every target runs
in a session of its own, so its CPU is read from /proc over its whole process group, whatever
threads or workers it runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import peers, procs
from bench.procs import Gateway, PyServer

# Read counts of these are socket reads (uvloop reads with read(2)).
PYTHON = ("gateway", "trace-1%", "trace-100%", "pure", "baseline", "lean", "naive")
ORDER = ("direct", "gateway", "trace-1%", "trace-100%", "pure", "baseline", "lean", "naive", "vllm-router",
         "sglang-router", "smg", "litellm")
# the gateway with tracing on, exporting to a collector (`bench/otlp_sink.py`): the share of requests sampled
TRACED = {"trace-1%": 0.01, "trace-100%": 1.0}


@dataclass(slots=True)
class Target:
    name: str  # one of ORDER
    url: str  # base URL
    pgid: int  # the process group doing the work (for direct: the upstream's)
    command: str = ""

    def cpu(self) -> float:
        return procs.group_cpu_seconds(self.pgid)

    def cpu_ticks(self) -> float:
        return procs.group_cpu_ticks(self.pgid)

    def reads(self) -> int | None:
        """Socket reads so far, where the read-syscall count means that (our Python servers)."""
        return procs.group_read_calls(self.pgid) if self.name in PYTHON else None


# The order a round measures them in: the gateway's comparisons nearest to it (the Rust routers, the
# previous commit, the plain relay), so that each ratio pairs two runs a few seconds apart; a shared
# machine's bursts of other work (`others' CPU` in the report) last seconds to a minute, and a pair
# measured a minute apart takes one burst on one side only. `measuring_order` reverses it every other
# round, so no target always follows the same neighbour.
MEASURE_ORDER = ("gateway", "vllm-router", "baseline", "lean", "smg", "sglang-router", "pure", "direct", "naive",
                 "trace-1%", "trace-100%", "litellm")


def measuring_order(targets: Sequence[Target], rnd: int) -> list[Target]:
    """`targets` in MEASURE_ORDER, reversed in odd rounds."""
    ordered = sorted(targets, key=lambda t: MEASURE_ORDER.index(t.name) if t.name in MEASURE_ORDER
                     else len(MEASURE_ORDER))
    return ordered[::-1] if rnd % 2 else ordered


@dataclass(frozen=True, slots=True)
class Options:
    pure_sources: Path | None  # None: the gateway is pure Python already (no `make native`)
    peers: Sequence[peers.Peer]  # installed peers to run
    baseline: Path | None = None  # the gateway's packages at an earlier commit (procs.baseline_sources)
    otlp: str | None = None  # a collector's OTLP/gRPC endpoint: the traced gateways (TRACED) export there


def start(label: str, upstream_url: str, upstream_pgid: int, tmp: Path, opts: Options, started: list[Any],
          ready_body: bytes, notes: list[str]) -> list[Target]:
    """Starts one set of targets in front of `upstream_url`; each process is appended to `started`
    (the caller stops them). A peer that does not answer `ready_body` is left out with a note."""
    out = [Target("direct", upstream_url, upstream_pgid)]
    gw = Gateway(f"gateway-{label}", upstream_url, tmp)
    started.append(gw)
    out.append(Target("gateway", gw.url, gw.pid))
    for name, ratio in TRACED.items() if opts.otlp is not None else ():
        traced = Gateway(f"{name.rstrip('%')}-{label}", upstream_url, tmp,
                         tracing={"otlp_endpoint": opts.otlp, "sample_ratio": ratio})
        started.append(traced)
        out.append(Target(name, traced.url, traced.pid))
    if opts.pure_sources is not None:
        pure = Gateway(f"pure-{label}", upstream_url, tmp, sources=opts.pure_sources)
        started.append(pure)
        out.append(Target("pure", pure.url, pure.pid))
    if opts.baseline is not None:
        base = Gateway(f"baseline-{label}", upstream_url, tmp, sources=opts.baseline)
        started.append(base)
        out.append(Target("baseline", base.url, base.pid))
    for name, module in (("lean", "bench.lean_proxy"), ("naive", "bench.naive_proxy")):
        server = PyServer(f"{name}-{label}", module, ["--upstream", upstream_url], tmp)
        started.append(server)
        out.append(Target(name, server.url, server.pid))
    running = []
    for peer in opts.peers:
        r = peers.start(peer, upstream_url, tmp, f"{peer.name}-{label}")
        started.append(r)
        running.append(r)
    for r in running:  # started together, waited for in turn: their start-ups overlap
        why = peers.wait_ready(r, ready_body)
        if why is None:
            out.append(Target(r.peer.name, r.url, r.pid, r.command))
        else:
            notes.append(f"peer {r.peer.name} ({label}) left out: it did not answer a chat completion ({why}); "
                         f"log: {peers.log_tail(r)!r}")
            r.stop()
            started.remove(r)
    return out
