"""The rules behind judging GPU code as packages load it (issue 42), each on its own: which extension
imports a package can run without, which library the loader can load, which build a package selects,
the PTX ISA table, and one decisive reason per server. Real packages: tests/test_gpu_packages.py."""

from __future__ import annotations

import itertools
import time

import pytest

from placement import gpu_code
from placement.cuda_drivers import ptx_cuda_reason, ptx_driver_floor, ptx_toolkit_of
from placement.cuda_needs import declared_vs_carried, gpu_reasons
from scanner.facts.badges import cuda_mismatch
from scanner.facts.gpu import build_overrides, gpu_facts
from scanner.layers import python_loads
from scanner.layers.code_loading import (
    Distribution,
    MissingLinks,
    annotate,
    build_version,
    chosen_build,
    distribution_from_record,
    distribution_index,
    exact_builds_only,
    nvidia_library,
    nvidia_profiling_library,
    package_of,
)
from scanner.layers.cuda_evidence import collect_layer, combine
from scanner.layers.python_loads import LoadSites, dotted_module
from scanner.layers.tarstream import TarEntry
from scanner.models import ContainerArchs, FileArchs, GpuArchs, GpuFacts, InferredCuda, PackageFacts

SITE = "/usr/local/lib/python3.11/site-packages"

# -- which extensions a package needs (scanner.layers.python_loads)


def sites(*files: tuple[str, str]) -> LoadSites:
    loads = LoadSites()
    for path, text in files:
        loads.add_source(f"{SITE}/{path}", text.encode())
    return loads


def test_module_level_imports_need_the_extension_guarded_and_lazy_ones_do_not() -> None:
    loads = sites(
        ("pkg/__init__.py", "import os\nfrom . import _core\n"),
        (
            "pkg/attention.py",
            "import contextlib\ntry:\n    from . import _fa3\nexcept ImportError:\n    _fa3 = None\n"
            "with contextlib.suppress(ImportError):\n    import pkg._fp4\n",
        ),
        ("pkg/models/kda.py", "def forward(x):\n    import pkg._kda\n    return x\n"),
        ("pkg/ops/__init__.py", "from .._fused import op  # a relative import two levels up\n"),
    )
    assert loads.state(f"{SITE}/pkg/_core.abi3.so") == "required"
    assert loads.state(f"{SITE}/pkg/_fa3.cpython-311-x86_64-linux-gnu.so") == "optional"
    assert loads.state(f"{SITE}/pkg/_fp4.abi3.so") == "optional"
    assert loads.state(f"{SITE}/pkg/_kda.so") == "optional"  # on demand, when that model runs
    assert loads.state(f"{SITE}/pkg/_fused.abi3.so") == "required"
    assert loads.state(f"{SITE}/pkg/_never.abi3.so") is None


@pytest.mark.parametrize("method", ["def import_module(self, name):", "async def load_library(self, path):"])
def test_a_method_named_like_a_load_call_loads_nothing(method: str) -> None:
    """torch.package's `PackageImporter` defines `import_module`, in a class whose text names
    `torch._C`. Read as a call, that class's text was a module-level scope naming `_C`, and every
    extension called `_C` in the layer was needed: xformers' (loaded in a `try:`) and vLLM 0.6.3's
    (imported in a `try:`), wherever torch shared their layer. Here the class is in the extension's
    own package, where a real call's words do name it."""
    importer = (
        "xlib/package/importer.py",
        f'class Importer:\n    """Imports modules, torch._C\'s too."""\n\n    {method}\n        return name\n',
    )
    guarded = ("xlib/__init__.py", "try:\n    from . import _C\nexcept ImportError:\n    _C = None\n")
    assert sites(importer, guarded).state(f"{SITE}/xlib/_C.so") == "optional"
    called = ("xlib/ops.py", 'import ctypes\n_C = ctypes.CDLL("_C.so")  # a call, at module level\n')
    assert sites(importer, guarded, called).state(f"{SITE}/xlib/_C.so") == "required"


def test_a_call_that_loads_by_path_names_its_own_packages_extensions() -> None:
    """torch loads libraries by path at module level in scopes that say `os.path.join`; pylibcudf
    ships `join.abi3.so`, `replace.abi3.so` and `round.abi3.so`. With torch in its layer, each of those
    read as needed. The words of a call's scope name its own top-level package's extension modules; a
    file outside any package is named by any scope's words, as before."""
    torch_init = (
        "torch/__init__.py",
        "import ctypes, os\n_lib = ctypes.CDLL(os.path.join(os.path.dirname(__file__), 'lib', 'libtorch_global_deps.so'))\n",
    )
    assert sites(torch_init).state(f"{SITE}/pylibcudf/join.abi3.so") is None
    own = (
        "pylibcudf/__init__.py",
        "import ctypes, os\nctypes.CDLL(os.path.join(os.path.dirname(__file__), 'x'))\n",
    )
    assert sites(torch_init, own).state(f"{SITE}/pylibcudf/join.abi3.so") == "required"
    loads = sites(torch_init)
    loads.add_source(
        "/opt/app/main.py", b"import ctypes, os\nctypes.CDLL(os.path.join('/opt/app', 'join.so'))\n"
    )
    assert loads.state("/opt/app/join.so") == "required"


def test_a_block_closed_by_a_dedent_no_longer_guards() -> None:
    loads = sites(
        ("pkg/__init__.py", "try:\n    import json\nexcept ImportError:\n    pass\nimport pkg._core\n")
    )
    assert loads.state(f"{SITE}/pkg/_core.abi3.so") == "required"


def test_a_module_level_import_needs_the_extension_only_where_its_module_runs_at_import() -> None:
    """vLLM 0.6.1's shape: a backend imports a separate package at its top, and the backend is imported
    only inside a function (the selector's). The package's extension loads on demand: optional. A
    module nothing imports runs at import (a user or a script may import it), and so does a script
    outside any package: importing the backend there needs the extension."""
    layer = [
        ("pkg/__init__.py", "from . import api\nfrom . import _core  # its own package: runs anyway\n"),
        ("pkg/api.py", "import pkg\ndef select():\n    from pkg.backends import fast\n    return fast\n"),
        ("pkg/backends/__init__.py", "from pkg import api\n"),
        ("pkg/backends/fast.py", "import fastlib\n"),
        ("fastlib/__init__.py", "from fastlib.interface import run\n"),
        ("fastlib/interface.py", "import fastlib_cuda  # the extension, at module level\n"),
    ]
    fast = f"{SITE}/fastlib_cuda.cpython-311-x86_64-linux-gnu.so"
    assert sites(*layer).state(fast) == "optional"
    assert sites(*layer).state(f"{SITE}/pkg/_core.abi3.so") == "required"
    assert sites(*layer[4:]).state(fast) == "required"  # the package alone: nothing imports it
    runner = ("pkg/runner.py", "from pkg.backends import fast\n")  # imported by nothing: it runs
    assert sites(*layer, runner).state(fast) == "required"
    loads = sites(*layer)
    loads.add_source("/app/main.py", b"import pkg.backends.fast\n")  # the image's own script
    assert loads.state(fast) == "required"
    guarded = ("pkg/warm.py", "try:\n    import pkg.backends.fast\nexcept ImportError:\n    pass\n")
    assert sites(*layer, guarded).state(fast) == "optional"  # run, but written to go on without it


