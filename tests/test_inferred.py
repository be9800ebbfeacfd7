"""Inferred CUDA from layer files: each source, the merged view (upper wins, whiteouts), disagreement."""

from __future__ import annotations

import gzip
import json

import pytest

from fixtures.oci import file, tar_bytes
from scanner.layers import cuda_evidence
from scanner.layers.cuda_evidence import (
    MAX_EVIDENCE_LINES,
    CudaEntryCollector,
    CudaLayerEvidence,
    choose_cuda,
    collect_layer,
    combine,
    layer_problems,
)
from scanner.layers.cuda_sources import (
    dist_info_finding,
    needed_finding,
    parse_tf_build_info,
    parse_torch_version,
    tf_cuda_version,
)
from scanner.layers.limits import AnalysisLimits, LimitExceeded, ScanBudget
from scanner.layers.tarstream import TarEntry
from scanner.layers.walk import LayerWalk
from tests.nvidia_wheels import NVJPEG_CU12, NVJPEG_CU13, wheel_members

SITE = "/usr/local/lib/python3.11/site-packages"

TORCH_NEW = """__version__ = '2.1.2+cu121'
debug = False
cuda: Optional[str] = '12.1'
git_version = 'a8e7c98cb95ff97bb30a728c6b2a1ce6bff946eb'
hip: Optional[str] = None
"""
TORCH_OLD = "__version__ = '1.8.1+cu111'\ndebug = False\ncuda = '11.1'\ngit_version = 'x'\nhip = None\n"
TORCH_CPU = "__version__ = '2.3.0+cpu'\ncuda: Optional[str] = None\nhip: Optional[str] = None\n"
TORCH_ROCM = "__version__ = '2.3.0+rocm6.0'\ncuda: Optional[str] = None\nhip: Optional[str] = '6.0.32830'\n"
TF_ORDERED = """# Auto-generated
import collections

build_info = collections.OrderedDict([('cpu_compiler', '/usr/bin/clang'), \
('cuda_compute_capabilities', ['sm_35', 'sm_50', 'sm_60', 'sm_70', 'sm_75', 'compute_80']), \
('cuda_version', '12.2'), ('cudnn_version', '8'), ('is_cuda_build', True), ('is_rocm_build', False)])
"""
TF_DICT = "build_info = {'is_cuda_build': True, 'cuda_version': '11.2', 'cudnn_version': '8'}\n"
TF_CPU = "build_info = {'is_cuda_build': False, 'is_rocm_build': False}\n"


def entry(path: str, size: int = 0, kind: str = "file") -> TarEntry:
    return TarEntry(path=path, kind=kind, size=size, mode=0o644)  # type: ignore[arg-type]


def layer(files: dict[str, bytes | str]) -> CudaLayerEvidence:
    items = []
    for path, content in files.items():
        data = content.encode() if isinstance(content, str) else content
        items.append((entry(path, len(data)), data))
    return collect_layer(items)


def test_torch_version_forms() -> None:
    assert parse_torch_version(TORCH_NEW) == "12.1"
    assert parse_torch_version(TORCH_OLD) == "11.1"
    assert parse_torch_version(TORCH_CPU) is None
    assert parse_torch_version(TORCH_ROCM) is None
    assert parse_torch_version("cuda = (") is False
    inferred, _ = combine([layer({f"{SITE}/torch/version.py": TORCH_NEW})])
    assert inferred is not None and inferred.cuda == "12.1" and inferred.sources == ["torch"]
    assert inferred.evidence == [f"{SITE}/torch/version.py: torch 2.1.2+cu121, cuda = '12.1'"]
    assert combine([layer({f"{SITE}/torch/version.py": TORCH_CPU})]) == (None, None)


