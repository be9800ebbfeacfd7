"""What an image carries decides too: real NVIDIA libraries in images on a real registry (issue 29).

Images are pushed with skopeo; their GPU code is NVIDIA's and PyTorch's own, downloaded from PyPI at
set-up (tests/nvidia_wheels.py): the libraries torch 2.7.0 pins (cuSPARSELt 0.6.3, NCCL 2.26.2,
cuRAND 10.3.9.90), CUDA 13's runtime wheel, and torchao 0.7.0, whose kernels stop at sm_90 with no
PTX (as torch 2.5.1's libtorch_cuda.so). Servers have drivers on both sides of each floor and GPUs
of compute capability 7.0, 8.0, 8.9, 9.0, 10.0 and 12.0. One store for the module: a layer shared
by two images is read once.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from fixtures.oci import Entry, ImageSpec, LayerSpec, file, tar_bytes
from fixtures.registry import LocalRegistry
from placement import gpu_code
from placement.decide import decide
from placement.exports import FORMATS, export_constraints
from placement.exports.nfd import artifact_yaml, compatibility_spec
from placement.image_facts import ImageFacts
from placement.inventory import Gpu, Server
from placement.nfd.features import from_server
from placement.nfd.match import evaluate_spec
from placement.request import DeployRequest
from scanner.models import ImageReport, PlatformReport
from scanner.registry.client import RegistryClient
from scanner.scan import Scanner
from scanner.settings import ScannerSettings
from store import open_store
from tests.conftest import Pusher
from tests.nvidia_wheels import (
    CUDA_RUNTIME_12_4,
    CUDA_RUNTIME_13,
    CURAND_CU12,
    CUSPARSELT_CU12,
    NCCL_CU12,
    TORCHAO_070,
    PinnedWheel,
    cached_layer,
    cuobjdump_listing,
    wheel_member,
    wheel_members,
)

SITE = "/usr/local/lib/python3.12/dist-packages"
TORCHAO_LIB = f"{SITE}/torchao/_C.cpython-311-x86_64-linux-gnu.so"
APP_LIB = "/app/lib/libkernels.so"  # torchao 0.7.0's _C as an application's own kernel library
CUDART_12_4 = "/usr/local/cuda-12.4/targets/x86_64-linux/lib/libcudart.so.12"
NCCL_LIB = f"{SITE}/nvidia/nccl/lib/libnccl.so.2"
CUSPARSELT_LIB = f"{SITE}/cusparselt/lib/libcusparseLt.so.0"
CURAND_BASE_LIB = "/usr/local/cuda-12.4/targets/x86_64-linux/lib/libcurand.so.10"


def torch_version(release: str, cuda: str) -> str:
    return f"__version__ = '{release}'\ndebug = False\ncuda: Optional[str] = '{cuda}'\nhip: Optional[str] = None\n"


def toolkit(version: str) -> LayerSpec:
    """What an nvidia/cuda base leaves: its toolkit tree's version.json."""
    short = ".".join(version.split(".")[:2])
    body = json.dumps({"cuda": {"name": "CUDA SDK", "version": version}})
    return LayerSpec([file(f"/usr/local/cuda-{short}/version.json", body)])


def wheel_entries(wheel: PinnedWheel) -> list[Entry]:
    return [file(f"{SITE}/{path}", data) for path, data in wheel_members(wheel).items()]


def torch27_libs_layer() -> LayerSpec:
    """The libraries torch 2.7.0 pins and its version file, one zstd layer (cached; `tests/prefetch.py`)."""
    wheels = (CUSPARSELT_CU12, NCCL_CU12, CURAND_CU12)

    def tar() -> bytes:
        entries = [entry for wheel in wheels for entry in wheel_entries(wheel)]
        entries.append(file(f"{SITE}/torch/version.py", torch_version("2.7.0+cu128", "12.8")))
        return tar_bytes(entries)

    blob, diff_id = cached_layer("torch27-libs", wheels, tar)
    return LayerSpec([], compression="zstd", blob=blob, diff_id=diff_id)


