"""CUDA extensions that packages build with torch's `cpp_extension` when they are imported: which files
build (`scanner.layers.python_builds`, `LoadSites.torch_builders`), which tools the image gives torch
(`scanner.layers.cuda_jit_tools`), and which GPUs the image is refused on
(`placement.torch_extension_compiler`). The ground, ExLlamaV2's and ExLlamaV3's own sources, is in
tests/test_gpu_packages.py."""

from __future__ import annotations

import time

import pytest

from fixtures.hostile_gpu_code import smallest_gpu_library
from placement import gpu_code
from placement.torch_extension_compiler import (
    ADD_NINJA,
    NO_NINJA,
    NO_NVCC,
    arch_targets,
    torch_extension_refusal,
)
from scanner.layers import python_loads
from scanner.layers.cuda_evidence import CudaLayerEvidence, collect_layer, layer_problems
from scanner.layers.python_builds import MAX_CLAUSE_SCAN_BYTES, build_calls, goes_on
from scanner.layers.python_loads import LoadSites
from scanner.layers.tarstream import TarEntry
from scanner.models import ContainerArchs, FileArchs, PackageFacts, TorchExtensionFacts
from tests.test_flashinfer_compiler import _archs, _entry, _toolkit

SITE = "/usr/local/lib/python3.11/site-packages"
FROM_IMPORT = {"torch.utils.cpp_extension", "torch.utils.cpp_extension.load"}


def _calls(source: str, imported: set[str] = FROM_IMPORT) -> list[tuple[int, int]]:
    return build_calls(b"\n" + source.encode(), imported)


def test_a_build_call_is_torchs_load_by_the_name_the_file_imports() -> None:
    assert len(_calls("ext = load(name='x', sources=s)\n")) == 1
    assert len(_calls("ext = load \\\n    (\n name='x')\n")) == 1  # exllamav2 breaks the line
    assert len(_calls("m = cpp_extension.load_inline(name='x')\n", set())) == 1
    assert len(_calls("m = torch.utils.cpp_extension.load(name='x')\n", set())) == 1
    assert _calls("ext = load(name='x')\n", {"torch.utils.cpp_extension"}) == []  # `load` is not torch's here
    assert _calls("data = json.load(f)\n") == []
    assert _calls("def load(path):\n    return path\n") == []
    assert _calls("# ext = load(name='x')\n") == []
    assert _calls("ext = load(name='x')\n")[0] == (0, 0)
    assert _calls("if a:\n    ext = load(name='x')\n")[0][1] == 4

    assert _calls("a = load(x); b = load(y)\n") == [(0, 0), (0, 0)]  # two calls on one line


def test_a_line_of_many_calls_costs_its_length() -> None:
    """A crafted 512 KiB line of 27,000 calls in a comment: each call looked back to its line's start
    (0.65 s of CPU for the file); now the line is read once, as long as the same calls on lines of
    their own (measured in the same process, so the bound holds on a slow host)."""
    call = b"cpp_extension.load("
    count = python_loads.MAX_SOURCE_BYTES // (len(call) + 3)
    one_line = b"\n# " + call * count
    own_lines = b"".join(b"\n# " + call for _ in range(count))  # the same calls, each on its own line

    def cpu_of(text: bytes) -> float:
        started = time.process_time()
        assert build_calls(text, set()) == []  # comments: no call counts
        return time.process_time() - started

    apart = cpu_of(own_lines)
    assert cpu_of(one_line) < 3 * apart + 0.05, apart


@pytest.mark.parametrize(
    ("clauses", "caught"),
    [
        ("finally:\n    done()\n", False),  # exllamav2: the failure goes through
        ("except IndexError as e:\n    if x:\n        raise RuntimeError('y') from e\n    raise\n", False),
        ("except Exception:\n    ext = None\n", True),  # a fallback: the package runs without it
        ("except ImportError:\n    raise\nexcept Exception:\n    ext = None\n", True),
        ("else:\n    pass\nfinally:\n    pass\n", False),
    ],
)
def test_a_try_counts_where_it_catches_the_failure_and_goes_on(clauses: str, caught: bool) -> None:
    text = b"\ntry:\n    ext = load(name='x')\n" + clauses.encode() + b"after = 1\n"
    (at, _), *_ = build_calls(text, FROM_IMPORT)
    assert goes_on(text, 0, at, MAX_CLAUSE_SCAN_BYTES)[0] is caught


