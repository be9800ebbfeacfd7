"""How long the registry waits for each webhook answer: a timing relay in front of each endpoint.

Docker's registry sends one endpoint's notifications one at a time and waits for each answer, so
the time it spends per delivery on an endpoint is what holds back every push behind it. The relay
sits between the registry and each endpoint (the null receiver, gpubadge), passes every request
and answer through unchanged, and prints, per delivery, when the registry's request began to
arrive and when the endpoint's answer had been passed back whole:
`delivery <name> <start epoch> <end epoch> <status>`. It runs in a process of its own, so the
bench's other work does not stall it; both endpoints pay the same relay.

Only what a registry sends is handled: HTTP/1.1 requests and answers framed by Content-Length,
over kept-alive connections.

python3 -m bench.delivery_relay --relay NAME:LISTEN_PORT:TARGET_PORT [--relay ...]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
import time

HEAD_END = b"\r\n\r\n"


def content_length(head: bytes) -> int:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value.strip())
        if name.strip().lower() == b"transfer-encoding":
            raise ValueError("chunked bodies are not relayed")
    return 0


async def read_message(reader: asyncio.StreamReader) -> tuple[bytes, float] | None:
    """One HTTP message (head and body), and when its first byte was read; None at EOF."""
    try:
        head = await reader.readuntil(HEAD_END)
    except asyncio.IncompleteReadError:
        return None
    started = time.time()
    body = await reader.readexactly(content_length(head))
    return head + body, started


async def relay_connection(
    name: str, target: int, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter
) -> None:
    upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", target)
    try:
        while (request := await read_message(client_reader)) is not None:
            message, started = request
            upstream_writer.write(message)
            answer = await read_message(upstream_reader)
            if answer is None:
                break
            client_writer.write(answer[0])
            await client_writer.drain()
            status = answer[0].split(b" ", 2)[1].decode()
            sys.stdout.write(f"delivery {name} {started:.6f} {time.time():.6f} {status}\n")
            sys.stdout.flush()
    except (ConnectionError, asyncio.IncompleteReadError, ValueError):
        pass
    finally:
        for writer in (upstream_writer, client_writer):
            with contextlib.suppress(Exception):
                writer.close()


async def serve(relays: list[tuple[str, int, int]]) -> None:
    servers = []
    for name, listen, target in relays:

        async def handle(
            reader: asyncio.StreamReader, writer: asyncio.StreamWriter, name: str = name, target: int = target
        ) -> None:
            await relay_connection(name, target, reader, writer)

        servers.append(await asyncio.start_server(handle, "127.0.0.1", listen))
    print("ready", flush=True)
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(signum, stop.set)
    await stop.wait()
    for server in servers:
        server.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--relay", action="append", required=True, help="NAME:LISTEN_PORT:TARGET_PORT")
    relays = []
    for text in parser.parse_args().relay:
        name, listen, target = text.split(":")
        relays.append((name, int(listen), int(target)))
    asyncio.run(serve(relays))


if __name__ == "__main__":
    main()
