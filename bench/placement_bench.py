"""Placement at fleet scale: `POST /api/eligibility` wall time through HTTP next to the function alone.

For each fleet size (100, 1,000, 10,000, 100,000 synthetic servers) one run:
- starts `gpubadge serve` as its own process with the fleet as its inventory file and the image's
  report in its store, warms it up, then times sequential POSTs over one keep-alive connection
  (what a deploy pipeline sees: request, decision, JSON answer of one page, response read);
- times the same work as a function in this process: `answer(decide(...))` on a built index;
- does both twice: the same question repeated (as a deploy pipeline asks it; the index keeps shape
  verdicts per query form), and a new query form every time (`-new-form` lines: nothing kept applies);
- prints p50/p99 of both, and each size's p99 as a multiple of the 100-server p99 (the growth).

Run: python3 -m bench.placement_bench [--quick] [--sizes 100,1000,10000,100000] [--queries N].
Prints numbers only; bench/run.py turns the `http ` and `function ` lines into figures.
The fleet is built from realistic SKUs (GPU model, driver, utilisation), as real fleets are.
"""

from __future__ import annotations

import argparse
import gc
import http.client
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fixtures.process import stop_process
from fixtures.registry import free_port
from fixtures.service import wait_healthy
from placement.answer import AnswerOptions, answer
from placement.decide import decide
from placement.image_facts import ImageFacts
from placement.index import FleetIndex
from placement.inventory import Server
from placement.request import DeployRequest
from scanner.models import GpuFacts, ImageReport, PlatformReport
from store import SqliteStore, queries

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
BRANDS_12_2 = ("tesla", "unknown", "nvidia", "nvidiartx", "geforce", "geforcertx", "quadro", "quadrortx")
REQUIRE_12_2 = " ".join(
    ["cuda>=12.2"]
    + [
        f"brand={b},driver>={n},driver<{n + 1}"
        for n in (470, 525)
        for b in (*BRANDS_12_2, "titan", "titanrtx")
    ]
)
REGISTRY, REPOSITORY, TAG = "127.0.0.1:5999", "bench/cuda", "12.2.2"
REFERENCE = f"{REGISTRY}/{REPOSITORY}:{TAG}"


