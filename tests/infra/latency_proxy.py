#!/usr/bin/env python3
"""A TCP proxy that adds latency, and stalls on a signal: a far-away or failing store for tests and benchmarks.

    python tests/infra/latency_proxy.py --to 127.0.0.1:9000 --delay-ms 30     # prints "listening <port>"

Every chunk the client sends (a request) reaches the server `--delay-ms` later, as over a long link. SIGUSR1 makes
it stop answering: connections stay open and new ones are accepted, but no byte moves either way (a server that
hangs); SIGUSR2 lets traffic move again.
"""

from __future__ import annotations

import argparse
import asyncio
import signal


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float, moving: asyncio.Event):
    try:
        while chunk := await reader.read(1 << 16):
            await moving.wait()
            if delay:
                await asyncio.sleep(delay)
            writer.write(chunk)
            await writer.drain()
    except (ConnectionError, asyncio.CancelledError):
        pass
    finally:
        writer.close()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--to", required=True, help="host:port of the server")
    parser.add_argument("--port", type=int, default=0, help="port to listen on, 127.0.0.1 (0: any free one)")
    parser.add_argument("--delay-ms", type=float, default=30.0, help="added to every request")
    args = parser.parse_args()
    host, port = args.to.rsplit(":", 1)
    moving = asyncio.Event()
    moving.set()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR1, moving.clear)
    loop.add_signal_handler(signal.SIGUSR2, moving.set)

    async def serve(client_reader, client_writer):
        try:
            server_reader, server_writer = await asyncio.open_connection(host, int(port))
        except OSError:
            client_writer.close()
            return
        await asyncio.gather(pipe(client_reader, server_writer, args.delay_ms / 1000, moving),
                             pipe(server_reader, client_writer, 0.0, moving))

    server = await asyncio.start_server(serve, "127.0.0.1", args.port)
    print(f"listening {server.sockets[0].getsockname()[1]}", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main())