@pytest.mark.parametrize(
    ("name", "cuda", "detail"),
    [
        ("nvidia_cuda_runtime_cu12-12.1.105.dist-info", "12.1", "nvidia-cuda-runtime-cu12 12.1.105"),
        ("nvidia_cuda_nvrtc_cu11-11.7.99.dist-info", "11.7", "nvidia-cuda-nvrtc-cu11 11.7.99"),
        ("nvidia_cublas_cu12-12.1.3.1.dist-info", "12", "nvidia-cublas-cu12 12.1.3.1"),
        ("nvidia_cudnn_cu12-8.9.2.26.dist-info", "12", "nvidia-cudnn-cu12 8.9.2.26"),
        ("nvidia_cuda_runtime-13.0.96.dist-info", "13.0", "nvidia-cuda_runtime 13.0.96"),
        ("jax_cuda12_plugin-0.4.30.dist-info", "12", "jax_cuda12_plugin-0.4.30"),
        ("jax_cuda13_pjrt-0.7.1.dist-info", "13", "jax_cuda13_pjrt-0.7.1"),
        ("jaxlib-0.4.7+cuda12.cudnn88.dist-info", "12", "jaxlib-0.4.7+cuda12.cudnn88"),
        ("cupy_cuda12x-13.0.0.dist-info", "12", "cupy-cuda12x 13.0.0"),
        ("cupy_cuda102-9.6.0.dist-info", "10.2", "cupy-cuda102 9.6.0"),
    ],
)
def test_dist_info_names(name: str, cuda: str, detail: str) -> None:
    finding = dist_info_finding(name)
    assert finding is not None and finding.cuda == cuda and finding.detail == detail


@pytest.mark.parametrize(
    "name",
    [
        "nvidia_cublas_cu13-0.0.1.dist-info",  # placeholder
        "nvidia_cuda_runtime_cu116-0.0.1.dev5.dist-info",  # placeholder
        "nvidia_ml_py-12.535.133.dist-info",  # NVML bindings, not CUDA
        "nvidia_nvjpeg-13.2.3.58.dist-info",  # unsuffixed library: its CUDA comes from nvidia/cu13/
        "numpy-1.26.4.dist-info",
    ],
)
def test_dist_info_that_says_nothing(name: str) -> None:
    assert dist_info_finding(name) is None


def test_nvidia_wheel_files_from_the_real_wheels() -> None:
    """The cu12 wheel: dist-info (major) + fatbin archs; the cu13 wheel: files under nvidia/cu13/."""
    cu12 = {f"{SITE}/{path}": data for path, data in wheel_members(NVJPEG_CU12).items()}
    inferred, archs = combine([layer(cu12)])  # type: ignore[arg-type]
    assert inferred is not None and inferred.cuda == "12.9" and inferred.sources == ["nvidia-wheel", "elf"]
    assert f"{SITE}/nvidia_nvjpeg_cu12-12.4.0.76.dist-info: nvidia-nvjpeg-cu12 12.4.0.76" in inferred.evidence
    assert f"{SITE}/nvidia/nvjpeg/lib: libnvjpeg.so.12" in inferred.evidence
    assert f"{SITE}/nvidia/nvjpeg/lib/libnvjpeg.so.12: GPU code in .nv_fatbin" in inferred.evidence
    assert archs is not None and archs.sass[0] == "50" and archs.ptx == ["121"]
    assert [f.path for f in archs.files] == [f"{SITE}/nvidia/nvjpeg/lib/libnvjpeg.so.12"]

    cu13 = {f"{SITE}/{path}": data for path, data in wheel_members(NVJPEG_CU13).items()}
    inferred13, archs13 = combine([layer(cu13)])  # type: ignore[arg-type]
    # nvjpeg 13.2.3.58's PTX is ISA 9.4, which CUDA 13.4 writes (nvcc 13.4.92 from PyPI): that toolkit built it
    assert inferred13 is not None and inferred13.cuda == "13.4"
    assert inferred13.set_by == f"{SITE}/nvidia/cu13/lib/libnvjpeg.so.13: PTX ISA 9.4, written by CUDA 13.4"
    assert archs13 is not None and archs13.sass[0] == "75"
    # the PTX says which toolkit wrote it (ISA 8.8: CUDA 12.9): listed, but the wheel's CUDA stays the answer
    lib = f"{SITE}/nvidia/nvjpeg/lib/libnvjpeg.so.12"
    assert inferred.versions[0].source == "ptx" and inferred.versions[0].cuda == "12.9"
    assert inferred.versions[0].evidence == f"{lib}: PTX ISA 8.8, written by CUDA 12.9"
    # with nothing else to say, the PTX sets the version
    alone, _ = combine([layer({lib: cu12[lib]})])  # type: ignore[arg-type]
    assert (
        alone is not None
        and alone.cuda == "12.9"
        and alone.set_by == f"{lib}: PTX ISA 8.8, written by CUDA 12.9"
    )

    # both in one image: sources disagree, the newest is kept and quoted, both listed
    both, both_archs = combine([layer(cu13), layer(cu12)])  # type: ignore[arg-type]
    assert both is not None and both.cuda == "13.4" and both.conflict
    assert both.set_by == f"{SITE}/nvidia/cu13/lib/libnvjpeg.so.13: PTX ISA 9.4, written by CUDA 13.4"
    assert [v.cuda for v in both.versions][:1] == ["13.4"] and "12" in [v.cuda for v in both.versions]
    # the archs are what the code holds (the union); placement.gpu_code judges where it runs
    assert both_archs is not None and both_archs.sass[0] == "50" and "75" in both_archs.sass


