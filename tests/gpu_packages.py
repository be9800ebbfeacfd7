"""Real GPU packages from PyPI, laid out as `pip install` lays them out, for placement's ground truth.

Each package layer is the members of pinned wheels that matter to where the image runs (the
libraries with GPU code or CUDA links, the Python sources that load them, the dist-info RECORD that
names the distribution, standalone module files), read from PyPI with range requests
(`tests/pypi_members.py`) and cached, never committed. A layer is streamed as a tar through the
scanner's own layer walk (`scanner.layers.walk.LayerWalk` with the CUDA collector, as an analysis
process runs it), and its evidence is cached on disk keyed by the pins, the members and the source of
`scanner/layers/`, so a change to the scanner reads the layers again.

What each package's own dispatch does, from its source and bytes (see also
../shared/reference/gpu_package_dispatch.md):
* vLLM 0.33.0 imports `vllm._C_stable_libtorch` at the top of `platforms/cuda.py`, the rest
  (FlashAttention 2 and 3, FlashMLA, QuTLASS, DeepSelect) under a `try:`/`suppress(ImportError)`, and
  picks kernels by compute capability; it pins torch 2.14.0 (cu130), whose pins bring CUDA 13.0's
  libraries (cuda-toolkit 13.0.3: cuBLAS 13.1.1.3, ...; cuDNN 9.24, NCCL 2.30.7, cuSPARSELt 0.8.1).
* bitsandbytes 0.50.2 loads one `libbitsandbytes_cudaXYZ.so`, picked by `torch.version.cuda`
  (`cextension.py`); beside torch 2.10.0+cu128 and CUDA 12.8's runtime it loads `_cuda128`.
* ONNX Runtime GPU 1.31.1 (CUDA 13) loads `libonnxruntime_providers_cuda.so` from its C++ core; its
  `[cuda,cudnn]` extras and cuBLAS bring the libraries it links.
* TensorFlow 2.21.0 (CUDA 12.5.1) dlopens its CUDA libraries and loads the fatbins of its generated
  kernels (`.rodata` of `libtensorflow_cc.so.2`) itself through `cuModuleLoadData`.
* FlashInfer 0.7.4 JIT-compiles CUDA sources and loads flashinfer-cubin 0.6.13's prebuilt `.cubin`
  files (sm_100f, sm_100a, sm_103a) and its own `.ptx` files (sm_103a) through the module API.
* torchao 0.18.0 globs its `_C*.so` files in a `try:` and loads each with `torch.ops.load_library` in
  a `try:` of its own (`__init__.py`): `_C_cutlass_90a.abi3.so` (sm_90a only) and `_C_mxfp8...so`
  (sm_100, PTX compute_120) are accelerators; the rest of torchao is Python and Triton.
* sglang-kernel 0.4.10 (CUDA 13, torch 2.14) loads `sm90/common_ops.abi3.so` on compute capability
  9.0 and `sm100/common_ops.abi3.so` on every other GPU, by path, at the top of `sgl_kernel/__init__.py`
  (`load_utils._load_architecture_specific_ops`): both built for sm_80, sm_89, sm_90, sm_90a,
  sm_100f and sm_120a, no PTX. FlashMLA (sm_90a, sm_100f, sm_103a) loads in a `try:`. Its
  FlashAttention 3 library (`flash_ops.abi3.so`, 1.1 GB) is left out of the layer.
"""

from __future__ import annotations

import hashlib
import json
import re
import tarfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from scanner.layers.cuda_evidence import CUDA_EVIDENCE_SCHEMA, CudaEntryCollector, CudaLayerEvidence
from scanner.layers.limits import AnalysisLimits, ScanBudget
from scanner.layers.walk import LayerWalk
from tests.nvidia_wheels import CACHE, cache_lock
from tests.pypi_members import RemoteWheel, member_files

SITE = "/usr/local/lib/python3.11/site-packages"
RAW_TAR = "application/vnd.oci.image.layer.v1.tar"
_CHUNK = 4 << 20
_SCANNER_LAYERS = Path(__file__).resolve().parent.parent / "scanner" / "layers"


def _wheel(project: str, filename: str, sha256: str) -> RemoteWheel:
    return RemoteWheel(project, filename, sha256)


