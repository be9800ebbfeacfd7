"""Placement latency over 10,000 synthetic servers: p50/p99 of `decide()` per query, index build,
and the service path (the cached fleet index after a reservation, a registration, a timed check).

Run: python3 -m bench.placement_bench [servers] [queries]. Prints numbers only; no thresholds.
The fleet is built from realistic SKUs (GPU model, driver, utilisation), as real fleets are.
`request=` lines are read by bench/run.py (the text before ` eligible=` names the figure; the
last p99_ms on the line, CPU, is the figure).
"""

from __future__ import annotations

import asyncio
import gc
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from placement.decide import Decision, FleetIndex, ImageFacts, decide
from placement.inventory import Server
from placement.request import DeployRequest
from scanner.models import GpuFacts, ImageReport, PlatformReport
from store import AsyncStore, SqliteStore
from web.fleet import FLEET_INDEX, STATIC_FLEET, FleetIndexCache, fleet_index, live_servers
from web.metrics import ServiceMetrics
from web.settings import ServiceSettings
from web.state import SERVICES, Services

# (GPU, brand, MiB, CC, GPUs per server, CPUs, memory GiB): a SKU fixes the box, as in real fleets.
SKUS = [
    ("NVIDIA H100 80GB HBM3", "NVIDIA", 81559, "9.0", 8, 192, 2048),
    ("NVIDIA A100-SXM4-40GB", "NVIDIA", 40960, "8.0", 8, 128, 1024),
    ("NVIDIA A100-SXM4-80GB", "NVIDIA", 81920, "8.0", 4, 64, 512),
    ("Tesla T4", "Tesla", 15360, "7.5", 4, 32, 256),
    ("NVIDIA L4", "NVIDIA", 23034, "8.9", 1, 16, 64),
    ("Tesla V100-SXM2-16GB", "Tesla", 16384, "7.0", 8, 64, 512),
    ("NVIDIA GeForce RTX 4090", "GeForce", 24564, "8.9", 2, 24, 128),
]
DRIVERS = [
    ("470.57.02", "11.4"),
    ("525.60.13", "12.0"),
    ("535.104.05", "12.2"),
    ("550.54.15", "12.4"),
    ("570.124.06", "12.8"),
]
REQUIRE_12_2 = " ".join(
    ["cuda>=12.2"]
    + [
        f"brand={b},driver>={n},driver<{n + 1}"
        for n in (470, 525)
        for b in (
            "tesla",
            "unknown",
            "nvidia",
            "nvidiartx",
            "geforce",
            "geforcertx",
            "quadro",
            "quadrortx",
            "titan",
            "titanrtx",
        )
    ]
)


def synthetic_fleet(count: int, seed: int = 7) -> list[Server]:
    rng = random.Random(seed)
    servers = []
    for n in range(count):
        name, brand, mib, cc, per, cpus, memory_gib = rng.choice(SKUS)
        driver, cuda = rng.choice(DRIVERS)
        uuids = [f"GPU-{n:05d}-{i}" for i in range(per)]
        gpus = [
            {"index": i, "uuid": u, "name": name, "brand": brand, "memory_mib": mib, "compute_capability": cc}
            for i, u in enumerate(uuids)
        ]
        servers.append(
            Server.model_validate(
                {
                    "name": f"srv-{n:05d}",
                    "arch": "arm64" if rng.random() < 0.1 else "amd64",
                    "cpus": cpus,
                    "memory": memory_gib * 1024**3,
                    "labels": {"zone": rng.choice(["a", "b", "c"])},
                    "driver_version": driver,
                    "cuda_driver_version": cuda,
                    "gpus": gpus,
                    "gpus_in_use": uuids[: rng.randint(0, per)],
                }
            )
        )
    return servers


