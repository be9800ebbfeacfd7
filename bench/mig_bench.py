"""MIG placement at fleet scale, as a function: what MIG devices cost placement against the same fleet without them.

Two fleets of N synthetic servers from the same seed (bench.placement_bench's SKUs and drivers): the
peer has every GPU whole; in the other, the A100 and H100 servers (about half) have their GPUs in MIG
mode with NVIDIA's common layouts (7 × 1g, 3g + 4g, 3g + 2g + 2 × 1g), one layout per server as
mig-parted's named configurations apply them (`--layout gpu`: one per GPU, the worst case for the
index), 40% of MIG devices (and of whole GPUs) in use at random. For each fleet: `FleetIndex.build`, then `answer(decide(...))` for a whole-GPU request,
a profile request and a minimum-memory request, each three ways: the same question repeated (the index
keeps shape verdicts per form), a new form every time that differs in its CPUs alone (the index keeps GPU
parts per GPU form, so these judge no GPU sub-shape again), and a new GPU form every time (a new
`min_driver` that every server meets: nothing kept applies). Prints p50/p99 and MIG/peer ratios.

Run: python3 -m bench.mig_bench [--sizes 10000,100000] [--queries N]
"""

from __future__ import annotations

import argparse
import gc
import itertools
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from bench.placement_bench import DRIVERS, SKUS, gpu_report
from placement.answer import AnswerOptions, answer
from placement.decide import decide
from placement.image_facts import ImageFacts
from placement.index import FleetIndex
from placement.inventory import Server
from placement.request import DeployRequest

# (profile, memory MiB, SMs) as tests/fake_pynvml.py's MIG_PROFILES have them (A100-80GB, H100 80GB)
LAYOUTS: dict[str, list[list[tuple[str, int, int]]]] = {
    "A100": [
        [("1g.10gb", 9728, 14)] * 7,
        [("3g.40gb", 40192, 42), ("4g.40gb", 40192, 56)],
        [("3g.40gb", 40192, 42), ("2g.20gb", 19968, 28), ("1g.10gb", 9728, 14), ("1g.10gb", 9728, 14)],
    ],
    "H100": [
        [("1g.10gb", 9984, 16)] * 7,
        [("3g.40gb", 40448, 60), ("4g.40gb", 40448, 64)],
        [("3g.40gb", 40448, 60), ("2g.20gb", 20096, 32), ("1g.10gb", 9984, 16), ("1g.10gb", 9984, 16)],
    ],
}


def fleet(count: int, mig: bool, seed: int = 11, per_gpu: bool = False) -> list[Server]:
    rng = random.Random(seed)
    servers = []
    for n in range(count):
        name, brand, mib, cc, per, cpus, memory_gib = rng.choice(SKUS)
        driver, cuda = rng.choice(DRIVERS)
        family = next((key for key in LAYOUTS if key in name), None)
        split = mig and family is not None
        gpus: list[dict[str, Any]] = []
        in_use: list[str] = []
        node_layout = rng.choice(LAYOUTS[family]) if split and family else []
        for i in range(per):
            gpu: dict[str, Any] = {
                "index": i,
                "uuid": f"GPU-{n:06d}-{i}",
                "name": name,
                "brand": brand,
                "memory_mib": mib,
                "compute_capability": cc,
            }
            layout = rng.choice(LAYOUTS[family]) if per_gpu and split and family else node_layout
            if split:
                gpu["mig"] = True
                gpu["mig_devices"] = [
                    {
                        "index": j,
                        "uuid": f"MIG-{n:06d}-{i}-{j}",
                        "profile": p,
                        "memory_mib": m,
                        "multiprocessors": s,
                    }
                    for j, (p, m, s) in enumerate(layout)
                ]
                in_use += [d["uuid"] for d in gpu["mig_devices"] if rng.random() < 0.4]
            elif rng.random() < 0.4:
                in_use.append(gpu["uuid"])
            gpus.append(gpu)
        servers.append(
            Server.model_validate(
                {
                    "name": f"srv-{n:06d}",
                    "cpus": cpus,
                    "memory": memory_gib * 1024**3,
                    "driver_version": driver,
                    "cuda_driver_version": cuda,
                    "gpus": gpus,
                    "gpus_in_use": in_use,
                }
            )
        )
    return servers


