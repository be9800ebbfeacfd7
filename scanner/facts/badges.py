"""Badge names for a platform image: short, stable words the UI and the SVG badges build on.

The vocabulary (in this order; each appears at most once):
- `nvidia-gpu`         the image asks for an NVIDIA GPU (GpuFacts.required)
- `cuda-<major.minor>` the CUDA version it was built for, e.g. `cuda-12.2`
- `cuda-<version>-inferred` CUDA found in the layers (deep scan), e.g. `cuda-12.1-inferred`
                       ("CUDA 12.1 inside (inferred)"); `cuda-inferred` when no version is known
- `cuda-mismatch`      a warning: the declared and the inferred CUDA disagree
- `require-disabled`   NVIDIA_DISABLE_REQUIRE turns the runtime's requirement check off
- `requirement-error`  a warning: an NVIDIA_REQUIRE_* value (or a legacy CUDA_VERSION) that
                       NVIDIA's runtime would reject, so the container may fail to start
- libc, exactly one:   `glibc`, `musl`, `no-libc` (static/scratch), `libc-unknown`, or, before or
                       without a layer read, `libc-pending` / `libc-not-analysed`
- `musl-also`          a musl loader sits beside glibc (e.g. Ubuntu with the musl package)
"""

from __future__ import annotations

from scanner.models import GpuFacts, LibcVerdict

LIBC_BADGES = {"glibc": "glibc", "musl": "musl", "none": "no-libc", "unknown": "libc-unknown"}
LAYER_STATE_BADGES = {"pending": "libc-pending", "not_analysed": "libc-not-analysed"}


def libc_label(libc: LibcVerdict) -> str:
    """The flavour once the layers were read, else the layer state (`pending`, `not_analysed`)."""
    return libc.flavour if libc.state == "analysed" else libc.state


def badges(gpu: GpuFacts, libc: LibcVerdict) -> list[str]:
    """The badge names for one platform image, in display order."""
    names: list[str] = []
    if gpu.required:
        names.append("nvidia-gpu")
    if gpu.cuda_version:
        names.append(f"cuda-{gpu.cuda_version}")
    if gpu.inferred is not None:
        names.append(f"cuda-{gpu.inferred.cuda}-inferred" if gpu.inferred.cuda else "cuda-inferred")
        if cuda_mismatch(gpu):
            names.append("cuda-mismatch")
    if gpu.disable_require:
        names.append("require-disabled")
    if gpu.requirement_errors:
        names.append("requirement-error")
    if libc.state == "analysed":
        names.append(LIBC_BADGES[libc.flavour])
    else:
        names.append(LAYER_STATE_BADGES[libc.state])
    if libc.flavour == "glibc" and libc.musl_also:
        names.append("musl-also")
    return names


def cuda_mismatch(gpu: GpuFacts) -> str | None:
    """A warning when the declared CUDA and the CUDA found in the layers disagree, else None.

    "12" found agrees with "12.2" declared (the evidence names only the major).
    """
    declared = gpu.cuda_version
    found = gpu.inferred.cuda if gpu.inferred is not None else None
    if not declared or not found:
        return None
    if found == declared or ("." not in found and declared.split(".")[0] == found):
        return None
    return f"the config declares CUDA {declared}, but the layers carry CUDA {found}"
