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
import itertools
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Literal

import aiohttp

from bench.common import (
    Figure,
    Results,
    cpu_by_role,
    ms,
    percentile,
    push_with_retry,
    tree_cpu_by_process,
    tree_cpu_seconds,
    tree_wakeups,
    wakeup_cpu_seconds,
)
from bench.registry_burst import put_manifests, stage_images
from bench.service_bench import push_layout_images
from fixtures.postgres import postgres_unavailable_reason, run_postgres
from fixtures.process import stop_process
from fixtures.registry import free_port, notification_endpoint, run_registry
from fixtures.service import RunningService, run_role_process, run_service_process, wait_healthy


@dataclass
class BurstFigures:
    images: int = 200
    clients: int = 50

    @classmethod
    def quick(cls) -> BurstFigures:
        return cls(images=60, clients=20)


class EndpointProcess:
    """A helper process of the bench (the null receiver, the timing relay) that prints one record
    per line on stdout; a thread hands each line to `on_line` as it comes."""

    def __init__(self, args: list[str], on_line: Callable[[list[str]], None]) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", *args], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        )
        assert self.process.stdout is not None
        if self.process.stdout.readline().strip() != "ready":
            raise RuntimeError(f"{args[0]} did not start")
        self._reader = threading.Thread(target=self._read, args=(on_line,), daemon=True)
        self._reader.start()

    def _read(self, on_line: Callable[[list[str]], None]) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            on_line(line.split())

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._reader.join(5)


class NullReceiver:
    """The floor: `bench.null_receiver` in a process of its own (its CPU is its own), answering 200
    at once; records when each tag's push arrived."""

    def __init__(self) -> None:
        self.arrivals: dict[str, float] = {}
        self.arrived: dict[str, asyncio.Event] = {}
        self.port = free_port()
        self.process: EndpointProcess | None = None

    def event(self, tag: str) -> asyncio.Event:
        return self.arrived.setdefault(tag, asyncio.Event())

    @contextlib.contextmanager
    def running(self) -> Iterator[str]:
        loop = asyncio.get_running_loop()

        def on_line(fields: list[str]) -> None:
            if len(fields) == 3 and fields[0] == "arrival" and fields[1] not in self.arrivals:
                tag, moment = fields[1], float(fields[2])
                loop.call_soon_threadsafe(self._arrived, tag, moment)

        self.process = EndpointProcess(["bench.null_receiver", "--port", str(self.port)], on_line)
        try:
            yield f"http://127.0.0.1:{self.port}/"
        finally:
            self.process.stop()

    def _arrived(self, tag: str, moment: float) -> None:
        self.arrivals.setdefault(tag, moment)
        self.event(tag).set()


@dataclass
class Delivery:
    """One webhook delivery as the registry saw it, through `bench.delivery_relay`."""

    started: float  # the request's first byte reached the relay
    answered: float  # the endpoint's answer was passed back whole
    status: int

    @property
    def seconds(self) -> float:
        return self.answered - self.started


