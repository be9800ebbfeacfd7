"""JAX's computations, compiled at run time with the `ptxas` XLA finds, judged per GPU against JAX's own
source and NVIDIA's own `ptxas`, both from PyPI (cached, never committed).

* the directory JAX names for XLA is what `_cuda_path` of each pinned `jax` wheel returns, run here over a
  made site directory (`CUDA_ROOT`, then `nvidia.cu13`, then `nvidia.cuda_nvcc`);
* an image of jax-cuda12-plugin 0.7.2 beside NVIDIA's nvcc wheel, read by the scanner's layer walk (which
  reads each `ptxas`'s release from its own banner), is placed on the fleet: CUDA 12.6's `ptxas` is refused
  on Blackwell ("ptxas too old": jaxlib 0.4.34 on an RTX 50xx), 12.8's runs on B200 and RTX 5090 but not
  on a GB10 (sm_121a came with 12.9); with no `ptxas` it runs nowhere, unless `XLA_FLAGS` lets the driver
  compile.
"""

from __future__ import annotations

import ast
import importlib
import os
import pathlib
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

from placement.image_facts import ImageFacts
from placement.jax_compiler import jax_refusal
from scanner.layers.code_loading import Distribution
from scanner.layers.cuda_jit_tools import with_jit_tools
from scanner.layers.jax_ptxas import jax_facts, with_jax_ptxas
from scanner.models import GpuArchs, GpuFacts, ImageReport, JaxFacts, LibcVerdict, PlatformReport
from tests.gpu_packages import SITE, layer_evidence, libraries, python_package
from tests.pypi_members import RemoteWheel, member_files
from tests.test_gpu_packages import ALL, FLEET_580, archs_of, eligible, image, only, place

pytestmark = pytest.mark.timeout(900)

JAX = {
    "0.4.34": RemoteWheel(
        "jax",
        "jax-0.4.34-py3-none-any.whl",
        "b957ca1fc91f7343f91a186af9f19c7f342c946f95a8c11c7f1e5cdfe2e58d9e",
    ),
    "0.4.35": RemoteWheel(
        "jax",
        "jax-0.4.35-py3-none-any.whl",
        "fa99e909a31424abfec750019a6dd36f6acc18a6e7d40e2c0086b932cc351325",
    ),
    "0.7.2": RemoteWheel(
        "jax",
        "jax-0.7.2-py3-none-any.whl",
        "e7e32f9be51ae5cc6854225958c57de8cca2187d279844338465b15e8a1fe7f2",
    ),
    "0.12.0": RemoteWheel(
        "jax",
        "jax-0.12.0-py3-none-any.whl",
        "758dd93b8c0682572fc9211da0e9441f73a9522ab315a4c9dbdd14673416f809",
    ),
}
JAX_PLUGIN = RemoteWheel(
    "jax-cuda12-plugin",
    "jax_cuda12_plugin-0.7.2-cp311-cp311-manylinux_2_27_x86_64.whl",
    "adc924ebc7a45c8d3400ea0118dc70a7082b2a86e35711738d403dd3815d09bf",
)
NVCC = {
    "12.6": RemoteWheel(
        "nvidia-cuda-nvcc-cu12",
        "nvidia_cuda_nvcc_cu12-12.6.85-py3-none-manylinux1_x86_64.manylinux_2_5_x86_64.whl",
        "d75d9d74599f4d7c0865df19ed21b739e6cb77a6497a3f73d6f61e8038a765e4",
    ),
    "12.8": RemoteWheel(
        "nvidia-cuda-nvcc-cu12",
        "nvidia_cuda_nvcc_cu12-12.8.93-py3-none-manylinux2010_x86_64.manylinux_2_12_x86_64.whl",
        "2d6dc36fb7cb5ac9c0b8825bc13d193c35487a315664007287d0126531238011",
    ),
}
WHEEL_PTXAS = f"{SITE}/nvidia/cuda_nvcc/bin/ptxas"


# -- the directory JAX names for XLA, by its own `_cuda_path`


@pytest.fixture
def clean_nvidia() -> Iterator[None]:
    """Imports of `nvidia.*` made by a test are forgotten after it (and none is there before it)."""
    saved = {
        name: module for name, module in sys.modules.items() if name == "nvidia" or name.startswith("nvidia.")
    }
    for name in saved:
        del sys.modules[name]
    yield
    for name in [n for n in sys.modules if n == "nvidia" or n.startswith("nvidia.")]:
        del sys.modules[name]
    sys.modules.update(saved)


