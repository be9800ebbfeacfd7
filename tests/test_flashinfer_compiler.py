"""FlashInfer's kernels, built with `nvcc` at first use: which tools the image gives it
(`scanner.layers.cuda_jit_tools`), and which GPUs its users are refused on (`placement.flashinfer_compiler`).
The ground of each rule, in the packages' own sources, is in tests/test_gpu_packages.py."""

from __future__ import annotations

import pytest

from placement import gpu_code
from placement.flashinfer_compiler import (
    ADD_CXX,
    NO_CXX,
    NO_NVCC,
    GapKind,
    default_path_use,
    flashinfer_gap,
    flashinfer_refusal,
)
from scanner.facts.gpu import gpu_facts
from scanner.layers.cuda_evidence import MAX_NVCC_PER_LAYER, CudaLayerEvidence, collect_layer, combine
from scanner.layers.cuda_jit_tools import with_jit_tools
from scanner.layers.ptxas import BANNER
from scanner.layers.tarstream import TarEntry
from scanner.models import FlashInferFacts, GpuArchs, PackageFacts

SITE = "/usr/local/lib/python3.11/site-packages"
CC = tuple[int, int]


def _entry(path: str, content: bytes) -> tuple[TarEntry, bytes]:
    return TarEntry(path=path, kind="file", size=len(content), mode=0o755), content


def _link(path: str, target: str) -> tuple[TarEntry, bytes]:
    return TarEntry(path=path, kind="symlink", size=0, mode=0o777, linkname=target), b""


def _nvcc(release: str) -> bytes:
    return b"\x7fELF" + b"\x00" * 64 + BANNER + f"{release}, V{release}.41".encode()


def _python(version: str = "0.7.4", user: str = "sglang", user_version: str = "0.5.9") -> CudaLayerEvidence:
    """FlashInfer's RECORD, and a user whose sources import it; GPU code (one PTX module) so the image is judged."""
    return collect_layer(
        [
            _entry(f"{SITE}/flashinfer_python-{version}.dist-info/RECORD", b"flashinfer/__init__.py,,\n"),
            _entry(f"{SITE}/{user}-{user_version}.dist-info/RECORD", f"{user}/__init__.py,,\n".encode()),
            _entry(f"{SITE}/{user}/srt/layers/attention.py", b"import flashinfer\n"),
            _entry("/opt/app/k.ptx", b".version 8.7\n.target sm_90\n.address_size 64\n"),
        ]
    )


def _toolkit(release: str = "13.0") -> CudaLayerEvidence:
    """A CUDA toolkit as NVIDIA's devel images install it, with Debian's g++ beside it."""
    return collect_layer(
        [
            _entry(f"/usr/local/cuda-{release}/bin/nvcc", _nvcc(release)),
            _link("/usr/local/cuda", "/etc/alternatives/cuda"),
            _link("/etc/alternatives/cuda", f"/usr/local/cuda-{release}"),
            _link("/usr/bin/c++", "/etc/alternatives/c++"),
        ]
    )


def _archs(layers_top_down: list[CudaLayerEvidence], *env: str) -> GpuArchs:
    _, archs = combine(layers_top_down)
    assert archs is not None
    return with_jit_tools(archs, gpu_facts({"config": {"Env": list(env)}}))


def _facts(layers_top_down: list[CudaLayerEvidence], *env: str) -> FlashInferFacts:
    facts = _archs(layers_top_down, *env).flashinfer
    assert facts is not None
    return facts