def test_a_module_its_package_names_in_a_string_runs_at_import() -> None:
    """vLLM 0.8.5 imports `vllm._C` at the top of `vllm/platforms/cuda.py`, which one module imports
    inside a function, and which `vllm/platforms/__init__.py` names in a string that
    `resolve_obj_by_qualname` imports when the package first asks for its platform. A module its own
    package names so may be imported by name at any time: it counts as run at import."""
    layer = [
        ("pkg/platforms/cuda.py", "import pkg._C  # noqa\n"),
        ("pkg/engine.py", "def start():\n    from pkg.platforms.cuda import device_id\n"),
        ("pkg/__init__.py", "from pkg import engine\n"),
    ]
    core = f"{SITE}/pkg/_C.abi3.so"
    assert sites(*layer).state(core) == "optional"  # only a function imports the module
    resolver = ("pkg/platforms/__init__.py", 'def plugin():\n    return "pkg.platforms.cuda.CudaPlatform"\n')
    assert sites(*layer, resolver).state(core) == "required"
    other = ("other/names.py", 'NAMES = ["pkg.platforms.cuda.CudaPlatform"]\n')  # another package's string
    assert sites(*layer, other).state(core) == "optional"


@pytest.mark.parametrize(
    "registry",
    [
        (
            "pkg/models/__init__.py",
            'def load(name):\n    return import_module(\n        f"pkg.models.{name}")\n',
        ),
        (
            "pkg/models/__init__.py",
            "def load(name):\n    return importlib.import_module('pkg.models.' + name)\n",
        ),
        ("pkg/models/__init__.py", 'def load(name):\n    return import_module("pkg.models.%s" % name)\n'),
        (
            "pkg/models/__init__.py",
            'def __getattr__(name):\n    return import_module(f".{name}", __name__)\n',
        ),
        (
            "pkg/models/__init__.py",
            "def __getattr__(name):\n    return import_module('.' + name, __name__)\n",
        ),
    ],
)
def test_modules_a_package_imports_by_a_name_it_makes_run_on_demand(registry: tuple[str, str]) -> None:
    """vLLM 0.5.5's model registry imports `f"vllm.model_executor.models.{module_name}"` for the model
    it serves, and its SigLIP module, which three vision models import at their top, imports
    `vllm_flash_attn` at its own: FlashAttention loads with those models only, so vLLM runs on a T4
    without it. Nothing else imports a model module; without the registry's made name each would
    count as run at import (a script, or what a user imports), and the extension as needed. A module
    of that package its own package names whole still runs at import."""
    layer = [
        ("pkg/__init__.py", "from pkg import engine\n"),
        ("pkg/engine.py", "def start(arch):\n    from pkg.models import load\n    return load(arch)\n"),
        ("pkg/models/paligemma.py", "from pkg.models.siglip import Vision\n"),
        ("pkg/models/siglip.py", "from fastlib import attention\n"),
        ("fastlib/__init__.py", "import fastlib_cuda\n"),
    ]
    fast = f"{SITE}/fastlib_cuda.cpython-311-x86_64-linux-gnu.so"
    assert sites(*layer).state(fast) == "required"  # paligemma: imported by nothing, so it runs
    assert sites(*layer, registry).state(fast) == "optional"
    named = ("pkg/config.py", 'DEFAULT = "pkg.models.paligemma.Model"\n')
    assert sites(*layer, registry, named).state(fast) == "required"
    elsewhere = ("other/loader.py", 'def load(name):\n    return import_module(f"pkg.models.{name}")\n')
    assert sites(*layer, elsewhere).state(fast) == "required"  # another package's made name


def test_a_layer_not_read_whole_needs_what_any_module_level_site_loads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past a bound, the modules that import a module may be the ones not read: the graph is not
    trusted, and a module-level site needs its extension, as before the graph was read."""
    monkeypatch.setattr(python_loads, "MAX_SITES_PER_LAYER", 3)
    loads = sites(
        ("pkg/api.py", "def select():\n    import pkg.fast\n"),
        ("pkg/fast.py", "import fastlib_cuda\n"),
        ("pkg/more.py", "import a, b, c, d\n"),
    )
    assert loads.truncated_by == "MAX_SITES_PER_LAYER"
    assert loads.state(f"{SITE}/fastlib_cuda.abi3.so") == "required"


def test_the_import_graph_costs_its_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """A crafted layer: a chain of 60,000 modules 20 names deep, each importing the next at its top
    and itself in a function, the last the extension, and the first again. What runs at import is
    one walk of the graph, once per layer, however many extensions ask."""
    deep = ".".join(f"p{n}" for n in range(20))
    extension = f"{SITE}/{deep.replace('.', '/')}/_ext.abi3.so"
    for top in ("import", "def main():\n    import"):  # the chain runs at import, or on demand
        loads = LoadSites()
        for n in range(60_000):
            after = f"{deep}._ext\nimport {deep}.m0" if n == 59_999 else f"{deep}.m{n + 1}"
            text = f"import {after}\ndef f():\n    import {deep}.m{n}\n".encode()
            loads.add_source(f"{SITE}/{deep.replace('.', '/')}/m{n}.py", text)
        loads.add_source(f"{SITE}/top.py", f"{top} {deep}.m0\n".encode())
        started = time.process_time()
        states = {loads.state(extension) for _ in range(4096)}
        assert time.process_time() - started < 2.0 and not loads.truncated
        assert states == ({"required"} if top == "import" else {"optional"})


def test_long_and_deep_names_cost_what_their_text_does() -> None:
    """Two crafted sources. One line importing 20,000 names from a module named by 20,000 characters
    built every name whole: 400 MB and 0.35 s for that line. A name 100 packages deep imported 100,000
    times by modules of its top package named each of its prefixes again at each site: 5.9 s for
    200,000 sites, several times the CPU of a name as long two packages deep. Measured against
    that flat name in the same process, so the bound holds on a slow host as on a quick one."""
    loads = LoadSites()
    names = ",".join(f"a{n}" for n in range(20_000))
    loads.add_source(f"{SITE}/pkg/wide.py", f"from {'m' * 20_000} import {names}\n".encode())
    assert loads.names_kept <= 2 and loads.state(f"{SITE}/{'m' * 20_000}/a1.abi3.so") is None
    deep = ".".join(f"p{n}" for n in range(100))
    flat = "p0." + "q" * (len(deep) - 3)  # as long, two packages deep

    def cpu_of(name: str) -> tuple[float, LoadSites]:
        sites_of = LoadSites()
        text = "".join(f"import {name}.x\n" for _ in range(100)).encode()
        started = time.process_time()
        for number in range(1000):
            sites_of.add_source(f"{SITE}/p0/m{number}.py", text)
        assert sites_of.sites_read == 100_000
        return time.process_time() - started, sites_of

    (flat_cpu, _), (deep_cpu, deep_sites) = cpu_of(flat), cpu_of(deep)
    assert deep_cpu < 2 * flat_cpu + 0.05, (deep_cpu, flat_cpu)
    assert deep_sites.state(f"{SITE}/{deep.replace('.', '/')}/x.abi3.so") == "required"


def test_libraries_loaded_by_path_are_named_by_their_block() -> None:
    """torchao 0.7.0 loads `_C*.so` with torch.ops.load_library in a try: and runs on without it."""
    loads = sites(
        (
            "torchao/__init__.py",
            "import torch\ntry:\n    from pathlib import Path\n"
            '    so_files = list(Path(__file__).parent.glob("_C*.so"))\n'
            "    torch.ops.load_library(so_files[0])\nexcept:\n    pass\n",
        )
    )
    assert loads.state(f"{SITE}/torchao/_C.cpython-311-x86_64-linux-gnu.so") == "optional"
    assert loads.state(f"{SITE}/torchao/_C_extra.abi3.so") == "optional"  # `_C*.so` matches it, as glob does
    assert loads.state(f"{SITE}/torchao/_D.abi3.so") is None  # neither named nor matched
    assert loads.state(f"{SITE}/other/_C_other.abi3.so") is None  # torchao's glob is of its own files


def test_a_glob_in_an_outer_block_names_what_an_inner_load_loads() -> None:
    """torchao 0.18: the glob in one `try:`, each match loaded in a `try:` of its own inside a loop, all
    under an `else:`; a function's loads are named by the whole function up to the call."""
    loads = sites(
        (
            "torchao/__init__.py",
            "import torch\nif skip:\n    pass\nelse:\n    try:\n        from pathlib import Path\n"
            '        so_files = list(Path(__file__).parent.glob("_C*.so"))\n'
            "        if len(so_files) > 0:\n            for file in so_files:\n"
            "                try:\n                    torch.ops.load_library(str(file))\n"
            "                except Exception as e:\n                    pass\n"
            "    except Exception as e:\n        pass\n",
        ),
        (
            "pkg/loader.py",
            'def load():\n    name = "libpkg_kernels*.so"\n    if True:\n'
            "        for found in glob.glob(name):\n            ctypes.CDLL(found)\n",
        ),
        ("pkg/__init__.py", 'import ctypes\nctypes.CDLL(path_of("_core"))\n'),
    )
    assert loads.state(f"{SITE}/torchao/_C_cutlass_90a.abi3.so") == "optional"
    assert loads.state(f"{SITE}/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so") == "optional"
    assert loads.state(f"{SITE}/pkg/libpkg_kernels_sm90.so") == "optional"  # loaded on demand
    assert loads.state(f"{SITE}/pkg/_core.abi3.so") == "required"  # a module-level call, named on its line


