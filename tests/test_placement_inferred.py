"""Placement of images whose CUDA was inferred from their layers: hint, driver floor, archs."""

from __future__ import annotations

import pytest

from placement.cuda_needs import driver_floor, ptx_driver_floor
from placement.decide import decide
from placement.decision import Decision
from placement.image_facts import ImageFacts
from placement.inventory import Gpu, Server
from placement.request import DeployRequest
from scanner.models import (
    ContainerArchs,
    FileArchs,
    GpuArchs,
    GpuFacts,
    ImageReport,
    InferredCuda,
    LibcVerdict,
    PlatformReport,
)

TORCH = "/usr/local/lib/python3.11/site-packages/torch/version.py"
LIB = "/usr/local/lib/python3.11/site-packages/torch/lib/libtorch_cuda.so"


def server(name: str, cc: str, driver: str, gpu_name: str = "NVIDIA GPU") -> Server:
    return Server(
        name=name,
        cpus=32,
        memory=1 << 40,
        driver_version=driver,
        gpus=[
            Gpu(
                index=0,
                uuid=f"GPU-{name}",
                name=gpu_name,
                brand="Tesla",
                memory_mib=81559,
                compute_capability=cc,
            )
        ],
    )


def image(cuda: str | None, containers: list[ContainerArchs] | None = None) -> ImageFacts:
    archs = None
    if containers is not None:
        archs = GpuArchs(files=[FileArchs(path=LIB, sections=[".nv_fatbin"], containers=containers)])
    gpu = GpuFacts(
        inferred=InferredCuda(cuda=cuda, evidence=[f"{TORCH}: cuda = '{cuda}'"], sources=["torch"]),
        archs=archs,
    )
    report = PlatformReport(
        platform="linux/amd64", digest="sha256:" + "2" * 64, gpu=gpu, libc=LibcVerdict(flavour="glibc")
    )
    return ImageFacts.from_report(ImageReport(reference="team/train:1", platforms=[report]))


def reasons(decision: Decision, name: str) -> list[str]:
    return next(item["reasons"] for item in decision.ineligible if item["server"] == name)


def eligible(decision: Decision) -> list[str]:
    return [item["server"] for item in decision.eligible]


FLEET = [
    server("old-driver", "8.0", "470.57.02"),
    server("a100", "8.0", "535.104.05"),
    server("h100-r550", "9.0", "550.54.15"),
    server("h100-r580", "9.0", "580.65.06"),
    server("v100", "7.0", "535.104.05"),
]


def test_without_gpus_it_places_as_a_cpu_image_with_a_hint() -> None:
    decision = decide(image("12.1"), DeployRequest(), FLEET)
    assert sorted(eligible(decision)) == sorted(s.name for s in FLEET)
    assert all(item["gpus"] == [] for item in decision.eligible)
    assert decision.hints == ["carries CUDA 12.1 (torch): ask for gpus to run it on a GPU"]


def test_driver_floor_of_minor_version_compatibility() -> None:
    decision = decide(image("12.1"), DeployRequest(gpus=1), FLEET)
    assert "a100" in eligible(decision) and decision.hints == []
    assert any(
        f"driver 470.57.02: CUDA 12.x needs driver >= 525.60.13 (minor-version compatibility); "
        f"the image carries CUDA 12.1 ({TORCH}: cuda = '12.1')" in line
        for line in reasons(decision, "old-driver")
    )


@pytest.mark.parametrize(
    ("cuda", "floor"),
    [("13.0", "580"), ("12", "525.60.13"), ("11.8", "450.80.02"), ("11.0", "450.51.05"), ("10.2", "440.33")],
)
def test_driver_floor_table(cuda: str, floor: str) -> None:
    found = driver_floor(cuda)
    assert found is not None and found[0] == floor


def test_a_library_without_code_for_the_gpu_is_refused_naming_the_file() -> None:
    containers = [
        ContainerArchs(sass=("75", "80", "90"), ptx=(), count=3),
        ContainerArchs(sass=("80", "90a"), ptx=("90",), ptx_isa="8.4"),
    ]
    decision = decide(image("12.4", containers), DeployRequest(gpus=1), FLEET)
    assert {"a100", "h100-r550", "h100-r580"} <= set(eligible(decision))
    v100 = reasons(decision, "v100")
    assert any(
        line.startswith(
            f"1 free NVIDIA GPU: compute capability 7.0: {LIB} has no kernel image for compute capability 7.0"
        )
        for line in v100
    )
    assert any("SASS runs only on its own major at or above its minor" in line for line in v100)


def test_an_a_build_runs_only_at_its_exact_cc() -> None:
    containers = [ContainerArchs(sass=("90a",))]
    fleet = [server("h100", "9.0", "580.65.06"), server("b200", "10.0", "580.65.06")]
    decision = decide(image("12.8", containers), DeployRequest(gpus=1), fleet)
    assert eligible(decision) == ["h100"]
    assert any("sm_90a" in line for line in reasons(decision, "b200"))


def test_ptx_only_needs_the_driver_of_the_toolkit_that_made_it() -> None:
    containers = [ContainerArchs(sass=("80",), ptx=("80",), ptx_isa="8.8")]  # CUDA 12.9's PTX
    decision = decide(image("12.9", containers), DeployRequest(gpus=1), FLEET)
    assert "a100" in eligible(decision)  # SASS sm_80 runs on 8.0: no JIT, no PTX floor
    assert "h100-r580" in eligible(decision)
    line = next(line for line in reasons(decision, "h100-r550") if "only through PTX" in line)
    assert "PTX ISA 8.8 comes from CUDA 12.9, whose driver 575.51.03 is the first to JIT it" in line
    assert "this server has 550.54.15" in line and LIB in line
    assert ptx_driver_floor("9.9") is not None  # unknown ISA: the newest known driver, said so


def test_without_fatbins_the_toolkit_support_range_applies() -> None:
    fleet = [server("v100", "7.0", "580.65.06"), server("t4", "7.5", "580.65.06")]
    decision = decide(image("13.0"), DeployRequest(gpus=1), fleet)
    assert eligible(decision) == ["t4"]
    assert any(  # CUDA 13's arch floor, for the CUDA the image carries as for the CUDA it declares
        "CUDA 13 image needs compute capability 7.5 or newer" in line for line in reasons(decision, "v100")
    )