def test_a_layer_records_each_nvcc_its_links_and_who_imports_flashinfer() -> None:
    python, toolkit = _python(), _toolkit("12.8")
    assert python.flashinfer_users == ["sglang"]
    assert toolkit.nvcc == {"/usr/local/cuda-12.8/bin/nvcc": "12.8"}
    assert toolkit.c_compilers == ["/usr/bin/c++"]
    archs = _archs([python, toolkit])
    assert archs.nvcc_links["/usr/local/cuda/bin/nvcc"] == "/usr/local/cuda-12.8/bin/nvcc"
    assert archs.toolkit_roots == ["/etc/alternatives/cuda", "/usr/local/cuda"]
    facts = archs.flashinfer
    assert facts is not None and facts.version == "0.7.4" and facts.user_versions == {"sglang": "0.5.9"}
    _, bare = combine([collect_layer([_entry("/opt/app/k.ptx", b".version 8.7\n.target sm_90\n")])])
    assert bare is not None and bare.flashinfer is None  # no FlashInfer installed: nothing to judge


def test_the_nvcc_flashinfer_runs_is_found_as_its_own_code_finds_it() -> None:
    """`$FLASHINFER_NVCC`, else `bin/nvcc` below `$CUDA_HOME`, `$CUDA_PATH`, two directories above the `nvcc` on
    PATH, or `/usr/local/cuda` where it exists (not in 0.4.x)."""
    python, toolkit = _python(), _toolkit("12.8")
    path = "PATH=/usr/local/cuda/bin:/usr/bin"
    facts = _facts([python, toolkit], path)
    assert (facts.nvcc, facts.nvcc_release, facts.cxx) == ("/usr/local/cuda/bin/nvcc", "12.8", "/usr/bin/c++")
    assert _facts([python, toolkit]).nvcc == "/usr/local/cuda/bin/nvcc"  # the default CUDA home
    assert _facts([_python("0.4.1"), toolkit]).nvcc == ""  # 0.4.x: "Could not find nvcc"
    assert _facts([python, toolkit], "CUDA_HOME=/usr/local/cuda-12.8").nvcc_release == "12.8"
    mounted = _facts([python, toolkit], "CUDA_PATH=/opt/cuda")  # not in the image: a mount, unknown
    assert (mounted.nvcc, mounted.nvcc_release) == ("/opt/cuda/bin/nvcc", None)
    assert _facts([python, toolkit], "FLASHINFER_NVCC=/x/nvcc").nvcc == "/x/nvcc"
    assert _facts([_python("0.2.5"), toolkit], "FLASHINFER_NVCC=/x/nvcc").nvcc == "/usr/local/cuda/bin/nvcc"
    assert _facts([_python("0.2.5"), toolkit], "PYTORCH_NVCC=/y/nvcc").nvcc == "/y/nvcc"
    runtime = collect_layer(  # NVIDIA's runtime images: the CUDA home holds libraries, no nvcc
        [
            _link("/usr/local/cuda", "/etc/alternatives/cuda"),
            _link("/etc/alternatives/cuda", "/usr/local/cuda-12.8"),
            _entry("/usr/local/cuda-12.8/lib64/libcudart.so.12", b"\x7fELF"),
        ]
    )
    assert _facts([python, runtime]).nvcc == ""
    assert _facts([python]).nvcc == ""  # no CUDA home at all
    unread = python.model_copy(update={"complete": False})
    assert _facts([unread, toolkit]).nvcc is None  # a name past a stopped read is unseen
    assert _facts([unread, toolkit]).cxx is None


def test_the_cxx_compiler_is_cxx_else_cplusplus_on_path() -> None:
    python, toolkit = _python(), _toolkit()
    assert _facts([python, toolkit]).cxx == "/usr/bin/c++"
    assert _facts([python, toolkit], "PATH=/usr/local/cuda/bin").cxx == ""
    assert _facts([python, toolkit], "PATH=/sbin", "CXX=g++-12").cxx == "g++-12"


def test_built_kernels_spare_the_tools() -> None:
    """flashinfer-jit-cache's modules, or an AOT build's, are loaded instead of compiled: nothing is claimed."""
    cache = collect_layer(
        [
            _entry(
                f"{SITE}/flashinfer_jit_cache-0.7.4+cu130.dist-info/RECORD",
                b"flashinfer_jit_cache/__init__.py,,\n",
            )
        ]
    )
    facts = _facts([cache, _python()])
    assert facts.prebuilt == ["flashinfer-jit-cache 0.7.4+cu130"] and facts.nvcc == ""
    assert flashinfer_gap(facts, (8, 9)) is None
    sglang = PackageFacts(id="python:sglang", name="sglang", version="0.5.9", kind="python")
    assert flashinfer_refusal(facts, [sglang], (8, 9)) is None