def their_cuda_path(
    version: str, site: Path, cuda_root: str | None, monkeypatch: pytest.MonkeyPatch
) -> str | None:
    """What `_cuda_path` of jax `version`'s own `jax/_src/lib/__init__.py` returns with `site` on sys.path."""
    (source,) = member_files(JAX[version], lambda name: name == "jax/_src/lib/__init__.py").values()
    tree = ast.parse(source.read_text())
    (function,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_cuda_path"]
    jaxlib = types.SimpleNamespace(__file__=str(site / "jaxlib" / "__init__.py"))  # 0.4.34 looks beside it
    scope: dict[str, object] = {"os": os, "importlib": importlib, "pathlib": pathlib, "jaxlib": jaxlib}
    exec(compile(ast.Module(body=[function], type_ignores=[]), str(source), "exec"), scope)
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    if cuda_root is None:
        monkeypatch.delenv("CUDA_ROOT", raising=False)
    else:
        monkeypatch.setenv("CUDA_ROOT", cuda_root)
    monkeypatch.delenv("PYTHON_RUNFILES", raising=False)
    found = scope["_cuda_path"]()  # type: ignore[operator]
    return None if found is None else str(found)


def made_site(root: Path, *kinds: str) -> Path:
    """A site directory with NVIDIA's nvcc wheels of `kinds` (`cuda_nvcc`, `cu13`) as pip lays them out."""
    site = root / "site-packages"
    for kind in kinds:
        package = site / "nvidia" / kind
        (package / "bin").mkdir(parents=True)
        (package / "bin" / "ptxas").write_bytes(b"")
        if kind == "cuda_nvcc":
            (package / "__init__.py").write_text("")  # the cu12 wheel's package has one; cu13 is a namespace
    return site


def ours(version: str, site: Path, cuda_root: str | None) -> str | None:
    """The directory whose `bin/ptxas` `with_jax_ptxas` takes, over the same layout (every file carried)."""
    carried = {str(path): "12.8" for path in site.rglob("ptxas")}
    if cuda_root is not None:
        carried[f"{cuda_root}/bin/ptxas"] = "12.8"
    archs = GpuArchs(
        ptxas=carried,
        c_compilers=[],
        jax=JaxFacts(distribution="jax-cuda12-pjrt", version=version, site=str(site)),
    )
    env = {"CUDA_ROOT": cuda_root} if cuda_root is not None else {}
    jax = with_jax_ptxas(archs, GpuFacts(flashinfer_env=env, executable_path=[])).jax
    assert jax is not None and jax.ptxas
    return jax.ptxas.removesuffix("/bin/ptxas")


@pytest.mark.parametrize("version", sorted(JAX))
@pytest.mark.parametrize(
    ("kinds", "cuda_root"),
    [(("cuda_nvcc",), None), (("cuda_nvcc", "cu13"), None), (("cuda_nvcc",), "/opt/cuda-root")],
)
def test_jax_names_the_directory_its_own_source_names(
    version: str,
    kinds: tuple[str, ...],
    cuda_root: str | None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    clean_nvidia: None,
) -> None:
    site = made_site(tmp_path, *kinds)
    theirs = their_cuda_path(version, site, cuda_root, monkeypatch)
    assert theirs is not None
    assert ours(version, site, cuda_root) == theirs.rstrip("/")


# -- an image: jax-cuda12-plugin 0.7.2 over NVIDIA's nvcc wheel


def jax_image(nvcc: str | None, env: dict[str, str] | None = None) -> ImageFacts:
    layers = [layer_evidence([python_package(JAX_PLUGIN)])]
    if nvcc is not None:
        layers.append(layer_evidence([libraries(NVCC[nvcc], "ptxas")]))
    archs = with_jit_tools(archs_of(image(layers)), GpuFacts(flashinfer_env=env or {}))
    report = PlatformReport(
        platform="linux/amd64",
        digest="sha256:" + "7" * 64,
        gpu=GpuFacts(archs=archs),
        libc=LibcVerdict(flavour="glibc", state="analysed"),
    )
    return ImageFacts.from_report(ImageReport(reference="jax/image:1", platforms=[report]))


def test_jax_with_cuda_12_6s_ptxas_is_refused_on_blackwell() -> None:
    facts = jax_image("12.6")
    jax = archs_of(facts).jax
    assert jax == JaxFacts(
        distribution="jax-cuda12-plugin",
        version="0.7.2",
        cuda_major=12,
        site=SITE,
        ptxas=WHEEL_PTXAS,
        ptxas_release="12.6",  # read from the real ptxas's banner as the walk streamed it
    )
    decision = place(facts, FLEET_580)
    assert eligible(decision) == ALL - {"b200", "rtx5090", "gb10"}
    assert only(decision, "rtx5090") == (
        "1 free NVIDIA GeForce RTX 5090: compute capability 12.0: jax-cuda12-plugin 0.7.2 compiles every jitted"
        f" computation at run time with ptxas, and the one it runs ({WHEEL_PTXAS}, CUDA 12.6) does not know"
        ' sm_120a: "ptxas too old", and XLA does not fall back to the driver; a ptxas of CUDA 12.8 or later does'
    )


def test_jax_with_cuda_12_8s_ptxas_runs_on_b200_and_rtx_5090_not_gb10() -> None:
    decision = place(jax_image("12.8"), FLEET_580)
    assert eligible(decision) == ALL - {"gb10"}
    assert "does not know sm_121a" in only(decision, "gb10")


def test_jax_with_no_ptxas_runs_nowhere_unless_the_driver_may_compile() -> None:
    decision = place(jax_image(None), FLEET_580)
    assert eligible(decision) == set()
    assert '"No PTX compilation provider is available"' in only(decision, "h100")
    flags = {
        "XLA_FLAGS": "--xla_gpu_enable_triton_gemm=false --xla_gpu_unsafe_fallback_to_driver_on_ptxas_not_found"
    }
    assert eligible(place(jax_image(None, flags), FLEET_580)) == ALL
    fallback = archs_of(jax_image(None, flags)).jax
    assert fallback is not None and fallback.driver_fallback and fallback.ptxas == ""
    assert jax_refusal(fallback, (12, 0)) is None
    off = archs_of(jax_image(None, {"XLA_FLAGS": f"{DRIVER_FLAG}=false"})).jax
    assert off is not None and not off.driver_fallback


DRIVER_FLAG = "--xla_gpu_unsafe_fallback_to_driver_on_ptxas_not_found"


def test_a_cuda_root_the_image_does_not_carry_claims_nothing() -> None:
    jax = archs_of(jax_image("12.6", {"CUDA_ROOT": "/mnt/cuda"})).jax
    assert jax is not None and jax.ptxas is None and jax_refusal(jax, (12, 0)) is None


def test_the_distribution_that_carries_xla_is_named() -> None:
    site = "/usr/lib/python3/dist-packages"
    found = jax_facts(
        {
            f"{site}/jax_cuda12_plugin-0.7.2.dist-info": Distribution(
                name="jax-cuda12-plugin", version="0.7.2"
            ),
            f"{site}/jax_cuda12_pjrt-0.7.2.dist-info": Distribution(name="jax-cuda12-pjrt", version="0.7.2"),
            f"{site}/jax-0.7.2.dist-info": Distribution(name="jax", version="0.7.2"),
        }
    )
    assert found == JaxFacts(distribution="jax-cuda12-pjrt", version="0.7.2", cuda_major=12, site=site)
    old = jax_facts(
        {
            f"{site}/jaxlib-0.4.26+cuda12.cudnn89.dist-info": Distribution(
                name="jaxlib", version="0.4.26+cuda12.cudnn89"
            )
        }
    )
    assert old is not None and (old.distribution, old.cuda_major) == ("jaxlib", 12)
    assert (
        jax_facts({f"{site}/jaxlib-0.4.26.dist-info": Distribution(name="jaxlib", version="0.4.26")}) is None
    )


def test_an_nvcc_wheel_in_another_site_directory_is_found() -> None:
    user = "/root/.local/lib/python3.11/site-packages"
    archs = GpuArchs(
        ptxas={f"{user}/nvidia/cuda_nvcc/bin/ptxas": "12.9"},
        c_compilers=[],
        jax=JaxFacts(distribution="jax-cuda12-pjrt", version="0.7.2", site=SITE),
    )
    jax = with_jax_ptxas(archs, GpuFacts(executable_path=[])).jax
    assert jax is not None and (jax.ptxas, jax.ptxas_release) == (
        f"{user}/nvidia/cuda_nvcc/bin/ptxas",
        "12.9",
    )
