"""Push bursts through a real registry: gpubadge's push -> badge next to a receiver that only records.

Docker's registry sends its notifications one at a time per endpoint and waits for each
answer, so a slow webhook answer holds back every push behind it. One registry notifies two
endpoints, each with its own queue: a null receiver (answers at once, records arrivals) and
`gpubadge serve`. The same pushes (N images by C concurrent skopeo clients) feed both, so the
null receiver's arrival latency is the floor that the registry and the machine impose, and
gpubadge's push -> badge (a client long-polling the report, as a pipeline does) is measured
against it in the same run.

Run alone: python3 -m bench.push_burst_bench [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import tempfile
import time
import urllib.parse
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from aiohttp import web

from bench.common import Figure, Results, ms, percentile, push_with_retry
from bench.service_bench import push_layout_images
from fixtures.registry import free_port, notification_endpoint, run_registry
from fixtures.service import run_service_process


@dataclass
class BurstFigures:
    images: int = 200
    clients: int = 50

    @classmethod
    def quick(cls) -> BurstFigures:
        return cls(images=60, clients=20)


class NullReceiver:
    """A webhook endpoint that answers 200 at once and records when each tag's push arrived."""

    def __init__(self) -> None:
        self.arrivals: dict[str, float] = {}
        self.arrived: dict[str, asyncio.Event] = {}
        self.port = free_port()

    def event(self, tag: str) -> asyncio.Event:
        return self.arrived.setdefault(tag, asyncio.Event())

    async def receive(self, request: web.Request) -> web.Response:
        now = time.time()
        with contextlib.suppress(ValueError, KeyError, TypeError):
            for event in json.loads(await request.read())["events"]:
                tag = event.get("target", {}).get("tag")
                if event.get("action") == "push" and tag and tag not in self.arrivals:
                    self.arrivals[tag] = now
                    self.event(tag).set()
        return web.Response(status=200)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[str]:
        app = web.Application()
        app.router.add_post("/", self.receive)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", self.port).start()
        try:
            yield f"http://127.0.0.1:{self.port}/"
        finally:
            await runner.cleanup()


def webhook_answer_mean(metrics: str) -> float:
    """Mean time gpubadge took to answer the registry's deliveries, from its own /metrics."""
    total = count = 0.0
    for line in metrics.splitlines():
        name, _, value = line.rpartition(" ")
        if name.startswith("gpubadge_webhook_duration_seconds_sum"):
            total += float(value)
        elif name.startswith("gpubadge_webhook_duration_seconds_count"):
            count += float(value)
    return total / count if count else 0.0


async def measure_burst(
    figures: BurstFigures, workdir: Path
) -> tuple[list[float], list[float], list[float], float]:
    """(null-receiver arrival latencies, push->badge latencies, skopeo push times, mean webhook answer)."""
    receiver = NullReceiver()
    port = free_port()
    loop = asyncio.get_running_loop()
    floor: list[float] = []
    badge: list[float] = []
    push_seconds: list[float] = []
    watchers: list[asyncio.Task[None]] = []
    async with receiver.running() as null_url:
        endpoints = [
            notification_endpoint(null_url) | {"name": "null"},
            notification_endpoint(f"http://127.0.0.1:{port}/hooks/distribution") | {"name": "gpubadge"},
        ]
        with (
            run_registry(extra_config={"notifications": {"endpoints": endpoints}}) as registry,
            run_service_process(workdir / "burst.db", port=port) as service,
        ):
            root = workdir / "layout"
            tags = push_layout_images(root, figures.images, 0)
            repo = f"{registry.host}/bench/burst"
            timeout = aiohttp.ClientTimeout(total=120)
            async with aiohttp.ClientSession(timeout=timeout) as session:

                async def watch(tag: str, pushed: float) -> None:
                    query = urllib.parse.urlencode({"ref": f"{repo}:{tag}", "wait": "30"})
                    while True:
                        async with session.get(f"{service.url}/api/images/by-ref?{query}") as response:
                            await response.read()
                            if response.status == 200:
                                badge.append(time.time() - pushed)
                                break
                    await asyncio.wait_for(receiver.event(tag).wait(), 60)
                    floor.append(receiver.arrivals[tag] - pushed)

                def push(tag: str) -> None:
                    started = time.time()
                    push_with_retry(root, tag, f"{repo}:{tag}")
                    pushed = time.time()
                    push_seconds.append(pushed - started)
                    loop.call_soon_threadsafe(lambda: watchers.append(loop.create_task(watch(tag, pushed))))

                with ThreadPoolExecutor(figures.clients) as pool:
                    await asyncio.gather(*(loop.run_in_executor(pool, push, tag) for tag in tags))
                await asyncio.wait_for(asyncio.gather(*watchers), 180)
                async with session.get(f"{service.url}/metrics") as response:
                    answers = webhook_answer_mean(await response.text())
    return floor, badge, push_seconds, answers


def run_all(results: Results, quick: bool) -> None:
    figures = BurstFigures.quick() if quick else BurstFigures()
    print(f"push burst: {figures.images} images by {figures.clients} concurrent skopeo clients", flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="gpubadge-bench-burst-"))
    try:
        floor, badge, pushes, answer = asyncio.run(measure_burst(figures, workdir))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    for name, pick in (("p50", 0.5), ("p99", 0.99)):
        ours, peer = percentile(badge, pick), percentile(floor, pick)
        results.add(
            Figure(
                "burst",
                f"push -> badge {name}, {figures.images} pushes by {figures.clients} clients, vs null receiver",
                ms(ours),
                peer=f"null receiver arrival {ms(peer)}",
                ratio=peer / ours if ours > 0 else None,
                target="within 100 ms of the floor",
                met=ours - peer <= 0.100,
                note=f"difference {ms(ours - peer)}; gpubadge answered each delivery in {ms(answer)} on average; "
                f"skopeo push itself p50 {ms(percentile(pushes, 0.5))}",
            )
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller workloads")
    results = Results()
    run_all(results, parser.parse_args().quick)
    for figure in results.figures:
        print(f"  {figure.name}: {figure.note}")


if __name__ == "__main__":
    main()