def test_the_clauses_are_looked_for_within_the_layers_bound() -> None:
    text = b"\ntry:\n    ext = load(name='x')\n" + b"    pass\n" * 1000 + b"except Exception:\n    pass\n"
    assert goes_on(text, 0, 0, 100) == (None, 100)
    caught, read = goes_on(text, 0, 0, MAX_CLAUSE_SCAN_BYTES)
    assert caught is True and read < len(text)


def _sites(files: dict[str, str]) -> LoadSites:
    sites = LoadSites()
    for path, source in files.items():
        sites.add_source(f"{SITE}/{path}", source.encode())
    return sites


EXT = (
    "import torch\nfrom torch.utils.cpp_extension import load\n"
    "build_jit = False\ntry:\n    import pkg_ext\nexcept ModuleNotFoundError:\n    build_jit = True\n"
    "if build_jit:\n    try:\n        pkg_ext = load(name='pkg_ext', sources=[])\n    finally:\n        pass\n"
)


def test_a_package_builds_at_import_where_its_top_reaches_the_building_module() -> None:
    sites = _sites(
        {
            "pkg/__init__.py": "from pkg.model import Model\n",
            "pkg/model.py": "from pkg.ext import pkg_ext\n",
            "pkg/ext.py": EXT,
        }
    )
    builds = sites.torch_builders()
    assert list(builds) == ["pkg"] and "pkg_ext" in builds["pkg"]  # the built extension it tries first
    # vLLM's and SGLang's hf3fs clients build at module level in modules nothing imports at the top
    aside = _sites({"pkg/__init__.py": "import os\n", "pkg/tests/test_ext.py": EXT, "pkg/ext.py": EXT})
    assert aside.torch_builders() == {}
    lazy = EXT.replace("if build_jit:", "def build():")
    assert (
        _sites({"pkg/__init__.py": "from pkg.ext import build\n", "pkg/ext.py": lazy}).torch_builders() == {}
    )
    guarded = EXT.replace("    finally:\n        pass\n", "    except Exception:\n        pkg_ext = None\n")
    assert _sites({"pkg/__init__.py": "from pkg import ext\n", "pkg/ext.py": guarded}).torch_builders() == {}
    suppressed = "import contextlib\nfrom torch.utils.cpp_extension import load\nwith contextlib.suppress(Exception):\n    e = load(name='e')\n"
    assert (
        _sites({"pkg/__init__.py": "from pkg import ext\n", "pkg/ext.py": suppressed}).torch_builders() == {}
    )
    # an import that is itself guarded does not run the building module
    optional = _sites(
        {
            "pkg/__init__.py": "try:\n    from pkg import ext\nexcept ImportError:\n    pass\n",
            "pkg/ext.py": EXT,
        }
    )
    assert optional.torch_builders() == {}


def _layer(*extra: tuple[TarEntry, bytes], builder: str = EXT) -> CudaLayerEvidence:
    """torch and a package that builds its extension at import, with GPU code (torch's) so the image is judged."""
    return collect_layer(
        [
            _entry(f"{SITE}/torch-2.14.0.dist-info/RECORD", b"torch/__init__.py,,\n"),
            _entry(f"{SITE}/pkg-1.2.dist-info/RECORD", b"pkg/__init__.py,,\npkg/ext.py,,\n"),
            _entry(f"{SITE}/pkg/__init__.py", b"from pkg.ext import pkg_ext\n"),
            _entry(f"{SITE}/pkg/ext.py", builder.encode()),
            _entry("/opt/app/k.ptx", b".version 8.7\n.target sm_75\n.address_size 64\n"),
            *extra,
        ]
    )