def _fi(
    nvcc: str | None = "",
    release: str | None = None,
    cxx: str | None = "/usr/bin/c++",
    version: str = "0.7.4",
    **settings: str,
) -> FlashInferFacts:
    return FlashInferFacts(version=version, nvcc=nvcc, nvcc_release=release, cxx=cxx, settings=settings)


def test_what_stops_flashinfer_on_a_gpu_is_named_with_what_gives_it_the_means() -> None:
    line = flashinfer_gap(_fi(), (8, 9))
    assert line is not None and line.startswith(
        f"FlashInfer 0.7.4's kernels: {NO_NVCC}, so none of them builds here"
    )
    line = flashinfer_gap(_fi("/usr/local/cuda/bin/nvcc", "13.0", cxx=""), (8, 9))
    assert line is not None and f"{NO_CXX}, so none of them builds here; {ADD_CXX}" in line
    old = flashinfer_gap(_fi("/usr/local/cuda/bin/nvcc", "12.6"), (10, 0))
    assert old is not None and "its nvcc (CUDA 12.6) does not know sm_100a" in old
    assert "FLASHINFER_NVCC or CUDA_HOME can name an nvcc that knows it (CUDA 12.8 or later)" in old
    # its own rule for 12.x: 0.6.7 to 0.7.0 ask CUDA 12.9 on every 12.x GPU, 0.7.1 on 12.8 for 12.0
    asks = flashinfer_gap(_fi("/usr/local/cuda/bin/nvcc", "12.8", version="0.7.0.post1"), (12, 0))
    assert asks is not None and "it asks CUDA 12.9 or later of its nvcc on compute capability 12.x" in asks
    assert flashinfer_gap(_fi("/usr/local/cuda/bin/nvcc", "12.8", version="0.7.4"), (12, 0)) is None
    assert flashinfer_gap(_fi("/usr/local/cuda/bin/nvcc", "12.8", version="0.6.6"), (12, 0)) is None
    for unknown in (
        _fi(None),
        _fi("/opt/cuda/bin/nvcc", None),
        _fi("/usr/local/cuda/bin/nvcc", "13.0", cxx=None),
    ):
        assert flashinfer_gap(unknown, (12, 1)) is None  # a tool or release not known: nothing is claimed


VLLM_STAGES: list[tuple[str, str, CC, bool]] = [
    # (vLLM, FlashInfer, GPU, refused where FlashInfer has no nvcc)
    ("0.7.3", "0.2.5", (9, 0), False),  # the V0 engine: never by default
    ("0.8.5", "0.2.5", (9, 0), False),  # 0.8 samples with it only below "0.2.3", as text
    ("0.8.5", "0.2.11", (9, 0), True),  # ... which "0.2.11" is
    ("0.9.2", "0.2.5", (9, 0), True),
    ("0.9.2", "0.2.11", (8, 0), False),  # 0.9.0 to 0.10.0: at or above "0.2.3", as text
    ("0.10.2", "0.2.11", (8, 0), True),  # compared as versions from 0.10.1
    ("0.11.2", "0.5.2", (9, 0), False),  # off by default from 0.11.1 ...
    ("0.11.2", "0.5.2", (10, 0), True),  # ... but FlashInfer is the attention backend on 10.x
    ("0.18.1", "0.6.6", (7, 5), True),  # ... and on 7.5 (FlashAttention needs 8.0) until 0.24
    ("0.21.0", "0.6.8.post1", (7, 5), True),  # the sampler on again, 7.5 to 12.1
    ("0.24.0", "0.6.12", (7, 5), False),  # from 8.0
    ("0.33.0", "0.7.2.post1", (8, 0), True),
    ("0.33.0", "0.7.2.post1", (8, 7), False),  # every Jetson Orin has 16 SMs or fewer
    ("0.33.0", "0.7.2.post1", (12, 1), True),
    ("0.33.0", "0.7.2.post1", (7, 0), False),
]