VLLM = _wheel(
    "vllm",
    "vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl",
    "4b6bdec4ab269990bf70d45a3c1e94c3760a27064513760193b26d6f0da883aa",
)
TORCH_214 = _wheel(
    "torch",
    "torch-2.14.0-cp311-cp311-manylinux_2_28_x86_64.whl",
    "8d9e232b6376c62f3090237889fb1cb6887c0ece9f73e6c1052e80fc1481f999",
)
TORCH_210 = _wheel(
    "torch",
    "torch-2.10.0-cp311-cp311-manylinux_2_28_x86_64.whl",
    "a2f9edd8dbc99f62bc4dfb78af7bf89499bca3d753423ac1b4e06592e467b763",
)
BITSANDBYTES = _wheel(
    "bitsandbytes",
    "bitsandbytes-0.50.2-py3-none-manylinux_2_24_x86_64.whl",
    "55348a9a4a21bfd99cf8c7b32fe67b4030ae5c2a05738e03c1747f65fa6ec283",
)
ONNXRUNTIME = _wheel(
    "onnxruntime-gpu",
    "onnxruntime_gpu-1.31.1-cp311-cp311-manylinux_2_28_x86_64.whl",
    "e26c475fe361b2015f45b4b824bd13f0bb20204e59b62814e6f0acd5f3d491a6",
)
TENSORFLOW = _wheel(
    "tensorflow",
    "tensorflow-2.21.0-cp311-cp311-manylinux_2_27_x86_64.whl",
    "9056fbc9ba04235810b71ae6cbd958a196e8804fb53bbcffbf3e23b56155f124",
)
FLASHINFER = _wheel(
    "flashinfer-python",
    "flashinfer_python-0.7.4-py3-none-any.whl",
    "a051a62e09a2738e8b0de47a1944fd2f0f3eff01b728b662141ea660cb09dd32",
)
FLASHINFER_070 = _wheel(
    "flashinfer-python",
    "flashinfer_python-0.7.0.post1-py3-none-any.whl",
    "c7adf826568d61fc1b7d3aadd4cae387a35a138bfc08e2deca2f34ecfa280716",
)
FLASHINFER_050 = _wheel(
    "flashinfer-python",
    "flashinfer_python-0.5.0-py3-none-any.whl",
    "f02f13c616482617e7bee0031e5777a3328989a0b1842496ce273086f6a5aeab",
)
FLASHINFER_041 = _wheel(  # no wheel on PyPI: its source distribution
    "flashinfer-python",
    "flashinfer_python-0.4.1.tar.gz",
    "fd120f05139d2c75b09c039009eec58ad1278c95bcf16466b90d480042b13a39",
)
VLLM_0210 = _wheel(
    "vllm",
    "vllm-0.21.0-cp38-abi3-manylinux_2_24_x86_64.whl",
    "b241b085742cf04a68c82c089d12afe4d9ee729e0c7f81b2b2b9961d36105ee5",
)
VLLM_0202 = _wheel(
    "vllm",
    "vllm-0.20.2-cp38-abi3-manylinux_2_35_x86_64.whl",
    "22a7dd06eb03371298e13d6100f3dedbf307352342aaf08e87c929c60aae9b4d",
)
VLLM_0110 = _wheel(
    "vllm",
    "vllm-0.11.0-cp38-abi3-manylinux1_x86_64.whl",
    "3861c75ff2b12e24f6d179ff5c084d791b42ded8675d76c8706697c79f68cd62",
)
FLASHINFER_CUBIN = _wheel(
    "flashinfer-cubin",
    "flashinfer_cubin-0.6.13-py3-none-any.whl",
    "41e4848c2d09d220e8394489b2fb6cfec6b6ad09f897b5ab8b39fc23055f6c24",
)
TORCHAO_018 = _wheel(
    "torchao",
    "torchao-0.18.0-cp310-abi3-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl",
    "6540b148e40ba81cbd4de86392225a076a1591146e9cebb099b3b234ba9feebe",
)
SGLANG_KERNEL = _wheel(
    "sglang-kernel",
    "sglang_kernel-0.4.10-cp310-abi3-manylinux2014_x86_64.whl",
    "043cbe4a10e7887ea1b25599b729ff1ce115a0d5217b2c177aff9f9ae5327724",
)
SGLANG = _wheel(  # pure Python: its Triton kernels are built on the GPU at hand
    "sglang",
    "sglang-0.5.9-py3-none-any.whl",
    "8a936c4d25fea605f44254e533cff2144c73ceffbc1f8738aba393461bbb64d1",
)
SGLANG_040 = _wheel(
    "sglang",
    "sglang-0.4.0-py3-none-any.whl",
    "f0ae1c466f2480baec034decf8676c46e30beb900e018184fa6076da920391db",
)
SGLANG_036 = _wheel(
    "sglang",
    "sglang-0.3.6-py3-none-any.whl",
    "00b98a4d81d7a0773faaafc6b8bf997e52c539ddf0ca7f2ad15133d5feb62740",
)
SGLANG_035 = _wheel(
    "sglang",
    "sglang-0.3.5.post2-py3-none-any.whl",
    "c5bb8bf4c5718f7097a30900d389e3a817360a6862508f8cd506654ca9aba106",
)
SGLANG_0511 = _wheel(  # from 0.5.11 a wheel per platform (its Rust parts), its kernels still JIT sources
    "sglang",
    "sglang-0.5.11-cp310-cp310-manylinux_2_34_x86_64.whl",
    "a0a1b9db9b03c2b4176257dfb2ac58b878db5b8a551828c641c672b8f9ee9147",
)
SGLANG_0510 = _wheel(
    "sglang",
    "sglang-0.5.10-py3-none-any.whl",
    "ac8855a5d57dac8831fee526bca5212f1ae451f378e2ab08b3baecbc4deb4076",
)
TVM_FFI = _wheel(
    "apache-tvm-ffi",
    "apache_tvm_ffi-0.1.9-cp310-cp310-manylinux2014_x86_64.manylinux_2_17_x86_64.whl",
    "7f6bc8846d570b8ce38692fc91b530b44cd6ae092c805a844da23970e81b12c0",
)
EXLLAMAV2 = _wheel(  # CUDA sources, no built extension: it builds one with torch when imported
    "exllamav2",
    "exllamav2-0.3.2-py3-none-any.whl",
    "7cd61ae4bf1d8d12034595ab9731f0f43bac415d6394fbb273d4383293d6079e",
)
EXLLAMAV3 = _wheel(
    "exllamav3",
    "exllamav3-1.6.5-py3-none-any.whl",
    "550c0d04c755f249840e5c1edc26b0e80c7342c33b5d99ad17479abb407e8ded",
)
MAMBA_SSM = _wheel(  # no wheel on PyPI: its source distribution, as a build from source installs it
    "mamba-ssm",
    "mamba_ssm-2.3.1.tar.gz",
    "4d529477ad94753962216d583fc8f1c127c717b7d7c875d6bbb9376366d0d761",
)
MAMBA_SSM_101 = _wheel(
    "mamba-ssm",
    "mamba_ssm-1.0.1.tar.gz",
    "809970f3187378c2546e8c9492a52149fd31b8de650e21a40394536df527de93",
)
UNSLOTH = _wheel(
    "unsloth",
    "unsloth-2025.11.1-py3-none-any.whl",
    "67ab663e4f89817647ee343bffb400eeca3a1725470bbfc1509ef2c42ef0f418",
)
GPU4PYSCF = _wheel(
    "gpu4pyscf-cuda12x",
    "gpu4pyscf_cuda12x-1.9.0-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl",
    "8b79e3a68be8b7fedf371f8d6d402ab3577012b4f611c4c4a58599b2409f5f26",
)
PYNVVIDEOCODEC = _wheel(
    "pynvvideocodec",
    "pynvvideocodec-2.2.4-cp311-cp311-manylinux_2_28_x86_64.whl",
    "fa19da4df068341863c651ae72c1a29557bfd3b68f2e8297ccbce7c391d148d6",
)
# bitsandbytes 0.43.3: builds for CUDA 11.7 to 12.5 by CUDA's own toolkits of those versions, loaded
# only for torch's exact CUDA version; cuobjdump 13.5 stops at the fifth cubin of its CUDA 12.0-12.2
# builds ("Invalid ELF"), so its ground truth is cuobjdump 12.4, as triton 3.1.0's wheel ships it.
BITSANDBYTES_043 = _wheel(
    "bitsandbytes",
    "bitsandbytes-0.43.3-py3-none-manylinux_2_24_x86_64.whl",
    "cc99507c352be0715098b2c7577b690dd158972dc4ea10c7495bac104c7c79f0",
)
# vLLM 0.6.1 and the FlashAttention package it pins (sources only: how its imports chain)
VLLM_061 = _wheel(
    "vllm",
    "vllm-0.6.1-cp38-abi3-manylinux1_x86_64.whl",
    "aa93a20d9ba9fa21f0c72d28d225a1b97485a81ab539f1da9226e303736248d3",
)
VLLM_FLASH_ATTN_261 = _wheel(
    "vllm-flash-attn",
    "vllm_flash_attn-2.6.1-cp311-cp311-manylinux1_x86_64.whl",
    "2ce0a1ca09bc07dca4b59a56f0db98f5f6a93f8392377fbfd2979e639bc91e88",
)
VLLM_055 = _wheel(
    "vllm",
    "vllm-0.5.5-cp38-abi3-manylinux1_x86_64.whl",
    "64fb5b8a3300af3006a3b9ba4eacdf5f4bd2a85887a695e6587684447c49eb8e",
)
VLLM_085 = _wheel(
    "vllm",
    "vllm-0.8.5-cp38-abi3-manylinux1_x86_64.whl",
    "74bfe92953bee1269c1e1c27827bc156777751cdd6a3457ee8e27dd8ebf1e247",
)
CUDA_CCCL = _wheel(
    "cuda-cccl",
    "cuda_cccl-1.2.1-cp311-cp311-manylinux_2_26_x86_64.whl",
    "c1b8293c1b9dedbc0b3877c1fbb8265db293c7945371791a3dc69ca99db4a541",
)
TRITON_31 = _wheel(
    "triton",
    "triton-3.1.0-cp311-cp311-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
    "0f34f6e7885d1bf0eaaf7ba875a5f0ce6f3c13ba98f9503651c1e6dc6757ed5c",
)
# Triton as torch 2.8.0 and 2.9.0 pin it (ptxas of CUDA 12.8) and as torch 2.14.0 does (ptxas of CUDA
# 12.9 below compute capability 9.0, `ptxas-blackwell` of CUDA 13.4 from 9.0 on).
TRITON_34 = _wheel(
    "triton",
    "triton-3.4.0-cp311-cp311-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl",
    "7b70f5e6a41e52e48cfc087436c8a28c17ff98db369447bcaff3b887a3ab4467",
)
CUDA13_NVCC = _wheel(  # CUDA 13.0's compiler, whose ptxas `TRITON_PTXAS_PATH` may name
    "nvidia-cuda-nvcc",
    "nvidia_cuda_nvcc-13.0.88-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl",
    "56fe502eb77625a12f25172caa3cdddb4e4c8ba2c8c17dba44b164761b380f03",
)
TRITON_39 = _wheel(
    "triton",
    "triton-3.9.0-cp311-cp311-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl",
    "1622118a038b0c6e16fa4a0305da62c8b3c15904ee1cc4d4e65846a25969e41e",
)
# CUDA 13.0's libraries as torch 2.14.0 pins them (cuda-toolkit 13.0.3's extras and its own pins).
CUDA13 = {
    "cudart": _wheel(
        "nvidia-cuda-runtime",
        "nvidia_cuda_runtime-13.0.96-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl",
        "7f82250d7782aa23b6cfe765ecc7db554bd3c2870c43f3d1821f1d18aebf0548",
    ),
    "cublas": _wheel(
        "nvidia-cublas",
        "nvidia_cublas-13.1.1.3-py3-none-manylinux_2_27_x86_64.whl",
        "37936a16db8fe4ac1f065c2139360608a543a09275cb1a1af612e08cfa065436",
    ),
    "nvrtc": _wheel(
        "nvidia-cuda-nvrtc",
        "nvidia_cuda_nvrtc-13.0.88-py3-none-manylinux2010_x86_64.manylinux_2_12_x86_64.whl",
        "ad9b6d2ead2435f11cbb6868809d2adeeee302e9bb94bcf0539c7a40d80e8575",
    ),
    "cufft": _wheel(
        "nvidia-cufft",
        "nvidia_cufft-12.0.0.61-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl",
        "6c44f692dce8fd5ffd3e3df134b6cdb9c2f72d99cf40b62c32dde45eea9ddad3",
    ),
    "cufile": _wheel(
        "nvidia-cufile",
        "nvidia_cufile-1.15.1.6-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl",
        "08a3ecefae5a01c7f5117351c64f17c7c62efa5fffdbe24fc7d298da19cd0b44",
    ),
    "cupti": _wheel(
        "nvidia-cuda-cupti",
        "nvidia_cuda_cupti-13.0.85-py3-none-manylinux_2_25_x86_64.whl",
        "4eb01c08e859bf924d222250d2e8f8b8ff6d3db4721288cf35d14252a4d933c8",
    ),
    "curand": _wheel(
        "nvidia-curand",
        "nvidia_curand-10.4.0.35-py3-none-manylinux_2_27_x86_64.whl",
        "1aee33a5da6e1db083fe2b90082def8915f30f3248d5896bcec36a579d941bfc",
    ),
    "cusolver": _wheel(
        "nvidia-cusolver",
        "nvidia_cusolver-12.0.4.66-py3-none-manylinux_2_27_x86_64.whl",
        "0a759da5dea5c0ea10fd307de75cdeb59e7ea4fcb8add0924859b944babf1112",
    ),
    "cusparse": _wheel(
        "nvidia-cusparse",
        "nvidia_cusparse-12.6.3.3-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl",
        "2b3c89c88d01ee0e477cb7f82ef60a11a4bcd57b6b87c33f789350b59759360b",
    ),
    "nvjitlink": _wheel(
        "nvidia-nvjitlink",
        "nvidia_nvjitlink-13.0.88-py3-none-manylinux2010_x86_64.manylinux_2_12_x86_64.whl",
        "13a74f429e23b921c1109976abefacc69835f2f433ebd323d3946e11d804e47b",
    ),
    "nvvm": _wheel(
        "nvidia-nvvm",
        "nvidia_nvvm-13.0.88-py3-none-manylinux2010_x86_64.manylinux_2_12_x86_64.whl",
        "c5f41ffeb6466944a026dfa5317d7d85355c119bbec279205d22f1869d1054e0",
    ),
    "cudnn": _wheel(
        "nvidia-cudnn-cu13",
        "nvidia_cudnn_cu13-9.24.0.43-py3-none-manylinux_2_27_x86_64.whl",
        "71f181cd810e90f9b6023b01186fe82d13d65f0ec098581ee201d39fad769e4b",
    ),
    "cusparselt": _wheel(
        "nvidia-cusparselt-cu13",
        "nvidia_cusparselt_cu13-0.8.1-py3-none-manylinux2014_x86_64.whl",
        "786ce87568c303fadb5afcc7102d454cd3040d75f6f8626f5db460d1871f4dd0",
    ),
    "nccl": _wheel(
        "nvidia-nccl-cu13",
        "nvidia_nccl_cu13-2.30.7-py3-none-manylinux_2_18_x86_64.whl",
        "cefa7fdb9710efd0f39c5f1be1d61ff6fc9a996c451265bd7fbdcf9455ed4b50",
    ),
}
CUDA12 = {
    "cudart": _wheel(
        "nvidia-cuda-runtime-cu12",
        "nvidia_cuda_runtime_cu12-12.8.90-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl",
        "adade8dcbd0edf427b7204d480d6066d33902cab2a4707dcfc48a2d0fd44ab90",
    ),
    "cublas": _wheel(
        "nvidia-cublas-cu12",
        "nvidia_cublas_cu12-12.8.4.1-py3-none-manylinux_2_27_x86_64.whl",
        "8ac4e771d5a348c551b2a426eda6193c19aa630236b418086020df5ba9667142",
    ),
    "nvjitlink": _wheel(
        "nvidia-nvjitlink-cu12",
        "nvidia_nvjitlink_cu12-12.8.93-py3-none-manylinux2010_x86_64.manylinux_2_12_x86_64.whl",
        "81ff63371a7ebd6e6451970684f916be2eab07321b73c9d244dc2b4da7f73b88",
    ),
}