TOOLS = (
    _entry("/usr/local/bin/ninja", b"#!/usr/local/bin/python\n"),  # PyPI's ninja, a dependency of ExLlamaV2
    _entry("/usr/local/include/python3.11/Python.h", b""),
)
PATH = "PATH=/usr/local/cuda/bin:/usr/local/bin:/usr/bin"


def _facts(layers: list[CudaLayerEvidence], *env: str) -> TorchExtensionFacts:
    facts = _archs(layers, *env).torch_extensions
    assert facts is not None
    return facts


def test_the_scan_finds_who_builds_and_the_tools_torch_finds() -> None:
    ready = _facts([_layer(*TOOLS), _toolkit("12.8")], PATH)
    assert (ready.users, ready.user_versions, ready.version) == (["pkg"], {"pkg": "1.2"}, "2.14.0")
    assert (ready.nvcc, ready.nvcc_release, ready.cxx) == ("/usr/local/cuda/bin/nvcc", "12.8", "/usr/bin/c++")
    assert (ready.ninja, ready.python_header) == (
        "/usr/local/bin/ninja",
        "/usr/local/include/python3.11/Python.h",
    )
    bare = _facts([_layer()])
    assert (bare.nvcc, bare.cxx, bare.ninja, bare.python_header) == ("", "", "", "")
    assert _facts([_layer(*TOOLS)], "PATH=/usr/bin").ninja == ""  # not on the config's PATH
    assert _facts([_layer(*TOOLS), _toolkit()], "TORCH_CUDA_ARCH_LIST=8.0;9.0+PTX").arch_list == "8.0;9.0+PTX"
    unread = _layer(*TOOLS).model_copy(update={"complete": False})
    assert _facts([unread]).ninja is None  # a name past a stopped read is unseen: unknown
    assert (
        _archs([collect_layer([_entry("/opt/app/k.ptx", b".version 8.7\n.target sm_75\n")])]).torch_extensions
        is None
    )


def test_the_built_extension_the_package_tries_first_spares_the_build() -> None:
    built = _entry(f"{SITE}/pkg_ext.cpython-311-x86_64-linux-gnu.so", smallest_gpu_library())
    facts = _facts([_layer(built)])
    assert facts.users == [] and facts.prebuilt == [built[0].path]
    assert not any("cpp_extension" in r for r in gpu_code.judge(_archs([_layer(built)]), (8, 0)).reasons)


TORCH = PackageFacts(id="python:torch", name="torch", version="2.14.0", kind="python")
TORCH_LIB = FileArchs(
    path=f"{SITE}/torch/lib/libtorch_cuda.so",
    package=TORCH.id,
    containers=[ContainerArchs(sass=[a], kernels=True) for a in ("75", "80", "90", "100", "120")],
)


def _refusal(cc: tuple[int, int], **facts: object) -> str | None:
    ready: dict[str, object] = {
        "users": ["pkg"],
        "user_versions": {"pkg": "1.2"},
        "nvcc": "/usr/local/cuda/bin/nvcc",
        "nvcc_release": "12.8",
        "cxx": "/usr/bin/c++",
        "ninja": "/usr/local/bin/ninja",
        "python_header": "/usr/local/include/python3.11/Python.h",
        "python_include": "/usr/local/include/python3.11",
    }
    return torch_extension_refusal(TorchExtensionFacts(**(ready | facts)), [TORCH_LIB], [TORCH], cc)


