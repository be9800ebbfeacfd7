"""Triton's compiler: the `ptxas` release read from a file's bytes, who imports Triton, and which GPUs
Triton can build kernels for (`scanner.layers.ptxas`, `placement.triton_compiler`).

Real copies of ptxas (triton 3.4.0's and 3.9.0's) are read and run in tests/test_gpu_packages.py;
here, the reader's edges on crafted bytes and the rules' tables.
"""

from __future__ import annotations

import time

import pytest

from placement import gpu_code
from placement.compiler_releases import compiles_for
from placement.triton_compiler import (
    arch_name,
    compile_gap,
    compile_refusal,
    default_path_use,
    ptxas_remedy,
    tool_for,
)
from scanner.facts.gpu import gpu_facts
from scanner.layers.cuda_evidence import (
    MAX_C_COMPILERS_PER_LAYER,
    MAX_PTXAS_ALIASES,
    MAX_PTXAS_PER_LAYER,
    MAX_PYTHON_HEADERS_PER_LAYER,
    MAX_TOOLKIT_LINKS_PER_LAYER,
    MAX_VENVS_PER_LAYER,
    CudaLayerEvidence,
    c_compiler_on,
    collect_layer,
    combine,
    layer_problems,
    ptxas_aliases,
    with_triton_config,
)
from scanner.layers.limits import DEFAULT_MAX_PATH_BYTES
from scanner.layers.ptxas import BANNER, ReleaseReader
from scanner.layers.python_headers import include_dir
from scanner.layers.python_loads import LoadSites
from scanner.layers.tarstream import TarEntry
from scanner.models import PackageFacts, TritonFacts

SITE = "/usr/local/lib/python3.11/site-packages"


def _read(content: bytes, chunk: int) -> str | None:
    reader = ReleaseReader()
    for start in range(0, len(content), chunk):
        if not reader.feed(memoryview(content)[start : start + chunk]):
            break
    return reader.release


@pytest.mark.parametrize("chunk", [1, 2, 5, 7, 31, 64, 1 << 20])
def test_the_release_is_read_wherever_a_chunk_cuts_the_banner(chunk: int) -> None:
    content = b"\x7fELF" + b"x" * 1000 + BANNER + b"12.8, V12.8.93\x00" + BANNER + b"99.9" + b"y" * 100
    assert _read(content, chunk) == "12.8"
    assert _read(b"\x00" * 300 + BANNER + b"13.10\n", chunk) == "13.10"  # never cut to 13.1


def test_a_file_without_a_banner_has_no_release() -> None:
    assert _read(b"\x7fELF" + b"Cuda compilation tools" * 50, 16) is None
    assert _read(BANNER + b"twelve", 1 << 20) is None
    assert _read(BANNER, 1 << 20) is None  # the banner at the end, no release after it


def test_releases_know_the_architectures_nvidia_lists() -> None:
    # (release, what it knows, what it does not), from NVIDIA's release notes; tests/test_gpu_packages.py
    # runs real copies of 12.8, 12.9 and 13.4 on every architecture
    table = [
        ((12, 4), [(7, 0), (8, 9), (9, 0)], [(10, 0), (12, 0), (12, 1)]),
        ((12, 8), [(10, 0), (10, 1), (12, 0)], [(10, 3), (11, 0), (12, 1)]),
        ((12, 9), [(10, 3), (12, 1), (10, 1)], [(11, 0), (8, 8)]),
        ((13, 0), [(7, 5), (11, 0), (12, 1), (8, 8)], [(7, 0), (10, 1), (10, 7)]),
        ((13, 3), [(8, 8), (11, 0)], [(10, 7)]),
        ((13, 4), [(10, 7), (12, 1)], [(11, 1), (12, 2)]),  # not listed here: known to none
        ((13, 5), [(10, 3), (11, 0), (10, 7)], [(7, 2), (13, 0), (9, 5)]),
    ]
    for cuda, known, unknown in table:
        assert all(compiles_for(cuda, cc) for cc in known), cuda
        assert not any(compiles_for(cuda, cc) for cc in unknown), cuda
    assert not compiles_for((13, 5), gpu_code.NEWER_THAN_KNOWN)


