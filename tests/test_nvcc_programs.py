"""Programs built at set-up by CUDA 13.0's nvcc from PyPI, one per target (`fixtures.cuda_program`):
what the scanner reads of them against NVIDIA's cuobjdump, and where placement says they run against
what each did on a real NVIDIA H200 (`RAN_ON_H200`, from bench/gpu_host_check.py).

That run found nvcc 13's empty module: every program it builds carries, first in its `.nv_fatbin`, a
fatbin container with no kernel (empty when only PTX is asked for, else a kernel-free cubin per real
arch). Placement used to count it as code that must run, and so rejected an H200 for programs that
ran there: PTX-only builds, and `sm_80` plus PTX, the usual forward-compatible build.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from pathlib import Path

import pytest

from fixtures.cuda_program import (
    DRIVER_OF_THE_H200_RUN,
    H200_COMPUTE_CAPABILITY,
    RAN_ON_H200,
    RAN_ON_H200_FROM_CUDA_13_5,
    TARGETS,
)
from fixtures.oci import ImageSpec, LayerSpec, file
from fixtures.registry import LocalRegistry
from placement import gpu_code
from placement.cuda_needs import ptx_driver_floor
from placement.decide import decide
from placement.image_facts import ImageFacts
from placement.inventory import Gpu, Server
from placement.request import DeployRequest
from scanner.layers.cuda_evidence import file_archs
from scanner.layers.cudaelf import ElfCudaProbe
from scanner.models import FileArchs, ImageReport
from scanner.registry.client import RegistryClient
from scanner.scan import Scanner
from scanner.settings import ScannerSettings
from tests.conftest import Pusher
from tests.nvidia_wheels import CUDA_13_0, CUDA_13_5, cuobjdump_listing, nvcc_program, toolkit_runtime


@pytest.fixture(scope="module")
def programs() -> dict[str, Path]:
    """Every target built (cached across runs: each build is a few seconds of nvcc)."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        built = dict(zip(TARGETS, pool.map(nvcc_program, TARGETS.values()), strict=True))
    return built


def read(path: Path) -> FileArchs:
    """The scanner's reading of one program, fed in chunks as a layer walk feeds it."""
    data = path.read_bytes()
    probe = ElfCudaProbe(len(data))
    for start in range(0, len(data), 4096):
        probe.feed(data[start : start + 4096])
    facts = probe.finish()
    assert facts is not None
    archs = file_archs(f"/app/{path.name}", facts)
    assert archs is not None and archs.error is None
    return archs


@pytest.mark.parametrize("name", list(TARGETS))
def test_the_scanner_lists_what_cuobjdump_lists(programs: dict[str, Path], name: str) -> None:
    archs = read(programs[name])
    sass, ptx = cuobjdump_listing(programs[name])
    # cuobjdump names a family cubin (flag 0x200000) by its base arch; the scanner keeps the `f`
    assert {arch.removesuffix("f") for arch in archs.sass} == sass
    assert set(archs.ptx) == ptx
    if name == "sass-sm_100f":
        assert archs.sass == ["100f"]


@pytest.mark.parametrize("name", list(TARGETS))
def test_nvcc_13s_empty_module_is_read_as_holding_no_kernel(programs: dict[str, Path], name: str) -> None:
    containers = read(programs[name]).containers
    assert [container.kernels for container in containers] == [False, True]
    empty, own = containers
    assert empty.ptx == ()  # never PTX, even where PTX was asked for
    assert empty.sass == tuple(arch for arch in own.sass)  # a cubin per real arch, or nothing


@pytest.mark.parametrize("name", list(TARGETS))
def test_placement_on_hopper_is_what_ran_on_an_h200(programs: dict[str, Path], name: str) -> None:
    verdict = gpu_code.judge_file(read(programs[name]), H200_COMPUTE_CAPABILITY)
    assert verdict.runs == RAN_ON_H200[name], verdict.lacks(H200_COMPUTE_CAPABILITY)