def test_import_paths_and_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    assert (
        dotted_module(f"{SITE}/vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so")
        == "vllm.vllm_flash_attn._vllm_fa3_C"
    )
    assert dotted_module(f"{SITE}/pkg/__init__.py") == "pkg"
    assert dotted_module("/app/main.py") is None
    monkeypatch.setattr(python_loads, "MAX_BLOCK_HEADERS", 1000)
    loads = LoadSites()
    for number in range(20):
        loads.add_source(f"{SITE}/pkg/m{number}.py", b"if x:\n    import pkg._a\n" * 100)
    assert (
        loads.truncated and loads.headers_read <= 1100
    )  # the layer's budget is spent: it says so, reads no more


def test_where_extensions_load_is_read_in_bounded_work() -> None:
    """A hostile layer: 100,000 imports, load-by-path calls with long scopes and a thousand globs,
    and 4,096 extension modules with GPU code. Each extension's state is a few lookups and at most
    `MAX_GLOBS_PER_LAYER` glob matches, never a pass over every site (that took 261 s of CPU here)."""
    loads = sites(("pkg/__init__.py", "from . import _core\n"))
    imports = b"".join(b"import pkg.m%d\n" % n for n in range(20_000))
    by_path = b"".join(
        b"try:\n    ctypes.CDLL('lib%d_*.so', '%s')\nexcept OSError:\n    pass\n" % (n, b"x" * 1400)
        for n in range(300)
    )
    for n in range(5):
        loads.add_source(f"{SITE}/pkg/imports{n}.py", imports)
        loads.add_source(f"{SITE}/pkg/by_path{n}.py", by_path)
    assert loads.truncated and loads.globs_read == python_loads.MAX_GLOBS_PER_LAYER  # and it says so
    started = time.process_time()
    states = [loads.state(f"{SITE}/pkg/lib{n}_kernels.abi3.so") for n in range(4096)]
    assert time.process_time() - started < 2.0
    assert states[:256] == ["optional"] * 256 and states[300:] == [None] * (4096 - 300)
    assert loads.state(f"{SITE}/pkg/_core.abi3.so") == "required"
    # a quote and 1,900 stars before each call: the first pattern for globs backtracked over every split
    # (18 ms a scope, 75 s for a layer's 4,096 calls); the quoted names are now read in one pass
    stars = b"".join(
        b"try:\n    x = '%s\n    ctypes.CDLL(x)\nexcept OSError:\n    pass\n" % (b"*" * 1900)
        for _ in range(300)
    )
    started = time.process_time()
    sites(("pkg/stars.py", stars.decode()))
    assert time.process_time() - started < 0.5


# -- what the loader can load, which build a package selects, which package ships a file


def test_a_library_loads_only_when_what_it_links_is_there_all_the_way_down() -> None:
    carried = {"libcudart.so.13", "libcusparse.so.12"}
    links = {"libcusparse.so.12": ["libnvJitLink.so.13"]}
    assert (
        MissingLinks(carried, links).of(["libcudart.so.13", "libcuda.so.1"]) == []
    )  # the driver is the host's
    assert MissingLinks(carried, links).of(["libcusparse.so.12"]) == [
        "libcusparse.so.12 -> libnvJitLink.so.13"
    ]
    assert MissingLinks(carried, links).of(["libcublas.so.13"]) == ["libcublas.so.13"]