class DeliveryRelay:
    """`bench.delivery_relay` in front of each endpoint: per endpoint, every delivery's timing."""

    def __init__(self, targets: dict[str, int]) -> None:
        self.ports = {name: free_port() for name in targets}
        self.targets = targets
        self.deliveries: dict[str, list[Delivery]] = {name: [] for name in targets}
        self.process: EndpointProcess | None = None

    @contextlib.contextmanager
    def running(self) -> Iterator[dict[str, int]]:
        def on_line(fields: list[str]) -> None:
            if len(fields) == 5 and fields[0] == "delivery":
                self.deliveries[fields[1]].append(
                    Delivery(float(fields[2]), float(fields[3]), int(fields[4]))
                )

        relays = [f"{name}:{self.ports[name]}:{target}" for name, target in self.targets.items()]
        self.process = EndpointProcess(
            ["bench.delivery_relay", *(arg for relay in relays for arg in ("--relay", relay))], on_line
        )
        try:
            yield self.ports
        finally:
            self.process.stop()


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
class BurstRun:
    """One burst, measured: every figure per push, the deliveries as the registry saw them, CPU."""

    images: int
    floor: list[float]  # push done -> its delivery at the null receiver
    badge: list[float]  # push done -> the badge (config facts) visible to a long-polling client
    complete: list[float]  # push done -> the full report (layers read) visible
    pushes: list[float]  # skopeo's own push times
    delivered: list[float]  # push done -> its job committed (jobs.created_at)
    scanned: list[float]  # job committed -> badge visible
    deliveries: dict[str, list[Delivery]]  # per endpoint ("null", "gpubadge"), from the timing relay
    cpu: dict[str, float]  # seconds over the burst: gpubadge (every process), null, registry, postgres
    handler_mean: float  # gpubadge's own histogram of its webhook handling, mean seconds
    roles: dict[str, float] = field(
        default_factory=dict
    )  # gpubadge's CPU by process role (bench.common.cpu_by_role)
    wakeups: dict[str, int] = field(default_factory=dict)  # threads' sleeps over the burst: gpubadge, null
    wakeup_cpu: float = 0.0  # this host's CPU per wake-up of an idle thread (bench.common.wakeup_cpu_seconds)

    def answers(self, endpoint: str) -> list[float]:
        return [delivery.seconds for delivery in self.deliveries[endpoint]]

    def per_delivery(self, endpoint: str) -> float:
        """The registry's time per delivery to `endpoint` while its queue was backed up: from the
        start of one delivery to the start of the next, over the run of deliveries that followed
        each other with no wait for a push (the median of such cycles)."""
        cycles = backlog_cycles(self.deliveries[endpoint])
        return percentile(cycles, 0.5) if cycles else float("nan")

    def cpu_per_image(self, who: str) -> float:
        return self.cpu.get(who, 0.0) / self.images


BACKLOG_GAP = 0.002  # seconds: a next delivery sent this soon after an answer was already waiting


def backlog_cycles(deliveries: list[Delivery]) -> list[float]:
    """Start-to-start times of consecutive deliveries where the next was sent at once (within
    BACKLOG_GAP of the answer): the registry's own cost per delivery plus the endpoint's answer."""
    ordered = sorted(deliveries, key=lambda delivery: delivery.started)
    return [
        after.started - before.started
        for before, after in itertools.pairwise(ordered)
        if after.started - before.answered <= BACKLOG_GAP
    ]


