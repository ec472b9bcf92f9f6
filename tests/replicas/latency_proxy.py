"""A loopback TCP proxy that delays every byte by a fixed time: a test double of the network path to
a Redis that is far away (or slow to answer).

It forwards each connection to `--target` and delivers every chunk `rtt/2` after it arrived, in each
direction, so that a command and its answer take one `rtt` more than they would, whatever else is in
flight: it adds latency, never serialises (a pipelined burst arrives `rtt` later, all together) and
never limits bandwidth. Connection set-up costs nothing extra (the proxy accepts at once and opens
its side to the target at once), as on a real path, where the TCP handshake is one round trip and
the first command the other.

Runs as its own process, started and stopped by pid (`LatencyProxy`, used by the replicas tests and
`python -m bench replicas`), or by hand:

    python -m tests.replicas.latency_proxy --target 127.0.0.1:6379 --rtt-ms 60
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import subprocess
import sys
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float) -> None:
    loop = asyncio.get_running_loop()
    due: deque[tuple[float, bytes]] = deque()
    ready = asyncio.Event()
    done = False

    async def deliver() -> None:
        while True:
            while not due:
                if done:
                    return
                ready.clear()
                await ready.wait()
            at, data = due.popleft()
            pause = at - loop.time()
            if pause > 0:
                await asyncio.sleep(pause)
            writer.write(data)
            await writer.drain()

    sender = loop.create_task(deliver())
    try:
        while data := await reader.read(65536):
            due.append((loop.time() + delay_s, data))
            ready.set()
    except (ConnectionError, OSError):
        pass
    finally:
        done = True
        ready.set()
        with contextlib.suppress(ConnectionError, OSError):
            await sender
        with contextlib.suppress(ConnectionError, OSError, RuntimeError):
            if writer.can_write_eof():
                writer.write_eof()


async def serve(listen_port: int, target: tuple[str, int], rtt_s: float) -> None:
    half = rtt_s / 2

    async def connected(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            server_r, server_w = await asyncio.open_connection(*target)
        except OSError:
            client_w.close()
            return
        try:
            await asyncio.gather(_pump(client_r, server_w, half), _pump(server_r, client_w, half))
        finally:
            for w in (client_w, server_w):
                w.close()

    server = await asyncio.start_server(connected, "127.0.0.1", listen_port)
    port = server.sockets[0].getsockname()[1]
    print(f"latency proxy on 127.0.0.1:{port} -> {target[0]}:{target[1]}, rtt {rtt_s * 1000:g} ms", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()


class LatencyProxy:
    """`python -m tests.replicas.latency_proxy` in a process of its own; `port` is where to connect."""

    def __init__(self, target_port: int, *, rtt_ms: float, log_path: Path | None = None) -> None:
        self.rtt_ms = rtt_ms
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.replicas.latency_proxy", "--target", f"127.0.0.1:{target_port}",
             "--rtt-ms", str(rtt_ms)],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT if log_path is None else log_path.open("ab"),
            text=True, start_new_session=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("latency proxy on "):
            self.stop()
            raise RuntimeError(f"the latency proxy did not start: {line!r}")
        self.port = int(line.split()[3].rsplit(":", 1)[1])

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", required=True, help="host:port to forward to")
    parser.add_argument("--rtt-ms", type=float, required=True, help="round trip added to every exchange")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    host, _, port = args.target.rpartition(":")
    asyncio.run(serve(args.port, (host or "127.0.0.1", int(port)), args.rtt_ms / 1000))


if __name__ == "__main__":
    main()