# DT_NEEDED of torch 2.11.0+cu130's lib/libtorch_cuda.so, read on a real H200 host (driver 580.159.04).
TORCH_211_CU130_NEEDED = [
    "libcublas.so.13",
    "libcublasLt.so.13",
    "libcudart.so.13",
    "libcudnn.so.9",
    "libcufft.so.12",
    "libcufile.so.0",
    "libcurand.so.10",
    "libcusparse.so.12",
    "libcusparseLt.so.0",
    "libnccl.so.2",
]


def test_cusparse_soname_is_not_the_cuda_major() -> None:
    """CUDA 13.0 ships cuSPARSE 12.x as libcusparse.so.12, so its SONAME says nothing of the CUDA major."""
    assert needed_finding(TORCH_211_CU130_NEEDED).cuda == "13"
    assert needed_finding(["libcusparse.so.12"]).cuda is None
    # a CUDA 13 wheel's cuSPARSE sits beside its cuBLAS under nvidia/cu13/lib: CUDA 13 alone, no disagreement
    inferred, _ = combine(
        [
            layer(
                {
                    f"{SITE}/nvidia/cu13/lib/libcusparse.so.12": b"",
                    f"{SITE}/nvidia/cu13/lib/libcublas.so.13": b"",
                }
            )
        ]
    )
    assert inferred is not None and inferred.cuda == "13" and not inferred.conflict
    assert [v.cuda for v in inferred.versions] == ["13"] * len(inferred.versions)


def test_tensorflow_build_info() -> None:
    info = parse_tf_build_info(TF_ORDERED)
    assert info is not None and info["cuda_version"] == "12.2"
    assert tf_cuda_version("64_112") == "11.2"
    path = f"{SITE}/tensorflow/python/platform/build_info.py"
    inferred, _ = combine([layer({path: TF_ORDERED})])
    assert inferred is not None and inferred.cuda == "12.2"
    assert "compute capabilities sm_35, sm_50" in inferred.evidence[0]
    assert combine([layer({path: TF_DICT})])[0].cuda == "11.2"  # type: ignore[union-attr]
    assert combine([layer({path: TF_CPU})]) == (None, None)


def test_conda_meta_reads_name_and_version_inside() -> None:
    meta = "/opt/conda/conda-meta"
    files = {
        f"{meta}/cuda-cudart-dev-12.1.105-0.json": json.dumps(
            {"name": "cuda-cudart-dev", "version": "12.1.105"}
        ),
        f"{meta}/cudatoolkit-11.8.0-h6a678d5_0.json": json.dumps(
            {"files": ["lib/libcudart.so"] * 3, "name": "cudatoolkit", "version": "11.8.0"}
        ),
        f"{meta}/pytorch-2.0.1-py3.10_cuda11.7_cudnn8.5.0_0.json": json.dumps(
            {"name": "pytorch", "version": "2.0.1"}
        ),
    }
    inferred, _ = combine([layer(files)])  # type: ignore[arg-type]
    assert inferred is not None and inferred.cuda == "11.8" and inferred.conflict  # the newest runtime
    assert inferred.set_by == f"{meta}/cudatoolkit-11.8.0-h6a678d5_0.json: cudatoolkit 11.8.0"
    assert not any("cuda-cudart-dev" in line for line in inferred.evidence)
    assert f"{meta}/cudatoolkit-11.8.0-h6a678d5_0.json: cudatoolkit 11.8.0" in inferred.evidence


def test_toolkit_tree_and_version_file() -> None:
    inferred, _ = combine(
        [
            layer(
                {
                    "/usr/local/cuda-12.4/lib64/libcudart.so.12.4.127": b"not elf " * 10,
                    "/usr/local/cuda/version.json": '{"cuda": {"name": "CUDA SDK", "version": "12.4.1"}}',
                }
            )
        ]
    )
    assert inferred is not None and inferred.cuda == "12.4"
    assert "/usr/local/cuda-12.4: CUDA toolkit tree 12.4" in inferred.evidence
    assert "/usr/local/cuda/version.json: CUDA toolkit 12.4" in inferred.evidence