def cuda_base_layer() -> LayerSpec:
    """An nvidia/cuda 12.4 base's toolkit tree with its cuRAND, one zstd layer (cached)."""

    def tar() -> bytes:
        _, curand = wheel_member(CURAND_CU12, "/libcurand.so.10")
        return tar_bytes([*toolkit("12.4.1").entries, file(CURAND_BASE_LIB, curand)])

    blob, diff_id = cached_layer("cuda-12.4-base", (CURAND_CU12,), tar)
    return LayerSpec([], compression="zstd", blob=blob, diff_id=diff_id)


def declared(cuda: str) -> dict[str, str]:
    """The config of a `FROM nvidia/cuda:<cuda>` image (one brand clause, as the real ones have many)."""
    short = ".".join(cuda.split(".")[:2])
    return {
        "CUDA_VERSION": cuda,
        "NVIDIA_REQUIRE_CUDA": f"cuda>={short} brand=tesla,driver>=470,driver<471",
        "NVIDIA_VISIBLE_DEVICES": "all",
        "NVIDIA_DRIVER_CAPABILITIES": "compute,utility",
    }


@pytest.fixture(scope="module")
def images(registry: LocalRegistry, push: Pusher) -> Iterator[dict[str, str]]:
    torch27_libs, cuda_base = torch27_libs_layer(), cuda_base_layer()
    cu130 = LayerSpec(
        [
            *wheel_entries(CUDA_RUNTIME_13),
            file(f"{SITE}/torch/version.py", torch_version("2.9.1+cu130", "13.0")),
        ]
    )
    torchao = LayerSpec(wheel_entries(TORCHAO_070))
    _, torchao_c = next((p, d) for p, d in wheel_members(TORCHAO_070).items() if p.endswith(".so"))
    app_kernels = LayerSpec([file(APP_LIB, torchao_c)])
    _, cudart = wheel_member(CUDA_RUNTIME_12_4, "/libcudart.so.12")
    base_124 = LayerSpec([*toolkit("12.4.1").entries, file(CUDART_12_4, cudart)])  # what its programs link
    specs = {
        "carried/cu130-on-128:1": ImageSpec([toolkit("12.8.1"), cu130], env=declared("12.8.1")),
        "carried/torchao-on-124:1": ImageSpec([base_124, torchao], env=declared("12.4.1")),
        "carried/app-kernels-on-124:1": ImageSpec([base_124, app_kernels], env=declared("12.4.1")),
        "carried/torch27-libs:1": ImageSpec([torch27_libs]),
        "carried/torch27-libs-declared:1": ImageSpec(
            [toolkit("12.8.1"), torch27_libs], env=declared("12.8.1")
        ),
        "carried/app-on-cuda-base:1": ImageSpec(
            [cuda_base, LayerSpec([file("/app/main.py", "print('hi')\n")])], env=declared("12.4.1")
        ),
    }
    for name, spec in specs.items():
        push(spec, name)
    yield {name: f"{registry.host}/{name}" for name in specs}


@pytest.fixture(scope="module")
def store_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("carried") / "scan.db"


async def scan(reference: str, store_path: Path, mode: str = "always") -> PlatformReport:
    settings = ScannerSettings(docker_config=None, deep_scan=mode, analysis_processes=0)  # type: ignore[arg-type]
    store = open_store(store_path)
    try:
        async with RegistryClient(settings) as client:
            scanner = Scanner(client, store.scan_cache, settings)
            report = await scanner.scan(reference)
            await scanner.close()
    finally:
        await store.close()
    assert report.error is None, report.error
    return report.platforms[0]


def server(name: str, cc: str, driver: str, cuda: str) -> Server:
    gpu = Gpu(index=0, uuid=f"GPU-{name}", name=name, brand="Tesla", memory_mib=81559, compute_capability=cc)
    return Server(
        name=name, cpus=32, memory=1 << 40, driver_version=driver, cuda_driver_version=cuda, gpus=[gpu]
    )