def _libraries(*names: str) -> Callable[[str], bool]:
    """Members named like one of `names` (`libcublasLt.so.13`) and every dist-info RECORD."""
    pattern = re.compile(r"(?:^|/)(?:" + "|".join(re.escape(n) for n in names) + r")$")
    return lambda member: bool(pattern.search(member)) or member.endswith(".dist-info/RECORD")


def _python_package(*also: str) -> Callable[[str], bool]:
    """A Python package's sources, compiled libraries and RECORD, plus members matching `also`."""
    extra = re.compile("|".join(also)) if also else None
    return lambda member: (
        member.endswith((".py", ".dist-info/RECORD"))
        or re.search(r"\.so(\.\d+)*$", member) is not None
        or (extra is not None and extra.search(member) is not None)
    )


@dataclass(frozen=True)
class Part:
    """Members of one wheel, installed under `SITE` as pip installs them."""

    wheel: RemoteWheel
    wanted: Callable[[str], bool]
    label: str  # names the selection in the cache key

    def files(self) -> dict[str, Path]:
        return member_files(self.wheel, self.wanted)


def libraries(wheel: RemoteWheel, *names: str) -> Part:
    return Part(wheel, _libraries(*names), "lib:" + ",".join(names))


def python_package(wheel: RemoteWheel, *also: str) -> Part:
    return Part(wheel, _python_package(*also), "py:" + ",".join(also))


