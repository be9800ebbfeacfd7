"""Standalone GPU code files (`.cubin`, `.fatbin`, `.ptx`) read as `cuobjdump` reads them (issue 42).

Cubins are built at set-up by PyPI's nvcc 13.0 (the ELF ABI of CUDA 12.8 and newer) and by CUDA 12.8's
ptxas (the ABI of CUDA 12 and older), one per target, `a` and `f` builds included; flashinfer-cubin's
real files are checked in tests/test_gpu_packages.py.
"""

from __future__ import annotations

import os
import subprocess
import zipfile
from pathlib import Path

import pytest

from fixtures.cuda_program import PROGRAM_SOURCE
from fixtures.oci import file, tar_bytes
from placement import gpu_code
from scanner.layers.cuda_evidence import collect_layer, combine
from scanner.layers.gpu_modules import (
    MAX_MODULE_FILE_BYTES,
    ModuleError,
    ModuleSink,
    parse_cubin,
    parse_ptx_head,
)
from scanner.layers.tarstream import TarEntry
from tests.nvidia_wheels import CACHE, CUDA_13_0, PTXAS_12_8, cuobjdump, cuobjdump_listing, nvcc, wheel_path

NEW_ABI_TARGETS = [
    "sm_75",
    "sm_80",
    "sm_90",
    "sm_90a",
    "sm_100",
    "sm_100a",
    "sm_100f",
    "sm_103a",
    "sm_120",
    "sm_120f",
    "sm_121a",
]
OLD_ABI_TARGETS = ["sm_80", "sm_86", "sm_90", "sm_90a", "sm_100a", "sm_120a"]


def _entry(path: str, data: bytes) -> tuple[TarEntry, bytes]:
    return TarEntry(path=path, kind="file", size=len(data), mode=0o644), data


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The program's kernel as a cubin per target, a PTX file and a fatbin, by nvcc 13.0."""
    root = CACHE / "nvcc-modules"
    done = root / ".done"
    if done.exists():
        return root
    compiler = nvcc(CUDA_13_0)
    root.mkdir(parents=True, exist_ok=True)
    source = root / "kernel.cu"
    source.write_text(PROGRAM_SOURCE)
    env = {**os.environ, "PATH": f"{compiler.parent}:{os.environ.get('PATH', '')}"}
    for target in NEW_ABI_TARGETS:
        subprocess.run(
            [str(compiler), "-cubin", f"-arch={target}", "-o", str(root / f"{target}.cubin"), str(source)],
            check=True,
            env=env,
            capture_output=True,
            timeout=300,
        )
    subprocess.run(
        [str(compiler), "-ptx", "-arch=compute_90a", "-o", str(root / "kernel.ptx"), str(source)],
        check=True,
        env=env,
        capture_output=True,
        timeout=300,
    )
    subprocess.run(
        [str(compiler), "-fatbin", "-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=compute_90",
         "-o", str(root / "kernel.fatbin"), str(source)],
        check=True, env=env, capture_output=True, timeout=300,
    )  # fmt: skip
    done.touch()
    return root


@pytest.fixture(scope="module")
def old_abi(built: Path) -> Path:
    """Cubins in CUDA 12's ELF ABI: CUDA 12.8's ptxas on PTX that nvcc 13.0 wrote for compute_80."""
    root = CACHE / "ptxas-12.8-modules"
    if (root / ".done").exists():
        return root
    root.mkdir(parents=True, exist_ok=True)
    ptxas = root / "ptxas"
    with zipfile.ZipFile(wheel_path(PTXAS_12_8)) as archive:
        ptxas.write_bytes(archive.read("nvidia/cuda_nvcc/bin/ptxas"))
    ptxas.chmod(0o755)
    compiler = nvcc(CUDA_13_0)
    source = built / "kernel.cu"
    ptx = root / "kernel.ptx"
    env = {**os.environ, "PATH": f"{compiler.parent}:{os.environ.get('PATH', '')}"}
    subprocess.run(
        [str(compiler), "-ptx", "-arch=compute_80", "-o", str(ptx), str(source)],
        check=True,
        env=env,
        capture_output=True,
        timeout=300,
    )
    ptx.write_text(ptx.read_text().replace(".version 9.0", ".version 8.7"))  # 12.8's ptxas reads up to 8.7
    for target in OLD_ABI_TARGETS:
        subprocess.run(
            [str(ptxas), f"-arch={target}", str(ptx), "-o", str(root / f"{target}.cubin")],
            check=True,
            capture_output=True,
            timeout=300,
        )
    (root / ".done").touch()
    return root


def _cuobjdump_arch(path: Path) -> str:
    sass, _ = cuobjdump_listing(path)
    (arch,) = sass
    return arch