def job_times(
    tags: dict[str, float], db: Path | None = None, database_url: str | None = None
) -> dict[str, float]:
    """When each tag's first job was committed (the store's clock: the same host's wall clock)."""
    if database_url:
        import psycopg

        with psycopg.connect(database_url, connect_timeout=10) as conn:
            rows = [
                (reference, created.timestamp())
                for reference, created in conn.execute("SELECT reference, created_at FROM jobs").fetchall()
            ]
    else:
        assert db is not None
        with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
            rows = [
                (reference, datetime.fromisoformat(created).timestamp())
                for reference, created in conn.execute("SELECT reference, created_at FROM jobs").fetchall()
            ]
    first: dict[str, float] = {}
    for reference, moment in rows:
        tag = reference.rpartition("@")[0] if "@" in reference else reference
        tag = tag.rpartition(":")[2]
        if tag in tags:
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
    figures: BurstFigures,
    workdir: Path,
    env: dict[str, str] | None = None,
    *,
    apart: bool = False,
    database_url: str | None = None,
    tree: Path | None = None,
    hooks: Hooks | None = None,
) -> BurstRun:
    """One burst: the registry notifies the null receiver and `gpubadge serve`, each through the
    timing relay. `apart`: the service is `serve --workers 0` beside one `gpubadge worker` on the
    same store. `database_url`: the service runs on that PostgreSQL database (else a SQLite file).
    `tree`: the service is the gpubadge checked out there (the peer), else this checkout. `hooks`:
    the port the registry notifies (default: the intake port, or the main port for a peer)."""
    receiver = NullReceiver()
    port, intake_port = free_port(), free_port()
    notified = intake_port if (hooks or default_hooks(tree)) == "intake" else port
    loop = asyncio.get_running_loop()
    floor: list[float] = []
    badge: list[float] = []
    push_seconds: list[float] = []
    watchers: list[asyncio.Task[None]] = []
    pushed_at: dict[str, float] = {}
    visible_at: dict[str, float] = {}
    complete: list[float] = []
    db = workdir / "burst.db"
    service_env = service_environment(env, database_url, tree)
    with receiver.running():
        relay = DeliveryRelay({"null": receiver.port, "gpubadge": notified})
        with relay.running() as relayed:
            endpoints = relayed_endpoints(relayed)
            with (
                run_registry(extra_config={"notifications": {"endpoints": endpoints}}) as registry,
                run_service_process(
                    db,
                    env={**service_env, **({"GPUBADGE_WORKERS": "0"} if apart else {})},
                    port=port,
                    cwd=tree,
                    intake_port=intake_port,
                ) as service,
                running_worker(db, service_env, workdir / "worker.log")
                if apart
                else contextlib.nullcontext(),
            ):
                assert service.process is not None
                root = workdir / "layout"
                tags = push_layout_images(root, figures.images, 0)
                repo = f"{registry.host}/bench/burst"
                timeout = aiohttp.ClientTimeout(total=120)
                async with aiohttp.ClientSession(timeout=timeout) as session:

                    async def watch(tag: str, pushed: float) -> None:
                        # the badge: the config facts (a pending report counts); then the full report
                        query = urllib.parse.urlencode(
                            {"ref": f"{repo}:{tag}", "wait": "30", "until": "facts"}
                        )
                        while True:
                            async with session.get(f"{service.url}/api/images/by-ref?{query}") as response:
                                await response.read()
                                if response.status == 200:
                                    visible_at[tag] = time.time()
                                    badge.append(visible_at[tag] - pushed)
                                    break
                        query = urllib.parse.urlencode(
                            {"ref": f"{repo}:{tag}", "wait": "30", "until": "done"}
                        )
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
                        loop.call_soon_threadsafe(
                            lambda: watchers.append(loop.create_task(watch(tag, pushed)))
                        )

                    pids = {
                        "gpubadge": service.process.pid,
                        "null": receiver.process.pid if receiver.process else 0,
                    }
                    pids["registry"] = registry.process.pid
                    if database_url:
                        pids["postgres"] = postgres_pid(database_url)
                    cpu_before = {who: tree_cpu_seconds(pid) for who, pid in pids.items() if pid}
                    roles_before = tree_cpu_by_process(service.process.pid)
                    sleeps = ("gpubadge", "null")
                    wakeups_before = {who: tree_wakeups(pids[who]) for who in sleeps if pids[who]}
                    with ThreadPoolExecutor(figures.clients) as pool:
                        await asyncio.gather(*(loop.run_in_executor(pool, push, tag) for tag in tags))
                    await asyncio.wait_for(asyncio.gather(*watchers), 180)
                    cpu = {who: tree_cpu_seconds(pid) - cpu_before[who] for who, pid in pids.items() if pid}
                    roles = cpu_by_role(roles_before, tree_cpu_by_process(service.process.pid))
                    wakeups = {
                        who: tree_wakeups(pids[who]) - before for who, before in wakeups_before.items()
                    }
                    async with session.get(f"{service.url}/metrics") as response:
                        answers = webhook_answer_mean(await response.text())
                committed = job_times(pushed_at, db, database_url)
    return BurstRun(
        images=figures.images,
        floor=floor,
        badge=badge,
        complete=complete,
        pushes=push_seconds,
        delivered=[committed[tag] - pushed_at[tag] for tag in committed],
        scanned=[visible_at[tag] - committed[tag] for tag in committed if tag in visible_at],
        deliveries=relay.deliveries,
        cpu=cpu,
        handler_mean=answers,
        roles=roles,
        wakeups=wakeups,
        wakeup_cpu=await asyncio.to_thread(wakeup_cpu_seconds),
    )


