"""Whether torch's `cpp_extension` can build, for a GPU, the CUDA extensions that packages of the image
build when they are imported. Pure.

ExLlamaV2 and ExLlamaV3 as PyPI serves them (py3-none-any wheels) ship CUDA sources and no built
extension: importing them calls `torch.utils.cpp_extension.load` at module level
(`exllamav2/ext.py`, `exllamav3/ext.py`), unless the extension built by their own release wheels
(`exllamav2_ext`) imports first; the scan spares those (`TorchExtensionFacts.prebuilt`) and finds
the builders (`scanner.layers.python_builds`). A build that fails fails the import, so the package,
and the image that runs it, does not run where it fails. `load` (torch 2.x,
`torch/utils/cpp_extension.py`), in the order it meets them:

* `ninja` on PATH (`verify_ninja_availability`: "Ninja is required to load C++ extensions");
* `nvcc` below the CUDA home `_find_cuda_home` finds (`$CUDA_HOME`, `$CUDA_PATH`, the `nvcc` on PATH,
  `/usr/local/cuda`; with none, "CUDA_HOME environment variable is not set");
* the architectures it builds for: `$TORCH_CUDA_ARCH_LIST` where the config sets it (ExLlamaV2 and V3
  leave a set one alone), else the GPU's own, capped at the newest torch was built for
  (`_get_cuda_arch_flags`; ExLlamaV2 and V3 set the variable to the same), each of which its `nvcc`
  must know (`placement.compiler_releases`); a list set in the config must also build code that runs
  on the GPU (SASS of its major at or below its minor, PTX at or below it);
* the C++ compiler (`$CXX`, else `c++`) and the interpreter's `Python.h`, which every build includes.

Nothing is claimed where a tool or its release is unknown (a path the image does not carry), or where
`$TORCH_CUDA_ARCH_LIST` names what this reading does not know.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from placement.compiler_releases import CC, compiles_for, release, toolkit_remedy
from placement.compiler_users import named
from placement.flashinfer_compiler import ADD_CXX, NO_CXX
from scanner.layers.fatbin import parse_arch
from scanner.models import FileArchs, PackageFacts, TorchExtensionFacts

NO_NINJA = "it finds no ninja on the image's PATH, which torch's cpp_extension builds with"
ADD_NINJA = "PyPI's ninja (pip install ninja) or Debian's ninja-build gives it one"
NO_NVCC = "it finds no nvcc in the image ($CUDA_HOME, $CUDA_PATH, PATH or /usr/local/cuda) to compile with"
ADD_NVCC = (
    "a CUDA toolkit in the image (NVIDIA's devel images) gives it one, or the package's own built extension"
)
NO_PYTHON_HEADER = "the image has no Python.h for torch's interpreter ({include}), which every build includes"
ADD_PYTHON_HEADER = "the interpreter's development headers (Debian's python3-dev) give it"
# `TORCH_CUDA_ARCH_LIST`'s names for families (torch 2.14's `_get_cuda_arch_flags`), combined ones first
NAMED_ARCHES = (
    ("Kepler+Tesla", "3.7"),
    ("Kepler", "3.5+PTX"),
    ("Maxwell+Tegra", "5.3"),
    ("Maxwell", "5.0;5.2+PTX"),
    ("Pascal", "6.0;6.1+PTX"),
    ("Volta+Tegra", "7.2"),
    ("Volta", "7.0+PTX"),
    ("Turing", "7.5+PTX"),
    ("Ampere+Tegra", "8.7"),
    ("Ampere", "8.0;8.6+PTX"),
    ("Ada", "8.9+PTX"),
    ("Hopper", "9.0+PTX"),
    ("Blackwell+Tegra", "11.0"),
    ("Blackwell", "10.0;10.3;12.0;12.1+PTX"),
    ("Rubin", "10.7+PTX"),
)
_ENTRY = re.compile(r"^(\d+)\.(\d+)(a?)(\+PTX)?$")

Target = tuple[CC, bool, bool]  # an architecture, built for it alone (`9.0a`), with PTX


def arch_targets(arch_list: str) -> list[Target] | None:
    """The architectures a `TORCH_CUDA_ARCH_LIST` value builds for; None where it names one this reading
    does not know (or asks for the GPU's own: `native`)."""
    text = arch_list.replace(" ", ";").replace(",", ";")
    for name, arches in NAMED_ARCHES:
        text = text.replace(name, arches)
    targets: list[Target] = []
    for entry in filter(None, text.split(";")):
        match = _ENTRY.match(entry)
        if match is None:
            return None
        cc = (int(match.group(1)), int(match.group(2)))
        targets.append((cc, bool(match.group(3)), bool(match.group(4))))
    return targets or None


def _arch_text(cc: CC, specific: bool = False) -> str:
    return f"sm_{cc[0] * 10 + cc[1]}{'a' if specific else ''}"


def _runs_on(targets: Sequence[Target], cc: CC) -> bool:
    for built, specific, ptx in targets:
        if built == cc or (not specific and built[0] == cc[0] and built[1] <= cc[1]) or (ptx and built <= cc):
            return True
    return False


def torch_newest(files: Sequence[FileArchs], packages: Sequence[PackageFacts]) -> CC | None:
    """The newest architecture torch's own libraries carry SASS for (what `torch.cuda.get_arch_list()`
    lists), or None where the image's torch has none read."""
    torch = {p.id for p in packages if p.kind == "python" and p.name == "torch"}
    newest: CC | None = None
    for file in files:
        if file.package in torch:
            for container in file.containers:
                for arch in container.sass:
                    major, minor, _ = parse_arch(arch)
                    newest = max(newest or (major, minor), (major, minor))
    return newest


def _gap(facts: TorchExtensionFacts, cc: CC, newest: CC | None) -> tuple[str, str] | None:
    """What stops torch building the extension on `cc`, and what gives it the means; None where it can,
    or where what it builds with is unknown."""
    if facts.ninja == "":
        return NO_NINJA, ADD_NINJA
    if facts.nvcc == "":
        return NO_NVCC, ADD_NVCC
    if facts.arch_list:
        targets = arch_targets(facts.arch_list)
        if targets is None:
            return None
        if not _runs_on(targets, cc):
            shown = ", ".join(_arch_text(built, specific) for built, specific, _ in targets)
            return (
                f"$TORCH_CUDA_ARCH_LIST ({facts.arch_list}) builds for {shown}, none of which runs here",
                "TORCH_CUDA_ARCH_LIST can name this GPU's architecture",
            )
    else:
        target = min(cc, newest) if newest is not None else cc
        targets = [(target, False, True)]
    cuda = release(facts.nvcc_release or "")
    if cuda is not None:
        for built, specific, _ in targets:
            if not compiles_for(cuda, built):
                known = f"its nvcc (CUDA {cuda[0]}.{cuda[1]}) does not know {_arch_text(built, specific)}"
                return known, toolkit_remedy(cuda, built)
    if facts.cxx == "":
        return NO_CXX, ADD_CXX
    if facts.python_header == "":
        return NO_PYTHON_HEADER.format(include=facts.python_include), ADD_PYTHON_HEADER
    return None


def torch_extension_refusal(
    facts: TorchExtensionFacts | None, files: Sequence[FileArchs], packages: Sequence[PackageFacts], cc: CC
) -> str | None:
    """Why the image does not run on `cc`: a package it carries builds its CUDA extension when imported,
    and torch cannot build it here; None where it can (or nothing builds, or a tool is unknown)."""
    if facts is None or not facts.users:
        return None
    found = _gap(facts, cc, torch_newest(files, packages))
    if found is None:
        return None
    gap, remedy = found
    builders = [f"{name} {version}" for name, version in facts.user_versions.items()] or facts.users
    verb = "builds its" if len(builders) == 1 else "build their"
    return (
        f"{named(builders)} {verb} CUDA extension with torch's cpp_extension when imported, and here"
        f" {gap}; {remedy}"
    )
