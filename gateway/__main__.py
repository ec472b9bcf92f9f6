"""Command line: `gateway serve`, `gateway check-config`, `gateway emulate`, `gateway compare`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence

from .settings import ConfigError, Settings

log = logging.getLogger("gateway")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gateway", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the gateway (with no --config: an embedded demo fleet)")
    serve.add_argument("--config", help="YAML config file; omit it to start the embedded demo fleet")
    serve.add_argument("--host", help="listen address (overrides the config's listen.host)")
    serve.add_argument("--port", type=int, help="listen port, 0 for any free port (overrides listen.port)")
    serve.add_argument("--picker-port", type=int,
                       help="also serve as Envoy's Endpoint Picker (ext_proc gRPC) on this port (overrides "
                       "endpoint_picker.listen.port; with no --config the demo fleet is on ports 8001-8007)")
    serve.add_argument("--workers", type=int, default=1, help="worker processes sharing the port (SO_REUSEPORT)")
    serve.add_argument("--reuse-port", action="store_true", help=argparse.SUPPRESS)
    serve.add_argument("--hub", help=argparse.SUPPRESS)  # a worker: its supervisor's socket
    serve.add_argument("--worker-slot", type=int, default=0, help=argparse.SUPPRESS)
    serve.add_argument("--log-level", default="INFO")
    check = sub.add_parser("check-config", help="validate a config file and print every error")
    check.add_argument("file")
    hash_key = sub.add_parser("hash-key", help="print the sha256:<hex> digest to put in auth.api_keys[].key")
    hash_key.add_argument("key", nargs="?", help="the key (default: read one line from stdin)")
    sub.add_parser("emulate", help="run one runtime emulator (see `gateway emulate --help`)", add_help=False)
    from .admin.compare_cli import add_arguments as add_compare_arguments

    add_compare_arguments(sub.add_parser("compare", help="print a running gateway's live comparison as tables"))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["emulate"]:
        from backends.emulator.cli import main as emulate_main

        return emulate_main(args_list[1:])
    args = _parser().parse_args(args_list)
    if args.command == "check-config":
        return _check_config(args.file)
    if args.command == "hash-key":
        from .access.secrets import hash_key as digest

        key = args.key if args.key is not None else sys.stdin.readline().rstrip("\n")
        if not key:
            print("hash-key: empty key", file=sys.stderr)
            return 2
        print(digest(key))
        return 0
    if args.command == "compare":
        from .admin.compare_cli import main as compare_main

        return compare_main(args)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = text = None
    if args.config and args.hub is None:  # (a worker of a supervisor runs its committed generation)
        try:
            text, settings = _checked(args.config)
        except (ConfigError, OSError) as exc:
            _print_config_error(exc)
            return 2
    _install_uvloop()
    from .process import serve

    return asyncio.run(
        serve(settings, host=args.host, port=args.port, workers=args.workers, reuse_port=args.reuse_port,
              config_path=args.config, hub=args.hub, worker_slot=args.worker_slot, config_text=text,
              picker_port=args.picker_port)
    )


def _checked(path: str) -> tuple[str, Settings]:
    """The config file's text and settings, through the one check every process makes (tokenizers
    and jinja2 are imported only here, when a config is checked)."""
    from pathlib import Path

    from .state.reload import check

    text = Path(path).read_text(encoding="utf-8")
    return text, check(text, source=path).settings


def _check_config(path: str) -> int:
    try:
        _, settings = _checked(path)
    except (ConfigError, OSError) as exc:
        _print_config_error(exc)
        return 1
    found = f", {len(settings.discovery)} discovery entries" if settings.discovery else ""
    print(f"{path}: OK ({len(settings.backends)} backends{found}, {len(settings.routes)} routes)")
    return 0


def _print_config_error(exc: Exception) -> None:
    if isinstance(exc, ConfigError):
        print(f"{exc.source}: invalid configuration", file=sys.stderr)
        for line in exc.errors:
            print(f"  {line}", file=sys.stderr)
    else:
        print(f"cannot read config: {exc}", file=sys.stderr)


def _install_uvloop() -> None:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on every supported platform
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


if __name__ == "__main__":
    sys.exit(main())