def test_a_way_to_a_missing_library_is_found_once_and_shown_short() -> None:
    """Every carried library's way to a missing one comes from one walk back from it, cycles too; a
    long way is shown to its fourth library and its end."""
    chain = [f"libcudart.so.1.{n}" for n in range(8)]
    links = {name: [after] for name, after in itertools.pairwise(chain)}
    links[chain[-1]] = ["libcublas.so.13", "libcuda.so.1"]  # missing; the driver's is the host's
    links["libcufft.so.12"] = ["libcurand.so.10"]
    links["libcurand.so.10"] = ["libcufft.so.12", chain[5]]  # a cycle that also reaches the chain
    resolve = MissingLinks({*chain, "libcufft.so.12", "libcurand.so.10"}, links)
    assert resolve.of([chain[0]]) == [
        "libcudart.so.1.0 -> libcudart.so.1.1 -> libcudart.so.1.2 -> libcudart.so.1.3 -> ... -> libcublas.so.13"
    ]
    assert resolve.of([chain[4]]) == [
        "libcudart.so.1.4 -> libcudart.so.1.5 -> libcudart.so.1.6 -> libcudart.so.1.7 -> libcublas.so.13"
    ]
    assert resolve.of(["libcufft.so.12", "libnpp.so.13"]) == [
        "libcufft.so.12 -> libcurand.so.10 -> libcudart.so.1.5 -> libcudart.so.1.6 -> ... -> libcublas.so.13",
        "libnpp.so.13",
    ]
    assert (
        MissingLinks(
            {"libcufft.so.12", "libcurand.so.10"},
            {"libcufft.so.12": ["libcurand.so.10"], "libcurand.so.10": ["libcufft.so.12"]},
        ).of(["libcufft.so.12"])
        == []
    )


def build(name: str, missing: tuple[str, ...] = ()) -> FileArchs:
    path = f"{SITE}/bitsandbytes/{name}"
    return FileArchs(path=path, missing=list(missing), cuda_build=build_version(path))


def test_builds_for_several_cuda_versions_are_alternatives_the_runtime_picks() -> None:
    assert build_version("libbitsandbytes_cuda128.so") == "12.8"
    assert build_version("libbitsandbytes_cuda118.so") == "11.8"
    assert build_version("foo_cu12.so") == "12" and build_version("libfoo.so") is None
    cu13 = ("libcudart.so.13",)
    builds = [build("libbitsandbytes_cuda121.so"), build("libbitsandbytes_cuda124.so"), build("libbitsandbytes_cuda128.so"),
              build("libbitsandbytes_cuda130.so", cu13), build("libbitsandbytes_cuda132.so", cu13)]  # fmt: skip
    name = lambda found: found.path.rsplit("_", 1)[1] if found else None  # noqa: E731
    assert name(chosen_build(builds, "12.8")) == "cuda128.so"  # the same version
    assert name(chosen_build(builds, "12.6")) == "cuda124.so"  # else the newest of its major below it
    assert name(chosen_build(builds, "12.0")) == "cuda121.so"  # else the oldest of its major above it
    assert name(chosen_build(builds, "13.0")) is None  # CUDA 13's builds cannot load: never another major
    assert name(chosen_build(builds, None)) == "cuda128.so"  # no runtime known: the newest loadable
    assert name(chosen_build(builds, "12")) == "cuda128.so"  # only the major known: its newest
    # bitsandbytes before 0.50.0 loads the build of torch's CUDA version or none
    assert name(chosen_build(builds, "12.4", exact=True)) == "cuda124.so"
    assert name(chosen_build(builds, "12.6", exact=True)) is None
    assert name(chosen_build(builds, "12.0", exact=True)) is None
    versions = {
        "0.43.1": True,
        "0.49.2": True,
        "0.50.0": False,
        "0.50.2": False,
        "1.0": False,
        "0.45.0.dev0": True,
    }
    for version, exact in versions.items():
        package = PackageFacts(id="python:bitsandbytes", name="bitsandbytes", version=version, kind="python")
        assert exact_builds_only(package) is exact, version
    other = PackageFacts(id="python:foo", name="foo", version="0.1", kind="python")
    assert not exact_builds_only(other) and not exact_builds_only(None)


def test_a_package_with_no_build_for_the_runtime_runs_without_them_and_says_so() -> None:
    """bitsandbytes 0.45.5 beside torch cu126 loads `libbitsandbytes_cuda126.so` or nothing; shipping
    only builds up to 12.4 here, it loads none (its `cextension.py` then falls back to its CPU library),
    so none of its builds counts, sets a CUDA floor, or stops the image: each GPU's answer says so.
    0.50.0 and later take the newest build of the same major below the runtime instead."""
    code = [ContainerArchs(sass=("50", "60", "70", "75", "80", "86", "89", "90"))]
    builds = [
        FileArchs(path=f"{SITE}/bitsandbytes/libbitsandbytes_cuda{v}.so", containers=code, needed=["libcudart.so.12"])
        for v in ("121", "124")
    ]  # fmt: skip
    torch = FileArchs(
        path=f"{SITE}/torch/lib/libtorch_cuda.so", containers=[ContainerArchs(sass=("80", "90", "120"))]
    )

    def annotated(version: str) -> GpuArchs:
        distributions = {
            f"{SITE}/bitsandbytes-{version}.dist-info": Distribution(name="bitsandbytes", version=version, top_level=["bitsandbytes"]),
            f"{SITE}/torch-2.7.1.dist-info": Distribution(name="torch", version="2.7.1", top_level=["torch"]),
        }  # fmt: skip
        files, packages = annotate(
            [*builds, torch], missing=MissingLinks({"libcudart.so.12"}), runtime_cuda="12.6",
            distributions=distributions, imports={},
        )  # fmt: skip
        return GpuArchs(files=files, packages=packages, runtime_cuda="12.6")

    old = annotated("0.45.5")
    assert [f.selected for f in old.files[:2]] == [False, False]
    line = (
        f"{SITE}/bitsandbytes/{{libbitsandbytes_cuda121.so … libbitsandbytes_cuda124.so}} (bitsandbytes 0.45.5):"
        " no build for CUDA 12.6, the image's CUDA runtime (builds for 12.1, 12.4); bitsandbytes 0.45.5 loads"
        " only the build of that version, so none"
    )
    hopper = gpu_code.judge(old, (9, 0))
    assert hopper.runs and hopper.without == [line]
    assert gpu_code.judge(old, (9, 0), rule="strict").without == [line]
    assert (
        f"runs without {SITE}/bitsandbytes/{{libbitsandbytes_cuda121.so … libbitsandbytes_cuda124.so}}"
        " (bitsandbytes 0.45.5) on compute capability 8.0–9.0, 12.0–12.1"
    ) in gpu_code.caveats(old)
    new = annotated("0.50.0")
    assert [f.selected for f in new.files[:2]] == [False, True]
    assert gpu_code.judge(new, (9, 0)).without == []
    unloadable = GpuArchs(files=[f.model_copy(update={"missing": ["libcudart.so.12"]}) for f in old.files[:2]] + [old.files[2]],
                          packages=old.packages, runtime_cuda="12.6")  # fmt: skip
    assert gpu_code.judge(unloadable, (9, 0)).without == []  # the loader could load none of them anyway