@pytest.mark.parametrize(("vllm", "flashinfer", "cc", "refused"), VLLM_STAGES)
def test_vllm_is_refused_where_it_calls_flashinfer_on_its_default_path(
    vllm: str, flashinfer: str, cc: CC, refused: bool
) -> None:
    facts = _fi(version=flashinfer).model_copy(update={"user_versions": {"vllm": vllm}})
    refusal = flashinfer_refusal(facts, [], cc)
    assert (refusal is not None) == refused, refusal
    assert refusal is None or refusal.startswith(
        f"FlashInfer {flashinfer} cannot build its kernels here: {NO_NVCC}, and vllm {vllm} "
    )


def test_the_configs_variables_decide_what_vllm_calls() -> None:
    vllm = PackageFacts(id="python:vllm", name="vllm", version="0.33.0", kind="python")
    off = _fi(VLLM_USE_FLASHINFER_SAMPLER="0")
    assert flashinfer_refusal(off, [vllm], (9, 0)) is None
    attention = flashinfer_refusal(off, [vllm], (10, 0))
    assert attention is not None and "vllm 0.33.0 takes FlashInfer's attention kernels" in attention
    assert (
        flashinfer_refusal(
            _fi(VLLM_USE_FLASHINFER_SAMPLER="0", VLLM_ATTENTION_BACKEND="FLASH_ATTN"), [vllm], (10, 0)
        )
        is None
    )
    opted = PackageFacts(id="python:vllm", name="vllm", version="0.15.1", kind="python")
    assert flashinfer_refusal(_fi(), [opted], (9, 0)) is None
    assert flashinfer_refusal(_fi(VLLM_USE_FLASHINFER_SAMPLER="1"), [opted], (9, 0)) is not None
    line = flashinfer_refusal(_fi(), [vllm], (9, 0))
    assert (
        line is not None
        and "samples with FlashInfer's top-k/top-p kernels, at start-up whatever the requests (VLLM_USE_FLASHINFER_SAMPLER=0 turns that off)"
        in line
    )


def test_from_0_31_vllm_samples_without_flashinfer_where_its_own_check_fails() -> None:
    """vLLM 0.31's preflight asks FlashInfer's `check_cuda_arch`, which fails on 12.x under FlashInfer's own
    rule: it samples natively there. Without nvcc the check passes (the version falls back to torch's)."""
    old_nvcc = _fi("/usr/local/cuda/bin/nvcc", "12.8", version="0.7.0.post1")
    for version, refused in (("0.30.0", True), ("0.31.0", False)):
        facts = old_nvcc.model_copy(update={"user_versions": {"vllm": version}})
        assert (flashinfer_refusal(facts, [], (12, 0)) is not None) == refused, version


@pytest.mark.parametrize(
    ("sglang", "cc", "refused"),
    [("0.4.0", (9, 0), True), ("0.4.5", (9, 0), False), ("0.5.9", (9, 0), False), ("0.5.9", (8, 9), True),
     ("0.5.9", (10, 0), True), ("0.5.9", (12, 1), True), ("0.2.15", (8, 9), False)],
)  # fmt: skip
def test_sglang_is_refused_where_flashinfer_is_its_default_attention(
    sglang: str, cc: CC, refused: bool
) -> None:
    facts = _fi().model_copy(update={"user_versions": {"sglang": sglang}})
    assert (flashinfer_refusal(facts, [], cc) is not None) == refused


