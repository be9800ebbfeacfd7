"""Real NVIDIA wheels for fatbin tests, downloaded at set-up and never committed (NVIDIA's licence).

`pip download --no-deps` into a cache outside the repository (`$GPUBADGE_CACHE/test-wheels`, default
~/.cache/gpubadge/test-wheels), or `$GPUBADGE_WHEEL_CACHE`; every file is checked against its pinned sha256
before use.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import threading
import zipfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import zstandard

from fixtures.cuda_program import PROGRAM_SOURCE

# Outside the clone, beside the image's wheelhouse (Makefile: $GPUBADGE_CACHE), so every clone on a
# machine shares one copy (about 10 GB): a fresh clone's suite would otherwise fetch, hash and build it
# all again while its tests run. Each entry is checked against its pinned sha256 before use.
CACHE = Path(
    os.environ.get("GPUBADGE_WHEEL_CACHE")
    or Path(os.environ.get("GPUBADGE_CACHE") or Path.home() / ".cache" / "gpubadge") / "test-wheels"
)


@contextlib.contextmanager
def cache_lock(name: str) -> Iterator[None]:
    """Hold the cache entry `name` alone, across threads and processes (`tests/prefetch.py` fills the
    cache beside the suite): an flock on its own lock file, so one download or build is never made
    twice, and a holder that dies releases it."""
    locks = CACHE / ".locks"
    locks.mkdir(parents=True, exist_ok=True)
    with (locks / f"{name}.lock").open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


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
# CUDA 12.4's runtime (libcudart.so.12), what an nvidia/cuda:12.4 base carries for its programs to link.
CUDA_RUNTIME_12_4 = PinnedWheel(
    "nvidia-cuda-runtime-cu12==12.4.127",
    "nvidia_cuda_runtime_cu12-12.4.127-py3-none-manylinux2014_x86_64.whl",
    "64403288fa2136ee8e467cdc9c9427e0434110899d07c779f25b5c068934faa5",
)
# A real library whose kernels stop before Blackwell and carry no PTX, as torch 2.5.1's libtorch_cuda.so
# (cuobjdump: 4 containers of SASS sm_80, sm_86, sm_90, no PTX), in a 4 MB wheel instead of 906 MB.
TORCHAO_070 = PinnedWheel(
    "torchao==0.7.0",
    "torchao-0.7.0-cp311-cp311-manylinux_2_17_x86_64.manylinux2014_x86_64.manylinux_2_28_x86_64.whl",
    "8b0bfda3c7d9ab797eb6f419bc160e55d2b378da1dbb4565e8dc84999be190d3",
    ("manylinux_2_28_x86_64", "manylinux2014_x86_64"),
)
CUOBJDUMP = PinnedWheel(
    "nvidia-cuda-cuobjdump==13.5.37",
    "nvidia_cuda_cuobjdump-13.5.37-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl",
    "38780fee50863252a0b8926357faa91615ca1c8346490563f33a06100cd73f58",
)

# CUDA 12.8's compiler wheel holds ptxas alone: enough to write cubins in CUDA 12's ELF ABI.
PTXAS_12_8 = PinnedWheel(
    "nvidia-cuda-nvcc-cu12==12.8.93",
    "nvidia_cuda_nvcc_cu12-12.8.93-py3-none-manylinux2010_x86_64.manylinux_2_12_x86_64.whl",
    "2d6dc36fb7cb5ac9c0b8825bc13d193c35487a315664007287d0126531238011",
    ("manylinux2010_x86_64", "manylinux_2_12_x86_64"),
)


@dataclass(frozen=True)
class Toolkit:
    """CUDA's compiler as PyPI serves it (`pip install nvidia-cuda-nvcc` and what it needs: NVVM, the
    CRT headers, the runtime's headers and libcudart), pinned: tests build real programs with it at
    set-up, into the cache (`nvcc_program`)."""

    version: str
    wheels: tuple[PinnedWheel, ...]


def _toolkit(version: str, digests: dict[str, str], *also: PinnedWheel) -> Toolkit:
    tags = {
        "nvidia-nvvm": (
            "manylinux2010_x86_64.manylinux_2_12_x86_64",
            ("manylinux2010_x86_64", "manylinux_2_12_x86_64"),
        ),
    }
    wheels = []
    for name, digest in digests.items():
        tag, platforms = tags.get(
            name, ("manylinux2014_x86_64.manylinux_2_17_x86_64", ("manylinux2014_x86_64",))
        )
        filename = f"{name.replace('-', '_')}-{version}-py3-none-{tag}.whl"
        wheels.append(PinnedWheel(f"{name}=={version}", filename, digest, platforms))
    return Toolkit(version, (*wheels, *also))


# CUDA 13.0 (the toolkit of a GPU host with driver 580), and 13.5, newer than that driver: its PTX (ISA
# 9.5) cannot be JIT-compiled there, its SASS and runtime run there (minor-version compatibility).
CUDA_13_0 = _toolkit(
    "13.0.88",
    {
        "nvidia-cuda-nvcc": "56fe502eb77625a12f25172caa3cdddb4e4c8ba2c8c17dba44b164761b380f03",
        "nvidia-nvvm": "c5f41ffeb6466944a026dfa5317d7d85355c119bbec279205d22f1869d1054e0",
        "nvidia-cuda-crt": "2c8043c7c9e02492716426e9919fc78d2c5b3b2a7a768a88e952676b08aa55a4",
    },
    CUDA_RUNTIME_13,  # its runtime: 13.0.96
)
CUDA_13_5 = _toolkit(
    "13.5.37",
    {
        "nvidia-cuda-nvcc": "f5c4f7ead5d964fb4af42bbf1e6d3ec3c1e6e9d83b53749f691d387e7fcaa3a7",
        "nvidia-nvvm": "c41bfa362e407405163f103c2229f0765f8cc2ed7d148b754dc77f228bf7e070",
        "nvidia-cuda-crt": "e898b7f73d3035fa89915a3f7bf3b54a73e90249746111aed295822c4729bb29",
        "nvidia-cuda-runtime": "df2b79a8852f10d1fef8c848489c49eebb5754051bf870202a862831412b179d",
    },
)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def wheel_path(wheel: PinnedWheel) -> Path:
    """The verified wheel file, downloaded from PyPI on first use."""
    with cache_lock(wheel.filename):
        return _wheel_path(wheel)


def _wheel_path(wheel: PinnedWheel) -> Path:
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


def nvcc(toolkit: Toolkit = CUDA_13_0) -> Path:
    """The toolkit's nvcc, its wheels unpacked into one tree in the cache, as `pip install` lays them out."""
    root = CACHE / f"nvcc-{toolkit.version}"
    target = root / "nvidia" / "cu13" / "bin" / "nvcc"
    with _UNPACKING, cache_lock(root.name):
        if not target.exists():
            _unpack(toolkit, root)
    return target