def postgres_pid(database_url: str) -> int:
    """The PostgreSQL postmaster serving `database_url` (its backends are its children)."""
    import psycopg

    with psycopg.connect(database_url, connect_timeout=10, autocommit=True) as conn:
        directory = conn.execute("SHOW data_directory").fetchone()
    assert directory is not None
    return int((Path(directory[0]) / "postmaster.pid").read_text().split()[0])


@dataclass
class IntakeRun:
    """A manifest burst (`bench.registry_burst`): every delivery as the registry saw it, per endpoint,
    and how many scans gpubadge finished while its deliveries came."""

    images: int  # in the measured burst
    deliveries: dict[str, list[Delivery]]  # those of the measured burst
    scans_during: int  # scans claimed (running or finished) during the measured burst
    burst_seconds: float  # the PUTs, from the first to the last answered
    roles: dict[str, float] = field(default_factory=dict)  # gpubadge's CPU by role until every scan was done
    null_cpu: float = 0.0  # the null receiver's CPU over the same window
    # the images whose deliveries and scans that CPU covers: all of them, the first third too
    counted: int = 0

    def answers(self, endpoint: str) -> list[float]:
        return [delivery.seconds for delivery in self.deliveries[endpoint]]

    def cycles(self, endpoint: str) -> list[float]:
        return backlog_cycles(self.deliveries[endpoint])


def service_environment(
    env: dict[str, str] | None, database_url: str | None, tree: Path | None
) -> dict[str, str]:
    """The service's environment: `env`, the database, and the peer's checkout first on the path."""
    return {
        **(env or {}),
        **({"GPUBADGE_DATABASE_URL": database_url} if database_url else {}),
        **({"PYTHONPATH": str(tree)} if tree else {}),
    }


Hooks = Literal["intake", "main"]  # which of serve's ports the registry notifies


def default_hooks(tree: Path | None) -> Hooks:
    """The intake port (GPUBADGE_INTAKE_PORT), as the docs tell registries; a peer checkout may
    predate it, so the main port there."""
    return "main" if tree is not None else "intake"


BareHow = Literal["together", "apart", "commit-on-loop", "intake-thread"]
BARE_FLAGS: dict[BareHow, list[str]] = {
    "together": [],
    "apart": ["--apart"],
    "commit-on-loop": ["--apart", "--commit-on-loop"],
    "intake-thread": ["--apart", "--intake-thread"],
}


@contextlib.contextmanager
def run_bare_scanner(db: Path, port: int, log: Path, how: BareHow) -> Iterator[RunningService]:
    """`bench.bare_scanner` on `port` with its jobs in `db`, ready (its /healthz answers); `how`: its
    scans in its own process (`together`) or in a child (`apart`), and its intake's commit on a
    thread, on its event loop (`commit-on-loop`), or on a listener of a thread's own (`intake-thread`)."""
    with log.open("ab") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "bench.bare_scanner", "--port", str(port), "--db", str(db)]
            + BARE_FLAGS[how],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        service = RunningService(f"http://127.0.0.1:{port}", process, log)
        wait_healthy(service.url, process)
        yield service
    finally:
        stop_process(process, grace=20)