FLEET = [
    server("v100-580", "7.0", "580.65.06", "13.0"),
    server("a100-520", "8.0", "520.61.05", "11.8"),  # below CUDA 12's floor (525.60.13)
    server("a100-570", "8.0", "570.86.15", "12.8"),
    server("l4-575", "8.9", "575.51.03", "12.9"),  # below CUDA 13's floor (580)
    server("h100-570", "9.0", "570.86.15", "12.8"),
    server("h100-580", "9.0", "580.65.06", "13.0"),
    server("b200-580", "10.0", "580.65.06", "13.0"),
    server("rtx5090-570", "12.0", "570.86.15", "12.8"),
    server("rtx5090-580", "12.0", "580.65.06", "13.0"),
]


def answer(platform: PlatformReport, reference: str) -> tuple[set[str], dict[str, list[str]], list[str]]:
    report = ImageReport(reference=reference, platforms=[platform])
    decision = decide(ImageFacts.from_report(report), DeployRequest(gpus=1), FLEET)
    eligible = {item["server"] for item in decision.eligible}
    reasons = {item["server"]: list(item["reasons"]) for item in decision.ineligible}
    return eligible, reasons, list(decision.warnings)


def cuobjdump_archs(data: bytes, tmp: Path) -> tuple[set[str], set[str]]:
    """(SASS archs, PTX archs) as NVIDIA's cuobjdump lists them for a file."""
    path = tmp / "lib.so"
    path.write_bytes(data)
    return cuobjdump_listing(path)


async def test_a_newer_carried_cuda_on_a_declared_base_needs_its_driver(
    images: dict[str, str], store_path: Path
) -> None:
    reference = images["carried/cu130-on-128:1"]
    platform = await scan(reference, store_path)
    gpu = platform.gpu
    assert gpu.cuda_version == "12.8" and gpu.inferred is not None and gpu.inferred.cuda == "13.0"
    setter = f"{SITE}/torch/version.py: torch 2.9.1+cu130, cuda = '13.0'"
    assert gpu.inferred.set_by == setter
    versions = {(v.cuda, v.evidence) for v in gpu.inferred.versions}
    assert ("13.0", f"{SITE}/nvidia_cuda_runtime-13.0.96.dist-info: nvidia-cuda_runtime 13.0.96") in versions
    assert ("12.8", "/usr/local/cuda-12.8: CUDA toolkit tree 12.8") in versions
    assert "cuda-newer-inside" in platform.badges
    assert any("carry the newer CUDA 13.0" in w and setter in w for w in platform.warnings)

    eligible, reasons, _ = answer(platform, reference)
    assert eligible == {"h100-580", "b200-580", "rtx5090-580"}
    for name in ("a100-570", "l4-575", "h100-570", "rtx5090-570"):
        line = next(line for line in reasons[name] if "CUDA 13.x needs driver >= 580" in line)
        assert f"the image carries CUDA 13.0 ({setter}), newer than the CUDA 12.8 it declares" in line
    assert any("compute capability 7.5 or newer" in line for line in reasons["v100-580"])

    # every export states the carried CUDA's driver floor
    facts = ImageFacts.from_report(ImageReport(reference=reference, platforms=[platform]))
    for form in FORMATS:
        body = json.dumps(export_constraints(facts, DeployRequest(gpus=1), [], form))
        assert "CUDA 13.x needs driver >= 580" in body, form
    dra = json.dumps(export_constraints(facts, DeployRequest(gpus=1), [], "dra"))
    assert "driverVersion.compareTo(semver('580.0.0')) >= 0" in dra

    # what the default was before: a declared image's layers were never read for what it carries
    before = await scan(reference, store_path.with_name("auto.db"), mode="auto")
    assert before.gpu.inferred is None
    assert {"a100-570", "l4-575", "h100-570", "rtx5090-570"} <= answer(before, reference)[0]


