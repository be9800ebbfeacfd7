"""Real NVIDIA wheels for fatbin tests, downloaded at set-up and never committed (NVIDIA's licence).

`pip download --no-deps` into a cache under the repository (`/.cache/`, ignored by git) or
`$GPUBADGE_WHEEL_CACHE`; every file is checked against its pinned sha256 before use.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import threading
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import zstandard

from fixtures.cuda_program import PROGRAM_SOURCE

CACHE = Path(
    os.environ.get("GPUBADGE_WHEEL_CACHE", Path(__file__).resolve().parent.parent / ".cache" / "wheels")
)


@dataclass(frozen=True)
class PinnedWheel:
    requirement: str
    filename: str
    sha256: str
    platforms: tuple[str, ...] = ("manylinux2014_x86_64",)  # the tags pip download is told to accept


NVJPEG_CU12 = PinnedWheel(
    "nvidia-nvjpeg-cu12==12.4.0.76",
    "nvidia_nvjpeg_cu12-12.4.0.76-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl",
    "3888f10b32fbd58e80166c48e01073732d752fa5f167b7cb5b9615f1c6375a20",
)
NVJPEG_CU13 = PinnedWheel(
    "nvidia-nvjpeg==13.2.3.58",
    "nvidia_nvjpeg-13.2.3.58-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl",
    "552b30b11ac8e2bbfb18fd8de31e48756188ebf9b84a8c342a88f07f81a6cdf1",
)
# The GPU libraries torch 2.7.0 pins (its METADATA's Requires-Dist), as PyPI serves them.
CUSPARSELT_CU12 = PinnedWheel(
    "nvidia-cusparselt-cu12==0.6.3",
    "nvidia_cusparselt_cu12-0.6.3-py3-none-manylinux2014_x86_64.whl",
    "e5c8a26c36445dd2e6812f1177978a24e2d37cacce7e090f297a688d1ec44f46",
)
NCCL_CU12 = PinnedWheel(
    "nvidia-nccl-cu12==2.26.2",
    "nvidia_nccl_cu12-2.26.2-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl",
    "694cf3879a206553cc9d7dbda76b13efaf610fdb70a50cba303de1b0d1530ac6",
)
CURAND_CU12 = PinnedWheel(
    "nvidia-curand-cu12==10.3.9.90",
    "nvidia_curand_cu12-10.3.9.90-py3-none-manylinux_2_27_x86_64.whl",
    "b32331d4f4df5d6eefa0554c565b626c7216f87a06a4f56fab27c3b68a830ec9",
    ("manylinux_2_27_x86_64",),
)
# CUDA 13's runtime wheel (what torch cu130 installs).
CUDA_RUNTIME_13 = PinnedWheel(
    "nvidia-cuda-runtime==13.0.96",
    "nvidia_cuda_runtime-13.0.96-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl",
    "7f82250d7782aa23b6cfe765ecc7db554bd3c2870c43f3d1821f1d18aebf0548",
)
# A real library whose kernels stop before Blackwell and carry no PTX, as torch 2.5.1's libtorch_cuda.so
# (cuobjdump: 4 containers of SASS sm_80, sm_86, sm_90, no PTX), in a 4 MB wheel instead of 906 MB.
TORCHAO_070 = PinnedWheel(
    "torchao==0.7.0",
    "torchao-0.7.0-cp311-cp311-manylinux_2_17_x86_64.manylinux2014_x86_64.manylinux_2_28_x86_64.whl",
    "8b0bfda3c7d9ab797eb6f419bc160e55d2b378da1dbb4565e8dc84999be190d3",
    ("manylinux_2_28_x86_64", "manylinux2014_x86_64"),
)
# CUDA 13.0's compiler as PyPI serves it (what `pip install nvidia-cuda-nvcc` gives): tests build real
# programs for chosen targets with it, at set-up, into the cache (`nvcc_program`).
NVCC_13 = PinnedWheel(
    "nvidia-cuda-nvcc==13.0.88",
    "nvidia_cuda_nvcc-13.0.88-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl",
    "56fe502eb77625a12f25172caa3cdddb4e4c8ba2c8c17dba44b164761b380f03",
)
NVVM_13 = PinnedWheel(
    "nvidia-nvvm==13.0.88",
    "nvidia_nvvm-13.0.88-py3-none-manylinux2010_x86_64.manylinux_2_12_x86_64.whl",
    "c5f41ffeb6466944a026dfa5317d7d85355c119bbec279205d22f1869d1054e0",
    ("manylinux2010_x86_64", "manylinux_2_12_x86_64"),
)
CRT_13 = PinnedWheel(
    "nvidia-cuda-crt==13.0.88",
    "nvidia_cuda_crt-13.0.88-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl",
    "2c8043c7c9e02492716426e9919fc78d2c5b3b2a7a768a88e952676b08aa55a4",
)
CUOBJDUMP = PinnedWheel(
    "nvidia-cuda-cuobjdump==13.5.37",
    "nvidia_cuda_cuobjdump-13.5.37-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl",
    "38780fee50863252a0b8926357faa91615ca1c8346490563f33a06100cd73f58",
)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def wheel_path(wheel: PinnedWheel) -> Path:
    """The verified wheel file, downloaded from PyPI on first use."""
    CACHE.mkdir(parents=True, exist_ok=True)
    path = CACHE / wheel.filename
    if not path.exists() or _sha256(path) != wheel.sha256:
        path.unlink(missing_ok=True)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--only-binary=:all:",
                *(arg for platform in wheel.platforms for arg in ("--platform", platform)),
                "--python-version",
                "3.11",
                "--dest",
                str(CACHE),
                wheel.requirement,
            ],
            check=True,
            capture_output=True,
            timeout=300,
        )
    actual = _sha256(path)
    if actual != wheel.sha256:
        path.unlink(missing_ok=True)
        raise RuntimeError(f"{wheel.filename}: sha256 {actual} is not the pinned {wheel.sha256}")
    return path


def wheel_members(wheel: PinnedWheel) -> dict[str, bytes]:
    """Every file of the wheel by its path inside the wheel."""
    with zipfile.ZipFile(wheel_path(wheel)) as archive:
        return {info.filename: archive.read(info) for info in archive.infolist() if not info.is_dir()}


def wheel_member(wheel: PinnedWheel, suffix: str) -> tuple[str, bytes]:
    """(path, bytes) of the one member of the wheel whose path ends with `suffix`."""
    with zipfile.ZipFile(wheel_path(wheel)) as archive:
        names = [info.filename for info in archive.infolist() if info.filename.endswith(suffix)]
        if len(names) != 1:
            raise RuntimeError(f"{wheel.filename}: {len(names)} members end with {suffix!r}")
        return names[0], archive.read(names[0])


def cuobjdump() -> Path:
    """NVIDIA's cuobjdump (from the pinned nvidia-cuda-cuobjdump wheel), unpacked into the cache."""
    target = CACHE / "cuobjdump-13.5.37" / "cuobjdump"
    if not target.exists():
        _, data = wheel_member(CUOBJDUMP, "/bin/cuobjdump")
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(".partial")
        partial.write_bytes(data)
        partial.chmod(0o755)
        partial.replace(target)
    return target