@pytest.mark.parametrize(
    ("name", "runs_on", "not_on"),
    [
        ("sass-sm_80", [(8, 0), (8, 6), (8, 9)], [(7, 5), (9, 0), (12, 0)]),
        ("sass-sm_90a", [(9, 0)], [(8, 9), (10, 0)]),
        ("sass-sm_100f", [(10, 0), (10, 3)], [(9, 0), (11, 0), (12, 0)]),
        ("ptx-compute_80", [(8, 0), (9, 0), (10, 0), (12, 0)], [(7, 5)]),
        ("ptx-compute_100", [(10, 0), (12, 1)], [(9, 0)]),
        ("fat-sm_80-ptx_80", [(8, 0), (8, 6), (9, 0), (12, 0)], [(7, 5)]),
        ("fat-sm_80-sm_86-no-ptx", [(8, 0), (8, 9)], [(9, 0), (10, 0)]),
    ],
)
def test_where_else_the_programs_run(
    programs: dict[str, Path], name: str, runs_on: list[tuple[int, int]], not_on: list[tuple[int, int]]
) -> None:
    """NVIDIA's rules on GPUs this suite has none of: SASS within its major at or above its minor (an
    `a` build at its CC only, an `f` build within its family), PTX JIT-compiled at or above its arch."""
    archs = read(programs[name])
    assert [cc for cc in runs_on if gpu_code.judge_file(archs, cc).runs] == runs_on
    assert [cc for cc in not_on if gpu_code.judge_file(archs, cc).runs] == []


def test_a_jit_needs_the_driver_of_the_nvcc_that_wrote_the_ptx(programs: dict[str, Path]) -> None:
    """Where a program runs from PTX, the verdict names the PTX ISA (9.0: CUDA 13.0) for the driver check."""
    verdict = gpu_code.judge_file(read(programs["fat-sm_80-ptx_80"]), (12, 0))
    assert verdict.runs and verdict.ptx_isa == "9.0"
    assert gpu_code.judge_file(read(programs["fat-sm_80-ptx_80"]), (8, 0)).ptx_isa is None  # SASS


@pytest.mark.parametrize("name", list(RAN_ON_H200_FROM_CUDA_13_5))
def test_a_newer_toolkits_ptx_needs_a_newer_driver_its_sass_does_not(name: str) -> None:
    """Built by CUDA 13.5 and run on the H200's 13.0 driver: the SASS ran, the PTX (ISA 9.5) could not
    be JIT-compiled. Placement says the same: the code runs on 9.0 only through PTX, whose floor is
    past that driver."""
    archs = read(nvcc_program(TARGETS[name], CUDA_13_5))
    verdict = gpu_code.judge_file(archs, H200_COMPUTE_CAPABILITY)
    floor = ptx_driver_floor(verdict.ptx_isa)
    jit_allowed = floor is None or gpu_code.version_key(DRIVER_OF_THE_H200_RUN) >= gpu_code.version_key(
        floor[0]
    )
    assert verdict.runs and jit_allowed == RAN_ON_H200_FROM_CUDA_13_5[name], (verdict, floor)
    assert verdict.ptx_isa == (None if name.startswith("sass") else "9.5")


def h200(name: str, driver: str, cuda: str) -> Server:
    gpu = Gpu(
        index=0,
        uuid=f"GPU-{name}",
        name="NVIDIA H200",
        brand="Nvidia",
        memory_mib=143771,
        compute_capability="9.0",
    )
    return Server(
        name=name, cpus=16, memory=1 << 37, driver_version=driver, cuda_driver_version=cuda, gpus=[gpu]
    )