async def test_a_declared_base_with_kernels_that_stop_at_sm_90(
    images: dict[str, str], store_path: Path, tmp_path: Path
) -> None:
    reference = images["carried/app-kernels-on-124:1"]
    platform = await scan(reference, store_path)
    archs = platform.gpu.archs
    assert archs is not None
    (lib,) = [f for f in archs.files if f.path == APP_LIB]
    # ground truth: NVIDIA's cuobjdump on the same file
    _, data = next(
        (p, d)
        for p, d in wheel_members(TORCHAO_070).items()
        if p.endswith("_C.cpython-311-x86_64-linux-gnu.so")
    )
    assert (set(lib.sass), set(lib.ptx)) == cuobjdump_archs(data, tmp_path) == ({"80", "86", "90"}, set())
    assert archs.sass == ["80", "86", "90"] and archs.ptx == []  # never empty for an image that runs on A100
    assert gpu_code.summary(archs) == "GPU code for sm_80–sm_90, no PTX: compute capability 8.0–9.0"
    assert not any("cuda-newer-inside" in b or "cuda-mismatch" in b for b in platform.badges)

    eligible, reasons, _ = answer(platform, reference)
    assert eligible == {"a100-570", "l4-575", "h100-570", "h100-580"}
    for name, cc in (("rtx5090-580", "12.0"), ("b200-580", "10.0"), ("v100-580", "7.0")):
        assert any(
            f"{APP_LIB} has no kernel image for compute capability {cc} (SASS sm_80–sm_90, no PTX)" in line
            for line in reasons[name]
        ), "\n".join(reasons[name])

    # the exports say the same: DRA's selector admits compute capability 8.0-9.0 and nothing newer
    facts = ImageFacts.from_report(ImageReport(reference=reference, platforms=[platform]))
    dra = json.dumps(export_constraints(facts, DeployRequest(gpus=1), [], "dra"))
    assert "cudaComputeCapability.compareTo(semver('8.0.0')) >= 0" in dra
    assert "cudaComputeCapability.compareTo(semver('9.0.0')) <= 0" in dra and "semver('10.0.0')" not in dra

    # NFD's artifact says the same on GFD's labels
    artifact = artifact_yaml(ImageReport(reference=reference, platforms=[platform]))
    assert artifact is not None
    text = artifact.decode()
    assert "name: gpu-code" in text and "nvidia.com/gpu.compute.major" in text
    assert "compute capability 8.0-8.9, 9.0" in text
    spec = compatibility_spec(ImageReport(reference=reference, platforms=[platform]))
    assert spec is not None
    code_rule = {}
    for node in FLEET:
        result = evaluate_spec(spec, from_server(node).features, node.name)
        rules = [rule for one in result.sets for rule in one.rules if rule.name == "gpu-code"]
        assert len(rules) == 1 and rules[0].error is None, rules
        code_rule[node.name] = rules[0].matched
    assert {name for name, matched in code_rule.items() if matched} == {"a100-520", *eligible}


async def test_a_package_that_runs_without_its_kernels_is_placed_without_them(
    images: dict[str, str], store_path: Path
) -> None:
    """The same bytes as torchao 0.7.0's own `_C` extension: torchao loads it with
    `torch.ops.load_library` inside a `try:` and runs on without it, so where its kernels stop
    (Blackwell) the image runs, and the answer says what it runs without."""
    reference = images["carried/torchao-on-124:1"]
    platform = await scan(reference, store_path)
    archs = platform.gpu.archs
    assert archs is not None
    (lib,) = [f for f in archs.files if f.path == TORCHAO_LIB]
    assert lib.imported == "optional" and lib.loadable  # libcudart.so.12 is in the base
    (package,) = [p for p in archs.packages if p.id == lib.package]
    assert package.name == "torchao" and package.version == "0.7.0" and package.optional
    eligible, _, warnings = answer(platform, reference)
    assert {"b200-580", "rtx5090-580", "h100-580"} <= eligible
    assert any(
        "(compute capability 12.0): runs; without" in w
        and TORCHAO_LIB in w
        and "torchao 0.7.0 runs without it" in w
        for w in warnings
    ), warnings