def test_below_compute_capability_7_5_flashinfer_runs_nothing_built_ahead_or_not() -> None:
    """FlashInfer's own `check_cuda_arch` runs before any module is built or loaded: a V100 gets nothing of
    it, whatever tools or built kernels the image has. vLLM 0.10 samples with it on any GPU (refused);
    from 0.21 its sampler starts at 7.5 (a line only)."""
    ready = _fi("/usr/local/cuda/bin/nvcc", "12.8").model_copy(
        update={"prebuilt": ["flashinfer-jit-cache 0.7.4"]}
    )
    line = flashinfer_gap(ready, (7, 0))
    assert (
        line
        == "FlashInfer 0.7.4's kernels: it builds and loads them for compute capability 7.5 and later only, so none of them builds here"
    )
    assert flashinfer_gap(ready, (7, 5)) is None
    old = ready.model_copy(update={"version": "0.2.5", "user_versions": {"vllm": "0.10.0"}})
    refusal = flashinfer_refusal(old, [], (7, 0))
    assert refusal is not None and refusal.endswith(
        "whatever the requests (VLLM_USE_FLASHINFER_SAMPLER=0 turns that off)"
    )
    new = ready.model_copy(update={"user_versions": {"vllm": "0.33.0"}})
    assert flashinfer_refusal(new, [], (7, 0)) is None


def test_other_importers_are_told_what_they_run_without() -> None:
    """A package not known to call FlashInfer on its default path: a line of what the image runs without."""
    facts = _fi().model_copy(update={"users": ["my_app"], "user_versions": {"my-app": "1.0"}})
    assert flashinfer_refusal(facts, [], (9, 0)) is None
    line = flashinfer_gap(facts, (9, 0))
    assert line is not None and "(my_app imports it)" in line
    kind: GapKind = "tool"
    unknown = PackageFacts(id="python:my-app", name="my-app", version="1.0", kind="python")
    assert default_path_use(unknown, facts, (9, 0), kind) is None


def test_the_verdict_carries_flashinfers_reason() -> None:
    archs = _archs([_python(), collect_layer([_link("/usr/bin/c++", "g++-12")])])
    l4 = gpu_code.judge(archs, (8, 9))
    assert not l4.runs and any("sglang 0.5.9 takes FlashInfer's attention kernels" in r for r in l4.reasons)
    h100 = gpu_code.judge(archs, (9, 0))
    assert any(line.startswith("FlashInfer 0.7.4's kernels: it finds no nvcc") for line in h100.without)
    devel = gpu_code.judge(
        _archs([_python(), _toolkit("13.0")], "PATH=/usr/local/cuda/bin:/usr/bin"), (12, 1)
    )
    assert not any("FlashInfer" in line for line in devel.reasons + devel.without)


def test_past_the_bound_on_nvcc_files_the_layer_says_so() -> None:
    layer = collect_layer(
        [_entry(f"/opt/t{n}/bin/nvcc", b"#!/bin/sh\n") for n in range(MAX_NVCC_PER_LAYER + 1)]
    )
    assert len(layer.nvcc) == MAX_NVCC_PER_LAYER and set(layer.nvcc.values()) == {""}
    assert layer.bounds_reached == ["MAX_NVCC_PER_LAYER"]


def _dir(path: str) -> tuple[TarEntry, bytes]:
    return TarEntry(path=path, kind="dir", size=0, mode=0o755), b""


def test_directories_named_cuda_count_as_a_toolkit_root_only_where_one_can_be() -> None:
    """torch's `torch/cuda` and a dozen more, FlashInfer's headers and a toolkit's own `include/cuda` are no
    toolkit root: a layer of them records none (and reaches no bound), while `/usr/local/cuda` counts."""
    names = [f"{SITE}/torch/cuda", f"{SITE}/torch/include/ATen/cuda", "/usr/local/cuda-12.8/include/cuda"]
    names += [f"{SITE}/pkg{n}/cuda" for n in range(80)]
    layer = collect_layer(
        [*(_dir(name) for name in names), _dir("/usr/local/cuda"), _dir("/usr/local/cuda-12.8")]
    )
    assert layer.toolkit_links == {"/usr/local/cuda": "", "/usr/local/cuda-12.8": ""}
    assert layer.bounds_reached == []