@pytest.mark.parametrize("target", NEW_ABI_TARGETS)
def test_a_cubin_reads_as_cuobjdump_lists_it(built: Path, target: str) -> None:
    path = built / f"{target}.cubin"
    container = parse_cubin(path.read_bytes())
    assert container.sass == (_cuobjdump_arch(path),)  # sm_100f reads as sm_100, as cuobjdump has it
    assert container.kernels and container.section == "module file"


@pytest.mark.parametrize("target", OLD_ABI_TARGETS)
def test_a_cubin_of_cuda_12s_abi_reads_as_cuobjdump_lists_it(old_abi: Path, target: str) -> None:
    path = old_abi / f"{target}.cubin"
    data = path.read_bytes()
    assert data[7] == (
        0x33 if int(target[3:6].rstrip("af")) < 100 else 0x41
    )  # 12.8 writes Blackwell in the new ABI
    assert parse_cubin(data).sass == (_cuobjdump_arch(path),)


def test_ptx_and_fatbin_files(built: Path) -> None:
    ptx = parse_ptx_head((built / "kernel.ptx").read_bytes()[:8192])
    assert ptx.ptx == ("90a",) and ptx.ptx_isa == "9.0"
    data = (built / "kernel.fatbin").read_bytes()
    sink = ModuleSink("fatbin", len(data))
    sink.feed(memoryview(data))
    sink.close(complete=True)
    assert sink.error is None
    assert {a for c in sink.containers if c.kernels for a in c.sass} == {"80"}
    assert {a for c in sink.containers for a in c.ptx} == {"90"}
    assert cuobjdump_listing(built / "kernel.fatbin") == ({"80"}, {"90"})


def test_bad_module_files_are_findings_of_their_own(built: Path) -> None:
    with pytest.raises(ModuleError, match="not CUDA"):
        parse_cubin(cuobjdump().read_bytes()[:4096])  # an x86-64 program, not a cubin
    with pytest.raises(ModuleError, match=r"no \.target"):
        parse_ptx_head(b"// just a comment\n")
    big = ModuleSink("cubin", MAX_MODULE_FILE_BYTES + 1)
    assert (
        big.error is not None and "bound on module files" in big.error and big.feed(memoryview(b"x")) is False
    )
    layer = collect_layer(
        [
            _entry("/opt/app/kernels/good.cubin", (built / "sm_90.cubin").read_bytes()),
            _entry("/opt/app/kernels/bad.cubin", b"\x7fELF" + bytes(200)),
            _entry("/opt/app/kernels/odd.ptx", b"not ptx at all\n"),
        ]
    )
    found = layer.modules["/opt/app/kernels"]
    assert found.files == 3 and found.errors == 2 and found.containers[0].sass == ("90",)
    _, archs = combine([layer])
    assert archs is not None
    (modules,) = archs.files
    assert modules.kind == "modules" and modules.files == 3 and modules.error is None  # the good one counts
    assert gpu_code.judge(archs, (9, 0)).runs


def test_module_files_make_an_image_a_gpu_image_that_picks_its_kernels(built: Path) -> None:
    """Module files are kernels a package loads itself for the GPU at hand: they never block a GPU
    they lack, but they are GPU code, and the answer says what the image runs without."""
    cubins = [
        _entry(
            f"/usr/lib/python3/dist-packages/fastattn/cubins/{t}.cubin", (built / f"{t}.cubin").read_bytes()
        )
        for t in ("sm_100a", "sm_103a")
    ]
    inferred, archs = combine([collect_layer(cubins)])
    assert inferred is not None and archs is not None
    (package,) = archs.packages
    assert package.name == "fastattn" and package.optional
    hopper = gpu_code.judge(archs, (9, 0))
    assert hopper.runs and "fastattn runs without it" in hopper.without[0]
    assert gpu_code.judge(archs, (10, 3)).covered_by == [
        "/usr/lib/python3/dist-packages/fastattn/cubins/: SASS sm_103a"
    ]


def test_a_layer_tar_of_module_files_streams_through_the_walk(built: Path) -> None:
    from scanner.layers.cuda_evidence import CudaEntryCollector
    from scanner.layers.limits import AnalysisLimits, ScanBudget
    from scanner.layers.walk import LayerWalk

    data = tar_bytes([file(f"/k/{t}.cubin", (built / f"{t}.cubin").read_bytes()) for t in NEW_ABI_TARGETS])
    collector = CudaEntryCollector()
    walk = LayerWalk(
        "application/vnd.oci.image.layer.v1.tar", [collector], budget=ScanBudget(AnalysisLimits())
    )
    for start in range(0, len(data), 1000):  # small chunks: a cubin spans many
        walk.feed(data[start : start + 1000])
    walk.close()
    found = collector.finish(complete=True).modules["/k"]
    assert found.files == len(NEW_ABI_TARGETS) and found.errors == 0
    assert {c.sass[0] for c in found.containers} == {
        "75",
        "80",
        "90",
        "90a",
        "100",
        "100a",
        "103a",
        "120",
        "121a",
    }