def test_which_ptxas_triton_runs_and_what_it_asks_for_follow_its_version() -> None:
    both = {"ptxas": "12.8", "ptxas-blackwell": "13.1"}
    assert tool_for(TritonFacts(version="3.7.1", ptxas=both), (9, 0)) == "ptxas"
    assert tool_for(TritonFacts(version="3.7.1", ptxas=both), (10, 0)) == "ptxas-blackwell"
    assert tool_for(TritonFacts(version="3.9.0", ptxas=both), (9, 0)) == "ptxas-blackwell"
    assert tool_for(TritonFacts(version="3.10.0", ptxas=both), (8, 9)) == "ptxas"
    assert tool_for(TritonFacts(version="3.4.0", ptxas={"ptxas": "12.8"}), (12, 1)) == "ptxas"
    assert arch_name(TritonFacts(version="3.4.0"), (12, 1)) == "sm_121a"
    assert arch_name(TritonFacts(version="3.2.0"), (10, 0)) == "sm_100"  # before 3.3: `a` at 9.0 alone
    assert arch_name(TritonFacts(version="3.2.0"), (9, 0)) == "sm_90a"


def test_no_gap_is_claimed_without_a_release() -> None:
    assert compile_gap(None, (12, 1)) is None
    assert compile_gap(TritonFacts(version="3.4.0", ptxas={"ptxas": ""}), (12, 1)) is None
    assert compile_gap(TritonFacts(version="3.4.0"), (12, 1)) is None
    users = [f"pkg{n}" for n in range(9)]
    line = compile_gap(TritonFacts(version="3.4.0", ptxas={"ptxas": "12.8"}, users=users), (12, 1))
    assert line is not None and "the Triton kernels of pkg0, pkg1, pkg2, pkg3, pkg4, pkg5 and 3 more" in line


def test_the_packages_that_import_triton_are_listed_guarded_or_not() -> None:
    sites = LoadSites()
    sites.add_source(f"{SITE}/vllm/triton_utils/__init__.py", b"if HAS_TRITON:\n    import triton\n")
    sites.add_source(f"{SITE}/xformers/ops/k.py", b"def f():\n    from triton import language as tl\n")
    sites.add_source(f"{SITE}/triton/language/__init__.py", b"from triton.language import core\n")
    sites.add_source(f"{SITE}/other/m.py", b"import tritonclient\nimport numpy\n")
    assert sites.importers_of("triton") == ["vllm", "xformers"]


def test_config_variables_name_the_ptxas_triton_runs() -> None:
    facts = gpu_facts(
        {
            "config": {
                "Env": [
                    "TRITON_PTXAS_PATH=/usr/local/cuda/bin/ptxas",
                    "TRITON_PTXAS-BLACKWELL_PATH=/opt/cuda-13/bin/ptxas",
                    "TRITON_CUOBJDUMP_PATH=/x",
                ]
            }
        }
    )
    assert facts.triton_ptxas == {
        "ptxas": "/usr/local/cuda/bin/ptxas",
        "ptxas-blackwell": "/opt/cuda-13/bin/ptxas",
    }
    assert (
        gpu_facts(
            {"config": {"Env": ["TRITON_PTXAS_PATH=bin/ptxas", "TRITON_PTXAS_BLACKWELL_PATH="]}}
        ).triton_ptxas
        == {}
    )


def _entry(path: str, content: bytes) -> tuple[TarEntry, bytes]:
    return TarEntry(path=path, kind="file", size=len(content), mode=0o755), content


def test_a_layer_records_each_ptxas_and_triton_only_where_its_distribution_is() -> None:
    ptxas = f"{SITE}/triton/backends/nvidia/bin/ptxas"
    toolkit = "/usr/local/cuda-12.9/bin/ptxas"
    layer = collect_layer(
        [
            _entry(ptxas, b"\x7fELF" + b"\x00" * 100 + BANNER + b"12.8, V12.8.93"),
            _entry(toolkit, b"\x7fELF" + BANNER + b"12.9, V12.9.86"),
            _entry(f"{SITE}/triton-3.4.0.dist-info/RECORD", b"triton/__init__.py,,\n"),
            _entry(f"{SITE}/app/main.py", b"import triton\n"),
        ]
    )
    assert layer.ptxas == {ptxas: "12.8", toolkit: "12.9"}
    assert layer.triton_users == ["app"]
    assert combine([layer])[1] is None  # no GPU code: nothing is judged