async def measure_intake(
    images: int,
    clients: int,
    workdir: Path,
    env: dict[str, str] | None = None,
    *,
    database_url: str | None = None,
    tree: Path | None = None,
    count_cpu: bool = True,
    bare: BareHow | None = None,
    hooks: Hooks | None = None,
) -> IntakeRun:
    """The intake beside running scans: `images` distinct images' manifests PUT by `clients` at once
    (their blobs uploaded first), the registry notifying the null receiver and `gpubadge serve`
    through the timing relay; each delivery queues a real scan. The first third's scans are
    running when the rest, the measured burst, is PUT: every delivery measured arrives while the
    service scans. `count_cpu`: wait for every scan to finish and count the CPU it all took.
    `bare`: the endpoint is `bench.bare_scanner` (the least a durable scanning service does), not
    gpubadge, run as `bare` says (`run_bare_scanner`). `hooks`: the port of `serve` the registry
    notifies (default: the intake port, or the main port for a peer)."""
    receiver = NullReceiver()
    port, intake_port = free_port(), free_port()
    notified = intake_port if (hooks or default_hooks(tree)) == "intake" and not bare else port
    service_env = service_environment(env, database_url, tree)
    loop = asyncio.get_running_loop()
    with receiver.running():
        relay = DeliveryRelay({"null": receiver.port, "gpubadge": notified})
        with relay.running() as relayed:
            endpoints = relayed_endpoints(relayed)
            with (
                run_registry(extra_config={"notifications": {"endpoints": endpoints}}) as registry,
                run_bare_scanner(workdir / "bare.db", port, workdir / "bare.log", bare)
                if bare
                else run_service_process(
                    workdir / "intake.db", env=service_env, port=port, cwd=tree, intake_port=intake_port
                ) as service,
            ):
                repository = "bench/intake"
                staged = await loop.run_in_executor(
                    None, stage_images, workdir / "layout", registry.url, repository, images
                )
                assert service.process is not None and receiver.process is not None
                roles_before = tree_cpu_by_process(service.process.pid)
                null_before = tree_cpu_seconds(receiver.process.pid)
                # A first third queues scans; once they run, the rest is the measured burst.
                first, rest = staged[: images // 3], staged[images // 3 :]
                await loop.run_in_executor(None, put_manifests, registry.url, repository, first, clients)
                await until_deliveries(relay, len(first))
                deadline = time.monotonic() + 120
                while True:  # until the first scans run (a fast service may have finished them all)
                    queue = await queue_of(service.url)
                    if queue["running"] or queue["done"] + queue["failed"] >= len(first):
                        break
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"no scan of the first {len(first)} started within 120 s")
                    await asyncio.sleep(0.01)
                settled = queue["done"] + queue["failed"]
                started = time.time()
                await loop.run_in_executor(None, put_manifests, registry.url, repository, rest, clients)
                burst = time.time() - started
                await until_deliveries(relay, images)
                queue = await queue_of(service.url)
                during = queue["running"] + queue["done"] + queue["failed"] - settled
                deadline = time.monotonic() + 240
                while count_cpu and (await queue_of(service.url))["done"] < images:
                    if time.monotonic() > deadline:
                        raise TimeoutError("scans not done 240 s after the burst")
                    await asyncio.sleep(0.5)  # seldom: each look costs the service a write check
                roles = cpu_by_role(roles_before, tree_cpu_by_process(service.process.pid))
                null_cpu = tree_cpu_seconds(receiver.process.pid) - null_before
    measured = {
        name: [delivery for delivery in deliveries if delivery.started >= started]
        for name, deliveries in relay.deliveries.items()
    }
    return IntakeRun(len(rest), measured, int(during), burst, roles, null_cpu, len(staged))


async def until_deliveries(relay: DeliveryRelay, count: int, timeout: float = 120.0) -> None:
    """Until both endpoints were sent `count` deliveries (bounded)."""
    deadline = time.monotonic() + timeout
    while min(len(relay.deliveries["null"]), len(relay.deliveries["gpubadge"])) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"deliveries after {timeout:.0f} s: { {k: len(v) for k, v in relay.deliveries.items()} }"
            )
        await asyncio.sleep(0.01)


async def queue_of(url: str) -> dict[str, int]:
    """The service's jobs by state, as /healthz counts them."""
    queue: dict[str, int] = json.loads(await fetch_text(f"{url}/healthz"))["queue"]
    return queue


async def fetch_text(url: str) -> str:
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session,
        session.get(url) as response,
    ):
        return await response.text()


PEER_TREE = "GPUBADGE_BENCH_PEER_TREE"  # a checkout of an earlier gpubadge to run as the peer