def nvcc() -> Path:
    """CUDA 13.0's nvcc, unpacked with what it needs (NVVM, the CRT headers, the runtime's headers and
    libcudart) from the pinned wheels into one tree in the cache, as `pip install` lays them out."""
    root = CACHE / "nvcc-13.0.88"
    target = root / "nvidia" / "cu13" / "bin" / "nvcc"
    with _UNPACKING:
        if not target.exists():
            _unpack_nvcc(root)
    return target


_UNPACKING = threading.Lock()  # programs are built from several threads; the tree is unpacked once


def _unpack_nvcc(root: Path) -> None:
    partial = root.parent / f"{root.name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    for wheel in (NVCC_13, NVVM_13, CRT_13, CUDA_RUNTIME_13):
        with zipfile.ZipFile(wheel_path(wheel)) as archive:
            archive.extractall(partial)
    tree = partial / "nvidia" / "cu13"
    for tool in [*(tree / "bin").iterdir(), *(tree / "nvvm" / "bin").iterdir()]:
        if tool.is_file():
            tool.chmod(0o755)
    (tree / "lib" / "libcudart.so").symlink_to("libcudart.so.13")  # what `-lcudart` links
    partial.replace(root)


def nvcc_program(gencodes: Sequence[str]) -> Path:
    """`PROGRAM_SOURCE` (one kernel, launched once) built by CUDA 13.0's nvcc for `gencodes` (each an
    `arch=compute_XY,code=sm_XY` of nvcc's -gencode), linked to the shared libcudart.so.13; cached by
    source and targets. bench/gpu_host_check.py runs the same program on a real GPU."""
    key = hashlib.sha256("\n".join([PROGRAM_SOURCE, *gencodes]).encode()).hexdigest()[:16]
    target = CACHE / "nvcc-13.0.88-programs" / f"program-{key}"
    if not target.exists():
        compiler = nvcc()
        target.parent.mkdir(parents=True, exist_ok=True)
        source = target.with_suffix(".cu")
        source.write_text(PROGRAM_SOURCE)
        partial = target.with_suffix(".partial")
        command = [str(compiler), "-O2", "-cudart", "shared", f"-L{compiler.parent.parent / 'lib'}"]
        for gencode in gencodes:
            command += ["-gencode", gencode]
        subprocess.run(
            [*command, "-o", str(partial), str(source)],
            check=True,
            capture_output=True,
            timeout=300,
            env={**os.environ, "PATH": f"{compiler.parent}:{os.environ.get('PATH', '')}"},
        )
        partial.replace(target)
    return target


def cached_layer(name: str, wheels: Sequence[PinnedWheel], build: Callable[[], bytes]) -> tuple[bytes, str]:
    """(zstd blob, diff_id) of a layer made of real wheels' files, built by `build()` (its tar) once and
    cached beside the wheels, keyed by `name` and the wheels' pinned digests: big layers of NVIDIA's
    libraries cost their inflate and compression once per machine, not once per test run."""
    key = hashlib.sha256("\n".join([name, *(w.sha256 for w in wheels)]).encode()).hexdigest()[:16]
    blob_path = CACHE / "layers" / f"{name}-{key}.tar.zst"
    diff_path = blob_path.with_suffix(".diffid")
    if not (blob_path.exists() and diff_path.exists()):
        raw = build()
        blob_path.parent.mkdir(parents=True, exist_ok=True)
        partial = blob_path.with_suffix(".partial")
        partial.write_bytes(zstandard.ZstdCompressor(level=3).compress(raw))
        diff_path.write_text("sha256:" + hashlib.sha256(raw).hexdigest())
        partial.replace(blob_path)
    return blob_path.read_bytes(), diff_path.read_text()