def _link(path: str, target: str) -> tuple[TarEntry, bytes]:
    return TarEntry(path=path, kind="symlink", size=0, mode=0o777, linkname=target), b""


def test_the_links_a_toolkit_is_reached_by_lead_to_its_ptxas() -> None:
    """NVIDIA's images: `/usr/local/cuda -> /etc/alternatives/cuda -> /usr/local/cuda-12.8` (update-alternatives),
    so `TRITON_PTXAS_PATH=/usr/local/cuda/bin/ptxas` names CUDA 12.8's. Links in another layer count;
    relative targets resolve from the link's directory; other links are not recorded."""
    base = collect_layer(
        [
            _link("/usr/local/cuda", "/etc/alternatives/cuda"),
            _link("/etc/alternatives/cuda", "/usr/local/cuda-12.8/"),
            _link("/usr/local/cuda-12", "cuda-12.8"),
            _link("/usr/lib/libfoo.so", "libfoo.so.1"),
        ]
    )
    assert base.toolkit_links == {
        "/usr/local/cuda": "/etc/alternatives/cuda",
        "/etc/alternatives/cuda": "/usr/local/cuda-12.8/",
        "/usr/local/cuda-12": "cuda-12.8",
    }
    toolkit = collect_layer(
        [
            _entry("/usr/local/cuda-12.8/bin/ptxas", b"\x7fELF" + BANNER + b"12.8, V12.8.93"),
            _link("/usr/bin/ptxas", "../local/cuda-12/bin/ptxas"),
        ]
    )
    aliases = ptxas_aliases(combine_ptxas([toolkit, base]), {**base.toolkit_links, **toolkit.toolkit_links})
    assert aliases == {
        "/etc/alternatives/cuda/bin/ptxas": "/usr/local/cuda-12.8/bin/ptxas",
        "/usr/bin/ptxas": "/usr/local/cuda-12.8/bin/ptxas",
        "/usr/local/cuda-12/bin/ptxas": "/usr/local/cuda-12.8/bin/ptxas",
        "/usr/local/cuda/bin/ptxas": "/usr/local/cuda-12.8/bin/ptxas",
    }
    upper = collect_layer([(TarEntry(path="/usr/local/cuda", kind="dir", size=0, mode=0o755), b"")])
    _, archs = combine([upper, toolkit, base, ptx_layer()])
    assert archs is not None and "/usr/local/cuda/bin/ptxas" not in archs.ptxas_links  # a directory now
    assert archs.ptxas_links["/usr/bin/ptxas"] == "/usr/local/cuda-12.8/bin/ptxas"
    loop = ptxas_aliases({"/opt/c/ptxas": "13.0"}, {"/opt/a": "/opt/b", "/opt/b": "/opt/a"})
    assert loop == {}  # a loop reaches nothing
    wide = ptxas_aliases({"/opt/c/ptxas": "13.0"}, {f"/l{n}/cuda": "/" for n in range(MAX_PTXAS_ALIASES + 9)})
    assert len(wide) == MAX_PTXAS_ALIASES


def ptx_layer() -> CudaLayerEvidence:
    """A layer with GPU code (one PTX module), so that the image's archs are judged."""
    return collect_layer([_entry("/opt/app/k.ptx", b".version 8.7\n.target sm_90\n.address_size 64\n")])


def test_following_links_is_bounded_in_work_whatever_the_image_holds() -> None:
    """127 layers, each at its bound of `ptxas` files and links (8,128 of each, plus links to `/`): each reached
    path's directories are looked up once, so this takes milliseconds where pairing every link with every path
    took seconds; no alias passes the caps on paths and on a path's length."""
    carried = {
        f"/l{layer}/d{n}/bin/ptxas": "12.8" for layer in range(127) for n in range(MAX_PTXAS_PER_LAYER)
    }
    links = {f"/k{layer}/c{n}/cuda": f"/l{layer}/d{n}" for layer in range(127) for n in range(64)}
    links |= {f"/z{n}/{'x' * 4000}/cuda": "/" for n in range(64)}  # aliases past a path's length
    started = time.process_time()
    aliases = ptxas_aliases(carried, links)
    assert time.process_time() - started < 2.0
    assert len(aliases) == MAX_PTXAS_ALIASES
    assert all(len(alias) <= DEFAULT_MAX_PATH_BYTES for alias in aliases)


