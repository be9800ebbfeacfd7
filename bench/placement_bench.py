"""Placement latency over 10,000 synthetic servers: p50/p99 of `decide()` per query.

Run: python3 -m bench.placement_bench [servers] [queries]. Prints numbers only; no thresholds.
The fleet is built from realistic SKUs (GPU model, driver, utilisation), as real fleets are.
"""

from __future__ import annotations

import random
import statistics
import sys
import time

from placement.decide import FleetIndex, ImageFacts, decide
from placement.inventory import Server
from placement.request import DeployRequest
from scanner.models import GpuFacts, ImageReport, PlatformReport

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


def image() -> ImageFacts:
    env = {"NVIDIA_REQUIRE_CUDA": REQUIRE_12_2, "CUDA_VERSION": "12.2.2", "NVIDIA_VISIBLE_DEVICES": "all"}
    gpu = GpuFacts(required=True, cuda_version="12.2", requirements=[REQUIRE_12_2], env=env)
    report = ImageReport(
        reference="nvidia/cuda:12.2.2",
        platforms=[PlatformReport(platform="linux/amd64", digest="sha256:0", gpu=gpu)],
    )
    return ImageFacts.from_report(report)


REQUESTS = [
    DeployRequest(gpus=1),
    DeployRequest(gpus=2, gpu_models=["h100", "a100"], gpu_model_order="ordered", min_gpu_memory="40Gi"),
    DeployRequest(gpus=4, cpus=64, memory="512Gi", labels={"zone": "a"}, min_compute_capability="8.0"),
]


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 10_000
    queries = int(sys.argv[2]) if len(sys.argv) > 2 else 200
    fleet = synthetic_fleet(count)
    started = time.perf_counter()
    index = FleetIndex.build(fleet)
    build_ms = (time.perf_counter() - started) * 1000
    facts = image()
    print(
        f"servers={count} gpu_classes={len(index.classes)} shapes={index.shape_count} "
        f"index_build_ms={build_ms:.1f}"
    )
    calibration = []
    for _ in range(20):
        t0 = time.perf_counter()
        _ = [{"server": n, "gpus": [n], "score": 1.0} for n in range(count)]
        calibration.append((time.perf_counter() - t0) * 1000)
    print(
        f"calibration: building {count} bare result dicts takes p50_ms={statistics.median(calibration):.2f}"
    )
    for request in REQUESTS:
        decide(facts, request, index)  # warm-up
        wall, cpu = [], []
        for _ in range(queries):
            t0, c0 = time.perf_counter(), time.process_time()
            decision = decide(facts, request, index)
            wall.append((time.perf_counter() - t0) * 1000)
            cpu.append((time.process_time() - c0) * 1000)
        print(
            f"request={request.model_dump(exclude_defaults=True)} eligible={len(decision.eligible)} "
            f"wall p50_ms={statistics.median(wall):.2f} p99_ms={percentile(wall, 0.99):.2f} "
            f"cpu p50_ms={statistics.median(cpu):.2f} p99_ms={percentile(cpu, 0.99):.2f}"
        )
    samples = []
    for _ in range(max(5, queries // 20)):
        t0 = time.perf_counter()
        decide(facts, REQUESTS[0], fleet)
        samples.append((time.perf_counter() - t0) * 1000)
    print(f"unindexed (Sequence[Server], index built per query): p50_ms={statistics.median(samples):.2f}")


if __name__ == "__main__":
    main()
