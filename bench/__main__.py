"""`python -m bench <benchmark> [options]`; each benchmark is a module with `add_arguments` and `run`.

Add one by listing its module in COMMANDS; modules are imported only when chosen.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

COMMANDS = {
    "overhead": ("bench.overhead", "gateway vs direct vs a naive proxy against nginx: throughput, latency, CPU"),
    "soak": ("bench.soak", "minutes of mixed load with faults: errors by cause, gateway RSS over time"),
    "routing": ("bench.routing", "routing quality of every policy over emulated fleets (--quick: < 3 min)"),
    "routing-sim": ("bench.routing_sim", "routing tail in virtual time: reuse, TTFT p50/p99, load balance of every "
                    "policy and SMG's cache_aware on the same seeded traffic (no processes; ~10 min)"),
    "real-vllm": ("bench.real_vllm", "round_robin vs prefix_affinity on two real vLLM CPU servers"),
    "multiturn": ("bench.multiturn", "multi-turn prefix reuse vs one infinite cache: prefix_affinity (today's, "
                  "this tree, with KV events) and sglang-router's cache_aware"),
    "instructions": ("bench.instructions", "instructions per request under callgrind (gateway vs the lean relay): "
                     "json, 20 events in one write, per extra one-event-per-write chunk"),
    "workers": ("bench.workers", "gateway serve --workers N scaling against nginx (wrk -c64)"),
    "pd": ("bench.pd", "prefill/decode disaggregation vs an aggregated pool of the same size (and when: auto) on "
                       "emulated vLLM: TTFT p50/p99 and output tokens/s, long and short prompts"),
    "scale": ("bench.scale", "10k idle streams (memory per stream), loop lag at 2,000 active streams, "
                             "--workers 2 vs 1; beside vllm-router"),
    "replicas": ("bench.replicas", "Redis + 3 replicas x 2 workers: shared budget, weight propagation, placement, "
                                   "scaling, store overhead"),
}


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    sub = parser.add_subparsers(dest="benchmark", required=True)
    chosen = args_list[0] if args_list and args_list[0] in COMMANDS else None
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        if name == chosen:
            importlib.import_module(module).add_arguments(p)
    args = parser.parse_args(args_list)
    code: int = importlib.import_module(COMMANDS[args.benchmark][0]).run(args, args_list)
    return code


if __name__ == "__main__":
    sys.exit(main())