def combine_ptxas(layers_top_down: list[CudaLayerEvidence]) -> dict[str, str]:
    return {path: release for layer in layers_top_down for path, release in layer.ptxas.items() if release}


def test_the_c_compiler_triton_builds_its_launcher_with_is_found_as_triton_finds_it() -> None:
    """Triton's `_find_compiler`: `$CC`, else `gcc` on PATH, else `clang`. The walk records the files and links
    so named; the config's PATH (Docker's default where unset) and CC pick one; where none is found, Triton
    builds nothing, on any GPU, and vLLM is refused everywhere, saying what gives it one."""
    layer = collect_layer(
        [
            _link("/usr/bin/gcc", "gcc-12"),
            _entry("/opt/llvm/bin/clang", b"\x7fELF"),
            _entry("/usr/share/doc/gcc-12/README", b"docs"),
        ]
    )
    assert layer.c_compilers == ["/usr/bin/gcc", "/opt/llvm/bin/clang"]
    _, archs = combine([layer, ptx_layer()])
    assert archs is not None and archs.c_compilers == ["/opt/llvm/bin/clang", "/usr/bin/gcc"]
    assert c_compiler_on(archs, gpu_facts({"config": {}})) == "/usr/bin/gcc"  # Docker's default PATH
    assert (
        c_compiler_on(archs, gpu_facts({"config": {"Env": ["PATH=/opt/llvm/bin:/usr/bin"]}}))
        == "/usr/bin/gcc"
    )
    assert (
        c_compiler_on(archs, gpu_facts({"config": {"Env": ["PATH=/opt/llvm/bin:/bin"]}}))
        == "/opt/llvm/bin/clang"
    )
    assert c_compiler_on(archs, gpu_facts({"config": {"Env": ["PATH=/sbin", "CC=/x/cc"]}})) == "/x/cc"
    assert c_compiler_on(archs, gpu_facts({"config": {"Env": ["PATH=/sbin:relative"]}})) == ""
    _, unread = combine([layer.model_copy(update={"complete": False}), ptx_layer()])
    assert unread is not None and unread.c_compilers is None  # a name past a stopped read is unseen
    assert c_compiler_on(unread, gpu_facts({"config": {"Env": ["PATH=/sbin"]}})) is None

    none = TritonFacts(version="3.9.0", ptxas={"ptxas": "12.9", "ptxas-blackwell": "13.4"}, c_compiler="")
    vllm = PackageFacts(id="python:vllm", name="vllm", version="0.19.0", kind="python")
    for cc in ((7, 5), (9, 0), (12, 1)):
        refusal = compile_refusal(none, [vllm], cc)
        assert refusal == (
            "Triton 3.9.0 cannot compile kernels here: it finds no C compiler in the image (gcc or clang on its"
            " PATH, or $CC) to build its launcher with, and vllm 0.19.0 builds a Triton kernel at every step (its"
            " KV cache's slot mapping), --enforce-eager or not; a C compiler in the image (Debian's gcc,"
            " build-essential) gives it one"
        )
        line = compile_gap(none, cc)
        assert line is not None and line.startswith("Triton 3.9.0's kernels: it finds no C compiler")
    for found in ("/usr/bin/gcc", None):  # a compiler, or none known either way: nothing is claimed
        facts = none.model_copy(update={"c_compiler": found})
        assert compile_refusal(facts, [vllm], (9, 0)) is None and compile_gap(facts, (9, 0)) is None


