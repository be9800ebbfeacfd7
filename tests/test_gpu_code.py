"""placement.gpu_code: GPU code judged as CUDA loads it (pure; the real libraries are in test_carried_cuda)."""

from __future__ import annotations

from placement import gpu_code
from placement.cuda_needs import compute_capability_ranges
from scanner.models import ContainerArchs, FileArchs, GpuArchs, GpuFacts

APP = "/app/lib/libkernels.so"
TORCH = "/usr/lib/python3/dist-packages/torch/lib/libtorch_cuda.so"
NCCL = "/usr/lib/python3/dist-packages/nvidia/nccl/lib/libnccl.so.2"
CUBLAS = "/usr/local/cuda-12.8/targets/x86_64-linux/lib/libcublasLt.so.12"


def one(path: str, *containers: ContainerArchs) -> FileArchs:
    return FileArchs(path=path, sections=[".nv_fatbin"], containers=list(containers))


def archs(*files: FileArchs) -> GpuArchs:
    return GpuArchs(files=list(files))


def test_arch_specific_code_beside_generic_code_is_a_fast_path() -> None:
    cusparselt_like = one(
        "/opt/lib/libfast.so",
        ContainerArchs(sass=("80", "86", "89", "90"), ptx=("90",), ptx_isa="8.4"),
        ContainerArchs(sass=("90a",), count=7),
    )
    for cc in ((8, 0), (8, 9), (9, 0), (12, 0)):
        assert gpu_code.judge(archs(cusparselt_like), cc).runs, cc
    only_specific = one("/opt/lib/libhopper.so", ContainerArchs(sass=("90a",)))
    assert gpu_code.judge(archs(only_specific), (9, 0)).runs
    assert not gpu_code.judge(archs(only_specific), (8, 0)).runs  # nothing else to run there
    family = one("/opt/lib/libbw.so", ContainerArchs(sass=("100f",)))
    assert gpu_code.judge(archs(family), (10, 3)).runs and not gpu_code.judge(archs(family), (12, 0)).runs


def test_device_link_input_never_counts() -> None:
    nccl = one(
        NCCL,
        ContainerArchs(sass=("50", "90"), ptx=("90",), ptx_isa="8.2", count=127, section="__nv_relfatbin"),
        ContainerArchs(sass=("50", "60", "70", "80", "90")),
    )
    verdict = gpu_code.judge_file(nccl, (12, 0))
    assert not verdict.runs and verdict.total == 1  # the PTX of the 127 link-input containers is never loaded


def test_the_images_own_code_decides_and_nvidia_libraries_are_caveats() -> None:
    torch = one(TORCH, ContainerArchs(sass=("50", "60", "70", "75", "80", "86", "90"), count=40))
    cublas = one(CUBLAS, ContainerArchs(sass=("75", "80", "90", "100", "120"), ptx=("120",), ptx_isa="8.7"))
    nccl = one(NCCL, ContainerArchs(sass=("50", "60", "70", "80", "90")))
    image = archs(torch, cublas, nccl)
    blackwell = gpu_code.judge(image, (12, 0))
    assert not blackwell.runs
    assert blackwell.reasons[0].startswith(
        f"compute capability 12.0: {TORCH} has no kernel image for compute capability 12.0"
        " (SASS sm_50–sm_90, no PTX)"
    )
    hopper = gpu_code.judge(image, (9, 0))
    assert hopper.runs and hopper.caveats == []
    # the same libraries without the image's own code: they run where any of them runs, gaps named
    libraries = gpu_code.judge(archs(cublas, nccl), (12, 0))
    assert libraries.runs and libraries.caveats == [
        f"{NCCL}: no kernel image for compute capability 12.0 (SASS sm_50–sm_90, no PTX);"
        " calls into this NVIDIA library fail here"
    ]
    assert (
        gpu_code.nvidia_library(NCCL)
        and gpu_code.nvidia_library(CUBLAS)
        and not gpu_code.nvidia_library(TORCH)
    )
    bundled = "/usr/lib/python3/dist-packages/torchvision.libs/libnvjpeg.02b6d700.so.12"  # auditwheel's copy
    assert gpu_code.nvidia_library(bundled) and not gpu_code.nvidia_library("/app/libcudagraph_helpers.so")
    assert gpu_code.nvidia_library("/usr/lib/python3/dist-packages/nvidia/cu13/lib/libcufile.so.0")


def test_summary_says_where_the_image_runs() -> None:
    torch = one(TORCH, ContainerArchs(sass=("50", "60", "70", "75", "80", "86", "90"), count=40))
    torch_90a = one(
        TORCH, ContainerArchs(sass=("50", "60", "70", "75", "80", "86", "90")), ContainerArchs(sass=("90a",))
    )
    expected = "GPU code for sm_50–sm_90, no PTX: compute capability 5.0–9.0"
    assert gpu_code.summary(archs(torch)) == expected == gpu_code.summary(archs(torch_90a))
    ampere = one(APP, ContainerArchs(sass=("80", "86")))
    assert gpu_code.summary(archs(ampere)) == "GPU code for sm_80, sm_86, no PTX: compute capability 8.0–8.9"
    holes = one(APP, ContainerArchs(sass=("75", "80", "89", "90a", "120a")))  # ONNX Runtime's CUDA provider
    assert gpu_code.summary(archs(holes)).endswith(": compute capability 7.5–9.0, 12.0")
    portable = one(APP, ContainerArchs(sass=("80",), ptx=("80",), ptx_isa="8.0"))
    assert (
        gpu_code.summary(archs(portable))
        == "GPU code for sm_80, PTX compute_80: compute capability 8.0–12.1 and newer GPUs"
    )


def test_ranges_carry_the_ptx_jit_driver_floor() -> None:
    portable = one(APP, ContainerArchs(sass=("80",), ptx=("80",), ptx_isa="8.7"))
    ranges = compute_capability_ranges(GpuFacts(archs=archs(portable)))
    assert ranges is not None
    assert ranges[0] == ((8, 0), (8, 9), None)  # SASS sm_80 covers the 8.x GPUs: no JIT
    assert ranges[1] == ((9, 0), (9, 0), "570.26")  # PTX ISA 8.7 comes from CUDA 12.8
    assert ranges[-1] == ((13, 0), None, "570.26")


def test_code_is_described_by_what_it_holds() -> None:
    """A rejection names the code a file has: only family or arch-specific SASS is that SASS, not 'none'."""
    from placement.gpu_code import describe_code

    assert describe_code([ContainerArchs(sass=("100f",))]) == "SASS sm_100f, no PTX"
    assert describe_code([ContainerArchs(ptx=("100",))]) == "no SASS, PTX compute_100"
    assert (
        describe_code([ContainerArchs(sass=("80", "86", "90", "90a"))]) == "SASS sm_80–sm_90 + sm_90a, no PTX"
    )
