"""SGLang's own kernels, which apache-tvm-ffi builds with `nvcc` at first use: which tools the image gives it
(`scanner.layers.cuda_jit_tools`), and where SGLang is refused for want of them (`placement.tvm_ffi_compiler`).
The ground, in SGLang's and tvm-ffi's own sources, is in tests/test_gpu_packages.py."""

from __future__ import annotations

import pytest

from placement import gpu_code
from placement.flashinfer_compiler import NO_CXX, NO_NVCC
from placement.tvm_ffi_compiler import tvm_ffi_gap, tvm_ffi_refusal
from scanner.layers.cuda_evidence import CudaLayerEvidence, collect_layer
from scanner.models import PackageFacts, TvmFfiFacts
from tests.test_flashinfer_compiler import SITE, _archs, _entry, _link, _toolkit

CC = tuple[int, int]


def _sglang(version: str) -> CudaLayerEvidence:
    """SGLang's RECORD and a module that imports tvm-ffi, tvm-ffi's RECORD, and GPU code (one PTX module)."""
    return collect_layer(
        [
            _entry(f"{SITE}/apache_tvm_ffi-0.1.9.dist-info/RECORD", b"tvm_ffi/__init__.py,,\n"),
            _entry(f"{SITE}/sglang-{version}.dist-info/RECORD", b"sglang/__init__.py,,\n"),
            _entry(
                f"{SITE}/sglang/jit_kernel/utils.py",
                b"def load_jit():\n    from tvm_ffi.cpp import load_inline\n",
            ),
            _entry("/opt/app/k.ptx", b".version 8.7\n.target sm_90\n.address_size 64\n"),
        ]
    )


def test_the_tools_tvm_ffi_builds_with_are_found_as_its_own_code_finds_them() -> None:
    layer = _sglang("0.5.11")
    assert layer.tvm_ffi_users == ["sglang"]
    devel = _archs([layer, _toolkit("12.8")]).tvm_ffi
    assert devel is not None and devel.user_versions == {"sglang": "0.5.11"}
    assert (devel.nvcc, devel.nvcc_release, devel.cxx) == ("/usr/local/cuda/bin/nvcc", "12.8", "/usr/bin/c++")
    home = _archs([layer, _toolkit("12.8")], "CUDA_HOME=/usr/local/cuda-12.8").tvm_ffi
    assert home is not None and home.nvcc == "/usr/local/cuda-12.8/bin/nvcc" and home.nvcc_release == "12.8"
    bare = _archs([layer, collect_layer([_link("/usr/bin/c++", "g++-12")])]).tvm_ffi
    assert bare is not None and (bare.nvcc, bare.cxx) == ("", "/usr/bin/c++")


@pytest.mark.parametrize(
    ("version", "cc", "refused"),
    [
        ("0.5.11", (9, 0), True),
        ("0.5.23", (8, 9), True),
        ("0.5.10", (9, 0), False),
        ("0.5.11", (12, 1), True),
    ],
)
def test_sglang_from_0_5_11_is_refused_on_every_gpu_without_nvcc(version: str, cc: CC, refused: bool) -> None:
    """Hopper too: its MLP activation is SGLang's own kernel from 0.5.11, whatever the attention backend."""
    facts = TvmFfiFacts(version="0.1.9", nvcc="", cxx="/usr/bin/c++", user_versions={"sglang": version})
    refusal = tvm_ffi_refusal(facts, [], cc)
    assert (refusal is not None) == refused
    assert refusal is None or refusal == (
        f"tvm-ffi cannot build kernels here: {NO_NVCC}, and sglang {version} builds its own kernels with it at"
        " first use, every model's MLP activation among them; a CUDA toolkit in the image (NVIDIA's devel"
        " images) gives it one"
    )


def test_what_stops_tvm_ffi_is_named() -> None:
    old = TvmFfiFacts(
        nvcc="/usr/local/cuda/bin/nvcc", nvcc_release="12.6", cxx="/usr/bin/c++", users=["sglang"]
    )
    line = tvm_ffi_gap(old, (10, 0))
    assert line == (
        "the kernels tvm-ffi builds: its nvcc (CUDA 12.6) does not know sm_100a, so none of them builds here"
        " (sglang imports it); CUDA_HOME can name a toolkit whose nvcc knows it (CUDA 12.8 or later)"
    )
    assert tvm_ffi_gap(old, (9, 0)) is None
    no_cxx = old.model_copy(update={"nvcc_release": "13.0", "cxx": ""})
    line = tvm_ffi_gap(no_cxx, (9, 0))
    assert line is not None and NO_CXX in line
    for unknown in (
        TvmFfiFacts(),
        old.model_copy(update={"nvcc_release": None}),
        old.model_copy(update={"cxx": None, "nvcc_release": "13.0"}),
    ):
        assert tvm_ffi_gap(unknown, (12, 1)) is None and tvm_ffi_refusal(unknown, [], (12, 1)) is None
    assert (
        tvm_ffi_gap(no_cxx.model_copy(update={"users": ["flashinfer", "tvm_ffi"]}), (9, 0)) is None
    )  # builds its own
    other = PackageFacts(id="python:other", name="other", version="1.0", kind="python")
    assert (
        tvm_ffi_refusal(no_cxx.model_copy(update={"user_versions": {"other": "1.0"}}), [other], (9, 0))
        is None
    )


def test_the_verdict_carries_tvm_ffis_reason_on_hopper() -> None:
    archs = _archs([_sglang("0.5.11"), collect_layer([_link("/usr/bin/c++", "g++-12")])])
    h100 = gpu_code.judge(archs, (9, 0))
    assert not h100.runs and any("sglang 0.5.11 builds its own kernels with it" in r for r in h100.reasons)
    devel = gpu_code.judge(_archs([_sglang("0.5.11"), _toolkit("13.0")]), (9, 0))
    assert not any("tvm-ffi" in line for line in devel.reasons + devel.without)


def test_only_importers_of_its_builder_count_as_building_through_it() -> None:
    """`tvm_ffi.cpp` (`load_inline`) builds with nvcc; vLLM 0.33's CuTe DSL kernels import `tvm_ffi` alone, to
    call what another compiler built, and are no user."""
    layer = collect_layer(
        [
            _entry(f"{SITE}/vllm/kernels/cute.py", b"import tvm_ffi\nfrom tvm_ffi import Module\n"),
            _entry(
                f"{SITE}/sglang/jit_kernel/utils.py",
                b"def load_jit():\n    from tvm_ffi.cpp import load_inline\n",
            ),
            _entry(f"{SITE}/other/build.py", b"from tvm_ffi import cpp\n"),
            _entry(f"{SITE}/tvm_ffi/cpp/extension.py", b"import tvm_ffi.cpp\n"),
        ]
    )
    assert layer.tvm_ffi_users == ["other", "sglang"]