def test_a_config_variable_names_the_build_a_package_loads() -> None:
    """`BNB_CUDA_VERSION=124` makes bitsandbytes load `libbitsandbytes_cuda124.so` whatever its runtime
    (every version's `cextension.py`): that build is the one selected, loadable or not; a value naming
    no build it ships leaves none, and every GPU's answer says which variable chose what."""
    assert build_overrides({"BNB_CUDA_VERSION": "124"}) == {"bitsandbytes": "12.4"}
    assert build_overrides({"BNB_CUDA_VERSION": "130"}) == {"bitsandbytes": "13.0"}
    for ignored in ("", " ", "12.4", "1240", "cuda124", "١٢٤"):
        assert build_overrides({"BNB_CUDA_VERSION": ignored}) == {}, ignored
    assert gpu_facts({"config": {"Env": ["BNB_CUDA_VERSION=121"]}}).build_overrides == {
        "bitsandbytes": "12.1"
    }
    code = [ContainerArchs(sass=("75", "80", "90"))]
    builds = [
        FileArchs(path=f"{SITE}/bitsandbytes/libbitsandbytes_cuda{v}.so", containers=code, needed=["libcudart.so.12"])
        for v in ("124", "128")
    ]  # fmt: skip
    distributions = {
        f"{SITE}/bitsandbytes-0.50.2.dist-info": Distribution(name="bitsandbytes", version="0.50.2", top_level=["bitsandbytes"])
    }  # fmt: skip

    def chosen(overrides: dict[str, str]) -> tuple[list[bool], GpuArchs]:
        files, packages = annotate(
            builds, missing=MissingLinks({"libcudart.so.12"}), runtime_cuda="12.8",
            distributions=distributions, imports={}, overrides=overrides,
        )  # fmt: skip
        archs = GpuArchs(files=files, packages=packages, runtime_cuda="12.8", build_overrides=overrides)
        return [f.selected for f in files], archs

    assert chosen({})[0] == [False, True]
    assert chosen({"bitsandbytes": "12.4"})[0] == [True, False]
    assert chosen({"other": "12.4"})[0] == [False, True]
    selected, archs = chosen({"bitsandbytes": "12.1"})
    assert selected == [False, False]
    assert gpu_code.judge(archs, (9, 0)).without == [
        f"{SITE}/bitsandbytes/{{libbitsandbytes_cuda124.so … libbitsandbytes_cuda128.so}} (bitsandbytes 0.50.2):"
        " the image's BNB_CUDA_VERSION names CUDA 12.1's build (builds for 12.4, 12.8); bitsandbytes 0.50.2"
        " loads only the build of that version, so none"
    ]


def test_packages_are_distributions_nvidia_libraries_or_application_directories() -> None:
    dist = distribution_from_record(
        f"{SITE}/onnxruntime_gpu-1.31.1.dist-info",
        b"onnxruntime/__init__.py,sha256=x,1\nonnxruntime_gpu-1.31.1.dist-info/RECORD,,\n",
    )
    assert dist is not None and (dist.name, dist.version, dist.top_level) == (
        "onnxruntime-gpu",
        "1.31.1",
        ["onnxruntime"],
    )
    found = package_of(
        f"{SITE}/onnxruntime/capi/libonnxruntime_providers_cuda.so", {f"{SITE}/onnxruntime": dist}
    )
    assert (found.id, found.kind, found.version) == ("python:onnxruntime-gpu", "python", "1.31.1")
    assert package_of(f"{SITE}/nvidia/cu13/lib/libcublasLt.so.13", {}).kind == "nvidia"
    assert package_of("/opt/app/lib/libkernels.so", {}).id == "app:/opt/app/lib"
    faiss = distribution_from_record(  # auditwheel vendors its libraries in `<name>.libs`
        f"{SITE}/faiss_gpu_cu12-1.14.1.post1.dist-info",
        b"faiss/__init__.py,sha256=x,1\nfaiss_gpu_cu12.libs/libfaiss-6b43fd57.so,sha256=y,2\n",
    )
    assert faiss is not None and faiss.top_level == ["faiss", "faiss_gpu_cu12.libs"]
    index = distribution_index({f"{SITE}/faiss_gpu_cu12-1.14.1.post1.dist-info": faiss})
    vendored = package_of(f"{SITE}/faiss_gpu_cu12.libs/libfaiss-6b43fd57.so", index)
    assert (vendored.id, vendored.version) == ("python:faiss-gpu-cu12", "1.14.1.post1")
    assert package_of(f"{SITE}/faiss/_swigfaiss.so", index).id == "python:faiss-gpu-cu12"  # one package
    assert nvidia_profiling_library("/usr/local/cuda/lib64/libcupti.so.12")
    assert not nvidia_profiling_library(f"{SITE}/nvidia/cu13/lib/libcufft.so.12")


def test_nvidia_packages_with_a_python_front_end_are_packages_not_cuda_libraries() -> None:
    """`nvidia/` is a namespace several distributions share: CUDA's libraries lie in a `lib/` below it
    (`nvidia/cu13/lib`, `nvidia/cublas/lib`, `nvidia/cublasmp/cu13/lib`), NVIDIA's wheels with a
    Python front end do not (DALI's `nvidia/dali/libdali.so`), and those belong to their distribution,
    judged like any package, not exempt as a CUDA library an image carries more of than it calls."""
    dali = distribution_from_record(
        f"{SITE}/nvidia_dali_cuda130-2.4.0.dist-info",
        b"nvidia/__init__.py,a,1\nnvidia/dali/__init__.py,b,2\nnvidia/dali/libdali.so,c,3\n"
        b"nvidia/dali/.libs/libcvcuda-90d2d242.so.0,d,4\n",
    )
    cublas = distribution_from_record(
        f"{SITE}/nvidia_cublas-13.1.0.3.dist-info", b"nvidia/cu13/lib/libcublas.so.13,a,1\n"
    )
    assert dali is not None and dali.top_level == ["nvidia/dali"]
    assert cublas is not None and cublas.top_level == ["nvidia/cu13"]
    index = distribution_index({f"{SITE}/{d.name}.dist-info": d for d in (cublas, dali)})
    for path in ("nvidia/dali/libdali.so", "nvidia/dali/.libs/libcvcuda-90d2d242.so.0", "nvidia/dali/"):
        found = package_of(f"{SITE}/{path}", index)
        assert (found.id, found.kind, found.version) == ("python:nvidia-dali-cuda130", "python", "2.4.0"), (
            path
        )
        assert not nvidia_library(f"{SITE}/{path}"), path
    for path in ("nvidia/cu13/lib/libcublas.so.13", "nvidia/cublasmp/cu13/lib/libcublasmp.so.0",
                 "nvidia/cu13/nvvm/lib64/libnvvm.so", "cusparselt/lib/libcusparseLt.so.0"):  # fmt: skip
        assert nvidia_library(f"{SITE}/{path}") and package_of(f"{SITE}/{path}", index).kind == "nvidia", path
    assert nvidia_library("/usr/local/cuda-12.4/targets/x86_64-linux/lib/libnvrtc-builtins.so.12.4")


def elf_entry(path: str, data: bytes) -> tuple[TarEntry, bytes]:
    return TarEntry(path=path, kind="file", size=len(data), mode=0o755), data


