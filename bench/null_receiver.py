"""The push-burst bench's floor: a webhook endpoint that answers 200 at once and records arrivals.

It runs in a process of its own, so its CPU is its own (`/proc/<pid>/stat`) and is set against
gpubadge's per pushed image. Each push event with a tag is printed on stdout as
`arrival <tag> <epoch seconds>` when its delivery arrives; the bench reads those lines.

python3 -m bench.null_receiver --port PORT
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
import time

from aiohttp import web


async def receive(request: web.Request) -> web.Response:
    now = time.time()
    with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError):
        for event in json.loads(await request.read())["events"]:
            tag = event.get("target", {}).get("tag")
            if event.get("action") == "push" and tag:
                sys.stdout.write(f"arrival {tag} {now:.6f}\n")
        sys.stdout.flush()
    return web.Response(status=200)


async def serve(port: int) -> None:
    app = web.Application()
    app.router.add_post("/", receive)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    print("ready", flush=True)
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(signum, stop.set)
    await stop.wait()
    await runner.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    asyncio.run(serve(parser.parse_args().port))


if __name__ == "__main__":
    main()
