"""Command line: `gateway serve`, `gateway check-config`, `gateway emulate`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Sequence

from aiohttp import web

from .settings import ConfigError, Settings, load_settings

log = logging.getLogger("gateway")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gateway", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the gateway (with no --config: an embedded demo fleet)")
    serve.add_argument("--config", help="YAML config file; omit it to start the embedded demo fleet")
    serve.add_argument("--host", help="listen address (overrides the config's listen.host)")
    serve.add_argument("--port", type=int, help="listen port, 0 for any free port (overrides listen.port)")
    serve.add_argument("--log-level", default="INFO")
    check = sub.add_parser("check-config", help="validate a config file and print every error")
    check.add_argument("file")
    sub.add_parser("emulate", help="run one runtime emulator (see `gateway emulate --help`)", add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["emulate"]:
        from backends.emulator.cli import main as emulate_main

        return emulate_main(args_list[1:])
    args = _parser().parse_args(args_list)
    if args.command == "check-config":
        return _check_config(args.file)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = None
    if args.config:
        try:
            settings = load_settings(args.config)
        except (ConfigError, OSError) as exc:
            _print_config_error(exc)
            return 2
    _install_uvloop()
    return asyncio.run(_serve(settings, host=args.host, port=args.port))


def _check_config(path: str) -> int:
    try:
        settings = load_settings(path)
    except (ConfigError, OSError) as exc:
        _print_config_error(exc)
        return 1
    print(f"{path}: OK ({len(settings.backends)} backends, {len(settings.routes)} routes)")
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


async def _serve(settings: Settings | None, *, host: str | None, port: int | None) -> int:
    from .app import build_app

    demo = None
    if settings is None:
        from .demo import start_demo

        demo = await start_demo(host=host or "127.0.0.1")
        settings = demo.settings
    host = host or settings.listen.host
    port = settings.listen.port if port is None else port
    app = await build_app(settings)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0][1] if runner.addresses else port
    url = f"http://{host}:{bound}"
    print(f"gateway listening on {url}", flush=True)
    if demo is not None:
        print(demo.banner(url), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down")
    await runner.cleanup()
    if demo is not None:
        await demo.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
