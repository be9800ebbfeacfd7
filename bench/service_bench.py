"""Service benchmarks: push-to-badge latency through a real registry's notifications, and
webhook ingest rate with durable commits.

The service runs as `gpubadge serve` in a child process, as in production; the
registry is Debian's docker-registry with a `notifications` endpoint pointing at
the service; images are pushed with skopeo. Setup is outside every measured window.

Run alone: python3 -m bench.service_bench [--quick]
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import sqlite3
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import aiohttp

from bench.common import (
    Figure,
    Results,
    measure,
    ms,
    percentile,
    process_cpu_seconds,
    push_with_retry,
    run_section,
)
from fixtures.oci import ImageSpec, LayerSpec, LayoutWriter, fake_elf, file
from fixtures.registry import free_port, run_registry
from fixtures.service import RunningService, run_service_process

GLIBC_LOADER = "/lib64/ld-linux-x86-64.so.2"
Synchronous = Literal["NORMAL", "FULL"]


@dataclass
class ServiceFigures:
    pushes: int = 50  # at once
    rounds: int = 3
    webhooks: int = 5000
    senders: int = 20

    @classmethod
    def quick(cls) -> ServiceFigures:
        return cls(rounds=1, webhooks=2000)


@contextlib.contextmanager
def run_service(db: Path, env: dict[str, str], synchronous: Synchronous) -> Iterator[RunningService]:
    """`gpubadge serve` with SQLite's synchronous mode set through GPUBADGE_SQLITE_SYNCHRONOUS."""
    with run_service_process(db, env={**env, "GPUBADGE_SQLITE_SYNCHRONOUS": synchronous}) as service:
        yield service


# --- push -> badge -------------------------------------------------------------------------------


def push_layout_images(root: Path, count: int, round_number: int) -> list[str]:
    """`count` distinct small glibc images over a shared base layer; returns their tags."""
    layout = LayoutWriter(root)
    base = LayerSpec(
        [
            file("bin/sh", fake_elf(GLIBC_LOADER), 0o755),
            file(GLIBC_LOADER.lstrip("/"), fake_elf(None), 0o755),
            file("etc/os-release", 'ID=debian\nVERSION_ID="12"\n'),
        ]
    )
    tags = []
    for n in range(count):
        top = LayerSpec([file(f"app/build-{round_number}-{n}.txt", f"round {round_number} image {n}\n")])
        env = {"CUDA_VERSION": "12.2.2", "NVIDIA_REQUIRE_CUDA": "cuda>=12.2"} if n % 2 else {}
        tag = f"r{round_number}-{n}"
        layout.tag(layout.image(ImageSpec([base, top], env=env)), tag)
        tags.append(tag)
    return tags


def push_then_wait(layout: Path, tag: str, destination: str, service_url: str) -> tuple[float, float]:
    """Push with skopeo, then long-poll the badge; returns (push seconds, push-finished-to-badge seconds)."""
    started = time.perf_counter()
    push_with_retry(layout, tag, destination)
    pushed = time.perf_counter()
    query = urllib.parse.urlencode({"ref": destination, "wait": "10"})
    deadline = pushed + 60
    while True:
        try:
            with urllib.request.urlopen(f"{service_url}/api/images/by-ref?{query}", timeout=15) as response:
                if response.status == 200:
                    json.loads(response.read())
                    return pushed - started, time.perf_counter() - pushed
        except urllib.error.HTTPError as exc:
            if exc.code != 404:
                raise
        if time.perf_counter() > deadline:
            raise TimeoutError(f"no badge for {destination} within 60 s of the push")


def bench_push_to_badge(results: Results, figures: ServiceFigures, workdir: Path) -> None:
    print(f"push -> badge: {figures.pushes} concurrent skopeo pushes x {figures.rounds} round(s)", flush=True)
    latencies: list[float] = []
    push_times: list[float] = []
    db = workdir / "push.db"
    port = free_port()
    notify_url = f"http://127.0.0.1:{port}/hooks/distribution"
    with run_registry(notify_url=notify_url) as registry, run_service_process(db, port=port) as service:
        assert service.process is not None
        service_cpu = process_cpu_seconds(service.process.pid)
        repo = f"{registry.host}/bench/push"
        for round_number in range(figures.rounds):
            root = workdir / f"push-layout-{round_number}"
            tags = push_layout_images(root, figures.pushes, round_number)
            jobs = [(root, tag, f"{repo}:{tag}", service.url) for tag in tags]
            with ThreadPoolExecutor(figures.pushes) as pool:
                outcomes = list(pool.map(lambda job: push_then_wait(*job), jobs))
            push_times += [push for push, _ in outcomes]
            latencies += [latency for _, latency in outcomes]
        service_cpu = process_cpu_seconds(service.process.pid) - service_cpu
        metrics = service_metrics(service.url)
    p50, p99 = percentile(latencies, 0.5), percentile(latencies, 0.99)
    results.add(
        Figure(
            "service",
            f"push -> badge latency, {figures.pushes} concurrent pushes ({len(latencies)} pushes)",
            f"p50 {ms(p50)}, p99 {ms(p99)}",
            target="p99 < 500 ms",
            met=p99 < 0.5,
            note=f"max {ms(max(latencies))}; skopeo push itself p50 {ms(percentile(push_times, 0.5))}, "
            f"p99 {ms(percentile(push_times, 0.99))}; service CPU {service_cpu:.1f} s; {metrics}",
        )
    )