def members(wheel: RemoteWheel, wanted: Callable[[str], bool], label: str) -> Part:
    return Part(wheel, wanted, label)


def _tar(parts: Sequence[Part]) -> Iterator[bytes]:
    """The layer's tar, streamed: headers and content chunks of every member under `SITE`."""
    directories: set[str] = set()
    for part in parts:
        for name, path in sorted(part.files().items()):
            target = f"{SITE}/{name}".lstrip("/")
            parent = target.rsplit("/", 1)[0]
            chain = parent.split("/")
            for depth in range(1, len(chain) + 1):
                directory = "/".join(chain[:depth])
                if directory not in directories:
                    directories.add(directory)
                    info = tarfile.TarInfo(directory)
                    info.type, info.mode = tarfile.DIRTYPE, 0o755
                    yield info.tobuf(format=tarfile.PAX_FORMAT)
            info = tarfile.TarInfo(target)
            info.size, info.mode = path.stat().st_size, 0o755 if ".so" in name else 0o644
            yield info.tobuf(format=tarfile.PAX_FORMAT)
            with path.open("rb") as handle:
                yield from iter(lambda: handle.read(_CHUNK), b"")
            if info.size % 512:
                yield bytes(512 - info.size % 512)
    yield bytes(1024)


@cache
def _scanner_source() -> str:
    digest = hashlib.sha256()
    for path in sorted(_SCANNER_LAYERS.glob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()


def layer_evidence(parts: Sequence[Part]) -> CudaLayerEvidence:
    """One layer of `parts` read by the scanner's layer walk, as an analysis process reads it; cached
    on disk by its inputs and the scanner's layer code."""
    key = hashlib.sha256(
        json.dumps(
            [CUDA_EVIDENCE_SCHEMA, _scanner_source(), [(p.wheel.sha256, p.label) for p in parts]]
        ).encode()
    ).hexdigest()[:24]
    cached = CACHE / "evidence" / f"{key}.json"
    with cache_lock(f"evidence-{key}"):
        return _layer_evidence(parts, cached)


def _layer_evidence(parts: Sequence[Part], cached: Path) -> CudaLayerEvidence:
    if cached.exists():
        return CudaLayerEvidence.model_validate_json(cached.read_bytes())
    collector = CudaEntryCollector()
    walk = LayerWalk(RAW_TAR, [collector], budget=ScanBudget(AnalysisLimits()))
    for chunk in _tar(parts):
        walk.feed(chunk)
    walk.close()
    evidence = collector.finish(complete=True)
    cached.parent.mkdir(parents=True, exist_ok=True)
    partial = cached.with_suffix(".partial")
    partial.write_text(evidence.model_dump_json())
    partial.replace(cached)
    return evidence


# The layers the package images are made of (each a pip install of its own, as in a Dockerfile).
def cuda13_stack() -> list[Part]:
    """CUDA 13.0's libraries as torch 2.14.0 pins them: the ones torch, vLLM and ONNX Runtime link."""
    return [
        libraries(CUDA13["cudart"], "libcudart.so.13"),
        libraries(CUDA13["cublas"], "libcublas.so.13", "libcublasLt.so.13"),
        libraries(CUDA13["nvrtc"], "libnvrtc.so.13"),
        libraries(CUDA13["cufft"], "libcufft.so.12"),
        libraries(CUDA13["cufile"], "libcufile.so.0"),
        libraries(CUDA13["cupti"], "libcupti.so.13"),
        libraries(CUDA13["curand"], "libcurand.so.10"),
        libraries(CUDA13["cusolver"], "libcusolver.so.12"),
        libraries(CUDA13["cusparse"], "libcusparse.so.12"),
        libraries(CUDA13["nvjitlink"], "libnvJitLink.so.13"),
        libraries(CUDA13["cudnn"], "libcudnn.so.9"),
        libraries(CUDA13["cusparselt"], "libcusparseLt.so.0"),
        libraries(CUDA13["nccl"], "libnccl.so.2"),
    ]


def torch_214() -> Part:
    """torch 2.14.0+cu130: its CUDA libraries, version file and RECORD."""
    return libraries(
        TORCH_214,
        "libtorch_cuda.so",
        "libtorch_cuda_linalg.so",
        "libc10_cuda.so",
        "libtorch_nvshmem.so",
        "version.py",
    )


# The images' layers, top-down, as tests/test_gpu_packages.py reads them.
def vllm_layer() -> list[Part]:
    """vLLM's own package (its torch and CUDA layers: `torch_214`, `cuda13_stack`)."""
    return [python_package(VLLM)]


def bitsandbytes_layers() -> list[list[Part]]:
    """bitsandbytes beside torch 2.10.0+cu128's version file and CUDA 12.8's runtime and cuBLAS."""
    return [
        [python_package(BITSANDBYTES)],
        [libraries(TORCH_210, "version.py")],  # torch.version.cuda = '12.8'
        [
            libraries(CUDA12["cudart"], "libcudart.so.12"),
            libraries(CUDA12["cublas"], "libcublas.so.12", "libcublasLt.so.12"),
            libraries(CUDA12["nvjitlink"], "libnvJitLink.so.12"),
        ],
    ]


def onnxruntime_layers() -> list[list[Part]]:
    """ONNX Runtime GPU over the CUDA 13 libraries it links."""
    return [
        [python_package(ONNXRUNTIME)],
        [
            libraries(CUDA13["cudart"], "libcudart.so.13"),
            libraries(CUDA13["cublas"], "libcublas.so.13", "libcublasLt.so.13"),
            libraries(CUDA13["curand"], "libcurand.so.10"),
            libraries(CUDA13["cudnn"], "libcudnn.so.9"),
        ],
    ]


def tensorflow_layers() -> list[list[Part]]:
    return [[python_package(TENSORFLOW)]]


# flashinfer-cubin's GEMM directories whole and its attention kernels built for sm_100a: every kind of
# cubin it ships (sm_100f, sm_100a, sm_103a), 2,830 of its 15,970 files (bench/package_bench.py reads all).
FLASHINFER_CUBIN_PART = re.compile(r"/(?:gemm-|deep-gemm/|batched_gemm-)|/fmhaSm100aKernel_[^/]*\.cubin$")


def _flashinfer_cubin_member(name: str) -> bool:
    return (name.endswith(".cubin") and FLASHINFER_CUBIN_PART.search(name) is not None) or name.endswith(
        (".py", "RECORD")
    )


def flashinfer_layers() -> list[list[Part]]:
    """flashinfer-cubin's part (`FLASHINFER_CUBIN_PART`) and FlashInfer with its `.ptx` files."""
    return [
        [members(FLASHINFER_CUBIN, _flashinfer_cubin_member, "cubins-part")],
        [python_package(FLASHINFER, r"\.ptx$")],
    ]


def torchao_layer() -> list[Part]:
    """torchao's own package (over `torch_214` and `cuda13_stack`)."""
    return [python_package(TORCHAO_018)]


def _sglang_kernel_member(name: str) -> bool:
    return _python_package()(name) and not name.endswith("/flash_ops.abi3.so")


def sglang_kernel_layer() -> list[Part]:
    """sglang-kernel's package but its FlashAttention 3 (over `torch_214` and `cuda13_stack`)."""
    return [members(SGLANG_KERNEL, _sglang_kernel_member, "py:no-flash_ops")]


def sglang_layer() -> list[Part]:
    """SGLang's own sources (pure Python; over `sglang_kernel_layer`, `torch_214` and `cuda13_stack`)."""
    return [python_package(SGLANG)]


def unsloth_layer() -> list[Part]:
    """Unsloth's own sources (pure Python; over `torch_214` and `cuda13_stack`)."""
    return [python_package(UNSLOTH)]


GPU4PYSCF_LIBRARIES = ("libcupy_helper.so", "libgint.so", "libgvhf.so", "libsolvent.so")


def _triton_member(name: str) -> bool:
    return name.endswith(".dist-info/RECORD") or re.search(r"/bin/ptxas(?:-blackwell)?$", name) is not None


def triton_layer(wheel: RemoteWheel) -> list[Part]:
    """Triton's RECORD and the `ptxas` copies it compiles kernels with (`backends/nvidia/bin/`)."""
    return [members(wheel, _triton_member, "triton:ptxas")]


def triton_ptxas(wheel: RemoteWheel) -> dict[str, Path]:
    """The wheel's `ptxas` copies, runnable: tool name -> file."""
    found = member_files(wheel, lambda name: re.search(r"/bin/ptxas(?:-blackwell)?$", name) is not None)
    for path in found.values():
        if not path.stat().st_mode & 0o100:
            path.chmod(0o755)
    return {name.rsplit("/", 1)[1]: path for name, path in found.items()}


def _gpu4pyscf_member(name: str) -> bool:
    return name.endswith((".py", ".dist-info/RECORD")) or name.rpartition("/")[2] in GPU4PYSCF_LIBRARIES


def gpu4pyscf_layer() -> list[Part]:
    """gpu4pyscf's sources and four of its eleven libraries: two with PTX compute_80 (one loaded at
    import, one by the solvent models on demand), two built for sm_70 to sm_90 without PTX."""
    return [members(GPU4PYSCF, _gpu4pyscf_member, "py:four-libs")]


BUNDLED_RUNTIME = "libcudart-c64a25f3.so.12.3.101"  # as auditwheel renamed it in PyNvVideoCodec 2.2.4


def pynvvideocodec_layer(runtime: bool = True) -> list[Part]:
    """PyNvVideoCodec's `__init__.py`, its NVENC 13 extension and, with `runtime`, the CUDA runtime
    its wheel bundles under auditwheel's name (in a directory the wheel names `pynvvideocodec.`)."""
    kept = (
        "__init__.py",
        "PyNvVideoCodec_130.cpython-311-x86_64-linux-gnu.so",
        *([BUNDLED_RUNTIME] * runtime),
    )

    def wanted(name: str) -> bool:
        return name.endswith(".dist-info/RECORD") or name.rpartition("/")[2] in kept

    return [members(PYNVVIDEOCODEC, wanted, f"py:nvenc13{'+runtime' if runtime else ''}")]


def bitsandbytes_043_cuda121() -> Path:
    """bitsandbytes 0.43.3's CUDA 12.1 build, `libbitsandbytes_cuda121.so`, cached."""
    (path,) = member_files(
        BITSANDBYTES_043, lambda name: name.endswith("/libbitsandbytes_cuda121.so")
    ).values()
    return path


def python_sources(*wheels: RemoteWheel) -> list[tuple[str, Path]]:
    """Every `.py` file of `wheels`, (its path in site-packages, the cached file), in name order."""
    found: list[tuple[str, Path]] = []
    for wheel in wheels:
        found += sorted(member_files(wheel, lambda name: name.endswith(".py")).items())
    return found


def cccl_parallel_cu13() -> Path:
    """cuda-cccl 1.2.1's `cuda/compute/cu13/cccl/libcccl.c.parallel.so` (CUDA 13.1), cached."""
    (path,) = member_files(CUDA_CCCL, lambda name: name.endswith("/cu13/cccl/libcccl.c.parallel.so")).values()
    return path


def cuobjdump_12_4() -> Path:
    """NVIDIA's cuobjdump of CUDA 12.4, as triton 3.1.0's wheel ships it (`backends/nvidia/bin`)."""
    (path,) = member_files(TRITON_31, lambda name: name.endswith("/bin/cuobjdump")).values()
    if not path.stat().st_mode & 0o100:
        path.chmod(0o755)
    return path


def package_layers() -> list[list[Part]]:
    """Every layer the package tests read, in the order their fixtures meet them (`tests/prefetch.py`)."""
    return [
        cuda13_stack(),
        [torch_214()],
        vllm_layer(),
        torchao_layer(),
        sglang_kernel_layer(),
        sglang_layer(),
        unsloth_layer(),
        gpu4pyscf_layer(),
        pynvvideocodec_layer(),
        pynvvideocodec_layer(runtime=False),
        *bitsandbytes_layers(),
        *onnxruntime_layers(),
        *tensorflow_layers(),
        *flashinfer_layers(),
        triton_layer(TRITON_34),
        triton_layer(TRITON_39),
        [libraries(CUDA13_NVCC, "ptxas")],
    ]