async def test_torch_27_libraries_declared_and_undeclared(images: dict[str, str], store_path: Path) -> None:
    undeclared = await scan(images["carried/torch27-libs:1"], store_path)
    gpu = undeclared.gpu
    assert gpu.inferred is not None and gpu.inferred.cuda == "12.8"  # torch/version.py beats the cu12 names
    assert gpu.inferred.set_by == f"{SITE}/torch/version.py: torch 2.7.0+cu128, cuda = '12.8'"
    archs = gpu.archs
    assert archs is not None and {"80", "86", "89", "90"} <= set(archs.sass)

    # NCCL: 127 device-link containers never count; its one runtime container stops at sm_90, no PTX
    (nccl,) = [f for f in archs.files if f.path == NCCL_LIB]
    assert sum(c.count for c in nccl.containers if c.section == "__nv_relfatbin") == 127
    assert gpu_code.judge_file(nccl, (12, 0)).total == 1 and not gpu_code.judge_file(nccl, (12, 0)).runs
    # cuSPARSELt: sm_90a-only containers are its Hopper fast path, not a requirement on A100 or L4
    (cusparselt,) = [f for f in archs.files if f.path == CUSPARSELT_LIB]
    assert (
        sum(c.count for c in cusparselt.containers if c.sass == ("90a",) and c.section == ".nv_fatbin") == 7
    )
    assert all(gpu_code.judge_file(cusparselt, cc).runs for cc in ((8, 0), (8, 9), (9, 0)))

    eligible, reasons, warnings = answer(undeclared, images["carried/torch27-libs:1"])
    assert eligible == {f.name for f in FLEET} - {"a100-520"}
    line = next(line for line in reasons["a100-520"] if "CUDA 12.x needs driver >= 525.60.13" in line)
    assert gpu.inferred.set_by in line
    # where only NVIDIA's libraries lack code, the answer names each and what it lacks
    assert any(
        NCCL_LIB in w and "compute capability 12.0" in w and "SASS sm_50–sm_90, no PTX" in w for w in warnings
    )
    # cuSPARSELt's generic kernels reach Blackwell through their PTX: a library runs where some of its
    # containers do, so it earns no caveat there (the strict rule, every container, would name it)
    assert not any(CUSPARSELT_LIB in w and "compute capability 10.0" in w for w in warnings)
    assert any(CUSPARSELT_LIB in w and "(compute capability 7.0): runs; without" in w for w in warnings)
    assert gpu_code.judge_file(cusparselt, (10, 0)).runs
    assert not gpu_code.judge_file(cusparselt, (10, 0), rule="strict").runs
    assert not any("compute capability 9.0)" in w or "compute capability 8.0)" in w for w in warnings)

    declared_platform = await scan(images["carried/torch27-libs-declared:1"], store_path)
    shared = declared_platform.layers[1]
    assert declared_platform.libc.bytes_read <= declared_platform.layers[0].size + (1 << 20)
    assert shared.digest == undeclared.layers[0].digest  # read once, for both images
    assert declared_platform.gpu.inferred is not None and declared_platform.gpu.inferred.cuda == "12.8"
    assert not any(b in declared_platform.badges for b in ("cuda-newer-inside", "cuda-mismatch"))
    declared_eligible, _, _ = answer(declared_platform, images["carried/torch27-libs-declared:1"])
    assert declared_eligible == eligible - {"a100-520"}  # NVIDIA_REQUIRE_CUDA cuda>=12.8 keeps 11.8 off too


async def test_an_app_on_a_cuda_base_that_carries_nothing_of_its_own(
    images: dict[str, str], store_path: Path
) -> None:
    reference = images["carried/app-on-cuda-base:1"]
    today = await scan(reference, store_path.with_name("auto.db"), mode="auto")  # the declared facts alone
    now = await scan(reference, store_path)
    assert now.gpu.inferred is not None and now.gpu.inferred.cuda == "12.4"
    assert now.warnings == [] and not any(b in now.badges for b in ("cuda-newer-inside", "cuda-mismatch"))
    assert answer(now, reference)[0] == answer(today, reference)[0]
    assert answer(now, reference)[2] == []