@pytest.fixture(scope="module")
def forward_compatible(
    programs: dict[str, Path], registry: LocalRegistry, push: Pusher
) -> Iterator[dict[str, str]]:
    """The usual forward-compatible build (sm_80 SASS plus its PTX) in an image beside its CUDA runtime:
    built by CUDA 13.0 (`13.0`), and by CUDA 13.5 with 13.5's runtime (`13.5`)."""
    builds = {
        "13.0": (programs["fat-sm_80-ptx_80"], CUDA_13_0),
        "13.5": (nvcc_program(TARGETS["fat-sm_80-ptx_80"], CUDA_13_5), CUDA_13_5),
    }
    references = {}
    for version, (program, toolkit) in builds.items():
        spec = ImageSpec(
            [
                LayerSpec(
                    [file("usr/local/cuda/lib64/libcudart.so.13", toolkit_runtime(toolkit).read_bytes())]
                ),
                LayerSpec([file("app/program", program.read_bytes(), 0o755)]),
            ],
            env={"NVIDIA_VISIBLE_DEVICES": "all", "NVIDIA_DRIVER_CAPABILITIES": "compute,utility"},
            cmd=["/app/program"],
        )
        name = f"nvcc/forward-compatible-{version}:1"
        push(spec, name)
        references[version] = f"{registry.host}/{name}"
    yield references


async def placed(reference: str, fleet: list[Server]) -> tuple[list[str], dict[str, list[str]]]:
    """Scanned through the registry and the layer walk, then decided: (eligible, reasons by server)."""
    settings = ScannerSettings(docker_config=None, deep_scan="always", analysis_processes=0)  # type: ignore[arg-type]
    async with RegistryClient(settings) as client:
        scanner = Scanner(client, None, settings)
        report = await scanner.scan(reference)
        await scanner.close()
    assert report.error is None, report.error
    facts = ImageFacts.from_report(ImageReport(reference=reference, platforms=report.platforms))
    decision = decide(facts, DeployRequest(gpus=1), fleet)
    return [item["server"] for item in decision.eligible], {
        item["server"]: list(item["reasons"]) for item in decision.ineligible
    }


async def test_an_image_of_the_forward_compatible_build_is_placed_on_hopper(
    forward_compatible: dict[str, str],
) -> None:
    """Eligible on an H200 with a CUDA 13 driver (it ran on one), not on one whose driver is older than
    the CUDA 13 runtime it links."""
    fleet = [h200("h200-580", "580.159.04", "13.0"), h200("h200-570", "570.86.15", "12.8")]
    eligible, reasons = await placed(forward_compatible["13.0"], fleet)
    assert eligible == ["h200-580"]
    assert list(reasons) == ["h200-570"] and any("580" in reason for reason in reasons["h200-570"])


async def test_ptx_from_a_newer_cuda_than_the_drivers_is_refused(forward_compatible: dict[str, str]) -> None:
    """Built by CUDA 13.5: on the H200 it ran only where SASS covers the GPU, and its PTX did not JIT
    on CUDA 13.0's driver. On a Hopper GPU only the PTX covers it, so a server whose driver reports CUDA
    13.0 is refused for the PTX, while one whose driver reports 13.5 takes it; an Ampere GPU (SASS
    sm_80) runs it on either, its CUDA 13 runtime running on 580 by minor-version compatibility."""
    fleet = [
        h200("h200-cuda-13.0", DRIVER_OF_THE_H200_RUN, "13.0"),
        h200("h200-cuda-13.5", "600.10", "13.5"),
        h200("a100-cuda-13.0", DRIVER_OF_THE_H200_RUN, "13.0").model_copy(
            update={
                "gpus": [
                    Gpu(
                        index=0,
                        uuid="GPU-a100",
                        name="NVIDIA A100",
                        memory_mib=81920,
                        compute_capability="8.0",
                    )
                ]
            }
        ),
    ]
    eligible, reasons = await placed(forward_compatible["13.5"], fleet)
    assert sorted(eligible) == ["a100-cuda-13.0", "h200-cuda-13.5"]
    reason, count = reasons["h200-cuda-13.0"]
    assert "only through PTX" in reason and "PTX ISA 9.5 comes from CUDA 13.5" in reason, reason
    assert "supports CUDA 13.0" in reason and "has 0" in count, reason