def synthetic_fleet(count: int, seed: int = 7) -> list[dict[str, Any]]:
    """Servers as inventory-file dicts; GPUs in use vary per server, so shapes repeat but not trivially."""
    rng = random.Random(seed)
    servers = []
    for n in range(count):
        name, brand, mib, cc, per, cpus, memory_gib = rng.choice(SKUS)
        driver, cuda = rng.choice(DRIVERS)
        uuids = [f"GPU-{n:06d}-{i}" for i in range(per)]
        gpus = [
            {"index": i, "uuid": u, "name": name, "brand": brand, "memory_mib": mib, "compute_capability": cc}
            for i, u in enumerate(uuids)
        ]
        servers.append(
            {
                "name": f"srv-{n:06d}",
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
    return servers


def gpu_report() -> ImageReport:
    env = {"NVIDIA_REQUIRE_CUDA": REQUIRE_12_2, "CUDA_VERSION": TAG, "NVIDIA_VISIBLE_DEVICES": "all"}
    gpu = GpuFacts(required=True, cuda_version="12.2", requirements=[REQUIRE_12_2], env=env)
    digest = "sha256:" + "b" * 64
    return ImageReport(
        reference=REFERENCE,
        digest=digest,
        registry=REGISTRY,
        repository=REPOSITORY,
        platforms=[PlatformReport(platform="linux/amd64", digest=digest, gpu=gpu)],
    )


REQUESTS: list[tuple[str, DeployRequest]] = [
    ("gpu-image", DeployRequest(gpus=1)),
    (
        "gpu-models",
        DeployRequest(gpus=2, gpu_models=["h100", "a100"], gpu_model_order="ordered", min_gpu_memory="40Gi"),
    ),
    (
        "labels-and-sizes",
        DeployRequest(gpus=4, cpus=64, memory="512Gi", labels={"zone": "a"}, min_compute_capability="8.0"),
    ),
]


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def timed(action: Callable[[], Any], rounds: int) -> list[float]:
    """Wall ms per call, after one warm-up call."""
    action()
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        action()
        samples.append((time.perf_counter() - t0) * 1000)
    return samples


def cold(request: DeployRequest, number: int) -> DeployRequest:
    """The same request as a new query form (a CPU count below every server's), so no shape
    verdict kept from earlier queries applies: the cost of a question the service never saw."""
    return request.model_copy(update={"cpus": 1 + number / 1000})


def function_only(
    servers: list[Server], request: DeployRequest, rounds: int, fresh: bool = False
) -> tuple[list[float], int, int]:
    """What the handler's worker thread does, in-process: decide + one page. (ms, eligible, shapes)."""
    index = FleetIndex.build(servers)
    # As the service does after start-up (web.app, with the inventory file's index built by then):
    # the long-lived fleet leaves the cyclic collector's reach, so full passes do not land in queries.
    gc.freeze()
    facts = ImageFacts.from_report(gpu_report())
    options = AnswerOptions()
    body = answer(decide(facts, request, index), options)
    forms = iter(range(1, 10**9))
    samples = timed(
        lambda: answer(decide(facts, cold(request, next(forms)) if fresh else request, index), options),
        rounds,
    )
    return samples, body["eligible_count"], len(index.view().shape_entries)


def over_http(
    fleet: list[dict[str, Any]], request: DeployRequest, rounds: int, workdir: Path
) -> tuple[list[float], list[float], int]:
    """`gpubadge serve` in its own process; sequential POSTs on one keep-alive connection. (ms, bytes)."""
    inventory = workdir / "fleet.json"
    inventory.write_text(json.dumps({"servers": fleet}))
    db = workdir / "bench.db"
    store = SqliteStore(db)
    report = gpu_report()
    store.run(queries.save_report, report)
    store.run(queries.record_tag, REGISTRY, REPOSITORY, TAG, report.digest or "")
    store.close()
    port = free_port()
    env = {
        **os.environ,
        "GPUBADGE_DB": str(db),
        "GPUBADGE_PORT": str(port),
        "GPUBADGE_INVENTORY_FILE": str(inventory),
    }
    with (workdir / "service.log").open("ab") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "gpubadge.cli", "serve", "--log-level", "WARNING"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_healthy(f"http://127.0.0.1:{port}", process, timeout=300)
        forms = iter(range(1, 10**9))

        def body_of(form: DeployRequest) -> str:
            return json.dumps({"image": REFERENCE, **form.model_dump(mode="json", exclude_defaults=True)})

        body = body_of(request)
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
        size = 0

        def post(fresh: bool = False) -> None:
            nonlocal size
            sent = body_of(cold(request, next(forms))) if fresh else body
            connection.request("POST", "/api/eligibility", sent, {"Content-Type": "application/json"})
            response = connection.getresponse()
            data = response.read()
            if response.status != 200:
                raise RuntimeError(f"{response.status}: {data[:300]!r}")
            size = len(data)

        for _ in range(5):  # the first query builds the service's index; later ones use it
            post()
        samples = timed(post, rounds)
        fresh_samples = timed(lambda: post(fresh=True), rounds)
        connection.close()
        return samples, fresh_samples, size
    finally:
        stop_process(process, grace=20)


def figures(samples: list[float]) -> str:
    return f"p50_ms={statistics.median(samples):.2f} p99_ms={percentile(samples, 0.99):.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer queries per size")
    parser.add_argument("--sizes", default="100,1000,10000,100000", help="fleet sizes, comma-separated")
    parser.add_argument("--queries", type=int, help="queries per size (default 300, --quick 100)")
    args = parser.parse_args()
    sizes = [int(size) for size in args.sizes.split(",")]
    rounds = args.queries or (100 if args.quick else 300)
    load = os.getloadavg()
    print(f"load_average_1m={load[0]:.2f} cpus={os.cpu_count()} queries_per_size={rounds}")
    http_p99: dict[int, float] = {}
    function_p99: dict[int, float] = {}
    for count in sizes:
        fleet = synthetic_fleet(count)
        servers = [Server.model_validate(item) for item in fleet]
        name, request = REQUESTS[0]
        samples, eligible, shapes = function_only(servers, request, rounds)
        gc.unfreeze()
        function_p99[count] = percentile(samples, 0.99)
        print(
            f"function servers={count} request={name} shapes={shapes} eligible={eligible} {figures(samples)}"
        )
        cold_samples, _, _ = function_only(servers, request, rounds, fresh=True)
        gc.unfreeze()
        print(f"function-new-form servers={count} request={name} {figures(cold_samples)}")
        with tempfile.TemporaryDirectory() as workdir:
            web_samples, web_cold, size = over_http(fleet, request, rounds, Path(workdir))
        http_p99[count] = percentile(web_samples, 0.99)
        print(f"http servers={count} request={name} answer_bytes={size} {figures(web_samples)}")
        print(f"http-new-form servers={count} request={name} {figures(web_cold)}")
        if count == 10_000:
            for other, other_request in REQUESTS[1:]:
                more, eligible, _ = function_only(servers, other_request, rounds)
                gc.unfreeze()
                print(f"function servers={count} request={other} eligible={eligible} {figures(more)}")
    base = sizes[0]
    for count in sizes[1:]:
        print(
            f"growth servers={count} vs={base} http_p99_ratio={http_p99[count] / http_p99[base]:.2f} "
            f"function_p99_ratio={function_p99[count] / function_p99[base]:.2f}"
        )
    print(f"load_average_1m_after={os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