def gpu_image(require: str = REQUIRE_12_2, reference: str = "nvidia/cuda:12.2.2") -> ImageFacts:
    env = {"NVIDIA_REQUIRE_CUDA": require, "CUDA_VERSION": "12.2.2", "NVIDIA_VISIBLE_DEVICES": "all"}
    gpu = GpuFacts(required=True, cuda_version="12.2", requirements=[require], env=env)
    report = ImageReport(
        reference=reference,
        platforms=[PlatformReport(platform="linux/amd64", digest="sha256:0", gpu=gpu)],
    )
    return ImageFacts.from_report(report)


def image() -> ImageFacts:
    return gpu_image()


def cpu_image() -> ImageFacts:
    report = ImageReport(
        reference="alpine:3",
        platforms=[
            PlatformReport(platform="linux/amd64", digest="sha256:1"),
            PlatformReport(platform="linux/arm64", digest="sha256:2"),
        ],
    )
    return ImageFacts.from_report(report)


REQUESTS = [
    DeployRequest(gpus=1),
    DeployRequest(gpus=2, gpu_models=["h100", "a100"], gpu_model_order="ordered", min_gpu_memory="40Gi"),
    DeployRequest(gpus=4, cpus=64, memory="512Gi", labels={"zone": "a"}, min_compute_capability="8.0"),
]
# (kind, image, request): the request forms the figures are named after.
QUERIES: list[tuple[str, Callable[[], ImageFacts], DeployRequest]] = [
    ("gpu-image", image, REQUESTS[0]),
    ("gpu-models", image, REQUESTS[1]),
    ("labels-and-sizes", image, REQUESTS[2]),
    ("cpu-image", cpu_image, DeployRequest(cpus=8)),
    ("fails-everywhere", lambda: gpu_image("cuda>=13.0", "needs/cuda:13"), DeployRequest(gpus=1)),
]


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def figures(wall: list[float], cpu: list[float]) -> str:
    return (
        f"wall p50_ms={statistics.median(wall):.2f} p99_ms={percentile(wall, 0.99):.2f} "
        f"cpu p50_ms={statistics.median(cpu):.2f} p99_ms={percentile(cpu, 0.99):.2f}"
    )


def timed(action: Callable[[], Any], rounds: int) -> tuple[list[float], list[float]]:
    """Wall and CPU ms per call. The previous result is dropped inside the timed region, as a
    service drops it after answering: freeing 10,000 result dicts is part of a query's cost."""
    wall, cpu = [], []
    result: Any = action()  # warm-up
    for _ in range(rounds):
        t0, c0 = time.perf_counter(), time.process_time()
        result = action()
        wall.append((time.perf_counter() - t0) * 1000)
        cpu.append((time.process_time() - c0) * 1000)
    del result
    return wall, cpu


async def timed_async(action: Callable[[], Awaitable[Any]], rounds: int) -> tuple[list[float], list[float]]:
    """`timed` for an async action (the service's store calls are awaited)."""
    wall, cpu = [], []
    result: Any = await action()  # warm-up
    for _ in range(rounds):
        t0, c0 = time.perf_counter(), time.process_time()
        result = await action()
        wall.append((time.perf_counter() - t0) * 1000)
        cpu.append((time.process_time() - c0) * 1000)
    del result
    return wall, cpu