@pytest.mark.parametrize(("version", "compiler"), [("3.7.1", None), ("3.4.0", "")])
def test_a_triton_cache_holding_its_built_driver_spares_the_compiler_from_3_7_on(
    version: str, compiler: str | None
) -> None:
    """From 3.7 Triton builds one module with a C compiler (`cuda_utils`, its driver), and a cache the image
    carries may hold it built; 3.0 to 3.6 also build a launcher per kernel, so a compiler is still needed."""
    layer = collect_layer(
        [
            _entry(f"{SITE}/triton-{version}.dist-info/RECORD", b"triton/__init__.py,,\n"),
            _entry("/root/.triton/cache/5f2a/cuda_utils.cpython-311-x86_64-linux-gnu.so", b"\x7fELF"),
        ]
    )
    assert layer.triton_utils == ["/root/.triton/cache/5f2a/cuda_utils.cpython-311-x86_64-linux-gnu.so"]
    _, archs = combine([layer, ptx_layer()])
    assert (
        archs is not None and archs.triton is not None and archs.triton.prebuilt_utils == layer.triton_utils
    )
    assert c_compiler_on(archs, gpu_facts({"config": {}})) == compiler


def test_past_the_bound_on_c_compilers_the_layer_says_so() -> None:
    layer = collect_layer([_link(f"/opt/t{n}/gcc", "x") for n in range(MAX_C_COMPILERS_PER_LAYER + 1)])
    assert len(layer.c_compilers) == MAX_C_COMPILERS_PER_LAYER
    assert layer.bounds_reached == ["MAX_C_COMPILERS_PER_LAYER"]


def test_past_the_bound_on_toolkit_links_the_layer_says_so() -> None:
    layer = collect_layer([_link(f"/opt/t{n}/cuda", "/x") for n in range(MAX_TOOLKIT_LINKS_PER_LAYER + 1)])
    assert len(layer.toolkit_links) == MAX_TOOLKIT_LINKS_PER_LAYER
    assert layer.bounds_reached == ["MAX_TOOLKIT_LINKS_PER_LAYER"]


def test_past_the_bound_on_ptxas_files_the_layer_says_so() -> None:
    layer = collect_layer(
        [_entry(f"/opt/t{n}/bin/ptxas", BANNER + b"12.8, V") for n in range(MAX_PTXAS_PER_LAYER + 1)]
    )
    assert len(layer.ptxas) == MAX_PTXAS_PER_LAYER and layer.bounds_reached == ["MAX_PTXAS_PER_LAYER"]
    assert any("64 files named ptxas (MAX_PTXAS_PER_LAYER)" in line for line in layer_problems([layer]))


def test_vllm_from_its_v1_engine_on_needs_triton_where_it_cannot_compile() -> None:
    """vLLM 0.8.0 made its V1 engine the default (`VLLM_USE_V1` defaults to 1), which compiles the model
    with torch.compile unless run eager: a refusal. vLLM 0.7.3 (V0 by default) and other packages: a caveat."""
    triton = TritonFacts(version="3.5.1", ptxas={"ptxas": "12.8"}, users=["vllm"])
    vllm = PackageFacts(id="python:vllm", name="vllm", version="0.8.0", kind="python")
    refusal = compile_refusal(triton, [vllm], (12, 1))
    assert refusal is not None and "sm_121a, and vllm 0.8.0 compiles its model with torch.compile" in refusal
    assert "runs Triton kernels of its own (fused MoE, Mamba, some attention backends) either way" in refusal
    assert compile_refusal(triton, [vllm], (12, 0)) is None  # CUDA 12.8 knows sm_120a
    old = vllm.model_copy(update={"version": "0.7.3"})
    other = PackageFacts(id="python:xformers", name="xformers", version="0.0.32", kind="python")
    assert compile_refusal(triton, [old, other], (12, 1)) is None
    assert compile_gap(triton, (12, 1)) is not None
    assert compile_refusal(triton.model_copy(update={"ptxas": {"ptxas": ""}}), [vllm], (12, 1)) is None


@pytest.mark.parametrize(
    ("version", "why"),
    [
        ("0.7.3", None),
        ("0.8.0", "compiles its model with torch.compile"),
        ("0.18.1", "compiles its model with torch.compile"),
        (
            "0.19.0",
            "builds a Triton kernel at every step (its KV cache's slot mapping), --enforce-eager or not",
        ),
        ("0.33.0rc1", "builds a Triton kernel at every step"),
        ("main", None),
    ],
)
def test_how_vllm_builds_triton_kernels_follows_its_version(version: str, why: str | None) -> None:
    """From 0.19.0 vLLM's model runner computes the slot mapping with a Triton kernel at every step, so
    running eager no longer avoids Triton; 0.8 to 0.18 compile with torch.compile unless eager."""
    package = PackageFacts(id="python:vllm", name="vllm", version=version, kind="python")
    found = default_path_use(package)
    assert (found is None) if why is None else (found is not None and found.startswith(why))
    assert default_path_use(package.model_copy(update={"kind": "deb"})) is None