def test_code_the_image_cannot_load_names_no_cuda() -> None:
    """A program linking CUDA 13's runtime sets CUDA 13 where the image carries that runtime, and
    nothing where it does not: the loader could not load it."""
    from tests.nvidia_wheels import CUDA_RUNTIME_13, nvcc_program, wheel_member

    program = nvcc_program(["arch=compute_80,code=sm_80"]).read_bytes()  # links libcudart.so.13
    _, cudart = wheel_member(CUDA_RUNTIME_13, "/libcudart.so.13")
    torch = (
        TarEntry(path=f"{SITE}/torch/version.py", kind="file", size=29, mode=0o644),
        b"cuda: Optional[str] = '12.8'\n",
    )
    app = elf_entry("/app/bin/solver", program)
    without = combine([collect_layer([torch, app])])
    assert without[0] is not None and without[0].cuda == "12.8" and without[1] is not None
    (solver,) = without[1].files
    assert solver.missing == ["libcudart.so.13"] and not gpu_code.has_code(without[1])
    with_runtime = combine(
        [collect_layer([torch, app, elf_entry("/usr/local/cuda-13.0/lib64/libcudart.so.13", cudart)])]
    )
    assert with_runtime[0] is not None and with_runtime[0].cuda == "13.0"
    assert with_runtime[1] is not None and gpu_code.has_code(with_runtime[1])


# -- the PTX ISA table and the drivers that JIT it (placement.cuda_drivers)


def test_the_ptx_isa_table_covers_every_toolkit_from_cuda_9() -> None:
    assert ptx_toolkit_of("6.0") == ((9, 0), True)
    assert ptx_toolkit_of("6.4") == ((10, 1), True)
    assert ptx_toolkit_of("6.5") == ((10, 2), True)
    assert ptx_toolkit_of("8.6") == ((12, 7), True)
    assert ptx_toolkit_of("9.5") == ((13, 5), True)
    assert ptx_toolkit_of("9.6") == ((13, 6), False)  # newer than the newest known toolkit
    floor = ptx_driver_floor("6.4")
    assert floor is not None and floor[0] == "418.39"
    floor = ptx_driver_floor("8.6")
    assert floor is not None and floor[0] == "570.26"  # no 12.7 driver: 12.8's is the first listed


def legacy(isa: str) -> GpuFacts:
    """An image of sm_70 SASS plus PTX, as CUDA 10.1 built them."""
    file = FileArchs(
        path="/app/lib/libold.so", containers=[ContainerArchs(sass=("70",), ptx=("70",), ptx_isa=isa)]
    )
    return GpuFacts(archs=GpuArchs(files=[file]))


def test_legacy_ptx_runs_on_new_gpus_and_a_newer_isa_than_any_known_is_refused() -> None:
    assert gpu_reasons(legacy("6.4"), "8.0", "535.104.05", "12.2") == []  # was: "JIT needs 590.44.01"
    too_new = gpu_reasons(legacy("9.6"), "9.0", "580.65.06", "13.0")
    assert len(too_new) == 1 and "PTX ISA 9.6 is newer than every toolkit known here" in too_new[0]
    assert gpu_reasons(legacy("9.5"), "9.0", "580.65.06", "13.0")  # 9.5 is refused there too
    assert gpu_reasons(legacy("9.6"), "9.0", "600.10", "13.6") == []  # a driver that says it is new enough
    assert ptx_cuda_reason("9.6", "13.5") is not None and ptx_cuda_reason("9.5", "13.5") is None


# -- one decisive reason, warnings by minor-version compatibility, summaries without holes


def test_a_driver_floor_rejection_comes_alone() -> None:
    file = FileArchs(path="/app/lib/libk.so", containers=[ContainerArchs(sass=("80",))])
    gpu = GpuFacts(
        inferred=InferredCuda(cuda="13.0", set_by="/app/lib/libk.so: links libcudart.so.13"),
        archs=GpuArchs(files=[file]),
    )
    reasons = gpu_reasons(
        gpu, "12.0", "575.51.03", "12.9"
    )  # no code for 12.0 either, but the runtime cannot start
    assert reasons == [
        "driver 575.51.03: CUDA 13.x needs driver >= 580 (minor-version compatibility); the image carries CUDA 13.0"
        " (/app/lib/libk.so: links libcudart.so.13)"
    ]


def test_a_newer_minor_inside_the_declared_major_is_not_a_new_driver_need() -> None:
    gpu = GpuFacts(cuda_version="12.4", inferred=InferredCuda(cuda="12.9", set_by="x: cuda = '12.9'"))
    said = declared_vs_carried(gpu)
    assert said is not None and "both run on driver >= 525.60.13" in said
    warning = cuda_mismatch(gpu)
    assert (
        warning is not None
        and "minor-version compatibility" in warning
        and "driver for CUDA 12.9" not in warning
    )
    other_major = cuda_mismatch(GpuFacts(cuda_version="12.8", inferred=InferredCuda(cuda="13.0", set_by="x")))
    assert other_major is not None and "needs a driver for CUDA 13" in other_major


@pytest.mark.parametrize("rule", ["dispatch", "strict"])
def test_summaries_name_where_code_runs_without_holes(rule: gpu_code.Rule) -> None:
    file = FileArchs(path="/app/lib/libk.so", containers=[ContainerArchs(sass=("80", "120"))])
    assert gpu_code.summary(GpuArchs(files=[file]), rule).endswith("compute capability 8.0–8.9, 12.0–12.1")


# -- packages on one GPU (placement.gpu_code, the dispatch rule)


def archs(*files: FileArchs, packages: tuple[PackageFacts, ...] = ()) -> GpuArchs:
    return GpuArchs(files=list(files), packages=list(packages))


def test_a_package_runs_where_some_of_its_libraries_do_and_names_the_rest() -> None:
    pkg = PackageFacts(id="python:pkg", name="pkg", version="1.0", kind="python")
    main = FileArchs(path=f"{SITE}/pkg/_C.abi3.so", package=pkg.id, containers=[
        ContainerArchs(sass=("75", "80", "90", "100", "120"), count=30), ContainerArchs(sass=("75",), count=7),
        ContainerArchs(sass=("89", "120f"), count=5)])  # fmt: skip
    hopper_only = FileArchs(
        path=f"{SITE}/pkg/_fa3.abi3.so", package=pkg.id, containers=[ContainerArchs(sass=("90a",))]
    )
    image = archs(main, hopper_only, packages=(pkg,))
    blackwell = gpu_code.judge(image, (10, 0))
    assert blackwell.runs and blackwell.without == [
        f"{SITE}/pkg/_fa3.abi3.so: no kernel image for compute capability 10.0 (SASS sm_90a, no PTX); used on other GPUs"
    ]
    volta = gpu_code.judge(image, (7, 0))
    assert not volta.runs and "no GPU code of pkg 1.0 runs here" in volta.reasons[0]
    optional = pkg.model_copy(update={"optional": True})
    assert gpu_code.judge(archs(main, hopper_only, packages=(optional,)), (7, 0)).runs  # it runs without them
    strict = gpu_code.judge(image, (9, 0), rule="strict")
    assert not strict.runs  # the strict rule: its sm_75-only containers have no image for Hopper


