"""Push bursts through a real registry: gpubadge's push -> badge next to a receiver that only records.

Docker's registry sends its notifications one at a time per endpoint and waits for each
answer, so a slow webhook answer holds back every push behind it. One registry notifies two
endpoints, each with its own queue: a null receiver (answers at once, records arrivals) and
`gpubadge serve`. The same pushes (N images by C concurrent skopeo clients) feed both, so the
null receiver's arrival latency is the floor that the registry and the machine impose, and
gpubadge's push -> badge (a client long-polling the badge, `until=facts`: the config facts, which the GPU
badge shows; then the full report, `until=done`, reported beside it) is measured
against it in the same run.

Run alone: python3 -m bench.push_burst_bench [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import sqlite3
import tempfile
import time
import urllib.parse
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import aiohttp
from aiohttp import web

from bench.common import Figure, Results, ms, percentile, push_with_retry
from bench.service_bench import push_layout_images
from fixtures.registry import free_port, notification_endpoint, run_registry
from fixtures.service import run_role_process, run_service_process, wait_healthy


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


@dataclass
class Breakdown:
    """Where gpubadge's push -> badge goes, per push: until the registry's delivery is committed as
    a job (the registry's queue to gpubadge, which waits on each answer), then until the badge
    is visible (queue wait, claim, the scan's registry round trips, the report's commit)."""

    delivered: list[float]  # push done -> its job committed (jobs.created_at)
    scanned: list[float]  # job committed -> badge visible to the long-polling client
    complete: list[float]  # push done -> the full report (layers read) visible


def job_times(db: Path, tags: dict[str, float]) -> dict[str, float]:
    """When each tag's first job was committed (the store's clock: the same host's wall clock)."""
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
        rows = conn.execute("SELECT reference, created_at FROM jobs").fetchall()
    first: dict[str, float] = {}
    for reference, created in rows:
        tag = reference.rpartition("@")[0] if "@" in reference else reference
        tag = tag.rpartition(":")[2]
        if tag in tags:
            moment = datetime.fromisoformat(created).timestamp()
            first[tag] = min(first.get(tag, moment), moment)
    return first


@contextlib.contextmanager
def running_worker(db: Path, env: dict[str, str] | None, log: Path) -> Iterator[None]:
    """`gpubadge worker` on `db`, ready (its /healthz answers) before the pushes start."""
    port = free_port()
    with run_role_process(["worker", "--metrics-port", str(port)], db, env, log) as process:
        wait_healthy(f"http://127.0.0.1:{port}", process)
        yield


async def measure_burst(
    figures: BurstFigures, workdir: Path, env: dict[str, str] | None = None, *, apart: bool = False
) -> tuple[list[float], list[float], list[float], float, Breakdown]:
    """(null-receiver arrival latencies, push->badge latencies, skopeo push times, mean webhook answer,
    where the badge's time went). `apart`: the service is `serve --workers 0` beside one `gpubadge
    worker` on the same SQLite file (they wake each other through `store.sqlite_notify`)."""
    receiver = NullReceiver()
    port = free_port()
    loop = asyncio.get_running_loop()
    floor: list[float] = []
    badge: list[float] = []
    push_seconds: list[float] = []
    watchers: list[asyncio.Task[None]] = []
    pushed_at: dict[str, float] = {}
    visible_at: dict[str, float] = {}
    complete: list[float] = []
    async with receiver.running() as null_url:
        endpoints = [
            notification_endpoint(null_url) | {"name": "null"},
            notification_endpoint(f"http://127.0.0.1:{port}/hooks/distribution") | {"name": "gpubadge"},
        ]
        with (
            run_registry(extra_config={"notifications": {"endpoints": endpoints}}) as registry,
            run_service_process(
                workdir / "burst.db",
                env={**(env or {}), **({"GPUBADGE_WORKERS": "0"} if apart else {})},
                port=port,
            ) as service,
            running_worker(workdir / "burst.db", env, workdir / "worker.log")
            if apart
            else contextlib.nullcontext(),
        ):
            root = workdir / "layout"
            tags = push_layout_images(root, figures.images, 0)
            repo = f"{registry.host}/bench/burst"
            timeout = aiohttp.ClientTimeout(total=120)
            async with aiohttp.ClientSession(timeout=timeout) as session:

                async def watch(tag: str, pushed: float) -> None:
                    # the badge: the config facts (a pending report counts); then the full report
                    query = urllib.parse.urlencode({"ref": f"{repo}:{tag}", "wait": "30", "until": "facts"})
                    while True:
                        async with session.get(f"{service.url}/api/images/by-ref?{query}") as response:
                            await response.read()
                            if response.status == 200:
                                visible_at[tag] = time.time()
                                badge.append(visible_at[tag] - pushed)
                                break
                    query = urllib.parse.urlencode({"ref": f"{repo}:{tag}", "wait": "30", "until": "done"})
                    while True:
                        async with session.get(f"{service.url}/api/images/by-ref?{query}") as response:
                            if response.status == 200 and not (await response.json()).get("pending"):
                                complete.append(time.time() - pushed)
                                break
                    await asyncio.wait_for(receiver.event(tag).wait(), 60)
                    floor.append(receiver.arrivals[tag] - pushed)

                def push(tag: str) -> None:
                    started = time.time()
                    push_with_retry(root, tag, f"{repo}:{tag}")
                    pushed = time.time()
                    pushed_at[tag] = pushed
                    push_seconds.append(pushed - started)
                    loop.call_soon_threadsafe(lambda: watchers.append(loop.create_task(watch(tag, pushed))))

                with ThreadPoolExecutor(figures.clients) as pool:
                    await asyncio.gather(*(loop.run_in_executor(pool, push, tag) for tag in tags))
                await asyncio.wait_for(asyncio.gather(*watchers), 180)
                async with session.get(f"{service.url}/metrics") as response:
                    answers = webhook_answer_mean(await response.text())
            committed = job_times(workdir / "burst.db", pushed_at)
    breakdown = Breakdown(
        [committed[tag] - pushed_at[tag] for tag in committed],
        [visible_at[tag] - committed[tag] for tag in committed if tag in visible_at],
        complete,
    )
    return floor, badge, push_seconds, answers, breakdown


async def measure_receivers(figures: BurstFigures, workdir: Path) -> dict[str, float]:
    """One burst, three receivers on the same registry, each with its own delivery queue: the null
    receiver, `gpubadge serve` with its defaults, and `gpubadge serve --workers 0` (the webhook
    intake alone: it commits every job, and no scan shares its process). Returns, per receiver, when
    its last delivery arrived (the null receiver) or was committed (the two services), in seconds
    after the last push finished. What the intake alone adds over the null receiver is the cost of
    the commit; what the full service adds over the intake alone is the scans sharing its process."""
    receiver = NullReceiver()
    full_port, intake_port = free_port(), free_port()
    loop = asyncio.get_running_loop()
    async with receiver.running() as null_url:
        endpoints = [
            notification_endpoint(null_url) | {"name": "null"},
            notification_endpoint(f"http://127.0.0.1:{full_port}/hooks/distribution") | {"name": "serve"},
            notification_endpoint(f"http://127.0.0.1:{intake_port}/hooks/distribution") | {"name": "intake"},
        ]
        with (
            run_registry(extra_config={"notifications": {"endpoints": endpoints}}) as registry,
            run_service_process(workdir / "full.db", port=full_port),
            run_service_process(workdir / "intake.db", env={"GPUBADGE_WORKERS": "0"}, port=intake_port),
        ):
            root = workdir / "layout"
            tags = push_layout_images(root, figures.images, 0)
            repo = f"{registry.host}/bench/receivers"
            with ThreadPoolExecutor(figures.clients) as pool:
                await asyncio.gather(
                    *(loop.run_in_executor(pool, push_with_retry, root, tag, f"{repo}:{tag}") for tag in tags)
                )
            pushed = time.time()
            await asyncio.wait_for(asyncio.gather(*(receiver.event(tag).wait() for tag in tags)), 120)
            last: dict[str, float] = {"null receiver": max(receiver.arrivals[tag] for tag in tags)}
            for name, db in (("serve", workdir / "full.db"), ("serve --workers 0", workdir / "intake.db")):
                deadline = time.monotonic() + 120
                while len(committed := job_times(db, dict.fromkeys(tags, 0.0))) < len(tags):
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{name}: {len(committed)} of {len(tags)} deliveries committed")
                    await asyncio.sleep(0.05)
                last[name] = max(committed.values())
    return {name: moment - pushed for name, moment in last.items()}


OLD_DEFAULT_CAP = {"GPUBADGE_PER_REGISTRY_SCANS": "4"}  # the default before issue 31: half of 8 workers
PEER_TREE = "GPUBADGE_BENCH_PEER_TREE"  # a checkout of an earlier gpubadge to run as the peer


def peer_env() -> tuple[str, dict[str, str]]:
    """The peer's label and environment: the checkout named by $GPUBADGE_BENCH_PEER_TREE (e.g. a
    worktree of main) with its own defaults, else this checkout with the old default cap."""
    tree = os.environ.get(PEER_TREE)
    if tree:
        return f"{Path(tree).name} with its defaults", {"PYTHONPATH": tree}
    return "old default cap (4 of 8 workers)", OLD_DEFAULT_CAP


def run_all(results: Results, quick: bool) -> None:
    """Ours (default settings: every worker on the one registry) and the peer (`peer_env`), each
    beside its own null receiver in the same run, the peer first; then ours again with a fifth of
    the pushers, where the registry and the pushers leave the two cores some room."""
    figures = BurstFigures.quick() if quick else BurstFigures()
    light = BurstFigures(figures.images, max(1, figures.clients // 5))
    print(f"push burst: {figures.images} images by {figures.clients} concurrent skopeo clients", flush=True)
    runs = {}
    peer_label, env_of_peer = peer_env()
    for label, env, workload in (
        (peer_label, env_of_peer, figures),
        ("defaults", None, figures),
        ("apart", None, figures),
        ("light", None, light),
    ):
        workdir = Path(tempfile.mkdtemp(prefix="gpubadge-bench-burst-"))
        try:
            runs[label] = asyncio.run(measure_burst(workload, workdir, env, apart=label == "apart"))
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    old_floor, old_badge, *_ = runs[peer_label]
    shapes = {
        "defaults": "",
        "apart": " (serve --workers 0 and one gpubadge worker on one SQLite file)",
        "light": "",
    }
    for label, workload in (("defaults", figures), ("apart", figures), ("light", light)):
        floor, badge, pushes, answer, breakdown = runs[label]
        for name, pick in (("p50", 0.5), ("p99", 0.99)):
            ours, peer = percentile(badge, pick), percentile(floor, pick)
            beside = ""
            if label == "defaults":
                old = percentile(old_badge, pick) - percentile(old_floor, pick)
                beside = f" ({peer_label}, same run: {ms(old)})"
            results.add(
                Figure(
                    "burst",
                    f"push -> badge {name}, {workload.images} pushes by {workload.clients} clients{shapes[label]},"
                    " vs null receiver",
                    ms(ours),
                    peer=f"null receiver arrival {ms(peer)}",
                    ratio=peer / ours if ours > 0 else None,
                    target="within 100 ms of the floor",
                    met=ours - peer <= 0.100,
                    note=f"difference {ms(ours - peer)}{beside}; gpubadge answered each delivery in {ms(answer)}"
                    f" on average; push -> job committed {name} {ms(percentile(breakdown.delivered, pick))},"
                    f" job -> badge {name} {ms(percentile(breakdown.scanned, pick))}; the full report (layers"
                    f" read) {name} {ms(percentile(breakdown.complete, pick))}; skopeo push itself p50"
                    f" {ms(percentile(pushes, 0.5))}",
                )
            )
    workdir = Path(tempfile.mkdtemp(prefix="gpubadge-bench-burst-"))
    try:
        last = asyncio.run(measure_receivers(figures, workdir))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    null, intake, full = last["null receiver"], last["serve --workers 0"], last["serve"]
    results.add(
        Figure(
            "burst",
            f"{figures.images} pushes by {figures.clients} clients, three receivers on one registry: the last"
            " delivery committed, after the last push",
            f"serve {ms(full)}; serve --workers 0 {ms(intake)}",
            peer=f"null receiver {ms(null)}",
            note=f"the intake alone (its commits, no scan in its process) ends {ms(intake - null)} after the null"
            f" receiver; the scans sharing the service's process add {ms(full - intake)}",
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