def relayed_endpoints(relayed: dict[str, int]) -> list[dict[str, object]]:
    """The registry's two notification endpoints, each through its port of the timing relay: the
    null receiver's and gpubadge's webhook."""
    return [
        notification_endpoint(f"http://127.0.0.1:{relayed['null']}/") | {"name": "null"},
        notification_endpoint(f"http://127.0.0.1:{relayed['gpubadge']}/hooks/distribution")
        | {"name": "gpubadge"},
    ]


def peer_tree() -> Path | None:
    """The peer: the checkout named by $GPUBADGE_BENCH_PEER_TREE (e.g. an export of main), run with its
    own defaults; None without one."""
    tree = os.environ.get(PEER_TREE)
    return Path(tree) if tree else None


def describe(run: BurstRun) -> str:
    """The figures of one run, in one line."""
    ours, null = run.answers("gpubadge"), run.answers("null")
    return (
        f"floor p50/p99 {ms(percentile(run.floor, 0.5))} / {ms(percentile(run.floor, 0.99))};"
        f" gpubadge {ms(percentile(run.badge, 0.5))} / {ms(percentile(run.badge, 0.99))};"
        f" push -> job {ms(percentile(run.delivered, 0.5))} / {ms(percentile(run.delivered, 0.99))};"
        f" job -> badge {ms(percentile(run.scanned, 0.5))} / {ms(percentile(run.scanned, 0.99))};"
        f" full report {ms(percentile(run.complete, 0.5))} / {ms(percentile(run.complete, 0.99))};"
        f" answers as the registry waited, gpubadge {ms(percentile(ours, 0.5))} / {ms(percentile(ours, 0.99))}"
        f" (max {ms(max(ours, default=0))}), null {ms(percentile(null, 0.5))} / {ms(percentile(null, 0.99))}"
        f" (max {ms(max(null, default=0))}); per delivery while backed up: gpubadge"
        f" {ms(run.per_delivery('gpubadge'))}, null {ms(run.per_delivery('null'))};"
        f" handler mean {ms(run.handler_mean)}; CPU per image: gpubadge {ms(run.cpu_per_image('gpubadge'))},"
        f" ({', '.join(f'{role} {ms(seconds / run.images)}' for role, seconds in sorted(run.roles.items()))}),"
        f" null {ms(run.cpu_per_image('null'))}, registry {ms(run.cpu_per_image('registry'))}"
        + (f", postgres {ms(run.cpu_per_image('postgres'))}" if "postgres" in run.cpu else "")
        + f"; skopeo push p50 {ms(percentile(run.pushes, 0.5))}"
        + (
            f"; threads' wake-ups per image: gpubadge {run.wakeups['gpubadge'] / run.images:.0f},"
            f" null {run.wakeups['null'] / run.images:.0f}, at {run.wakeup_cpu * 1e6:.0f} us of CPU"
            " per wake-up of an idle thread on this host"
            if "gpubadge" in run.wakeups and "null" in run.wakeups
            else ""
        )
    )


def add_figures(
    results: Results, label: str, workload: BurstFigures, run: BurstRun, peer: BurstRun | None
) -> None:
    """The bench's figures for one run: badge latency against the floor, the answers against the
    null receiver's, CPU per image against the null receiver's."""
    shape = f"{workload.images} pushes by {workload.clients} clients, {label}"
    for name, pick in (("p50", 0.5), ("p99", 0.99)):
        ours, floor = percentile(run.badge, pick), percentile(run.floor, pick)
        beside = ""
        if peer is not None:
            beside = (
                f" (peer, same session: {ms(percentile(peer.badge, pick) - percentile(peer.floor, pick))})"
            )
        results.add(
            Figure(
                "burst",
                f"push -> badge {name}, {shape}, vs null receiver",
                ms(ours),
                peer=f"null receiver arrival {ms(floor)}",
                ratio=floor / ours if ours > 0 else None,
                target="within the floor + 100 ms",
                met=ours - floor <= 0.100,
                note=f"difference {ms(ours - floor)}{beside}",
            )
        )
    for name, pick in (("p50", 0.5), ("p99", 0.99)):
        ours, null = percentile(run.answers("gpubadge"), pick), percentile(run.answers("null"), pick)
        results.add(
            Figure(
                "burst",
                f"delivery answered {name} (as the registry waited), {shape}",
                ms(ours),
                peer=f"null receiver {ms(null)}",
                ratio=null / ours if ours > 0 else None,
                note=f"per delivery while backed up: gpubadge {ms(run.per_delivery('gpubadge'))},"
                f" null {ms(run.per_delivery('null'))}",
            )
        )
    ours_cpu, null_cpu = run.cpu_per_image("gpubadge"), run.cpu_per_image("null")
    results.add(
        Figure(
            "burst",
            f"CPU per pushed image, {shape}",
            ms(ours_cpu),
            peer=f"null receiver {ms(null_cpu)}",
            ratio=null_cpu / ours_cpu if ours_cpu > 0 else None,
            target="<= 4x the null receiver's",
            met=ours_cpu <= 4 * null_cpu,
            note=describe(run),
        )
    )