def service_metrics(url: str) -> str:
    """Webhook deliveries and mean scan time from the service's /metrics (read after the run)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if line.startswith(("gpubadge_webhooks_total{", "gpubadge_scan_duration_seconds_")):
            key = name.split("{", 1)[0]
            values[key] = values.get(key, 0.0) + float(value)
    deliveries = values.get("gpubadge_webhooks_total", 0.0)
    scans = values.get("gpubadge_scan_duration_seconds_count", 0.0)
    mean = values.get("gpubadge_scan_duration_seconds_sum", 0.0) / scans if scans else 0.0
    return f"{deliveries:.0f} webhook deliveries from the registry, {scans:.0f} scans, mean scan {ms(mean)}"


# --- webhook ingest ------------------------------------------------------------------------------


def distribution_event(registry_host: str, n: int) -> bytes:
    digest = f"sha256:{n:064x}"
    return json.dumps(
        {
            "events": [
                {
                    "id": f"bench-{n}",
                    "timestamp": "2026-11-02T10:15:04.123456789Z",
                    "action": "push",
                    "target": {
                        "mediaType": "application/vnd.oci.image.manifest.v1+json",
                        "digest": digest,
                        "size": 1043,
                        "length": 1043,
                        "repository": f"bench/ingest-{n % 97}",
                        "url": f"http://{registry_host}/v2/bench/ingest-{n % 97}/manifests/{digest}",
                        "tag": f"v{n}",
                    },
                    "request": {"id": f"req-{n}", "host": registry_host, "method": "PUT"},
                    "actor": {},
                    "source": {"addr": "bench:5000", "instanceID": "bench"},
                }
            ]
        }
    ).encode()


async def send_webhooks(url: str, bodies: list[bytes], senders: int) -> list[float]:
    """POST every body with `senders` concurrent senders; returns each request's latency (s)."""
    queue: asyncio.Queue[bytes] = asyncio.Queue()
    for body in bodies:
        queue.put_nowait(body)
    latencies: list[float] = []
    headers = {"Content-Type": "application/vnd.docker.distribution.events.v1+json"}

    async def sender(session: aiohttp.ClientSession) -> None:
        while not queue.empty():
            body = queue.get_nowait()
            started = time.perf_counter()
            async with session.post(url, data=body, headers=headers) as response:
                await response.read()
                if response.status != 202:
                    raise RuntimeError(f"webhook answered {response.status}: {await response.text()}")
            latencies.append(time.perf_counter() - started)

    connector = aiohttp.TCPConnector(limit=senders)
    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(*(sender(session) for _ in range(senders)))
    return latencies


def count_jobs(db: Path) -> int:
    with contextlib.closing(sqlite3.connect(db)) as connection:
        (count,) = connection.execute("SELECT count(*) FROM jobs").fetchone()
        return int(count)


def bench_ingest(results: Results, figures: ServiceFigures, workdir: Path, synchronous: Synchronous) -> None:
    n = figures.webhooks
    print(f"webhook ingest, synchronous={synchronous}: {n} webhooks, {figures.senders} senders", flush=True)
    db = workdir / f"ingest-{synchronous.lower()}.db"
    # Workers off: the figure is the ingest path (parse, allowlist, durable enqueue), not scanning.
    env = {"GPUBADGE_WORKERS": "0"}
    registry_host = "127.0.0.1:5999"  # loopback: on the default allowlist; never contacted
    warmup = [distribution_event(registry_host, 10_000_000 + i) for i in range(200)]
    bodies = [distribution_event(registry_host, i) for i in range(n)]
    with run_service(db, env, synchronous) as service:
        assert service.process is not None
        url = f"{service.url}/hooks/distribution"
        asyncio.run(send_webhooks(url, warmup, figures.senders))
        with measure(service.process.pid) as window:
            latencies = asyncio.run(send_webhooks(url, bodies, figures.senders))
    stored = count_jobs(db)
    rate = n / window.wall_s
    p99 = percentile(latencies, 0.99)
    results.add(
        Figure(
            "service",
            f"webhook ingest, durable commit (WAL, synchronous={synchronous}), {figures.senders} senders",
            f"{rate:,.0f}/s; 202 p50 {ms(percentile(latencies, 0.5))}, p99 {ms(p99)}",
            target=">= 1,000/s and p99 < 20 ms",
            met=rate >= 1000 and p99 < 0.020 and stored == n + len(warmup),
            note=f"{stored} jobs in the store after the run; service CPU {window.watched_cpu_s:.1f} s "
            f"for {n} webhooks ({window.watched_cpu_s / n * 1000:.2f} ms each); the client shares the cores",
        )
    )


def run_all(results: Results, quick: bool) -> None:
    figures = ServiceFigures.quick() if quick else ServiceFigures()
    workdir = Path(tempfile.mkdtemp(prefix="gpubadge-bench-service-"))
    try:
        bench_push_to_badge(results, figures, workdir)
        bench_ingest(results, figures, workdir, "NORMAL")
        bench_ingest(results, figures, workdir, "FULL")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    run_section(run_all, __doc__)
