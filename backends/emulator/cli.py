"""`gateway emulate ...`: run one emulator in its own process until SIGINT/SIGTERM.

Prints one line with the URL once the port is bound, so scripts and tests can wait for it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import signal
import sys

from backends.base import Runtime
from backends.emulator.config import EmulatorConfig, KvEventsConfig
from backends.emulator.faults import Faults
from backends.emulator.pd_args import disagg_config
from backends.emulator.profiles import PROFILES
from backends.emulator.server import start_emulator


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gateway emulate", description="Run one emulated serving runtime.")
    p.add_argument("--runtime", required=True, choices=[r.value for r in Runtime])
    p.add_argument("--port", type=int, required=True, help="0 picks a free port")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--model", default="tiny-moe")
    p.add_argument("--profile", default="tiny", choices=sorted(PROFILES))
    p.add_argument("--speed", type=float, default=1.0, help="simulated seconds per wall second")
    p.add_argument("--metrics-port", type=int, default=0, help="Triton only: the separate metrics port")
    p.add_argument("--max-model-len", type=int, default=32768)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prefix-reuse", choices=["on", "off", "default"], default="default")
    p.add_argument("--block-size", type=int, default=None,
                   help="KV block size (vLLM --block-size, SGLang --page-size, trtllm tokens_per_block)")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="KV pool size in blocks (--num-gpu-blocks-override)")
    p.add_argument("--embedding-dim", type=int, default=None,
                   help="serve an embedding model of this dimension (vLLM/SGLang/trtllm-serve /v1/embeddings)")
    p.add_argument("--data-parallel-size", type=int, default=1, metavar="N",
                   help="vLLM/SGLang: one server of N data-parallel engines (own caches, batches, KV events on "
                        "port + rank, per-rank metrics); pinned by X-data-parallel-rank (vLLM) or routed_dp_rank "
                        "(SGLang), else balanced as the engine does")
    d = p.add_argument_group("prefill/decode disaggregation (docs/emulator.md)")
    d.add_argument("--role", choices=["prefill", "decode", "both"], default=None,
                   help="what the server does with P/D requests (default: both when P/D is configured; "
                        "without any P/D flag the server is aggregated)")
    d.add_argument("--kv-transfer-config", default=None, metavar="JSON",
                   help='vLLM: {"kv_connector":"NixlConnector"|"ExampleConnector","kv_role":"kv_producer"|'
                        '"kv_consumer"|"kv_both",...}; the role follows kv_role unless --role narrows it')
    d.add_argument("--disaggregation-mode", choices=["null", "prefill", "decode"], default=None, help="SGLang")
    d.add_argument("--disaggregation-bootstrap-port", type=int, default=None, metavar="N",
                   help="SGLang prefill: the bootstrap (rendezvous) HTTP server's port (default 8998; 0: free)")
    d.add_argument("--kv-transfer-timeout-s", type=float, default=None, metavar="S",
                   help="how long a prefill keeps KV no decode read (vLLM VLLM_NIXL_ABORT_REQUEST_TIMEOUT, "
                        "trtllm kv_transfer_timeout_ms); SGLang: both bootstrap and waiting timeouts")
    k = p.add_argument_group("KV-cache events")
    k.add_argument("--kv-events", metavar="ENDPOINT", default=None,
                   help="publish KV-cache events: vLLM/SGLang a ZMQ endpoint (tcp://127.0.0.1:PORT connects, "
                        "tcp://*:PORT binds); trtllm-serve any value (served by POST /kv_cache_events)")
    k.add_argument("--kv-events-topic", default="")
    k.add_argument("--kv-events-encoding", choices=["map", "array"], default="map",
                   help="vLLM: tagged maps (0.32) or positional arrays (before vLLM PR #42892)")
    k.add_argument("--kv-events-replay", metavar="ENDPOINT", default=None, help="a ROUTER replay endpoint")
    k.add_argument("--kv-events-drop", default="", metavar="SEQ[,SEQ...]",
                   help="batches (sequence numbers) to consume but not send: a gap")
    k.add_argument("--kv-events-silent-after", type=int, default=None, metavar="N",
                   help="send nothing after N batches: a silent publisher")
    f = p.add_argument_group("fault knobs")
    f.add_argument("--fail-first", type=int, default=0)
    f.add_argument("--fail-status", type=int, default=503)
    f.add_argument("--fail-rate", type=float, default=0.0)
    f.add_argument("--hang", action="store_true")
    f.add_argument("--die-after-tokens", type=int, default=None)
    f.add_argument("--error-after-tokens", type=int, default=None)
    f.add_argument("--not-ready-for-s", type=float, default=0.0)
    f.add_argument("--max-queue", type=int, default=None)
    return p


def config_from_args(args: argparse.Namespace) -> EmulatorConfig:
    faults = Faults(
        fail_first=args.fail_first, fail_status=args.fail_status, fail_rate=args.fail_rate, hang=args.hang,
        die_after_tokens=args.die_after_tokens, error_after_tokens=args.error_after_tokens,
        not_ready_for_s=args.not_ready_for_s, max_queue=args.max_queue,
    )
    reuse = {"on": True, "off": False, "default": None}[args.prefix_reuse]
    kv = None
    if args.kv_events is not None:
        drop = frozenset(int(x) for x in args.kv_events_drop.split(",") if x.strip())
        kv = KvEventsConfig(endpoint=args.kv_events, topic=args.kv_events_topic, encoding=args.kv_events_encoding,
                            replay_endpoint=args.kv_events_replay, drop_batches=drop,
                            silent_after=args.kv_events_silent_after)
    runtime = Runtime(args.runtime)
    disagg = disagg_config(runtime, role=args.role, kv_transfer_config=args.kv_transfer_config,
                           disaggregation_mode=args.disaggregation_mode,
                           bootstrap_port=args.disaggregation_bootstrap_port, env=os.environ)
    if disagg is not None and args.kv_transfer_timeout_s is not None:
        t = args.kv_transfer_timeout_s
        disagg = dataclasses.replace(disagg, kv_lease_s=t, bootstrap_timeout_s=t, waiting_timeout_s=t)
    return EmulatorConfig(runtime=runtime, model=args.model, profile=args.profile, speed=args.speed,
                          faults=faults, max_model_len=args.max_model_len, seed=args.seed, prefix_reuse=reuse,
                          block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
                          embedding_dim=args.embedding_dim, kv_events=kv, data_parallel_size=args.data_parallel_size,
                          disagg=disagg)


async def _run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    emu = await start_emulator(cfg, host=args.host, port=args.port, metrics_port=args.metrics_port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    extra = f" metrics={emu.metrics_url}" if emu.metrics_url != emu.url else ""
    if cfg.kv_events is not None and cfg.runtime is not Runtime.TRTLLM:
        extra += f" kv_events={cfg.kv_events.endpoint}"
    if cfg.disagg is not None:
        extra += f" role={cfg.disagg.role}{emu.disagg_summary()}"
    print(f"emulator {cfg.runtime.value} ready at {emu.url}{extra} (profile={cfg.profile}, speed={cfg.speed})",
          flush=True)
    try:
        await stop.wait()
    finally:
        await emu.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return asyncio.run(_run(args))
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