def run_all(results: Results, quick: bool, figures: BurstFigures | None = None) -> None:
    """On SQLite, then on PostgreSQL where it can run: the peer (`peer_tree`, when named) and this
    checkout with its defaults, each beside its own null receiver in the same run; then, on
    SQLite, this checkout with a fifth of the pushers; then the intake beside running scans for
    the peer, the defaults, scans at SCHED_IDLE (`GPUBADGE_WORKER_SCHEDULING=idle`), on PostgreSQL
    the intake's local journal (`GPUBADGE_INTAKE_JOURNAL`) and, on SQLite,
    `bench.bare_scanner` four ways (`BARE`): the least a durable scanning service does, CPU per
    image's second floor, and where a durable intake's answer waits."""
    figures = figures or (BurstFigures.quick() if quick else BurstFigures())
    light = BurstFigures(figures.images, max(1, figures.clients // 5))
    print(f"push burst: {figures.images} images by {figures.clients} concurrent skopeo clients", flush=True)
    peer = peer_tree()
    engines: list[str] = ["SQLite"]
    if postgres_unavailable_reason() is None:
        engines.append("PostgreSQL")
    else:
        results.detail(f"burst on PostgreSQL skipped: {postgres_unavailable_reason()}")
    for engine in engines:
        with run_postgres() if engine == "PostgreSQL" else contextlib.nullcontext() as server:
            runs: dict[str, BurstRun] = {}
            plan: list[tuple[str, Path | None, BurstFigures]] = []
            if peer is not None:
                plan.append(("peer", peer, figures))
            plan.append(("defaults", None, figures))
            if engine == "SQLite":
                plan.append(("light", None, light))
            for number, (label, tree, workload) in enumerate(plan):
                workdir = Path(tempfile.mkdtemp(prefix="gpubadge-bench-burst-"))
                try:
                    url = server.create_database(f"burst{number}") if server is not None else None
                    runs[label] = asyncio.run(measure_burst(workload, workdir, database_url=url, tree=tree))
                finally:
                    shutil.rmtree(workdir, ignore_errors=True)
                results.detail(f"burst {engine}, {label}: {describe(runs[label])}")
            peer_run = runs.get("peer")
            add_figures(results, f"{engine}, defaults", figures, runs["defaults"], peer_run)
            if peer_run is not None and peer is not None:
                add_figures(
                    results, f"{engine}, peer ({peer.name} with its defaults)", figures, peer_run, None
                )
            if "light" in runs:
                add_figures(results, f"{engine}, defaults", light, runs["light"], None)
            intakes: list[tuple[str, Path | None, dict[str, str] | None]] = []
            if peer is not None:
                intakes.append((f"peer ({peer.name})", peer, None))
            intakes.append(("defaults", None, None))
            intakes.append((MAIN_PORT, None, None))
            intakes.append(("scans at SCHED_IDLE", None, {"GPUBADGE_WORKER_SCHEDULING": "idle"}))
            if engine == "PostgreSQL":
                intakes.append((JOURNALED, None, None))
            if engine == "SQLite":  # the least a durable scanning service does, not gpubadge
                intakes.extend((label, None, None) for label in BARE)
            for number, (label, tree, env) in enumerate(intakes, start=len(plan)):
                workdir = Path(tempfile.mkdtemp(prefix="gpubadge-bench-intake-"))
                try:
                    url = server.create_database(f"intake{number}") if server else None
                    if label == JOURNALED:
                        env = {"GPUBADGE_INTAKE_JOURNAL": str(workdir / "intake-journal")}
                    intake = asyncio.run(
                        measure_intake(
                            INTAKE_IMAGES,
                            INTAKE_CLIENTS,
                            workdir,
                            env,
                            database_url=url,
                            tree=tree,
                            bare=BARE.get(label),
                            hooks="main" if label == MAIN_PORT else None,
                        )
                    )
                finally:
                    shutil.rmtree(workdir, ignore_errors=True)
                add_intake_figures(results, f"{engine}, {label}", intake)


MAIN_PORT = "defaults, webhooks to the main port (GPUBADGE_PORT)"
JOURNALED = "webhooks journaled locally, then moved (GPUBADGE_INTAKE_JOURNAL)"
INTAKE_IMAGES, INTAKE_CLIENTS = 300, 8  # a manifest burst: 100 to start the scans, then 200 measured
BARE: dict[str, BareHow] = {  # the intake bench's other peers on SQLite: bench.bare_scanner, not gpubadge
    "bare scanner (bench.bare_scanner)": "together",
    "bare scanner, its scans in a second process (--apart)": "apart",
    "bare scanner, its scans apart, its intake's commit on its event loop (--commit-on-loop)": "commit-on-loop",
    "bare scanner, its scans apart, its intake a thread's own listener (--intake-thread)": "intake-thread",
}


def add_intake_figures(results: Results, label: str, run: IntakeRun) -> None:
    """Point 1's figure: each delivery's answer and the registry's time per delivery, against the null
    receiver's, while scans run; and CPU per image without the bench's long polls."""
    ours, null = run.answers("gpubadge"), run.answers("null")
    cycle, null_cycle = percentile(run.cycles("gpubadge"), 0.5), percentile(run.cycles("null"), 0.5)
    cpu = sum(run.roles.values()) / run.counted if run.roles else 0.0
    null_cpu = run.null_cpu / run.counted if run.null_cpu else 0.0
    roles = ", ".join(f"{role} {ms(seconds / run.counted)}" for role, seconds in sorted(run.roles.items()))
    results.add(
        Figure(
            "burst",
            f"intake beside running scans, {run.images} manifests PUT by {INTAKE_CLIENTS} clients, {label}:"
            " the registry's time per delivery while backed up (p50)",
            ms(cycle),
            peer=f"null receiver {ms(null_cycle)}",
            ratio=null_cycle / cycle if cycle > 0 else None,
            target="<= 1.2x the null receiver's",
            met=cycle <= 1.2 * null_cycle,
            note=f"answers p50 {ms(percentile(ours, 0.5))} vs {ms(percentile(null, 0.5))}, p90"
            f" {ms(percentile(ours, 0.9))} vs {ms(percentile(null, 0.9))}, p99 {ms(percentile(ours, 0.99))} vs"
            f" {ms(percentile(null, 0.99))}, max {ms(max(ours, default=0))} vs {ms(max(null, default=0))};"
            f" {run.scans_during} scans claimed meanwhile; CPU per image until every scan was done {ms(cpu)}"
            f" ({roles}) vs null {ms(null_cpu)}",
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller workloads")
    parser.add_argument("--images", type=int, help="images per burst")
    parser.add_argument("--clients", type=int, help="concurrent pushers")
    args = parser.parse_args()
    results = Results()
    base = BurstFigures.quick() if args.quick else BurstFigures()
    run_all(results, args.quick, BurstFigures(args.images or base.images, args.clients or base.clients))
    for figure in results.figures:
        print(f"  {figure.name}: {figure.note}")


if __name__ == "__main__":
    main()