def test_pure_python_users_are_judged_by_the_distribution_that_ships_them() -> None:
    """SGLang and Unsloth ship no GPU code, so `packages` lacks them; `user_versions` names them."""
    triton = TritonFacts(version="3.4.0", ptxas={"ptxas": "12.8"}, users=["liger_kernel", "sglang"])
    for name, version, refused in (
        ("sglang", "0.4.0", True),
        ("sglang", "0.3.6", True),
        ("sglang", "0.3.5.post2", False),  # no Triton kernel there yet
        ("unsloth", "2025.11.1", True),
        ("mamba-ssm", "2.3.1", True),
        ("liger-kernel", "0.6.2", False),  # its kernels run only where a model is patched with them
    ):
        facts = triton.model_copy(update={"user_versions": {name: version}})
        refusal = compile_refusal(facts, [], (12, 1))
        assert (refusal is not None) == refused, (name, version)
        assert refusal is None or f"sm_121a, and {name} {version} " in refusal
        assert compile_refusal(facts, [], (12, 0)) is None
    vllm = PackageFacts(id="python:vllm", name="vllm", version="0.11.0", kind="python")
    both = triton.model_copy(update={"user_versions": {"vllm": "0.19.0"}})
    refusal = compile_refusal(both, [vllm], (12, 1))
    assert refusal is not None and "vllm 0.19.0 builds a Triton kernel at every step" in refusal


def test_the_answer_names_the_releases_whose_ptxas_knows_the_gpu() -> None:
    """A newer release for a newer GPU, an older one where a major dropped it (CUDA 13 and Volta), and the
    range where a name lived for one release span (sm_101a, Thor as CUDA 12 named it)."""
    cases = [
        ((12, 8), (12, 1), "CUDA 12.9 or later", [(12, 9), (13, 0)]),
        ((12, 9), (11, 0), "CUDA 13.0 or later", [(13, 0), (13, 5)]),
        ((13, 4), (10, 1), "CUDA 12.8 to 12.9", [(12, 8), (12, 9)]),
        ((13, 0), (7, 0), "CUDA 12 or earlier", [(12, 9), (11, 8)]),
    ]
    for cuda, cc, releases, knowing in cases:
        assert not compiles_for(cuda, cc)
        assert ptxas_remedy(cuda, cc) == f"TRITON_PTXAS_PATH can name a ptxas that knows it ({releases})"
        assert all(compiles_for(other, cc) for other in knowing)
    assert (
        ptxas_remedy((13, 5), (13, 0)) == "TRITON_PTXAS_PATH can name a newer ptxas"
    )  # no release known does


@pytest.mark.parametrize(
    ("site", "venvs", "include"),
    [
        ("/usr/local/lib/python3.11/site-packages", {}, "/usr/local/include/python3.11"),  # python:3.11
        ("/usr/local/lib/python3.10/dist-packages", {}, "/usr/include/python3.10"),  # pip as root on Ubuntu
        ("/usr/lib/python3.12/dist-packages", {}, "/usr/include/python3.12"),
        ("/opt/conda/envs/x/lib/python3.11/site-packages", {}, "/opt/conda/envs/x/include/python3.11"),
        ("/opt/venv/lib/python3.12/site-packages", {"/opt/venv": "/usr/bin"}, "/usr/include/python3.12"),
        (
            "/opt/venv/lib/python3.13t/site-packages",
            {"/opt/venv": "/usr/local/bin"},
            "/usr/local/include/python3.13t",
        ),
        ("/root/.local/lib/python3.11/site-packages", {}, None),  # a user's: any interpreter's
        ("/opt/venv/lib/python3.12/site-packages", {"/opt/venv": ""}, None),  # a venv whose home is not read
        ("/opt/lib/python3.11/dist-packages", {}, None),
        ("/app/vendor", {}, None),
    ],
)
def test_the_headers_triton_includes_are_those_of_the_interpreter_it_is_installed_for(
    site: str, venvs: dict[str, str], include: str | None
) -> None:
    assert include_dir(site, venvs) == include


