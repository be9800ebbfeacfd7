"""Real GPU packages placed as their own dispatch runs them (issue 42).

Each image is a glibc base plus the package's files as `pip install` lays them out, no NVIDIA
variables: members of the pinned wheels read from PyPI (`tests/gpu_packages.py`), each layer read by
the scanner's own walk. The fleet has the GPU classes the issue measured: V100 (7.0, driver 535), T4
(535 and 580), A100 (550), A10G and L4 (570), H100 (580, and one on 535 for TensorFlow's PTX), B200
(580), RTX 5090 (575), GB10 (12.1, 580); each driver reports its CUDA version as NVML does. Every
eligible set is asserted with the reason for each refused server, from the package's own source
(its dispatch) and the containers `cuobjdump` lists.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sysconfig
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from fixtures.hostile_gpu_code import smallest_gpu_library
from fixtures.oci import ImageSpec, LayerSpec, fake_elf, file, symlink
from fixtures.registry import LocalRegistry
from placement import gpu_code
from placement.compiler_releases import compiles_for, release
from placement.decide import decide
from placement.decision import Decision
from placement.flashinfer_compiler import flashinfer_gap, flashinfer_refusal
from placement.image_facts import ImageFacts
from placement.inventory import Gpu, Server
from placement.request import DeployRequest
from placement.triton_compiler import arch_name
from scanner.facts.gpu import gpu_facts
from scanner.layers.cuda_evidence import (
    PREBUILT_UTILS_FROM,
    CudaLayerEvidence,
    combine,
    file_archs,
    with_triton_ptxas,
)
from scanner.layers.cudaelf import ElfCudaProbe
from scanner.layers.fatbin import PTX_ISA_TOOLKITS
from scanner.layers.ptxas import ReleaseReader
from scanner.layers.python_loads import LoadSites
from scanner.models import (
    FlashInferFacts,
    GpuArchs,
    GpuFacts,
    ImageReport,
    InferredCuda,
    LibcVerdict,
    PackageFacts,
    PlatformReport,
    TritonFacts,
)
from scanner.registry.client import RegistryClient
from scanner.scan import Scanner
from scanner.settings import ScannerSettings
from store import open_store
from tests.conftest import Pusher
from tests.gpu_packages import (
    BITSANDBYTES,
    BUNDLED_RUNTIME,
    CUDA12,
    CUDA13,
    CUDA13_NVCC,
    EXLLAMAV2,
    EXLLAMAV3,
    FLASHINFER,
    FLASHINFER_041,
    FLASHINFER_050,
    FLASHINFER_070,
    FLASHINFER_CUBIN,
    GPU4PYSCF,
    MAMBA_SSM,
    MAMBA_SSM_101,
    ONNXRUNTIME,
    PYNVVIDEOCODEC,
    SGLANG,
    SGLANG_035,
    SGLANG_036,
    SGLANG_040,
    SGLANG_0510,
    SGLANG_0511,
    SGLANG_KERNEL,
    SITE,
    TENSORFLOW,
    TORCH_210,
    TORCH_214,
    TORCHAO_018,
    TRITON_34,
    TRITON_39,
    TVM_FFI,
    UNSLOTH,
    VLLM,
    VLLM_0110,
    VLLM_0202,
    VLLM_0210,
    VLLM_055,
    VLLM_061,
    VLLM_085,
    VLLM_FLASH_ATTN_261,
    Part,
    bitsandbytes_043_cuda121,
    bitsandbytes_layers,
    cccl_parallel_cu13,
    cuda13_stack,
    cuobjdump_12_4,
    flashinfer_layers,
    gpu4pyscf_layer,
    layer_evidence,
    libraries,
    onnxruntime_layers,
    pynvvideocodec_layer,
    python_package,
    python_sources,
    sglang_kernel_layer,
    sglang_layer,
    tensorflow_layers,
    torch_214,
    torchao_layer,
    triton_layer,
    triton_ptxas,
    unsloth_layer,
    vllm_layer,
)
from tests.nvidia_wheels import cuobjdump, nvcc
from tests.pypi_members import RemoteWheel, member_files, sdist_files

pytestmark = pytest.mark.timeout(900)

# (name, model, compute capability, driver, the CUDA version that driver reports)
FLEET_SPEC = [
    ("v100", "Tesla V100-SXM2-32GB", "7.0", "535.104.05", "12.2"),
    ("t4-535", "Tesla T4", "7.5", "535.104.05", "12.2"),
    ("t4-580", "Tesla T4", "7.5", "580.65.06", "13.0"),
    ("a100", "NVIDIA A100-SXM4-80GB", "8.0", "550.54.15", "12.4"),
    ("a10g", "NVIDIA A10G", "8.6", "570.86.15", "12.8"),
    ("l4", "NVIDIA L4", "8.9", "570.86.15", "12.8"),
    ("h100", "NVIDIA H100 80GB HBM3", "9.0", "580.65.06", "13.0"),
    ("b200", "NVIDIA B200", "10.0", "580.65.06", "13.0"),
    ("rtx5090", "NVIDIA GeForce RTX 5090", "12.0", "575.51.03", "12.9"),
    ("gb10", "NVIDIA GB10", "12.1", "580.95.05", "13.0"),
]
FLEET = [
    Server(
        name=name,
        cpus=32,
        memory=1 << 40,
        driver_version=driver,
        cuda_driver_version=cuda,
        gpus=[
            Gpu(
                index=0,
                uuid=f"GPU-{name}",
                name=model,
                brand="Tesla",
                memory_mib=40960,
                compute_capability=cc,
            )
        ],
    )
    for name, model, cc, driver, cuda in FLEET_SPEC
]
H100_535 = Server(
    name="h100-535",
    cpus=32,
    memory=1 << 40,
    driver_version="535.104.05",
    cuda_driver_version="12.2",
    gpus=[
        Gpu(
            index=0,
            uuid="GPU-h100-535",
            name="NVIDIA H100 80GB HBM3",
            memory_mib=81559,
            compute_capability="9.0",
        )
    ],
)
ALL = {name for name, *_ in FLEET_SPEC}
DRIVER_580 = "CUDA 13.x needs driver >= 580 (minor-version compatibility)"


def image(layers_top_down: Sequence[CudaLayerEvidence]) -> ImageFacts:
    inferred, archs = combine(layers_top_down)
    report = PlatformReport(
        platform="linux/amd64",
        digest="sha256:" + "5" * 64,
        gpu=GpuFacts(inferred=inferred, archs=archs),
        libc=LibcVerdict(flavour="glibc", state="analysed"),
    )
    return ImageFacts.from_report(ImageReport(reference="pkg/image:1", platforms=[report]))


def archs_of(facts: ImageFacts) -> GpuArchs:
    archs = facts.platforms[0].gpu.archs
    assert archs is not None
    return archs


def inferred_of(facts: ImageFacts) -> InferredCuda:
    inferred = facts.platforms[0].gpu.inferred
    assert inferred is not None
    return inferred


def place(facts: ImageFacts, servers: Sequence[Server] = FLEET, **request: object) -> Decision:
    return decide(facts, DeployRequest(gpus=1, **request), list(servers))  # type: ignore[arg-type]


def eligible(decision: Decision) -> set[str]:
    return {item["server"] for item in decision.eligible}


def reasons(decision: Decision) -> dict[str, list[str]]:
    return {item["server"]: item["reasons"] for item in decision.ineligible}


def only(decision: Decision, server: str) -> str:
    """The one reason a server's GPU is refused for: decisive, never wrong ones beside it (the count
    of suitable GPUs that follows is its consequence)."""
    found = [line for line in reasons(decision)[server] if not line.startswith("needs ")]
    assert len(found) == 1, found
    return found[0]


def file_of(archs: GpuArchs, suffix: str) -> gpu_code.FileArchs:
    (found,) = [f for f in archs.files if f.path.endswith(suffix)]
    return found


def listing(path: str) -> tuple[set[str], set[str]]:
    """(SASS, PTX) archs `cuobjdump -all --list-elf --list-ptx` names for a file ("80", "90a")."""
    import subprocess

    text = subprocess.run(
        [str(cuobjdump()), "-all", "--list-elf", "--list-ptx", path],
        capture_output=True,
        text=True,
        timeout=300,
    ).stdout
    sass = set(re.findall(r"\.sm_(\d+[a-z]?)\.cubin", text))
    ptx = set(re.findall(r"\.sm_(\d+[a-z]?)\.ptx", text))
    return sass, ptx


# -- the images


@pytest.fixture(scope="module")
def cuda13() -> CudaLayerEvidence:
    return layer_evidence(cuda13_stack())


@pytest.fixture(scope="module")
def torch14() -> CudaLayerEvidence:
    return layer_evidence([torch_214()])


@pytest.fixture(scope="module")
def vllm(cuda13: CudaLayerEvidence, torch14: CudaLayerEvidence) -> ImageFacts:
    return image([layer_evidence(vllm_layer()), torch14, cuda13])


@pytest.fixture(scope="module")
def bitsandbytes() -> ImageFacts:
    return image([layer_evidence(layer) for layer in bitsandbytes_layers()])


@pytest.fixture(scope="module")
def onnxruntime() -> ImageFacts:
    return image([layer_evidence(layer) for layer in onnxruntime_layers()])


@pytest.fixture(scope="module")
def tensorflow() -> ImageFacts:
    return image([layer_evidence(layer) for layer in tensorflow_layers()])


@pytest.fixture(scope="module")
def flashinfer() -> ImageFacts:
    return image([layer_evidence(layer) for layer in flashinfer_layers()])


# -- vLLM 0.33.0 with its torch 2.14.0+cu130


def test_vllm_runs_where_its_dispatch_runs_it(vllm: ImageFacts) -> None:
    decision = place(vllm)
    assert eligible(decision) == {"t4-580", "h100", "b200", "gb10"}
    assert only(decision, "v100") == (
        "1 free Tesla V100-SXM2-32GB: CUDA 13 image needs compute capability 7.5 or newer (CUDA 13 dropped"
        " Maxwell, Pascal and Volta); this GPU has 7.0"
    )
    for name, driver in [("t4-535", "535.104.05"), ("a100", "550.54.15"), ("a10g", "570.86.15"),
                         ("l4", "570.86.15"), ("rtx5090", "575.51.03")]:  # fmt: skip
        assert only(decision, name).endswith(
            f": driver {driver}: {DRIVER_580}; the image carries CUDA 13.0"
            f" ({SITE}/torch/version.py: torch 2.14.0+cu130, cuda = '13.0')"
        )


def test_vllm_says_what_it_runs_without_on_each_gpu(vllm: ImageFacts) -> None:
    archs = archs_of(vllm)
    t4 = gpu_code.judge(archs, (7, 5))
    missing = "\n".join(t4.without)
    assert (
        "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so (FlashAttention 2): no kernel image for compute capability 7.5"
        in missing
    )
    assert (
        "torch/lib/libtorch_cuda_linalg.so (torch.linalg): no kernel image for compute capability 7.5"
        in missing
    )
    assert "_vllm_fa3_C" in missing and "_qutlass_C" in missing
    hopper = "\n".join(gpu_code.judge(archs, (9, 0)).without)
    assert "_vllm_fa3_C" not in hopper and "_vllm_fa2_C" not in hopper  # FA3 on Hopper; FA2 from its PTX
    assert (
        "vllm/_qutlass_C.abi3.so (QuTLASS (FP4 kernels)): no kernel image for compute capability 9.0"
        in hopper
    )
    blackwell = "\n".join(gpu_code.judge(archs, (10, 0)).without)
    assert (
        "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so (FlashAttention 3): no kernel image for compute capability 10.0 (SASS sm_90a, no PTX); used on other GPUs"
        in blackwell
    )
    assert "_qutlass_C" not in blackwell
    warnings = "\n".join(place(vllm).warnings)
    assert (
        f"on Tesla T4 (compute capability 7.5): runs; without {SITE}/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so"
        in warnings
    )


def test_vllm_facts_match_cuobjdump_and_its_imports(vllm: ImageFacts) -> None:
    archs = archs_of(vllm)
    main = file_of(archs, "vllm/_C_stable_libtorch.abi3.so")
    assert main.imported == "required"  # `import vllm._C_stable_libtorch` atop vllm/platforms/cuda.py
    assert sum(c.count for c in main.containers) == 118
    assert len({(c.sass, c.ptx) for c in main.containers}) == 17
    assert file_of(archs, "_vllm_fa3_C.abi3.so").imported == "optional"  # in a try: (flash_attn_interface.py)
    assert file_of(archs, "_qutlass_C.abi3.so").imported == "optional"  # contextlib.suppress(ImportError)
    for suffix in ("/_vllm_fa3_C.abi3.so", "/_qutlass_C.abi3.so", "/_C_stable_libtorch.abi3.so"):
        file = file_of(archs, suffix)
        (local,) = member_files(VLLM, lambda name, suffix=suffix: name.endswith(suffix)).values()
        sass, ptx = listing(str(local))
        assert {arch.removesuffix("f") for arch in file.sass} == sass, (
            file.path
        )  # cuobjdump: sm_100f is sm_100
        assert set(file.ptx) == ptx, file.path
    packages = {p.id: p for p in archs.packages}
    assert packages["python:vllm"].version == "0.33.0" and not packages["python:vllm"].optional
    assert packages["python:torch"].version == "2.14.0"
    assert archs.runtime_cuda == "13.0"


def test_strict_rule_is_a_request_option_and_refuses_vllm_everywhere(vllm: ImageFacts) -> None:
    """The old rule, kept for images made of one application's own kernels: vLLM's per-architecture
    containers make it run nowhere, and each refusal names the file and the kernels it lacks."""
    decision = place(vllm, gpu_code_rule="strict")
    assert eligible(decision) == set()
    hopper = "\n".join(reasons(decision)["h100"])
    assert (
        f"compute capability 9.0: {SITE}/vllm/_C_stable_libtorch.abi3.so has no kernel image for compute capability 9.0"
        in hopper
    )
    assert "driver 570.86.15: CUDA 13.x needs driver >= 580" in only(decision, "l4")  # still decisive first
    assert eligible(place(vllm, gpu_code_rule="dispatch")) == {"t4-580", "h100", "b200", "gb10"}


# -- torchao 0.18.0 and sglang-kernel 0.4.10, each beside torch 2.14.0+cu130

FLEET_580 = [  # the fleet on driver 580, which runs CUDA 13: only the GPU code decides
    server.model_copy(update={"driver_version": "580.65.06", "cuda_driver_version": "13.0"})
    for server in FLEET
]


@pytest.fixture(scope="module")
def torchao(cuda13: CudaLayerEvidence, torch14: CudaLayerEvidence) -> ImageFacts:
    return image([layer_evidence(torchao_layer()), torch14, cuda13])


@pytest.fixture(scope="module")
def sglang(cuda13: CudaLayerEvidence, torch14: CudaLayerEvidence) -> ImageFacts:
    return image([layer_evidence(sglang_kernel_layer()), torch14, cuda13])


def assert_matches_cuobjdump(archs: GpuArchs, wheel: RemoteWheel, suffix: str) -> None:
    file = file_of(archs, suffix)
    (local,) = member_files(wheel, lambda name: f"/{name}".endswith(suffix)).values()
    sass, ptx = listing(str(local))
    assert {arch.removesuffix("f") for arch in file.sass} == sass, file.path  # cuobjdump: sm_100f is sm_100
    assert set(file.ptx) == ptx, file.path


def test_torchao_runs_wherever_torch_does_and_names_its_accelerators(torchao: ImageFacts) -> None:
    """torchao's `_C*.so` are loaded by a glob in a `try:` (no Hopper or Blackwell, no kernels of
    its own are needed): an A100 runs it without either, a Hopper without the Blackwell one."""
    archs = archs_of(torchao)
    cutlass, mxfp8 = "/torchao/_C_cutlass_90a.abi3.so", "/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so"
    for suffix in (cutlass, mxfp8):
        assert_matches_cuobjdump(archs, TORCHAO_018, suffix)
        assert file_of(archs, suffix).imported == "optional"
    assert file_of(archs, cutlass).sass == ["90a"] and file_of(archs, mxfp8).ptx == ["120"]
    (package,) = [p for p in archs.packages if p.name == "torchao"]
    assert package.version == "0.18.0" and package.optional
    decision = place(torchao, FLEET_580)
    assert eligible(decision) == ALL - {"v100"}  # wherever torch 2.14.0+cu130 runs
    warnings = "\n".join(decision.warnings)
    assert (
        f"on NVIDIA A100-SXM4-80GB (compute capability 8.0): runs; without {SITE}{cutlass}: no kernel"
        " image for compute capability 8.0 (SASS sm_90a, no PTX); torchao 0.18.0 runs without it"
    ) in warnings
    hopper = [line for line in gpu_code.judge(archs, (9, 0)).without if "torchao" in line]
    assert hopper == [
        f"{SITE}{mxfp8}: no kernel image for compute capability 9.0 (SASS sm_100, PTX compute_120);"
        " used on other GPUs"
    ]


def test_sglang_kernel_runs_where_the_common_ops_it_loads_by_path_have_code(sglang: ImageFacts) -> None:
    """sgl_kernel loads `sm90/` or `sm100/common_ops` by path at import, both built for sm_80 to
    sm_120a without PTX: no Turing, and no GB10, whose 12.1 an `sm_120a` build does not run on."""
    archs = archs_of(sglang)
    for suffix in (
        "/sm90/common_ops.abi3.so",
        "/sm100/common_ops.abi3.so",
        "/flashmla_ops.abi3.so",
        "/infllm_ops.cpython-310-x86_64-linux-gnu.so",
    ):
        assert_matches_cuobjdump(archs, SGLANG_KERNEL, suffix)
    assert file_of(archs, "/sm100/common_ops.abi3.so").imported is None  # no import names it: needed
    assert file_of(archs, "/flashmla_ops.abi3.so").imported == "optional"  # in a try: (flash_mla.py)
    (package,) = [p for p in archs.packages if p.name == "sglang-kernel"]
    assert package.version == "0.4.10" and not package.optional
    decision = place(sglang, FLEET_580)
    assert eligible(decision) == {"a100", "a10g", "l4", "h100", "b200", "rtx5090"}
    for name in ("t4-535", "t4-580", "gb10"):
        assert only(decision, name).endswith(
            "no GPU code of sglang-kernel 0.4.10 runs here; SASS runs only on its own major at or above"
            " its minor, an `a` build only at its exact CC, PTX at or above its arch"
        ), name
    assert (
        f"{SITE}/sgl_kernel/sm100/common_ops.abi3.so has no kernel image for compute capability 12.1"
        " (SASS sm_80–sm_90 + sm_90a, sm_100f, sm_120a, no PTX)"
    ) in only(decision, "gb10")
    assert gpu_code.judge(archs, (9, 0)).without == []
    blackwell = [line for line in gpu_code.judge(archs, (10, 0)).without if "sgl_kernel" in line]
    assert blackwell == [
        f"{SITE}/sgl_kernel/infllm_ops.cpython-310-x86_64-linux-gnu.so: no kernel image for compute"
        " capability 10.0 (SASS sm_80, sm_90 + sm_120a, no PTX); used on other GPUs"
    ]


# -- gpu4pyscf-cuda12x 1.9.0: built for sm_70 to sm_90, PTX compute_80 in some libraries only


def test_gpu4pyscf_is_refused_where_only_some_of_its_libraries_have_ptx() -> None:
    """gpu4pyscf's wheel is built for sm_70, sm_80 and sm_90. `libcupy_helper.so` also carries PTX
    compute_80; `libgint.so` carries its PTX only as device-link input, which CUDA never loads, and
    `gpu4pyscf/gto/int3c1e.py` loads it at import. On Blackwell the
    package has no code built for the GPU, so what lacks PTX there is not a build for other GPUs it
    picks instead: it fails (its users' report: pyscf/gpu4pyscf#440, "failed in block_diag kernel"
    on an RTX 5090)."""
    facts = image([layer_evidence(gpu4pyscf_layer())])
    archs = archs_of(facts)
    gint = file_of(archs, "/gpu4pyscf/lib/libgint.so")
    (local,) = member_files(GPU4PYSCF, lambda name: name.endswith("/libgint.so")).values()
    assert listing(str(local)) == ({"70", "80", "90"}, {"80"})  # cuobjdump lists every section
    assert (gint.sass, gint.ptx) == (["70", "80", "90"], [])
    assert {arch for c in gint.containers if c.section == "__nv_relfatbin" for arch in c.ptx} == {"80"}
    gvhf = file_of(archs, "/libgvhf.so")  # host code, loaded at import; its linked module has no kernel
    assert gvhf.imported == "required" and not gpu_code.counted(gvhf)
    helper, solvent = file_of(archs, "/libcupy_helper.so"), file_of(archs, "/libsolvent.so")
    assert helper.ptx == ["80"] and helper.imported == "required"
    assert solvent.ptx == ["80"] and solvent.imported == "optional"  # inside the solvent models' functions
    decision = place(facts, FLEET_580)
    assert eligible(decision) == ALL - {"b200", "rtx5090", "gb10"}
    for name, cc in (("b200", "10.0"), ("rtx5090", "12.0"), ("gb10", "12.1")):
        refused = only(decision, name)
        assert (
            f"{SITE}/gpu4pyscf/lib/libgint.so has no kernel image for compute capability {cc}"
            " (SASS sm_70–sm_90, no PTX): gpu4pyscf-cuda12x 1.9.0 loads it at import, and none of its"
            " code was built for this GPU: its other libraries run here only through PTX"
        ) in refused, name
        assert not any(library in refused for library in ("libgvhf", "libsolvent", "libcupy_helper")), name
    hopper = gpu_code.judge(archs, (9, 0))
    assert hopper.runs and hopper.without == [] and hopper.ptx == []


# -- PyNvVideoCodec 2.2.4: a CUDA runtime that auditwheel bundled and renamed


def test_a_runtime_bundled_by_auditwheel_is_linked_by_the_name_auditwheel_gave_it() -> None:
    """PyNvVideoCodec's extensions link `libcudart-c64a25f3.so.12.3.101`, the CUDA 12.3 runtime its
    wheel carries under auditwheel's name: that is CUDA 12's runtime, carried, so the extension loads.
    Without the file, the loader could not load the extension, and its code counts for nothing."""
    suffix = "/PyNvVideoCodec/PyNvVideoCodec_130.cpython-311-x86_64-linux-gnu.so"
    facts = image([layer_evidence(pynvvideocodec_layer())])
    archs = archs_of(facts)
    extension = file_of(archs, suffix)
    assert_matches_cuobjdump(archs, PYNVVIDEOCODEC, suffix)
    assert (extension.needed, extension.missing, extension.loadable) == ([BUNDLED_RUNTIME], [], True)
    assert BUNDLED_RUNTIME in archs.libraries
    inferred = inferred_of(facts)
    assert inferred.cuda == "12.3"  # the PTX's ISA 8.3 names the minor
    assert [(v.source, v.cuda) for v in inferred.versions if BUNDLED_RUNTIME in v.evidence] == [("elf", "12")]
    assert gpu_code.judge(archs, (12, 0)).runs  # PTX compute_86

    alone = image([layer_evidence(pynvvideocodec_layer(runtime=False))])
    gpu = alone.platforms[0].gpu
    assert gpu.archs is None or not gpu_code.has_code(gpu.archs)
    if gpu.archs is not None:
        assert file_of(gpu.archs, suffix).missing == [BUNDLED_RUNTIME]


# -- torch 2.14.0+cu130 and cuBLAS 13 alone


def test_torch_cu130_runs_on_a_t4_without_its_linear_algebra(
    cuda13: CudaLayerEvidence, torch14: CudaLayerEvidence
) -> None:
    torch = image([torch14, cuda13])
    decision = place(torch)
    assert eligible(decision) == {"t4-580", "h100", "b200", "gb10"}
    t4 = gpu_code.judge(archs_of(torch), (7, 5))
    assert t4.runs and any(
        line.startswith(
            f"{SITE}/torch/lib/libtorch_cuda_linalg.so (torch.linalg): no kernel image for compute capability 7.5"
        )
        for line in t4.without
    )
    assert f"{SITE}/torch/lib/libtorch_cuda.so: SASS sm_75" in t4.covered_by


def test_cublas_13_alone_runs_where_its_kernels_are(cuda13: CudaLayerEvidence) -> None:
    cublas = image(
        [
            layer_evidence(
                [
                    libraries(CUDA13["cudart"], "libcudart.so.13"),
                    libraries(CUDA13["cublas"], "libcublas.so.13", "libcublasLt.so.13"),
                ]
            )
        ]
    )
    assert eligible(place(cublas)) == {"t4-580", "h100", "b200", "gb10"}
    lt = file_of(archs_of(cublas), "libcublasLt.so.13")
    only_75 = [c for c in lt.containers if c.sass == ("75",)]
    assert only_75 and any(c.sass == ("100",) for c in lt.containers)  # per-architecture kernel modules
    assert {c.section for c in lt.containers} >= {
        ".nv_fatbin",
        ".cask_resource",
    }  # CASK kernels it loads itself


# -- bitsandbytes 0.43.3: a CUDA 12.1 build, read where cuobjdump 13.5 stops


def read_as_walked(local: Path, path: str) -> gpu_code.FileArchs:
    """One library's reading, its bytes fed in 1 MiB slices as a layer's walk feeds them, as if at `path`."""
    data = local.read_bytes()
    probe = ElfCudaProbe(len(data))
    for start in range(0, len(data), 1 << 20):
        probe.feed(memoryview(data)[start : start + (1 << 20)])
    facts = probe.finish()
    assert facts is not None
    found = file_archs(path, facts)
    assert found is not None
    return found


def test_a_cuda_12_1_build_is_read_as_cuda_12_4s_cuobjdump_lists_it() -> None:
    """bitsandbytes 0.43.3's `libbitsandbytes_cuda121.so`, built by CUDA 12.1: cuobjdump 13.5 lists
    four of its cubins, then stops ("Invalid ELF"); cuobjdump 12.4 lists what CUDA loads, SASS sm_50
    to sm_90 and no PTX, and with `-all` its device-link input too, which carries PTX compute_90. The
    file is read as a layer's walk reads it (the library alone: it links CUDA 12's cuSPARSE, which
    this image lacks, so it would not load; the reading is what is checked)."""
    local = bitsandbytes_043_cuda121()
    found = read_as_walked(local, f"{SITE}/bitsandbytes/libbitsandbytes_cuda121.so")
    tool = str(cuobjdump_12_4())
    loaded = subprocess.run(
        [tool, "--list-elf", "--list-ptx", str(local)], capture_output=True, text=True, timeout=300
    )
    every = subprocess.run(
        [tool, "-all", "--list-elf", "--list-ptx", str(local)], capture_output=True, text=True, timeout=300
    )
    assert (
        "release 12.4"
        in subprocess.run([tool, "--version"], capture_output=True, text=True, timeout=60).stdout
    )
    sass = {"50", "52", "60", "61", "70", "75", "80", "86", "89", "90"}
    assert set(re.findall(r"\.sm_(\d+[a-z]?)\.cubin", loaded.stdout)) == sass
    assert ".ptx" not in loaded.stdout
    assert set(re.findall(r"\.sm_(\d+[a-z]?)\.ptx", every.stdout)) == {"90"}
    assert (set(found.sass), found.ptx, found.error) == (sass, [], None)
    assert found.needed == ["libcublas.so.12", "libcublasLt.so.12", "libcudart.so.12", "libcusparse.so.12"]
    relocatable = [c for c in found.containers if c.section == "__nv_relfatbin"]
    assert relocatable and {arch for c in relocatable for arch in c.ptx} == {"90"}
    alone = GpuArchs(files=[found])
    assert gpu_code.judge(alone, (9, 0)).runs
    assert not gpu_code.judge(alone, (10, 0)).runs  # no sm_100 and no PTX that CUDA loads


def test_modules_with_no_kernel_set_no_floor_though_they_carry_ptx(tmp_path: Path) -> None:
    """cuda-cccl 1.2.1's `libcccl.c.parallel.so` (cuda.compute, CUDA 13.1) carries 13 fatbin
    containers, each SASS sm_75 and PTX compute_75 (ISA 9.1) of libcu++'s global objects and no
    kernel: cuobjdump prints 13 symbol tables with no ENTRY and extracts 13 PTX files with no
    `.entry`. Read as code, they asked every GPU past Turing for CUDA 13.1's driver to JIT them, and
    cuda-cccl was refused on all of them on driver 580.65 (CUDA 13.0); the package's kernels are the
    ones it compiles at run time with NVRTC."""
    local = cccl_parallel_cu13()
    found = read_as_walked(local, f"{SITE}/cuda/compute/cu13/cccl/libcccl.c.parallel.so")
    assert found.error is None
    tool = str(cuobjdump())
    elf = subprocess.run([tool, "-elf", str(local)], capture_output=True, text=True, timeout=300).stdout
    assert elf.count(".section .symtab") == 13 and " ENTRY " not in elf
    subprocess.run(
        [tool, "-xptx", "all", str(local)], cwd=tmp_path, check=True, capture_output=True, timeout=300
    )
    ptx = sorted(tmp_path.glob("*.ptx"))
    assert len(ptx) == 13 and not any(".entry" in path.read_text() for path in ptx)
    assert (found.sass, found.ptx) == (["75"], ["75"])
    assert [(c.sass, c.ptx, c.ptx_isa, c.count, c.kernels) for c in found.containers] == [
        (("75",), ("75",), "9.1", 13, False)
    ]
    assert not gpu_code.counted(found)
    alone = GpuArchs(files=[found])
    for cc in [(7, 5), (8, 0), (9, 0), (10, 0), (12, 0)]:
        verdict = gpu_code.judge(alone, cc)
        assert verdict.runs and verdict.ptx == [], (cc, verdict)  # nothing to JIT: no driver floor


# -- bitsandbytes 0.50.2 beside torch 2.10.0+cu128 and CUDA 12.8's runtime


def test_bitsandbytes_loads_the_build_torchs_cuda_selects(bitsandbytes: ImageFacts) -> None:
    assert eligible(place(bitsandbytes)) == ALL
    archs = archs_of(bitsandbytes)
    assert archs.runtime_cuda == "12.8"
    selected = [f.path.rsplit("/", 1)[1] for f in archs.files if f.cuda_build and f.selected]
    assert selected == ["libbitsandbytes_cuda128.so"]
    cuda130 = file_of(archs, "libbitsandbytes_cuda130.so")
    assert (
        cuda130.missing == ["libcublas.so.13", "libcublasLt.so.13", "libcudart.so.13"]
        and not cuda130.loadable
    )
    assert not file_of(
        archs, "libbitsandbytes_cuda126.so"
    ).selected  # loadable, not the one torch's CUDA picks
    inferred = inferred_of(bitsandbytes)
    assert inferred.cuda == "12.8"  # never CUDA 13 from the build it cannot load
    assert all(not v.cuda.startswith("13") for v in inferred.versions)


# -- ONNX Runtime GPU 1.31.1 (CUDA 13)


def test_onnxruntime_runs_on_turing_and_hopper_not_blackwell(onnxruntime: ImageFacts) -> None:
    decision = place(onnxruntime)
    assert eligible(decision) == {"t4-580", "h100"}
    b200 = only(decision, "b200")
    assert (
        f"compute capability 10.0: {SITE}/onnxruntime/capi/libonnxruntime_providers_cuda.so has no kernel image for compute capability 10.0"
        in b200
    )
    assert "no GPU code of onnxruntime-gpu 1.31.1 runs here" in b200  # no sm_100, no PTX
    assert "has no kernel image for compute capability 12.1" in only(
        decision, "gb10"
    )  # sm_120a runs only at 12.0
    assert "driver 575.51.03" in only(decision, "rtx5090")  # decisive: CUDA 13's driver floor
    t4 = gpu_code.judge(archs_of(onnxruntime), (7, 5))
    assert t4.runs and not any("providers_cuda" in line for line in t4.without)  # 217 containers have sm_75


# -- TensorFlow 2.21.0 (CUDA 12.5.1): the kernels it loads itself


def test_tensorflow_reads_the_fatbins_it_loads_itself(tensorflow: ImageFacts) -> None:
    archs = archs_of(tensorflow)
    lib = file_of(archs, "tensorflow/libtensorflow_cc.so.2")
    own = [c for c in lib.containers if c.section != ".nv_fatbin"]
    assert sum(c.count for c in own) == 1149
    assert {(c.sass, c.ptx, c.ptx_isa) for c in own} == {(("60", "70", "80", "89"), ("90",), "8.5")}
    decision = place(tensorflow, [*FLEET, H100_535])
    assert eligible(decision) == ALL
    refused = only(decision, "h100-535")  # its generated kernels exist on Hopper only as ISA 8.5 PTX
    assert "tensorflow/libtensorflow_cc.so.2 runs here only through PTX in some kernels" in refused
    assert "PTX ISA 8.5 comes from CUDA 12.5, and this server's driver supports CUDA 12.2" in refused


# -- FlashInfer 0.7.4 with flashinfer-cubin 0.6.13


def test_flashinfer_is_a_gpu_package_that_picks_its_modules(flashinfer: ImageFacts) -> None:
    archs = archs_of(flashinfer)
    modules = [f for f in archs.files if f.kind == "modules"]
    assert sum(f.files for f in modules if "flashinfer_cubin" in f.path) == 2830
    assert {a for f in modules for a in f.sass} == {"100", "100a", "103a"}  # sm_100f reads as sm_100
    assert any(f.ptx == ["103a"] for f in modules)
    assert inferred_of(flashinfer).cuda == "13.2"  # its PTX's ISA 9.2
    decision = place(flashinfer)
    assert eligible(decision) == {"t4-580", "h100", "b200", "gb10"}
    assert "compute capability 7.5 or newer" in only(decision, "v100")
    hopper = gpu_code.judge(archs, (9, 0))
    assert hopper.runs and any("runs without it" in line for line in hopper.without)


# -- what was wrong besides


def test_one_line_summary_lists_where_it_runs_without_holes(onnxruntime: ImageFacts) -> None:
    summary = gpu_code.summary(archs_of(onnxruntime))
    assert summary.endswith("compute capability 7.5–9.0, 12.0"), summary


def test_a_whole_environment_in_one_layer_is_read_whole() -> None:
    """One `pip install` layer of torch 2.14.0 and every package here holds 238,000 load sites, past
    the 200,000 the layer bound once was: the sources after it (vLLM's, torchao's) went unread, and
    torchao's accelerators counted as needed again. Each extension's state is what its own package
    alone gives."""
    wheels = (BITSANDBYTES, FLASHINFER, ONNXRUNTIME, SGLANG_KERNEL, TENSORFLOW, TORCH_214, TORCHAO_018, VLLM)
    everything, alone = LoadSites(), {}
    for wheel in wheels:
        sources = python_sources(wheel)
        alone[wheel] = LoadSites()
        for name, path in sources:
            text = path.read_bytes()
            everything.add_source(f"{SITE}/{name}", text)
            alone[wheel].add_source(f"{SITE}/{name}", text)
    assert not everything.truncated and everything.sites_read > 200_000
    for wheel, extension in [
        (VLLM, "vllm/_C_stable_libtorch.abi3.so"),
        (VLLM, "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so"),
        (TORCHAO_018, "torchao/_C_cutlass_90a.abi3.so"),
        (ONNXRUNTIME, "onnxruntime/capi/onnxruntime_pybind11_state.so"),
    ]:
        assert everything.state(f"{SITE}/{extension}") == alone[wheel].state(f"{SITE}/{extension}"), extension
    assert everything.state(f"{SITE}/torchao/_C_cutlass_90a.abi3.so") == "optional"


def test_vllm_0_6_1_loads_flash_attention_only_where_its_selector_picks_it() -> None:
    """vLLM 0.5.5 to 0.6.1 pin vllm-flash-attn 2.6.1, whose extension (SASS sm_80 and sm_90 only) its
    own `flash_attn_interface` imports at module level, and its `__init__` imports that. vLLM 0.6.1
    imports `vllm_flash_attn` at the top of its FlashAttention backend alone, and that backend is imported
    only inside functions: by the attention selector, which picks it on compute capability 8.0 and
    up and XFormers below, and by three other modules. Read from both wheels' sources in one layer,
    as pip installs them, the extension loads on demand, so vLLM runs on a T4 without it; it was a
    needed package there, and the T4 and V100 were refused. Alone in a layer, where nothing imports
    the package (so its user may), the extension is needed."""
    extension = f"{SITE}/vllm_flash_attn_2_cuda.cpython-311-x86_64-linux-gnu.so"
    together, alone = LoadSites(), LoadSites()
    for name, path in python_sources(VLLM_061, VLLM_FLASH_ATTN_261):
        text = path.read_bytes()
        together.add_source(f"{SITE}/{name}", text)
        if name.startswith("vllm_flash_attn/"):
            alone.add_source(f"{SITE}/{name}", text)
    assert not together.truncated and together.sites_read > 8000
    assert together.state(extension) == "optional"
    assert alone.state(extension) == "required"
    backend = (VLLM_061, "vllm/attention/backends/flash_attn.py")
    (path,) = member_files(backend[0], lambda name: name == backend[1]).values()
    assert re.search(r"^from vllm_flash_attn import", path.read_text(), re.MULTILINE)  # at its top


def test_vllm_0_5_5_loads_flash_attention_with_the_models_that_import_it() -> None:
    """vLLM 0.5.5 imports `vllm_flash_attn` at the top of its SigLIP module alone, which PaliGemma,
    LLaVA and LLaVA-NeXT import at theirs; nothing imports a model module but the registry, which
    imports `f"vllm.model_executor.models.{module_name}"` for the model it serves. So FlashAttention
    (SASS sm_80 and sm_90 only) loads with those models: vLLM runs on a T4 without it, as its selector
    (XFormers below 8.0) runs it. Before the registry's made name was read, each model module counted
    as run at import, and the T4 and V100 were refused."""
    extension = f"{SITE}/vllm_flash_attn_2_cuda.cpython-311-x86_64-linux-gnu.so"
    loads = LoadSites()
    sources = dict(python_sources(VLLM_055, VLLM_FLASH_ATTN_261))
    for name, path in sources.items():
        loads.add_source(f"{SITE}/{name}", path.read_bytes())
    assert not loads.truncated and loads.sites_read > 8000
    assert loads.state(extension) == "optional"
    registry = sources["vllm/model_executor/models/__init__.py"].read_text()
    assert 'f"vllm.model_executor.models.{module_name}"' in registry
    siglip = sources["vllm/model_executor/models/siglip.py"].read_text()
    assert re.search(r"^from vllm_flash_attn import", siglip, re.MULTILINE)  # at its top
    importers = [
        name
        for name, path in sources.items()
        if re.search(r"^from \.siglip import", path.read_text(), re.MULTILINE)
    ]
    assert sorted(importers) == [
        f"vllm/model_executor/models/{model}.py" for model in ("llava", "llava_next", "paligemma")
    ]


def _function_source(path: Path, name: str) -> str:
    """The source of the first function called `name` in `path` (empty if none)."""
    source = path.read_text()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return ast.get_source_segment(source, node) or ""
    return ""


def test_vllm_builds_a_triton_kernel_at_every_step_eager_or_not() -> None:
    """The ground of `DEFAULT_PATH_USERS`' second vLLM stage, in the pinned 0.33.0 wheel's own source: the
    GPU model runner's `_prepare_inputs` computes the slot mapping with no test of eager mode, and
    `BlockTable.compute_slot_mapping` launches a `@triton.jit` kernel. 0.8.5 prepares its inputs with
    no Triton at all, so before 0.19.0 only torch.compile (which eager mode turns off) is certain."""
    names = ("vllm/v1/worker/gpu_model_runner.py", "vllm/v1/worker/block_table.py")
    runner, table = (member_files(VLLM, names.__contains__)[name] for name in names)
    prepare = _function_source(runner, "_prepare_inputs")
    assert ".block_table.compute_slot_mapping(" in prepare and "eager" not in prepare
    assert "_COMPUTE_SLOT_MAPPING_KERNEL(" in _function_source(table, "compute_slot_mapping")
    assert re.search(r"class ComputeSlotMappingKernel\b[\s\S]*@triton\.jit", table.read_text())
    old_runner, old_table = (member_files(VLLM_085, names.__contains__)[name] for name in names)
    assert "triton" not in _function_source(old_runner, "_prepare_inputs") + old_table.read_text()


def test_sglang_builds_a_triton_kernel_for_every_prefill() -> None:
    """The ground of SGLang's stage, in the pinned wheels' own source: a prefill batch's positions come
    from `compute_position_triton`, a `@triton.jit` kernel: always in 0.3.6, unless the attention backend
    is `torch_native` in 0.4.0 (that test inline in `ForwardBatch.init_new`) and 0.5.9 (`support_triton`,
    which also spares `intel_amx`); 0.3.5.post2 has no Triton there."""
    batch = "sglang/srt/model_executor/forward_batch_info.py"
    new = member_files(SGLANG, lambda name: name in (batch, "sglang/srt/utils/common.py"))
    assert "compute_position(" in _function_source(new[batch], "init_new")
    position = _function_source(new[batch], "compute_position")
    assert position.index("if support_triton(attn_backend):") < position.index("compute_position_triton(")
    assert 'backend not in ["torch_native", "intel_amx"]' in _function_source(
        new["sglang/srt/utils/common.py"], "support_triton"
    )
    assert re.search(r"@triton\.jit\ndef compute_position_kernel\(", new[batch].read_text())
    old = _function_source(member_files(SGLANG_040, lambda name: name == batch)[batch], "init_new")
    assert old.index('attention_backend != "torch_native"') < old.index("compute_position_triton(")
    first = _function_source(member_files(SGLANG_036, lambda name: name == batch)[batch], "init_new")
    assert "compute_position_triton(" in first and "torch_native" not in first
    before = member_files(SGLANG_035, lambda name: name == batch)[batch].read_text()
    assert "triton" not in before and "def init_new(" in before


def test_flashinfer_finds_its_tools_as_the_scan_does() -> None:
    """The ground of `scanner.layers.cuda_jit_tools`, in FlashInfer's own source: `get_cuda_path` takes
    `$CUDA_HOME`, else `$CUDA_PATH`, else two directories above `which nvcc`, else `/usr/local/cuda` where it
    exists (0.5.0, 0.7.4; 0.4.1 stops with "Could not find nvcc" instead); the build runs `$FLASHINFER_NVCC`,
    else `$cuda_home/bin/nvcc`, and links with `$CXX`, else `c++`."""
    cpp_ext = "flashinfer/jit/cpp_ext.py"
    for wheel in (FLASHINFER_050, FLASHINFER):
        source = member_files(wheel, lambda name: name == cpp_ext)[cpp_ext]
        find = _function_source(source, "get_cuda_path")
        steps = ('"CUDA_HOME"', '"CUDA_PATH"', '["which", "nvcc"]', "os.path.dirname(", '"/usr/local/cuda"')
        assert [find.index(step) for step in steps] == sorted(find.index(step) for step in steps), wheel
        assert "Could not find nvcc and default" in find
        text = source.read_text()
        assert 'os.environ.get("CXX", "c++")' in text
        assert 'os.environ.get("FLASHINFER_NVCC", "$cuda_home/bin/nvcc")' in text
    old = _function_source(
        sdist_files(FLASHINFER_041, lambda name: name == cpp_ext)[cpp_ext], "get_cuda_path"
    )
    assert 'raise RuntimeError("Could not find nvcc")' in old and "/usr/local/cuda" not in old


def test_flashinfer_asks_its_own_release_of_nvcc_on_compute_capability_12() -> None:
    """The ground of `placement.flashinfer_compiler`'s rule for 12.x: 0.7.0.post1 asks CUDA 12.9 on every 12.x
    GPU, 0.7.4 asks 12.8 on 12.0 and 12.9 from 12.1 (`CompilationContext._normalize_cuda_arch`)."""
    name = "flashinfer/compilation_context.py"
    old, new = (
        _function_source(member_files(wheel, lambda n: n == name)[name], "_normalize_cuda_arch")
        for wheel in (FLASHINFER_070, FLASHINFER)
    )
    assert 'raise RuntimeError("SM 12.x requires CUDA >= 12.9")' in old and "12.8" not in old
    core = "flashinfer/jit/core.py"
    source = member_files(FLASHINFER, lambda n: n == core)[core]
    assert "check_cuda_arch()" in _function_source(
        source, "gen_jit_spec"
    )  # every module's spec, built or not
    assert '"FlashInfer requires GPUs with sm75 or higher. "' in _function_source(source, "check_cuda_arch")
    assert 'raise RuntimeError("SM 120 requires CUDA >= 12.8")' in new
    assert 'raise RuntimeError("SM 12.1+ requires CUDA >= 12.9")' in new
    for cc, floor in (((12, 0), "12.9"), ((12, 1), "12.9")):
        line = flashinfer_gap(
            FlashInferFacts(version="0.7.0.post1", nvcc="n", nvcc_release="12.8", cxx="c"), cc
        )
        assert line is not None and f"it asks CUDA {floor} or later of its nvcc" in line
    assert (
        flashinfer_gap(FlashInferFacts(version="0.7.4", nvcc="n", nvcc_release="12.8", cxx="c"), (12, 0))
        is None
    )


def test_vllm_samples_with_flashinfer_at_start_up_as_its_versions_say() -> None:
    """The ground of vLLM's FlashInfer stages, in its wheels' own source. 0.33.0: `VLLM_USE_FLASHINFER_SAMPLER`
    defaults to True; the sampler takes FlashInfer on compute capability 8.0 to 12.1, unless the GPU has 16
    SMs or fewer or FlashInfer's own check of it fails; start-up profiling samples with `top_p` 0.9 whatever
    the requests; FlashInfer is the first attention backend on 10.x. The default was None (off) in 0.20.2,
    True from 0.21.0; 0.11.0 took FlashInfer unless the variable was set to 0."""
    envs, sampler = "vllm/envs.py", "vllm/v1/sample/ops/topk_topp_sampler.py"
    runner, platform = "vllm/v1/worker/gpu_model_runner.py", "vllm/platforms/cuda.py"
    backend = "vllm/v1/attention/backends/flashinfer.py"
    wanted = (envs, sampler, runner, platform, backend)
    new = member_files(VLLM, wanted.__contains__)
    assert re.search(
        r"in os\.environ\s+else True\s+\),",
        new[envs].read_text().split('"VLLM_USE_FLASHINFER_SAMPLER": lambda')[1][:300],
    )
    supported = _function_source(new[sampler], "flashinfer_sampler_supported")
    assert "FlashInferBackend.supports_compute_capability(capability)" in supported
    assert ") <= 16:" in supported and "_flashinfer_jit_unsupported_reason(capability)" in supported
    compute = _function_source(new[backend], "supports_compute_capability")
    assert "capability >= DeviceCapability(8, 0) and capability <= DeviceCapability(" in compute
    assert "top_p=dummy_tensors(0.9)" in _function_source(new[runner], "_dummy_sampler_run")
    priorities = new[platform].read_text()
    blackwell = priorities.index("if device_capability.major == 10 and not use_non_causal:")
    assert priorities.index("AttentionBackendEnum.FLASHINFER,", blackwell) < priorities.index(
        "AttentionBackendEnum.FLASH_ATTN,", blackwell
    )
    for wheel, default in ((VLLM_0202, "None"), (VLLM_0210, "True")):
        text = member_files(wheel, lambda name: name == envs)[envs].read_text()
        assert re.search(
            rf"in os\.environ\s+else {default}\s+\),",
            text.split('"VLLM_USE_FLASHINFER_SAMPLER": lambda')[1][:300],
        )
    eleven = member_files(VLLM_0110, lambda name: name == sampler)[sampler].read_text()
    assert "elif envs.VLLM_USE_FLASHINFER_SAMPLER is not False:" in eleven
    facts = FlashInferFacts(version="0.7.2.post1", nvcc="", cxx="")
    for version, cc, refused in (
        ("0.20.2", (9, 0), False),
        ("0.21.0", (9, 0), True),
        ("0.11.0", (9, 0), True),
    ):
        vllm = PackageFacts(id="python:vllm", name="vllm", version=version, kind="python")
        assert (flashinfer_refusal(facts, [vllm], cc) is not None) == refused, version


def test_sglang_takes_flashinfer_for_attention_as_its_versions_say() -> None:
    """The ground of SGLang's FlashInfer stage: with no backend named, 0.4.0 takes FlashInfer wherever it is
    available; 0.5.9 takes FlashAttention 3 on Hopper, `trtllm_mha` (FlashInfer's) on 10.x, else FlashInfer."""
    args = "sglang/srt/server_args.py"
    old = member_files(SGLANG_040, lambda name: name == args)[args].read_text()
    assert re.search(
        r'self\.attention_backend = \(\s+"flashinfer" if is_flashinfer_available\(\) else "triton"', old
    )
    new = member_files(SGLANG, lambda name: name == args)[args].read_text()
    mha = new[new.index("if not use_mla_backend:") : new.index("# MLA architecture")]
    steps = (
        'self.attention_backend = "fa3"',
        'self.attention_backend = "trtllm_mha"',
        '"flashinfer" if is_flashinfer_available() else "triton"',
    )
    assert [mha.index(step) for step in steps] == sorted(mha.index(step) for step in steps)
    assert "is_hopper_with_cuda_12_3()" in mha[: mha.index(steps[0])]


def test_sglang_builds_its_own_activation_with_tvm_ffi_from_0_5_11() -> None:
    """The ground of `placement.tvm_ffi_compiler`: SGLang 0.5.11's `SiluAndMul` calls `sglang.jit_kernel`'s
    `silu_and_mul` on CUDA, imported with no guard, whose module is built by `load_jit` with tvm-ffi's
    `load_inline` and no fallback; 0.5.10's comes from sgl-kernel. tvm-ffi 0.1.9's `_find_cuda_home` takes
    `$CUDA_HOME`, `$CUDA_PATH`, two directories above `which nvcc`, then `/usr/local/cuda`, and its build
    runs that home's `bin/nvcc` and links with `$CXX`, else `c++`."""
    layer = "sglang/srt/layers/activation.py"
    names = (layer, "sglang/jit_kernel/activation.py", "sglang/jit_kernel/utils.py")
    new = member_files(SGLANG_0511, names.__contains__)
    text = new[layer].read_text()
    assert re.search(
        r"if _is_cuda:\n    from sglang\.jit_kernel\.activation import \(\n[^)]*silu_and_mul,", text
    )
    assert "silu_and_mul(x, out)" in _function_source(new[layer], "forward_cuda")
    jit = new["sglang/jit_kernel/activation.py"].read_text()
    assert "return load_jit(" in jit and "try:" not in _function_source(
        new["sglang/jit_kernel/activation.py"], "_run_activation_inplace"
    )
    assert "from tvm_ffi.cpp import load, load_inline" in _function_source(
        new["sglang/jit_kernel/utils.py"], "load_jit"
    )
    old = member_files(SGLANG_0510, lambda name: name == layer)[layer].read_text()
    assert "jit_kernel" not in old and "from sgl_kernel import" in old
    extension = "tvm_ffi/cpp/extension.py"
    source = member_files(TVM_FFI, lambda name: name == extension)[extension]
    find = _function_source(source, "_find_cuda_home")
    steps = ('"CUDA_HOME"', '"CUDA_PATH"', 'shutil.which("nvcc")', ".parent.parent", '"/usr/local/cuda"')
    assert [find.index(step) for step in steps] == sorted(find.index(step) for step in steps)
    build = source.read_text()
    assert 'str(Path(_find_cuda_home()) / "bin" / "nvcc")' in build
    assert 'os.environ.get("CXX", "cl" if IS_WINDOWS else "c++")' in build


def test_unsloth_runs_its_own_triton_kernels_in_the_models_it_patches() -> None:
    """The ground of Unsloth's stage: its Llama attention applies RoPE with `fast_rope_embedding` and its
    decoder layers normalise with `fast_rms_layernorm`, both Triton kernels of `unsloth/kernels/`."""
    names = (
        "unsloth/models/llama.py",
        "unsloth/kernels/rope_embedding.py",
        "unsloth/kernels/rms_layernorm.py",
    )
    llama, rope, rms = (member_files(UNSLOTH, names.__contains__)[name] for name in names)
    assert "Q, K = fast_rope_embedding(Q, K, cos, sin)" in llama.read_text()
    assert "fast_rms_layernorm(self.input_layernorm, hidden_states)" in llama.read_text()
    assert "_rope_embedding = triton.jit(_rope_embedding)" in rope.read_text()
    assert "@triton.jit" in rms.read_text()


@pytest.mark.parametrize("sdist", [MAMBA_SSM_101, MAMBA_SSM], ids=["1.0.1", "2.3.1"])
def test_mamba_ssm_updates_its_state_with_a_triton_kernel_at_every_decoding_step(sdist: RemoteWheel) -> None:
    """The ground of mamba-ssm's stage, in its pinned source distributions (PyPI has no wheel): `Mamba.step`,
    which each decoding step runs, calls `selective_state_update`, a `@triton.jit` kernel, whenever its
    import in a `try:` succeeded, that is wherever Triton is installed."""
    names = ("mamba_ssm/modules/mamba_simple.py", "mamba_ssm/ops/triton/selective_state_update.py")
    simple, kernel = (sdist_files(sdist, names.__contains__)[name] for name in names)
    source = simple.read_text()
    assert re.search(
        r"try:\n\s+from mamba_ssm\.ops\.triton\.selective_state_update import selective_state_update\n",
        source,
    )
    step = _function_source(simple, "step")
    assert step.index("if selective_state_update is None:") < step.index("selective_state_update(")
    assert re.search(r"@triton\.jit\ndef _selective_scan_update_kernel\(", kernel.read_text())


def test_vllm_0_8_5_needs_its_core_where_it_resolves_its_platform_by_name() -> None:
    """vLLM 0.8.5 imports `vllm._C` in a `try:` in `_custom_ops.py`, and at the top of
    `vllm/platforms/cuda.py`, which `vllm/v1/engine/core.py` imports inside a function and
    `vllm/platforms/__init__.py` names in a string (`"vllm.platforms.cuda.CudaPlatform"`) that it
    imports when the platform is first asked for. Its core is needed; its FlashAttention and FlashMLA
    extensions are not."""
    loads = LoadSites()
    for name, path in python_sources(VLLM_085):
        loads.add_source(f"{SITE}/{name}", path.read_bytes())
    assert not loads.truncated
    assert loads.state(f"{SITE}/vllm/_C.abi3.so") == "required"
    for optional in ("_flashmla_C", "_moe_C", "vllm_flash_attn/_vllm_fa2_C", "vllm_flash_attn/_vllm_fa3_C"):
        assert loads.state(f"{SITE}/vllm/{optional}.abi3.so") == "optional", optional


# -- through a real registry: pushed by skopeo, read by the scanner's own client and walk


async def test_flashinfer_modules_through_a_registry(
    registry: LocalRegistry, push: Pusher, tmp_path: Path
) -> None:
    """FlashInfer's own `.ptx` files and one directory of flashinfer-cubin's (93 GEMM cubins, sm_100f),
    pushed with skopeo as pip lays them out: the scan finds a GPU image, and placement its fleet."""
    ptx = member_files(FLASHINFER, lambda name: name.endswith((".ptx", ".dist-info/RECORD")))
    gemm = member_files(
        FLASHINFER_CUBIN, lambda name: "/gemm-91e0ba0-2710384/" in name or name.endswith(".dist-info/RECORD")
    )
    layers = [
        LayerSpec([file(f"{SITE}/{name}", path.read_bytes()) for name, path in sorted(files.items())])
        for files in (ptx, gemm)
    ]
    reference = f"{registry.host}/pkg/flashinfer:0.7.4"
    push(ImageSpec(layers), "pkg/flashinfer:0.7.4")
    settings = ScannerSettings(docker_config=None, analysis_processes=0)
    store = open_store(tmp_path / "scan.db")
    try:
        async with RegistryClient(settings) as client:
            scanner = Scanner(client, store.scan_cache, settings)
            report = await scanner.scan(reference)
            await scanner.close()
    finally:
        await store.close()
    assert report.error is None, report.error
    (platform,) = report.platforms
    assert platform.gpu.inferred is not None and platform.gpu.inferred.cuda == "13.2"
    archs = platform.gpu.archs
    assert archs is not None
    cubins = [f for f in archs.files if f.kind == "modules" and "flashinfer_cubin" in f.path]
    assert [f.files for f in cubins] == [93] and cubins[0].sass == ["100"]
    decision = decide(ImageFacts.from_report(report), DeployRequest(gpus=1), FLEET)
    assert eligible(decision) == {"t4-580", "h100", "b200", "gb10"}


def _site_layer(parts: Sequence[dict[str, Path]]) -> LayerSpec:
    """One zstd layer holding wheel members (name -> file) where pip puts them, below `SITE`."""
    return LayerSpec(
        [
            file(f"{SITE}/{name}", path.read_bytes())
            for files in parts
            for name, path in sorted(files.items())
        ],
        compression="zstd",
    )


async def _scan_all(tmp_path: Path, references: Sequence[str]) -> list[ImageReport]:
    """Each reference scanned by the scanner the service runs, its walk in an analysis process."""
    settings = ScannerSettings(docker_config=None, analysis_processes=1, inline_analysis_bytes=0)
    store = open_store(tmp_path / "scan.db")
    try:
        async with RegistryClient(settings) as client:
            scanner = Scanner(client, store.scan_cache, settings)
            reports = [await scanner.scan(reference) for reference in references]
            await scanner.close()
    finally:
        await store.close()
    return reports


async def test_a_config_variable_that_names_a_build_reaches_the_analysis_process(
    registry: LocalRegistry, push: Pusher, tmp_path: Path
) -> None:
    """bitsandbytes 0.50.2's CUDA 12.6 and 12.8 builds beside torch 2.10.0+cu128's version file and
    CUDA 12.8's runtime (not its cuBLAS, so neither build can load), pushed with skopeo twice: as is,
    and with `BNB_CUDA_VERSION=126` in the config, which makes bitsandbytes load `_cuda126.so` and no
    other. The variable crosses into the analysis process that walks the layers."""
    bnb = python_package(BITSANDBYTES).files()
    kept = {
        n: p for n, p in bnb.items() if not n.endswith(".so") or n.endswith(("_cuda126.so", "_cuda128.so"))
    }
    parts = [
        kept,
        libraries(TORCH_210, "version.py").files(),
        libraries(CUDA12["cudart"], "libcudart.so.12").files(),
    ]
    layer = _site_layer(parts)
    plain, forced = f"{registry.host}/pkg/bnb:plain", f"{registry.host}/pkg/bnb:forced"
    push(ImageSpec([layer]), "pkg/bnb:plain")
    push(ImageSpec([layer], env={"BNB_CUDA_VERSION": "126"}), "pkg/bnb:forced")
    reports = await _scan_all(tmp_path, [plain, forced])
    chosen: list[list[str]] = []
    for report in reports:
        assert report.error is None, report.error
        archs = report.platforms[0].gpu.archs
        assert archs is not None and archs.runtime_cuda == "12.8"
        chosen.append([f.path.rsplit("/", 1)[1] for f in archs.files if f.selected and "_cuda" in f.path])
        assert all(
            f.missing == ["libcublas.so.12", "libcublasLt.so.12"] for f in archs.files if "_cuda" in f.path
        )
    assert chosen == [[], ["libbitsandbytes_cuda126.so"]]  # loadable builds only, unless named
    assert reports[1].platforms[0].gpu.build_overrides == {"bitsandbytes": "12.6"}
    assert reports[0].platforms[0].gpu.build_overrides == {}


def test_the_image_page_rows_per_generation_for_vllm(vllm: ImageFacts) -> None:
    from placement.cuda_needs import generations

    rows = {f"{row.cc[0]}.{row.cc[1]}": row for row in generations(vllm.platforms[0].gpu)}
    assert rows["7.0"].status == "does not run" and "7.5 and newer" in rows["7.0"].decided_by[0]
    assert rows["7.5"].status == "runs without" and (rows["7.5"].driver or "").startswith("580")
    assert any("FlashAttention 2" in line for line in rows["7.5"].decided_by)
    assert rows["9.0"].status == "runs without" and not any(
        "FlashAttention 3" in line for line in rows["9.0"].decided_by
    )
    assert rows["12.1"].status in ("runs", "runs without") and rows["12.1"].driver is not None


# -- Triton: the ptxas it compiles kernels with, per GPU


@pytest.fixture(scope="module")
def triton34(cuda13: CudaLayerEvidence, torch14: CudaLayerEvidence) -> ImageFacts:
    """Triton 3.4.0 (as torch 2.8.0 pins it) beside vLLM 0.33.0, whose sources import it, and torch's code."""
    return image([layer_evidence(triton_layer(TRITON_34)), layer_evidence(vllm_layer()), torch14, cuda13])


@pytest.fixture(scope="module")
def triton39(cuda13: CudaLayerEvidence, torch14: CudaLayerEvidence) -> ImageFacts:
    return image([layer_evidence(triton_layer(TRITON_39)), torch14, cuda13])


def _triton_lines(archs: GpuArchs, cc: tuple[int, int]) -> list[str]:
    return [line for line in gpu_code.judge(archs, cc).without if line.startswith("Triton")]


@pytest.mark.parametrize("wheel", [TRITON_34, TRITON_39], ids=["3.4.0", "3.9.0"])
def test_what_triton_builds_with_a_c_compiler_follows_its_version(wheel: RemoteWheel) -> None:
    """The ground of `c_compiler_on`, in the pinned wheels' own source: `gcc`, else `clang` (or `$CC`), found
    as `shutil.which` finds them; 3.4.0 builds its driver module and a launcher per kernel with it, 3.9.0
    its driver module alone (`PREBUILT_UTILS_FROM`), which a Triton cache in the image may hold built."""
    names = ("triton/runtime/build.py", "triton/backends/nvidia/driver.py", "triton/backends/nvidia/driver.c")
    build, driver, source = (member_files(wheel, names.__contains__)[name].read_text() for name in names)
    assert 'os.environ.get("CC")' in build
    assert build.index('shutil.which("clang")') < build.index("gcc if gcc is not None else clang")
    version = release(".".join(wheel.filename.split("-")[1].split(".")[:2]))
    assert version is not None and '"cuda_utils"' in driver
    assert ("__triton_launcher" in driver) == (version < PREBUILT_UTILS_FROM)  # a launcher per kernel
    # the ground of `python_headers.include_dir`: its driver module includes Python.h, from the directory
    # CPython's `posix_prefix` scheme names (Debian's `posix_local` read as it), as this interpreter's own
    # `sysconfig` says: the base interpreter's prefix, `include/python{X.Y}{abiflags}`
    assert "#include <Python.h>" in source
    assert "if scheme == 'posix_local':\n        scheme = 'posix_prefix'" in build
    assert 'py_include_dir = sysconfig.get_paths(scheme=scheme)["include"]' in build
    assert 'cc_cmd += [f"-I{dir}" for dir in include_dirs' in build
    assert sysconfig.get_paths(scheme="posix_prefix", expand=False)["include"] == (
        "{installed_base}/include/python{py_version_short}{abiflags}"
    )


@pytest.mark.parametrize("wheel", [TRITON_34, TRITON_39], ids=["3.4.0", "3.9.0"])
def test_each_ptxas_triton_ships_knows_the_gpus_it_assembles_for(wheel: RemoteWheel, tmp_path: Path) -> None:
    """Ground truth: each copy's `--version` names the release the scan reads from its bytes, and it
    assembles a kernel for exactly the GPUs `compiles_for` says (`--gpu-name` as Triton passes it)."""
    tools = triton_ptxas(wheel)
    assert set(tools) == ({"ptxas"} if wheel is TRITON_34 else {"ptxas", "ptxas-blackwell"})
    for tool, path in tools.items():
        reader = ReleaseReader()
        with path.open("rb") as stream:
            while (chunk := stream.read(1 << 20)) and reader.feed(chunk):
                pass
        banner = subprocess.run([path, "--version"], capture_output=True, text=True, check=True).stdout
        assert reader.release is not None and f"release {reader.release}," in banner, tool
        cuda = release(reader.release)
        assert cuda is not None
        isa = max(isa for isa, toolkit in PTX_ISA_TOOLKITS.items() if toolkit <= cuda)
        # and two architectures no GPU of the fleet tables has yet: sm_88 (CUDA 13.0) and sm_107 (13.4)
        for cc in [*(cc for cc in gpu_code.KNOWN_COMPUTE_CAPABILITIES if cc >= (7, 0)), (8, 8), (10, 7)]:
            facts = TritonFacts(version=wheel.filename.split("-")[1], ptxas={tool: reader.release})
            name = arch_name(facts, cc)
            source = tmp_path / f"{tool}-{name}.ptx"
            source.write_text(
                f".version {isa[0]}.{isa[1]}\n.target {name}\n.address_size 64\n"
                ".visible .entry k(.param .u64 p) { ret; }\n"
            )
            run = subprocess.run(
                [path, f"--gpu-name={name}", source, "-o", tmp_path / "k.cubin"],
                capture_output=True,
                text=True,
            )
            assert compiles_for(cuda, cc) == (run.returncode == 0), (tool, name, run.stderr)


def test_triton_that_cannot_compile_for_a_gpu_refuses_vllm_there(
    triton34: ImageFacts, vllm: ImageFacts
) -> None:
    """Triton 3.4.0's ptxas (CUDA 12.8) stops at sm_121a and sm_103a. vLLM 0.33.0 builds a Triton kernel at
    every step, eager or not (vllm-project/vllm#32575: a GB10), so those GPUs are refused,
    naming why; nothing changes where Triton's ptxas knows the GPU."""
    archs = archs_of(triton34)
    assert archs.triton is not None
    assert (archs.triton.version, archs.triton.ptxas) == ("3.4.0", {"ptxas": "12.8"})
    assert archs.triton.users == ["vllm"]
    assert archs.triton.user_versions == {"vllm": "0.33.0"}
    decision = place(triton34, FLEET_580)
    assert eligible(decision) == eligible(place(vllm, FLEET_580)) - {"gb10"}
    assert only(decision, "gb10") == (
        "1 free NVIDIA GB10: compute capability 12.1: Triton 3.4.0 cannot compile kernels here: its ptxas (CUDA 12.8) does not know"
        " sm_121a, and vllm 0.33.0 builds a Triton kernel at every step (its KV cache's slot mapping), --enforce-eager"
        " or not; TRITON_PTXAS_PATH can name a ptxas that knows it (CUDA 12.9 or later)"
    )
    assert not gpu_code.judge(archs, (10, 3)).runs
    for cc in ((7, 5), (8, 0), (8, 9), (9, 0), (10, 0), (12, 0)):
        verdict = gpu_code.judge(archs, cc)
        assert verdict.runs and _triton_lines(archs, cc) == [], cc
    assert not gpu_code.judge(archs, (12, 1), rule="strict").runs


@pytest.mark.parametrize(
    ("layers", "name", "why"),
    [
        (
            lambda: [sglang_layer(), sglang_kernel_layer()],
            "sglang 0.5.9",
            "computes every prefill's positions with a Triton kernel (any attention backend but torch_native)",
        ),
        (
            lambda: [unsloth_layer()],
            "unsloth 2025.11.1",
            "runs its own Triton kernels (RoPE, RMS norm, cross-entropy) at every training step",
        ),
    ],
    ids=["sglang", "unsloth"],
)
def test_pure_python_packages_that_build_triton_kernels_are_refused_where_triton_cannot(
    layers: Callable[[], list[list[Part]]],
    name: str,
    why: str,
    cuda13: CudaLayerEvidence,
    torch14: CudaLayerEvidence,
) -> None:
    """SGLang and Unsloth ship no GPU code of their own, so they are found as the distributions whose
    sources import Triton. Beside Triton 3.4.0 they are refused on the GPUs its ptxas does not know,
    and placed as before elsewhere."""
    own = [layer_evidence(layer) for layer in layers()]
    without = image([*own, torch14, cuda13])
    facts = image([layer_evidence(triton_layer(TRITON_34)), *own, torch14, cuda13])
    archs = archs_of(facts)
    assert archs.triton is not None
    package, version = name.split()
    assert archs.triton.user_versions[package] == version
    b200 = next(server for server in FLEET_580 if server.name == "b200")
    b300 = b200.model_copy(
        update={
            "name": "b300",
            "gpus": [
                gpu.model_copy(
                    update={"uuid": "GPU-b300", "name": "NVIDIA B300", "compute_capability": "10.3"}
                )
                for gpu in b200.gpus
            ],
        }
    )
    fleet = [*FLEET_580, b300]
    before = eligible(place(without, fleet))
    decision = place(facts, fleet)
    assert "b300" in before  # sglang-kernel's sm_100f and torch's sm_103f run there
    assert eligible(decision) == before - {"b300", "gb10"}
    for server, model, cc, arch in (("b300", "B300", "10.3", "sm_103a"), ("gb10", "GB10", "12.1", "sm_121a")):
        if server in before:
            assert only(decision, server) == (
                f"1 free NVIDIA {model}: compute capability {cc}: Triton 3.4.0 cannot compile kernels here: its"
                f" ptxas (CUDA 12.8) does not know {arch}, and {name} {why}; TRITON_PTXAS_PATH can name a ptxas"
                " that knows it (CUDA 12.9 or later)"
            )


def test_triton_that_cannot_compile_for_a_gpu_is_named_where_the_image_runs_without_it(
    cuda13: CudaLayerEvidence, torch14: CudaLayerEvidence
) -> None:
    """With no package that compiles Triton kernels on its default path (torch's eager kernels need
    none), the image runs there, and the answer names what fails: torch.compile."""
    facts = image([layer_evidence(triton_layer(TRITON_34)), torch14, cuda13])
    archs = archs_of(facts)
    decision = place(facts, FLEET_580)
    assert eligible(decision) == ALL - {"v100"}  # wherever torch 2.14.0+cu130 runs
    line = (
        "Triton 3.4.0's kernels: its ptxas (CUDA 12.8) does not know sm_121a, so nothing Triton compiles"
        " runs here (torch.compile); TRITON_PTXAS_PATH can name a ptxas that knows it (CUDA 12.9 or later)"
    )
    assert f"on NVIDIA GB10 (compute capability 12.1): runs; without {line}" in decision.warnings
    assert _triton_lines(archs, (12, 1)) == [line]
    assert len(_triton_lines(archs, (10, 3))) == 1
    assert not gpu_code.judge(archs, (11, 0)).runs  # Thor: torch 2.14.0 has no code there; no caveats
    for cc in ((7, 5), (8, 0), (8, 9), (9, 0), (10, 0), (12, 0)):
        assert _triton_lines(archs, cc) == [], cc
    assert "runs without Triton 3.4.0's kernels on compute capability 10.3, 12.1" in gpu_code.caveats(archs)


def test_triton_39_runs_ptxas_blackwell_from_hopper_on(triton39: ImageFacts) -> None:
    """Triton 3.9.0 runs `ptxas-blackwell` (CUDA 13.4) from compute capability 9.0 on: it knows every
    GPU in the fleet, but not Thor as CUDA 12.x named it (sm_101a); below 9.0, CUDA 12.9's ptxas."""
    archs = archs_of(triton39)
    assert archs.triton is not None and archs.triton.ptxas == {"ptxas": "12.9", "ptxas-blackwell": "13.4"}
    decision = place(triton39, FLEET_580)
    assert not [w for w in decision.warnings if "Triton" in w]
    assert _triton_lines(archs, (10, 1)) == [
        "Triton 3.9.0's kernels: its ptxas-blackwell (CUDA 13.4) does not know sm_101a, so nothing Triton"
        " compiles runs here (torch.compile); TRITON_PTXAS_PATH can name a ptxas that knows it (CUDA 12.8 to 12.9)"
    ]
    assert _triton_lines(archs, (7, 0)) == []  # CUDA 12.9's ptxas still knows Volta


def test_a_ptxas_named_by_the_config_replaces_tritons_own(
    triton34: ImageFacts, cuda13: CudaLayerEvidence, torch14: CudaLayerEvidence
) -> None:
    """`TRITON_PTXAS_PATH` naming CUDA 13.0's ptxas, which the image carries (nvidia-cuda-nvcc), makes
    Triton 3.4.0 compile for a GB10; a path the image does not carry as a file (a link into a toolkit,
    a mount) leaves the release unknown, and a variable for a tool Triton 3.4.0 does not run is not read."""
    nvcc = layer_evidence([libraries(CUDA13_NVCC, "ptxas")])
    (ptxas,) = [path for path in nvcc.ptxas if path.endswith("/bin/ptxas")]
    assert nvcc.ptxas[ptxas] == "13.0"
    _, archs = combine([layer_evidence(triton_layer(TRITON_34)), nvcc, torch14, cuda13])
    assert archs is not None and archs.triton is not None
    env = gpu_facts({"config": {"Env": [f"TRITON_PTXAS_PATH={ptxas}"]}})
    assert env.triton_ptxas == {"ptxas": ptxas}
    chosen = with_triton_ptxas(archs, env.triton_ptxas)
    assert chosen.triton is not None and chosen.triton.ptxas == {"ptxas": "13.0"}
    assert _triton_lines(chosen, (12, 1)) == []
    assert (
        with_triton_ptxas(archs, {"ptxas-blackwell": ptxas}).triton == archs.triton
    )  # 3.4 runs no such tool
    linked = with_triton_ptxas(archs, {"ptxas": "/usr/local/cuda/bin/ptxas"})  # a link, or nothing: unknown
    assert linked.triton is not None and linked.triton.ptxas == {"ptxas": ""}
    assert _triton_lines(linked, (12, 1)) == []  # nothing is claimed


async def test_flashinfers_tools_reach_the_report_and_decide_sglangs_gpus(
    registry: LocalRegistry, push: Pusher, tmp_path: Path
) -> None:
    """SGLang 0.5.9's RECORD and FlashInfer backend, FlashInfer 0.7.4's RECORD and `.ptx` files, pushed with
    skopeo three ways: over NVIDIA's runtime layout (`/usr/local/cuda` holds libraries, no nvcc), over its
    devel layout (CUDA 13.0's real nvcc behind the same links, on PATH), and that without a C++ compiler.
    The scan finds the tools as FlashInfer would; SGLang is refused on an L4 (FlashInfer is its attention
    there) where FlashInfer cannot build, and runs on an H100 (FlashAttention 3), told what it runs without."""
    sources = [
        member_files(
            SGLANG, lambda name: name.endswith(("attention/flashinfer_backend.py", ".dist-info/RECORD"))
        ),
        member_files(FLASHINFER, lambda name: name.endswith((".ptx", ".dist-info/RECORD"))),
    ]
    python = _site_layer(sources)
    home = [
        symlink("/usr/local/cuda", "/etc/alternatives/cuda"),
        symlink("/etc/alternatives/cuda", "/usr/local/cuda-13.0"),
    ]
    runtime = LayerSpec([*home, file("/usr/local/cuda-13.0/lib64/libcudart.so.13", fake_elf(None))])
    devel = LayerSpec([*home, file("/usr/local/cuda-13.0/bin/nvcc", nvcc().read_bytes(), 0o755)])
    cxx = LayerSpec(
        [symlink("/usr/bin/c++", "/etc/alternatives/c++"), file("/usr/bin/g++-12", fake_elf(None), 0o755)]
    )
    path = {"PATH": "/usr/local/cuda/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
    push(ImageSpec([cxx, runtime, python]), "pkg/flashinfer:runtime")
    push(ImageSpec([cxx, devel, python], env=path), "pkg/flashinfer:devel")
    push(ImageSpec([devel, python], env=path), "pkg/flashinfer:nocxx")
    reports = await _scan_all(
        tmp_path, [f"{registry.host}/pkg/flashinfer:{tag}" for tag in ("runtime", "devel", "nocxx")]
    )
    archs: list[GpuArchs] = []
    for report in reports:
        assert report.error is None, report.error
        found = report.platforms[0].gpu.archs
        assert found is not None and found.flashinfer is not None
        archs.append(found)
    tools = [(a.flashinfer.nvcc, a.flashinfer.nvcc_release, a.flashinfer.cxx) for a in archs if a.flashinfer]
    assert tools == [
        ("", None, "/usr/bin/c++"),
        ("/usr/local/cuda/bin/nvcc", "13.0", "/usr/bin/c++"),
        ("/usr/local/cuda/bin/nvcc", "13.0", ""),
    ]
    assert archs[0].flashinfer is not None and archs[0].flashinfer.user_versions == {"sglang": "0.5.9"}
    for facts, missing in (
        (archs[0], "it finds no nvcc in the image"),
        (archs[2], "it finds no C++ compiler"),
    ):
        refused = [r for r in gpu_code.judge(facts, (8, 9)).reasons if "FlashInfer" in r]
        assert len(refused) == 1 and missing in refused[0]
        assert "and sglang 0.5.9 takes FlashInfer's attention kernels for models without MLA" in refused[0]
        hopper = gpu_code.judge(facts, (9, 0))
        assert not any("FlashInfer" in r for r in hopper.reasons)
        assert any(w.startswith("FlashInfer 0.7.4's kernels: " + missing) for w in hopper.without)
    for cc in ((8, 9), (9, 0), (12, 1)):
        verdict = gpu_code.judge(archs[1], cc)
        assert not any("FlashInfer" in line for line in verdict.reasons + verdict.without), cc


async def test_the_ptxas_a_config_variable_names_reaches_the_report(
    registry: LocalRegistry, push: Pusher, tmp_path: Path
) -> None:
    """Triton 3.4.0's RECORD and ptxas, CUDA 13.0's ptxas (nvidia-cuda-nvcc) and FlashInfer's `.ptx`
    files, pushed with skopeo twice: as is, and with `TRITON_PTXAS_PATH` naming CUDA 13.0's ptxas. The
    walk in an analysis process reads each release from the bytes; the config picks the one Triton runs."""
    parts = [
        triton_layer(TRITON_34)[0].files(),
        libraries(CUDA13_NVCC, "ptxas").files(),
        member_files(FLASHINFER, lambda name: name.endswith((".ptx", ".dist-info/RECORD"))),
    ]
    layer = _site_layer(parts)
    nvcc = f"{SITE}/nvidia/cu13/bin/ptxas"
    assert any(f"{SITE}/{name}" == nvcc for name in parts[1])
    toolkit = LayerSpec(  # CUDA 13.0's ptxas where NVIDIA's images install it, and their links to it
        [
            file("/usr/local/cuda-13.0/bin/ptxas", parts[1]["nvidia/cu13/bin/ptxas"].read_bytes(), 0o755),
            symlink("/usr/local/cuda", "/etc/alternatives/cuda"),
            symlink("/etc/alternatives/cuda", "/usr/local/cuda-13.0"),
        ]
    )
    gcc = [symlink("/usr/bin/gcc", "gcc-12"), file("/usr/bin/gcc-12", fake_elf(None), 0o755)]
    headers = file(
        "/usr/local/include/python3.11/Python.h", b"#include <patchlevel.h>\n"
    )  # as python:3.11 has it
    compiler = LayerSpec([*gcc, headers])
    push(ImageSpec([compiler, layer]), "pkg/triton:plain")
    push(ImageSpec([compiler, layer], env={"TRITON_PTXAS_PATH": nvcc}), "pkg/triton:cuda13")
    linked = {"TRITON_PTXAS_PATH": "/usr/local/cuda/bin/ptxas"}
    push(ImageSpec([compiler, toolkit, layer], env=linked), "pkg/triton:linked")
    push(ImageSpec([layer], env={"TRITON_PTXAS_PATH": nvcc}), "pkg/triton:nocc")  # no C compiler at all
    push(ImageSpec([LayerSpec(gcc), layer], env={"TRITON_PTXAS_PATH": nvcc}), "pkg/triton:noheaders")
    tags = ("plain", "cuda13", "linked", "nocc", "noheaders")
    reports = await _scan_all(tmp_path, [f"{registry.host}/pkg/triton:{tag}" for tag in tags])
    found = []
    for report in reports:
        assert report.error is None, report.error
        archs = report.platforms[0].gpu.archs
        assert archs is not None and archs.triton is not None
        found.append(archs.triton.ptxas)
    assert found == [{"ptxas": "12.8"}] + [{"ptxas": "13.0"}] * 4
    triton = [r.platforms[0].gpu.archs.triton for r in reports if r.platforms[0].gpu.archs is not None]
    assert [t.c_compiler if t is not None else "-" for t in triton] == ["/usr/bin/gcc"] * 3 + [
        "",
        "/usr/bin/gcc",
    ]
    header = "/usr/local/include/python3.11/Python.h"
    assert [t.python_header if t is not None else "-" for t in triton] == [header] * 3 + ["", ""]
    via = reports[2].platforms[0].gpu.archs
    assert (
        via is not None and via.ptxas_links["/usr/local/cuda/bin/ptxas"] == "/usr/local/cuda-13.0/bin/ptxas"
    )
    gb10 = [s for s in FLEET if s.name == "gb10"]
    warnings = [decide(ImageFacts.from_report(r), DeployRequest(gpus=1), gb10).warnings for r in reports]
    assert any("does not know sm_121a" in line for line in warnings[0])
    assert not any("Triton" in line for line in warnings[1] + warnings[2])
    assert any("finds no C compiler in the image" in line for line in warnings[3])
    assert any(f"it finds no C header of its Python in the image ({header})" in line for line in warnings[4])


def test_exllama_builds_its_extension_with_torch_when_imported() -> None:
    """The ground of `placement.torch_extension_compiler`: ExLlamaV2 0.3.2 and ExLlamaV3 1.6.5 as PyPI
    serves them carry CUDA sources and no built extension; their tops import `ext.py` at module level
    (through `model.py` and the modules that use the extension), which calls torch's `cpp_extension.load`
    at module level unless the extension their own release wheels build imports first. Torch 2.14.0's
    `load` checks for ninja on PATH, runs `bin/nvcc` below the CUDA home `_find_cuda_home` finds, links
    with `$CXX`, else `c++`, and builds for the visible GPUs' architectures capped at torch's newest, as
    both packages also set `TORCH_CUDA_ARCH_LIST`."""
    for wheel, top in ((EXLLAMAV2, "exllamav2"), (EXLLAMAV3, "exllamav3")):
        files = member_files(wheel, lambda name: name.endswith((".py", ".dist-info/RECORD")))
        assert not any(
            ".so" in line
            for line in next(p for n, p in files.items() if n.endswith("RECORD")).read_text().splitlines()
        )
        sites = LoadSites()
        for name, path in files.items():
            if name.endswith(".py"):
                sites.add_source(f"{SITE}/{name}", path.read_bytes())
        builds = sites.torch_builders()
        assert list(builds) == [top] and f"{top}_ext" in builds[top], (top, builds)
        ext = files[f"{top}/ext.py"].read_text()
        assert "from torch.utils.cpp_extension import load" in ext
        assert (
            'os.environ["TORCH_CUDA_ARCH_LIST"]'
            in files[f"{top}/ext.py" if top == "exllamav2" else f"{top}/util/arch_list.py"].read_text()
        )
    name = "torch/utils/cpp_extension.py"
    source = member_files(TORCH_214, lambda member: member == name)[name]
    text = source.read_text()
    assert "subprocess.check_output(['ninja', '--version'])" in text
    find = _function_source(source, "_find_cuda_home")
    steps = (
        "'CUDA_HOME'",
        "'CUDA_PATH'",
        'shutil.which("nvcc")',
        "os.path.dirname(os.path.dirname(nvcc_path))",
        "'/usr/local/cuda'",
    )
    assert [find.index(step) for step in steps] == sorted(find.index(step) for step in steps)
    assert "_join_cuda_home('bin', 'nvcc')" in text and "os.environ.get('CXX', 'c++')" in text
    assert "capability = min(max_supported_sm, capability)" in _function_source(
        source, "_get_cuda_arch_flags"
    )


async def test_exllama_is_refused_where_torch_cannot_build_its_extension(
    registry: LocalRegistry, push: Pusher, tmp_path: Path
) -> None:
    """ExLlamaV2 0.3.2's sources and RECORD, with torch 2.14.0's RECORD, PyPI's `ninja` script (a dependency
    of ExLlamaV2) and the interpreter's `Python.h` (stand-ins: the names decide), and a PTX module standing
    in for torch's GPU code, pushed with skopeo three ways: over NVIDIA's runtime layout (no nvcc), over
    its devel layout (CUDA 13.0's real nvcc behind the same links, on PATH, with a C++ compiler), and with
    the extension built by ExLlamaV2's release wheels beside it (a stand-in library of that name). The
    scan finds who builds and the tools torch finds; the image is refused on every GPU without nvcc, on a
    V100 with CUDA 13.0's (it does not know sm_70), and nowhere when the built extension is there."""
    python = _site_layer(
        [
            member_files(EXLLAMAV2, lambda name: name.endswith((".py", ".dist-info/RECORD"))),
            member_files(TORCH_214, lambda name: name.endswith(".dist-info/RECORD")),
        ]
    )
    tools = LayerSpec(
        [
            file("/usr/local/bin/ninja", b"#!/usr/local/bin/python\nfrom ninja import ninja\n", 0o755),
            file("/usr/local/include/python3.11/Python.h", b"#include <patchlevel.h>\n"),
            file("/opt/torch-code/kernels.ptx", b".version 8.7\n.target sm_75\n.address_size 64\n"),
        ]
    )
    home = [
        symlink("/usr/local/cuda", "/etc/alternatives/cuda"),
        symlink("/etc/alternatives/cuda", "/usr/local/cuda-13.0"),
    ]
    runtime = LayerSpec([*home, file("/usr/local/cuda-13.0/lib64/libcudart.so.13", fake_elf(None))])
    devel = LayerSpec(
        [
            *home,
            file("/usr/local/cuda-13.0/bin/nvcc", nvcc().read_bytes(), 0o755),
            symlink("/usr/bin/c++", "/etc/alternatives/c++"),
        ]
    )
    built = LayerSpec([file(f"{SITE}/exllamav2_ext.cpython-311-x86_64-linux-gnu.so", smallest_gpu_library())])
    path = {"PATH": "/usr/local/cuda/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
    push(ImageSpec([tools, runtime, python], env=path), "pkg/exllama:runtime")
    push(ImageSpec([tools, devel, python], env=path), "pkg/exllama:devel")
    push(ImageSpec([built, tools, runtime, python], env=path), "pkg/exllama:built")
    reports = await _scan_all(
        tmp_path, [f"{registry.host}/pkg/exllama:{tag}" for tag in ("runtime", "devel", "built")]
    )
    facts = []
    for report in reports:
        assert report.error is None, report.error
        archs = report.platforms[0].gpu.archs
        assert archs is not None and archs.torch_extensions is not None
        facts.append(archs.torch_extensions)
    runtime_facts, devel_facts, built_facts = facts
    assert (runtime_facts.users, runtime_facts.user_versions) == (["exllamav2"], {"exllamav2": "0.3.2"})
    assert (runtime_facts.nvcc, runtime_facts.ninja) == ("", "/usr/local/bin/ninja")
    assert runtime_facts.python_header == "/usr/local/include/python3.11/Python.h"
    assert (devel_facts.nvcc, devel_facts.nvcc_release, devel_facts.cxx) == (
        "/usr/local/cuda/bin/nvcc",
        "13.0",
        "/usr/bin/c++",
    )
    assert built_facts.users == [] and built_facts.prebuilt == [
        f"{SITE}/exllamav2_ext.cpython-311-x86_64-linux-gnu.so"
    ]
    builds = "exllamav2 0.3.2 builds its CUDA extension with torch's cpp_extension when imported, and here "
    for cc in ((8, 0), (9, 0), (12, 1)):  # the stand-in built extension has PTX compute_80
        refused = gpu_code.judge(reports[0].platforms[0].gpu.archs, cc).reasons  # type: ignore[arg-type]
        assert refused == [
            f"compute capability {cc[0]}.{cc[1]}: {builds}it finds no nvcc in the image ($CUDA_HOME, $CUDA_PATH, PATH or /usr/local/cuda) to compile with; a CUDA toolkit in the image (NVIDIA's devel images) gives it one, or the package's own built extension"
        ]
        assert gpu_code.judge(reports[1].platforms[0].gpu.archs, cc).runs, cc  # type: ignore[arg-type]
        assert gpu_code.judge(reports[2].platforms[0].gpu.archs, cc).runs, cc  # type: ignore[arg-type]
    volta = gpu_code.judge(reports[1].platforms[0].gpu.archs, (7, 0)).reasons  # type: ignore[arg-type]
    assert [r for r in volta if builds in r] == [
        f"compute capability 7.0: {builds}its nvcc (CUDA 13.0) does not know sm_70; CUDA_HOME can name a toolkit whose nvcc knows it (CUDA 12 or earlier)"
    ]