def test_each_missing_tool_refuses_every_gpu_and_says_what_gives_it() -> None:
    assert _refusal((9, 0)) is None
    no_ninja = _refusal((9, 0), ninja="")
    assert no_ninja == (
        f"pkg 1.2 builds its CUDA extension with torch's cpp_extension when imported, and here {NO_NINJA}; {ADD_NINJA}"
    )
    assert NO_NVCC in (_refusal((8, 0), nvcc="") or "")
    assert "no C++ compiler" in (_refusal((8, 0), cxx="") or "")
    assert "no Python.h for torch's interpreter (/usr/local/include/python3.11)" in (
        _refusal((8, 0), python_header="") or ""
    )
    assert _refusal((8, 0), ninja=None, nvcc=None, cxx=None, python_header=None) is None  # unknown: no claim
    assert _refusal((8, 0), users=[], nvcc="") is None  # nobody builds


def test_its_nvcc_must_know_the_architecture_torch_builds_for() -> None:
    """The GPU's own, capped at the newest torch was built for, as `_get_cuda_arch_flags` and ExLlamaV2 pick."""
    assert "its nvcc (CUDA 12.4) does not know sm_100" in (_refusal((10, 0), nvcc_release="12.4") or "")
    assert _refusal((9, 0), nvcc_release="12.4") is None
    assert "does not know sm_70" in (_refusal((7, 0), nvcc_release="13.0") or "")  # 13.0 dropped Volta
    # a GPU newer than torch's newest (sm_120 here): torch builds for sm_120 with PTX, which 12.8 knows
    assert _refusal((12, 1), nvcc_release="12.8") is None


def test_a_configured_arch_list_must_run_here_and_be_known_to_nvcc() -> None:
    assert arch_targets("8.0;8.6+PTX") == [((8, 0), False, False), ((8, 6), False, True)]
    assert arch_targets("Ampere 9.0a") == [
        ((8, 0), False, False),
        ((8, 6), False, True),
        ((9, 0), True, False),
    ]
    assert arch_targets("native") is None and arch_targets("8.0;sm_90") is None
    assert _refusal((9, 0), arch_list="8.0;8.6+PTX") is None  # PTX compute_86 runs on 9.0
    refused = _refusal((9, 0), arch_list="8.0;8.6")
    assert refused is not None and "builds for sm_80, sm_86, none of which runs here" in refused
    assert _refusal((8, 9), arch_list="8.0") is None  # SASS of its major at or below its minor
    assert "does not know sm_100" in (_refusal((8, 0), arch_list="8.0;10.0", nvcc_release="12.4") or "")
    assert _refusal((8, 0), arch_list="native", nvcc_release="12.4") is None  # not read: no claim


def test_the_image_is_refused_where_torch_cannot_build_through_the_decision() -> None:
    archs = _archs([_layer(*TOOLS), _toolkit("12.4")], PATH)
    verdicts = {cc: gpu_code.judge(archs, cc) for cc in ((7, 5), (9, 0), (10, 0))}
    assert verdicts[(7, 5)].runs and verdicts[(9, 0)].runs
    assert verdicts[(10, 0)].reasons == [
        "compute capability 10.0: pkg 1.2 builds its CUDA extension with torch's cpp_extension when imported,"
        " and here its nvcc (CUDA 12.4) does not know sm_100; CUDA_HOME can name a toolkit whose nvcc knows it"
        " (CUDA 12.8 or later)"
    ]


def test_past_the_clause_bound_the_layer_claims_no_build_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """A `try:` whose body runs long before its clauses: reading for them stops at the layer's bound, the
    layer's remaining sources are not read, no build is claimed, and the report names the bound."""
    monkeypatch.setattr(python_loads, "MAX_CLAUSE_SCAN_BYTES", 4096)
    long_try = EXT.replace("    finally:\n", "        pass\n" * 2000 + "    finally:\n")
    sites = _sites({"pkg/__init__.py": "from pkg.ext import pkg_ext\n", "pkg/ext.py": long_try})
    assert sites.truncated_by == "MAX_CLAUSE_SCAN_BYTES" and sites.clause_bytes <= 4096
    assert sites.torch_builders() == {}
    layer = _layer(builder=long_try)
    assert layer.torch_builds == {}
    assert any("MAX_CLAUSE_SCAN_BYTES" in line for line in layer_problems([layer]))