def test_a_package_built_for_some_gpus_alone_is_fast_paths_where_other_code_runs() -> None:
    """cuequivariance-ops-torch-cu13 0.13.0's extension, loaded at import, is built for sm_90a, sm_100a,
    sm_103a and sm_120a alone; it links cuequivariance-ops-cu13's `libcue_ops.so`, whose generic kernels
    run from sm_75 on, and its Python picks its fast paths by compute capability. On an A100 the image
    runs without them. An image with nothing else to run there does not run."""
    ops = PackageFacts(
        id="python:cuequivariance-ops-cu13", name="cuequivariance-ops-cu13", version="0.13.0", kind="python"
    )
    ext = PackageFacts(
        id="python:cuequivariance-ops-torch-cu13",
        name="cuequivariance-ops-torch-cu13",
        version="0.13.0",
        kind="python",
    )
    library = FileArchs(path=f"{SITE}/cuequivariance_ops/lib/libcue_ops.so", package=ops.id, containers=[
        ContainerArchs(sass=("75", "80", "86", "89", "90", "100", "103", "120", "121a"), ptx=("120",)),
        ContainerArchs(sass=("100f",))])  # fmt: skip
    extension = FileArchs(path=f"{SITE}/cuequivariance_ops_torch/_ext/ext.so", package=ext.id, imported="required",
                          containers=[ContainerArchs(sass=("90a", "100a", "103a", "120a"))])  # fmt: skip
    ampere = gpu_code.judge(archs(library, extension, packages=(ops, ext)), (8, 0))
    assert ampere.runs and ampere.without == [
        f"{SITE}/cuequivariance_ops_torch/_ext/ext.so: no kernel image for compute capability 8.0 (SASS sm_90a,"
        " sm_100a, sm_103a, sm_120a, no PTX); cuequivariance-ops-torch-cu13 0.13.0 is built for some GPUs alone:"
        " used on other GPUs"
    ]
    assert gpu_code.judge(archs(library, extension, packages=(ops, ext)), (9, 0)).without == []
    alone = gpu_code.judge(archs(extension, packages=(ext,)), (8, 0))
    assert (
        not alone.runs and "no GPU code of cuequivariance-ops-torch-cu13 0.13.0 runs here" in alone.reasons[0]
    )
    generic = extension.model_copy(update={"containers": [ContainerArchs(sass=("90",))]})  # not fast paths
    assert not gpu_code.judge(archs(library, generic, packages=(ops, ext)), (8, 0)).runs


def test_where_a_package_runs_only_through_ptx_what_it_loads_at_import_without_code_fails() -> None:
    """Built for sm_70 to sm_90, with PTX compute_80 in one library only (gpu4pyscf-cuda12x 1.9.0's
    shape): on Blackwell the package runs only through that PTX, so a library built like it and loaded
    at import, with nothing for Blackwell, fails there. Builds only for older GPUs or for one
    architecture, and libraries loaded on demand, are extensions used elsewhere; where the package has
    SASS for the GPU, its gaps are too."""
    pkg = PackageFacts(id="python:pkg", name="pkg", version="1.0", kind="python")

    def library(name: str, *containers: ContainerArchs, imported: str | None = "required") -> FileArchs:
        return FileArchs(path=f"{SITE}/pkg/lib/{name}", package=pkg.id, containers=list(containers),
                         imported=imported)  # type: ignore[arg-type]  # fmt: skip

    helper = library("libhelper.so", ContainerArchs(sass=("70", "80", "90"), ptx=("80",)))
    gint = library("libgint.so", ContainerArchs(sass=("70", "80", "90")))
    turing = library("libturing.so", ContainerArchs(sass=("75",)))
    hopper = library("libhopper.so", ContainerArchs(sass=("90a",)))
    solvent = library("libsolvent.so", ContainerArchs(sass=("70", "80", "90")), imported="optional")
    unknown = library("libunknown.so", ContainerArchs(sass=("70", "80", "90")), imported=None)
    blackwell = gpu_code.judge(
        archs(helper, gint, turing, hopper, solvent, unknown, packages=(pkg,)), (10, 0)
    )
    assert blackwell.reasons == [
        f"compute capability 10.0: {SITE}/pkg/lib/libgint.so has no kernel image for compute capability 10.0"
        " (SASS sm_70–sm_90, no PTX): pkg 1.0 loads it at import, and none of its code was built for this"
        " GPU: its other libraries run here only through PTX"
    ]
    others = archs(helper, turing, hopper, solvent, unknown, packages=(pkg,))
    fine = gpu_code.judge(others, (10, 0))
    assert (
        fine.runs
        and len(fine.without) == 4
        and all(line.endswith("used on other GPUs") for line in fine.without)
    )
    ampere = gpu_code.judge(
        archs(helper, gint, library("lib86.so", ContainerArchs(sass=("86",))), packages=(pkg,)), (8, 0)
    )
    assert ampere.runs  # SASS sm_80 was built for it: lib86.so is a build for other GPUs
    newer = library("libnewer.so", ContainerArchs(sass=("70", "80", "90", "100")))
    assert (
        gpu_code.judge(archs(helper, gint, newer, packages=(pkg,)), (12, 0)).reasons != []
    )  # sm_100 is not 12.0
    assert gpu_code.judge(
        archs(helper, gint, newer, packages=(pkg,)), (10, 3)
    ).runs  # SASS sm_100 runs on 10.3


def test_optional_code_built_only_for_older_gpus_is_loaded_where_the_image_was_built_before_the_gpu() -> None:
    """vLLM 0.6.1's shape: its own kernels built for sm_70 to sm_90 with PTX compute_90, and the
    FlashAttention package it loads on demand (optional) built for sm_80 and sm_90 alone. Its selector
    takes FlashAttention from compute capability 8.0 up: on a T4 it runs without it (the builds start
    past the T4); on a B200, where vLLM runs only through its PTX, it was written before the GPU and
    picks FlashAttention there too, which has nothing for it: a reason. A build of the image for
    Blackwell knows the GPU, and runs there without it."""
    vllm = PackageFacts(id="python:vllm", name="vllm", version="0.6.1", kind="python", optional=True)
    fa = PackageFacts(id="python:vllm-flash-attn", name="vllm-flash-attn", version="2.6.1", kind="python",
                      optional=True)  # fmt: skip
    own = FileArchs(path=f"{SITE}/vllm/_C.abi3.so", package=vllm.id, imported="optional",
                    containers=[ContainerArchs(sass=("70", "75", "80", "86", "89", "90"), ptx=("90",))])  # fmt: skip
    flash = FileArchs(path=f"{SITE}/vllm_flash_attn_2_cuda.abi3.so", package=fa.id, imported="optional",
                      containers=[ContainerArchs(sass=("80", "90"))])  # fmt: skip
    image = archs(own, flash, packages=(vllm, fa))
    turing = gpu_code.judge(image, (7, 5))
    assert turing.runs and turing.without == [
        f"{flash.path}: no kernel image for compute capability 7.5 (SASS sm_80, sm_90, no PTX);"
        " vllm-flash-attn 2.6.1 runs without it"
    ]
    assert gpu_code.judge(image, (9, 0)).runs
    blackwell = gpu_code.judge(image, (10, 0))
    assert blackwell.reasons == [
        f"compute capability 10.0: {flash.path} has no kernel image for compute capability 10.0 (SASS sm_80,"
        f" sm_90, no PTX): vllm-flash-attn 2.6.1 {gpu_code.BUILT_BEFORE}"
    ]
    for_blackwell = own.model_copy(
        update={"containers": [ContainerArchs(sass=("80", "90", "100"), ptx=("100",))]}
    )
    assert gpu_code.judge(archs(for_blackwell, flash, packages=(vllm, fa)), (10, 0)).runs
    with_ptx = flash.model_copy(update={"containers": [ContainerArchs(sass=("80",), ptx=("80",))]})
    assert gpu_code.judge(archs(own, with_ptx, packages=(vllm, fa)), (10, 0)).runs  # it JITs here
    hopper_only = flash.model_copy(update={"containers": [ContainerArchs(sass=("90a",))]})
    assert gpu_code.judge(archs(own, hopper_only, packages=(vllm, fa)), (10, 0)).runs  # a fast path