_UNPACKING = threading.Lock()  # programs are built from several threads; a tree is unpacked once


def _unpack(toolkit: Toolkit, root: Path) -> None:
    partial = root.parent / f"{root.name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    for wheel in toolkit.wheels:
        with zipfile.ZipFile(wheel_path(wheel)) as archive:
            archive.extractall(partial)
    tree = partial / "nvidia" / "cu13"
    for tool in [*(tree / "bin").iterdir(), *(tree / "nvvm" / "bin").iterdir()]:
        if tool.is_file():
            tool.chmod(0o755)
    (tree / "lib" / "libcudart.so").symlink_to("libcudart.so.13")  # what `-lcudart` links
    partial.replace(root)


def toolkit_runtime(toolkit: Toolkit = CUDA_13_0) -> Path:
    """The toolkit's libcudart.so.13: what its programs load."""
    return nvcc(toolkit).parent.parent / "lib" / "libcudart.so.13"


def nvcc_program(gencodes: Sequence[str], toolkit: Toolkit = CUDA_13_0) -> Path:
    """`PROGRAM_SOURCE` (one kernel, launched once) built by the toolkit's nvcc for `gencodes` (each an
    `arch=compute_XY,code=sm_XY` of nvcc's -gencode), linked to the shared libcudart.so.13; cached by
    toolkit, source and targets. bench/gpu_host_check.py runs the same program on a real GPU."""
    key = hashlib.sha256("\n".join([toolkit.version, PROGRAM_SOURCE, *gencodes]).encode()).hexdigest()[:16]
    target = CACHE / "nvcc-programs" / f"program-{key}"
    if not target.exists():
        compiler = nvcc(toolkit)
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


def cuobjdump_listing(path: Path) -> tuple[set[str], set[str]]:
    """(SASS, PTX) archs of a file as `cuobjdump --list-elf --list-ptx` names them ("80", "90a")."""
    listing = subprocess.run(
        [str(cuobjdump()), "--list-elf", "--list-ptx", str(path)], capture_output=True, text=True, timeout=60
    ).stdout
    lines = listing.splitlines()
    sass = {line.rsplit(".sm_", 1)[1].removesuffix(".cubin") for line in lines if ".cubin" in line}
    ptx = {line.rsplit(".sm_", 1)[1].removesuffix(".ptx") for line in lines if ".ptx" in line}
    return sass, ptx


def cached_layer(name: str, wheels: Sequence[PinnedWheel], build: Callable[[], bytes]) -> tuple[bytes, str]:
    """(zstd blob, diff_id) of a layer made of real wheels' files, built by `build()` (its tar) once and
    cached beside the wheels, keyed by `name` and the wheels' pinned digests: big layers of NVIDIA's
    libraries cost their inflate and compression once per machine, not once per test run."""
    key = hashlib.sha256("\n".join([name, *(w.sha256 for w in wheels)]).encode()).hexdigest()[:16]
    blob_path = CACHE / "layers" / f"{name}-{key}.tar.zst"
    diff_path = blob_path.with_suffix(".diffid")
    with cache_lock(f"layer-{name}-{key}"):
        if not (blob_path.exists() and diff_path.exists()):
            raw = build()
            blob_path.parent.mkdir(parents=True, exist_ok=True)
            partial = blob_path.with_suffix(".partial")
            partial.write_bytes(zstandard.ZstdCompressor(level=3).compress(raw))
            diff_path.write_text("sha256:" + hashlib.sha256(raw).hexdigest())
            partial.replace(blob_path)
        return blob_path.read_bytes(), diff_path.read_text()