def test_upper_layer_wins_and_whiteouts_hide() -> None:
    torch = f"{SITE}/torch/version.py"
    lower = layer({torch: TORCH_NEW, f"{SITE}/nvidia_cuda_runtime_cu12-12.1.105.dist-info/METADATA": "x"})
    cpu_on_top = layer({torch: TORCH_CPU})
    inferred, _ = combine([cpu_on_top, lower])
    assert inferred is not None and inferred.cuda == "12.1"  # the wheel is still there
    assert inferred.evidence[-1] == f"{torch}: cuda = None (a CPU, ROCm or XPU build)"
    assert f"{torch}: torch 2.1.2+cu121, cuda = '12.1'" not in inferred.evidence

    removed = collect_layer(
        [
            (entry(f"{SITE}/.wh.nvidia_cuda_runtime_cu12-12.1.105.dist-info"), b""),
            (entry(f"{SITE}/torch/.wh.version.py"), b""),
        ]
    )
    assert combine([removed, lower]) == (None, None)
    opaque = collect_layer([(entry(f"{SITE}/.wh..wh..opq"), b"")])
    assert combine([opaque, lower]) == (None, None)
    assert combine([lower, opaque])[0] is not None  # an opaque dir hides only what lies below it


def test_a_layer_past_a_per_layer_bound_says_which(monkeypatch: pytest.MonkeyPatch) -> None:
    """Evidence past a per-layer bound is dropped, and the report's warnings name the bound."""
    monkeypatch.setattr(cuda_evidence, "MAX_FINDINGS_PER_LAYER", 2)
    wheels = {f"{SITE}/nvidia_cuda_runtime_cu12-12.{n}.0.dist-info/METADATA": "x" for n in range(1, 4)}
    crowded = layer(wheels)
    assert crowded.truncated and crowded.bounds_reached == ["MAX_FINDINGS_PER_LAYER"]
    assert layer_problems([layer({}), crowded]) == [
        "layer 2 from the top: more than 2 files with CUDA evidence (MAX_FINDINGS_PER_LAYER); evidence past"
        " it was not kept, and placement judges what was"
    ]


def test_evidence_listed_per_image_is_bounded() -> None:
    """256 layers of 4,096 findings would list a million lines in the report: past
    `MAX_EVIDENCE_LINES`, the rest is counted."""
    layers = [
        CudaLayerEvidence(
            findings={
                f"/usr/lib/layer{n}/libkernels{i}.so": needed_finding(["libcudart.so.12"])
                for i in range(1000)
            }
        )
        for n in range(3)
    ]
    inferred, _ = combine(layers)
    assert inferred is not None and inferred.cuda == "12"
    assert len(inferred.evidence) == MAX_EVIDENCE_LINES + 1
    assert inferred.evidence[-1] == f"... and {3000 - MAX_EVIDENCE_LINES:,} more"


def test_choose_cuda() -> None:
    assert choose_cuda(["12", "12.1"]) == ("12.1", False)
    assert choose_cuda(["12.4", "12.1", "12"]) == ("12.4", True)  # the newest the image carries
    assert choose_cuda(["13", "12.8"]) == ("13", True)  # a newer major, even named only by its major
    assert choose_cuda(["13", "13.0", "12.8"]) == ("13.0", True)  # the most precise of the newest major
    assert choose_cuda(["12", "11"]) == ("12", True)
    assert choose_cuda([]) == (None, False)


def test_a_decompression_bomb_stops_the_walk_with_the_cuda_collector() -> None:
    """The ratio guard is the walk's: a walk feeding the CUDA collector stops there too."""
    archive = gzip.compress(tar_bytes([file("/zeros", bytes(8 << 20))]))
    strict = AnalysisLimits(max_inflation_ratio=10, inflation_ratio_floor=1 << 20)
    walk = LayerWalk(
        "application/vnd.oci.image.layer.v1.tar+gzip", [CudaEntryCollector()], budget=ScanBudget(strict)
    )
    with pytest.raises(LimitExceeded, match=r"\(GPUBADGE_MAX_INFLATION_RATIO\)$"):
        for start in range(0, len(archive), 4096):
            walk.feed(archive[start : start + 4096])
        walk.close()
    fine = CudaEntryCollector()
    lenient = AnalysisLimits(max_inflation_ratio=10_000, inflation_ratio_floor=1 << 20)
    walk = LayerWalk("application/vnd.oci.image.layer.v1.tar+gzip", [fine], budget=ScanBudget(lenient))
    walk.feed(archive)
    walk.close()
    assert fine.finish(complete=True).complete