def test_a_layer_records_python_headers_and_virtual_environments() -> None:
    """A venv made from Debian's python3 without python3-dev: Triton's launcher includes
    `/usr/include/python3.11/Python.h`, which is not there, so it builds nothing (sgl-project/sglang#1117);
    with the headers, or from 3.7 with its driver module built in a cache, nothing is claimed."""
    venv = "/opt/venv/lib/python3.11/site-packages"
    layer = collect_layer(
        [
            _entry(
                "/opt/venv/pyvenv.cfg",
                b"home = /usr/bin\ninclude-system-site-packages = false\nversion = 3.11.2\n",
            ),
            _entry(f"{venv}/triton-3.4.0.dist-info/RECORD", b"triton/__init__.py,,\n"),
            _link("/usr/bin/gcc", "gcc-12"),
        ]
    )
    assert layer.venv_homes == {"/opt/venv": "/usr/bin"}
    _, archs = combine([layer, ptx_layer()])
    assert archs is not None and archs.triton is not None
    assert (archs.triton.python_include, archs.triton.python_header) == ("/usr/include/python3.11", "")
    chosen = with_triton_config(archs, gpu_facts({"config": {}})).triton
    assert chosen is not None and chosen.c_compiler == "/usr/bin/gcc"
    line = compile_gap(chosen, (9, 0))
    assert line is not None and line.startswith(
        "Triton 3.4.0's kernels: it finds no C header of its Python in the image (/usr/include/python3.11/Python.h)"
        " to build its launcher with, so nothing Triton compiles runs here"
    )
    assert line.endswith("; the interpreter's headers (Debian's python3-dev) give it them")
    vllm = PackageFacts(id="python:vllm", name="vllm", version="0.19.0", kind="python")
    assert compile_refusal(chosen, [vllm], (9, 0)) is not None
    headers = collect_layer([_entry("/usr/include/python3.11/Python.h", b"#include <patchlevel.h>\n")])
    _, with_headers = combine([headers, layer, ptx_layer()])
    assert with_headers is not None and with_headers.triton is not None
    assert with_headers.triton.python_header == "/usr/include/python3.11/Python.h"
    _, unread = combine([layer.model_copy(update={"complete": False}), ptx_layer()])
    assert unread is not None and unread.triton is not None and unread.triton.python_header is None
    built = collect_layer(
        [
            _entry("/opt/venv/pyvenv.cfg", b"home = /usr/bin\n"),
            _entry(f"{venv}/triton-3.7.1.dist-info/RECORD", b"triton/__init__.py,,\n"),
            _entry("/root/.triton/cache/5f2a/cuda_utils.cpython-311-x86_64-linux-gnu.so", b"\x7fELF"),
            _link("/usr/bin/gcc", "gcc-12"),
        ]
    )
    _, cached = combine([built, ptx_layer()])
    assert cached is not None
    spared = with_triton_config(cached, gpu_facts({"config": {}})).triton
    assert spared is not None and spared.python_header is None and compile_gap(spared, (9, 0)) is None


def test_past_the_bounds_on_headers_and_venvs_the_layer_says_so() -> None:
    layer = collect_layer(
        [
            _entry(f"/opt/p{n}/include/python3.11/Python.h", b"")
            for n in range(MAX_PYTHON_HEADERS_PER_LAYER + 1)
        ]
        + [_entry(f"/opt/v{n}/pyvenv.cfg", b"home = /usr/bin\n") for n in range(MAX_VENVS_PER_LAYER + 1)]
    )
    assert (
        len(layer.python_headers) == MAX_PYTHON_HEADERS_PER_LAYER
        and len(layer.venv_homes) == MAX_VENVS_PER_LAYER
    )
    assert layer.bounds_reached == ["MAX_PYTHON_HEADERS_PER_LAYER", "MAX_VENVS_PER_LAYER"]