def bench_queries(fleet: list[Server], queries: int) -> None:
    count = len(fleet)
    builds = []
    for _ in range(5):
        t0 = time.perf_counter()
        index = FleetIndex.build(fleet)
        builds.append((time.perf_counter() - t0) * 1000)
    print(
        f"servers={count} gpu_classes={len(index.classes)} shapes={index.shape_count} "
        f"index_build_ms={statistics.median(builds):.1f} (median of 5, includes the query view)"
    )
    # The fleet is long-lived, as in a service: gc.freeze() keeps full cyclic-GC passes (~150 ms here)
    # from re-walking a million inventory objects inside a sample. web.fleet does not freeze (a
    # process-wide choice for the service's startup); without it, such a pass lands in ~1% of queries.
    gc.freeze()
    calibration = []
    for _ in range(20):
        t0 = time.perf_counter()
        _ = [{"server": n, "gpus": [n], "score": 1.0} for n in range(count)]
        calibration.append((time.perf_counter() - t0) * 1000)
    print(
        f"calibration: building {count} bare result dicts takes p50_ms={statistics.median(calibration):.2f}"
    )
    for kind, make_image, request in QUERIES:
        facts = make_image()
        decision: Decision = decide(facts, request, index)
        wall, cpu = timed(lambda: decide(facts, request, index), queries)  # noqa: B023 - called at once
        print(
            f"request={kind} {request.model_dump(exclude_defaults=True)} eligible={len(decision.eligible)} "
            f"{figures(wall, cpu)}"
        )
    samples = []
    for _ in range(max(5, queries // 40)):
        t0 = time.perf_counter()
        decide(image(), REQUESTS[0], fleet)
        samples.append((time.perf_counter() - t0) * 1000)
    print(f"unindexed (list[Server], index built per query): p50_ms={statistics.median(samples):.2f}")


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def bench_service(fleet: list[Server], queries: int, workdir: Path) -> None:
    """The service's way: web.fleet's cached index over a real store (static file + agents)."""
    agents = fleet[: len(fleet) // 10]  # a tenth register as agents, the rest come from the file
    settings = ServiceSettings(db=workdir / "bench.db", port=0, docker_config=None)
    backend = SqliteStore(settings.db)
    for server in agents:
        stored = server.model_copy(update={"source": "agent", "gpus_in_use": []})
        backend.upsert_server(server.name, stored.model_dump_json())
    store = AsyncStore(backend)
    app = web.Application()
    app[SERVICES] = Services(settings=settings, store=store, metrics=ServiceMetrics())
    app[STATIC_FLEET] = fleet[len(agents) :]
    clock = _Clock()
    cache = app[FLEET_INDEX] = FleetIndexCache(check_seconds=2.0, clock=clock)
    facts, request = image(), REQUESTS[0]
    t0 = time.perf_counter()
    index = await fleet_index(app)
    print(f"service: first query builds the cached index: ms={(time.perf_counter() - t0) * 1000:.1f}")
    wall, cpu = timed(lambda: decide(facts, request, index), queries)
    print(f"service: decide on the cached index {figures(wall, cpu)}")
    free = [
        (server.name, gpu.uuid)
        for server in fleet
        for gpu in server.gpus
        if gpu.uuid not in set(server.gpus_in_use)
    ]
    picks = iter(free)

    async def after_reservation() -> Decision:
        name, gpu_uuid = next(picks)
        await store.create_deployment(os.urandom(8).hex(), name, [gpu_uuid], "{}")
        cache.reservations_changed()
        return decide(facts, request, await fleet_index(app))

    rounds = min(queries, len(free) - 1)
    wall, cpu = await timed_async(after_reservation, rounds)
    print(f"service: reserve 1 GPU, then decide (index follows the reservation) {figures(wall, cpu)}")

    async def after_timed_check() -> Decision:
        clock.now += cache.check_seconds
        return decide(facts, request, await fleet_index(app))

    wall, cpu = await timed_async(after_timed_check, max(20, queries // 10))
    print(
        f"service: timed re-check (re-read {len(agents)} agents, nothing changed), then decide {figures(wall, cpu)}"
    )
    samples = []
    for _ in range(max(5, queries // 40)):
        t0 = time.perf_counter()
        decide(facts, request, await live_servers(app))
        samples.append((time.perf_counter() - t0) * 1000)
    print(f"service: uncached path (live_servers list per request) p50_ms={statistics.median(samples):.2f}")
    await store.close()


def main() -> None:
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 10_000
    queries = int(sys.argv[2]) if len(sys.argv) > 2 else 200
    load = os.getloadavg()
    print(
        f"load_average_1m={load[0]:.2f} cpus={os.cpu_count()} python_gc={'on' if gc.isenabled() else 'off'}"
    )
    fleet = synthetic_fleet(count)
    bench_queries(fleet, queries)
    with tempfile.TemporaryDirectory() as workdir:
        asyncio.run(bench_service(fleet, queries, Path(workdir)))
    print(f"load_average_1m_after={os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