def test_each_optional_file_built_before_the_gpu_is_a_reason_its_fast_paths_are_not() -> None:
    """vLLM 0.8.5's files beside torch built up to sm_90 with PTX, in a package whose every extension
    import is guarded (as `_custom_ops.py` imports `_C`), so it reads as optional. On a B200, where
    torch runs only through its PTX, vLLM's `_C` (sm_70 to sm_90, and sm_90a kernels) and
    FlashAttention 2 (sm_80, sm_90) were built before the GPU: reasons. FlashMLA (sm_90a alone) and
    FlashAttention 3 (sm_80 with sm_90a: vLLM takes it on Hopper alone) are fast paths of a GPU before
    it: it runs without them. A rule for the whole package, which the fast paths kept from applying,
    left the B200 eligible "without" all of them."""
    torch = PackageFacts(id="python:torch", name="torch", version="2.6.0", kind="python")
    vllm = PackageFacts(id="python:vllm", name="vllm", version="0.8.5", kind="python", optional=True)
    libtorch = FileArchs(path=f"{SITE}/torch/lib/libtorch_cuda.so", package=torch.id,
                         containers=[ContainerArchs(sass=("50", "60", "70", "75", "80", "86", "90"), ptx=("90",))])  # fmt: skip

    def extension(name: str, *containers: ContainerArchs) -> FileArchs:
        return FileArchs(
            path=f"{SITE}/vllm/{name}", package=vllm.id, imported="optional", containers=list(containers)
        )

    core = extension(
        "_C.abi3.so", ContainerArchs(sass=("70", "80", "90"), count=20), ContainerArchs(sass=("90a",))
    )
    fa2 = extension("vllm_flash_attn/_vllm_fa2_C.abi3.so", ContainerArchs(sass=("80", "90"), count=60))
    fa3 = extension("vllm_flash_attn/_vllm_fa3_C.abi3.so", ContainerArchs(sass=("80", "90a"), count=172))
    mla = extension("_flashmla_C.abi3.so", ContainerArchs(sass=("90a",)))
    image = archs(libtorch, core, fa2, fa3, mla, packages=(torch, vllm))
    blackwell = gpu_code.judge(image, (10, 0))
    assert len(blackwell.reasons) == 2 and all(
        gpu_code.BUILT_BEFORE in reason for reason in blackwell.reasons
    )
    assert (
        f": {core.path} has no" in blackwell.reasons[0]
        and f": {fa2.path} (FlashAttention 2)" in blackwell.reasons[1]
    )
    assert gpu_code.judge(image, (9, 0)).runs and gpu_code.judge(image, (7, 5)).runs


def test_a_package_with_code_for_a_gpu_in_a_few_odd_objects_only_was_not_built_for_it() -> None:
    """PaddlePaddle 2.6.2's shape, its containers as the scan read them from its wheel: `libphi.so` has
    654 containers built for sm_61 to sm_86 and one odd object built for sm_35 to sm_90, and
    warp-ctc's libraries three more of those. On an H100 4 of its 819 generic containers have code:
    the package was not built for Hopper, and is refused there. A build for that GPU alone (an
    `sm_90a` fast path) is code built for it, and so is a share of 1 in 20."""
    pkg = PackageFacts(id="python:paddle", name="paddle", version="2.6.2", kind="python")
    odd = ContainerArchs(sass=("35", "50", "52", "60", "61", "70", "90"))
    phi = FileArchs(path=f"{SITE}/paddle/libs/libphi.so", package=pkg.id, containers=[
        ContainerArchs(sass=("61", "70", "75", "80", "86"), count=654), odd])  # fmt: skip
    core = FileArchs(path=f"{SITE}/paddle/base/libpaddle.so", package=pkg.id,
                     containers=[ContainerArchs(sass=("61", "70", "75", "80", "86"), count=122)])  # fmt: skip
    ctc = FileArchs(path=f"{SITE}/paddle/libs/libwarpctc.so", package=pkg.id,
                    containers=[odd.model_copy(update={"count": 3})])  # fmt: skip
    hopper = gpu_code.judge(archs(phi, core, ctc, packages=(pkg,)), (9, 0))
    assert hopper.reasons == [
        "compute capability 9.0: paddle 2.6.2 was not built for this GPU: 4 of its 780 containers have a"
        f" kernel image for it (in {SITE}/paddle/libs/libphi.so, {SITE}/paddle/libs/libwarpctc.so); the rest:"
        " SASS sm_61–sm_86, no PTX"
    ]
    assert gpu_code.judge(archs(phi, core, ctc, packages=(pkg,)), (8, 6)).runs
    alone = gpu_code.judge_file(phi, (9, 0))
    assert not alone.runs and alone.lacks((9, 0)) == (
        f"{SITE}/paddle/libs/libphi.so was not built for compute capability 9.0: 1 of its 655 containers"
        " has a kernel image for it (the rest: SASS sm_61–sm_86, no PTX)"
    )
    fast = FileArchs(path=f"{SITE}/paddle/libs/libhopper.so", package=pkg.id,
                     containers=[ContainerArchs(sass=("90a",))])  # fmt: skip
    assert gpu_code.judge(archs(phi, core, ctc, fast, packages=(pkg,)), (9, 0)).runs  # built for Hopper
    wide = ctc.model_copy(update={"containers": [odd.model_copy(update={"count": 41})]})  # 42 of 818
    assert gpu_code.judge(archs(phi, core, wide, packages=(pkg,)), (9, 0)).runs
    optional = pkg.model_copy(update={"optional": True})
    unneeded = gpu_code.judge(archs(phi, core, ctc, packages=(optional,)), (9, 0))
    assert unneeded.runs and unneeded.without[0].endswith("; the image runs without paddle 2.6.2")