REQUESTS = {
    "whole": DeployRequest(gpus=1),
    "profile": DeployRequest(mig_profiles=["1g.10gb"]),
    "memory": DeployRequest(mig_devices=2, min_gpu_memory="20Gi"),
}


def _asker(
    image: ImageFacts, request: DeployRequest, index: FleetIndex, options: AnswerOptions, vary: str
) -> Callable[[int], object]:
    """One question: the same each time (vary ""), a new form in its CPUs ("cpus"), or a new GPU form
    ("gpu", a `min_driver` of 450.<n> that every server meets) each time."""
    seen = itertools.count(int(time.time() * 1000) % 1_000_000)  # never a form an earlier run kept

    def ask(q: int) -> object:
        asked = request
        if vary == "cpus":
            asked = request.model_copy(update={"cpus": float(q % 97)})
        elif vary == "gpu":
            asked = request.model_copy(update={"min_driver": f"450.{next(seen)}"})
        return answer(decide(image, asked, index), options)

    return ask


def timed(fn: Callable[[int], object], queries: int) -> tuple[float, float]:
    samples = []
    for q in range(queries):
        started = time.perf_counter()
        fn(q)
        samples.append((time.perf_counter() - started) * 1000)
    samples.sort()
    return statistics.median(samples), samples[min(len(samples) - 1, int(len(samples) * 0.99))]


def main() -> None:
    parser = argparse.ArgumentParser(prog="bench.mig_bench")
    parser.add_argument("--sizes", default="10000,100000")
    parser.add_argument("--queries", type=int, default=100)
    parser.add_argument(
        "--layout", choices=("node", "gpu"), default="node", help="one MIG layout per server or per GPU"
    )
    args = parser.parse_args()
    image = ImageFacts.from_report(gpu_report())
    options = AnswerOptions(limit=50)
    for size in (int(text) for text in args.sizes.split(",")):
        figures: dict[str, dict[str, float]] = {}
        for label, mig in (("peer", False), ("mig", True)):
            servers = fleet(size, mig, per_gpu=args.layout == "gpu")
            started = time.perf_counter()
            index = FleetIndex.build(servers)
            build = (time.perf_counter() - started) * 1000
            row = {"build": build, "shapes": float(len(index.view().shape_entries))}
            gc.collect()
            gc.freeze()  # as the service freezes its start-up heap (web.app)
            for name, request in REQUESTS.items():
                if not mig and name != "whole":
                    continue
                for suffix, vary in (("", ""), ("-new-form", "cpus"), ("-new-gpu-form", "gpu")):
                    p50, p99 = timed(_asker(image, request, index, options, vary), args.queries)
                    row[f"{name}{suffix} p50"], row[f"{name}{suffix} p99"] = p50, p99
            gc.unfreeze()
            figures[label] = row
            parts = ", ".join(f"{key} {value:.2f}" for key, value in row.items())
            print(f"{size} {label} ({args.layout} layouts): {parts} (ms; shapes a count)", flush=True)
        peer, mig = figures["peer"], figures["mig"]
        print(
            f"{size} ratio mig/peer: build {mig['build'] / peer['build']:.2f}x, whole p99 "
            f"{mig['whole p99'] / peer['whole p99']:.2f}x, whole new-form p99 "
            f"{mig['whole-new-form p99'] / peer['whole-new-form p99']:.2f}x, whole new-gpu-form p99 "
            f"{mig['whole-new-gpu-form p99'] / peer['whole-new-gpu-form p99']:.2f}x, profile new-gpu-form p99 "
            f"{mig['profile-new-gpu-form p99'] / peer['whole-new-gpu-form p99']:.2f}x of whole",
            flush=True,
        )


if __name__ == "__main__":
    main()
