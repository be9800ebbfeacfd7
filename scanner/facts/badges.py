"""Badge names for a platform image: short, stable words the UI and the SVG badges build on.

The vocabulary (in this order; each appears at most once):
- `nvidia-gpu`         the image asks for an NVIDIA GPU (GpuFacts.required)
- `cuda-<major.minor>` the CUDA version it was built for, e.g. `cuda-12.2`
- `cuda-<version>-inferred` CUDA found in the layers (deep scan), e.g. `cuda-12.1-inferred`
                       ("CUDA 12.1 inside (inferred)"); `cuda-inferred` when no version is known
- `cuda-newer-inside`  a warning: the layers carry a NEWER CUDA than the config declares (torch cu130 on a
                       `cuda:12.8` base), so the image needs the newer CUDA's driver
- `cuda-mismatch`      a warning: the layers carry an older CUDA than the config declares
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
        newer = carried_newer(gpu)
        if newer is not None:
            names.append("cuda-newer-inside" if newer else "cuda-mismatch")
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


def _version_key(version: str) -> tuple[int, int]:
    major, _, minor = version.partition(".")
    return (int(major) if major.isdigit() else 0, int(minor) if minor.isdigit() else -1)


def carried_newer(gpu: GpuFacts) -> bool | None:
    """Whether the CUDA the layers carry is newer (True) or older (False) than the one the config
    declares; None when they agree or one is unknown. "12" carried agrees with "12.2" declared (the
    evidence names only the major)."""
    declared = gpu.cuda_version
    found = gpu.inferred.cuda if gpu.inferred is not None else None
    if not declared or not found:
        return None
    if found == declared or ("." not in found and declared.split(".")[0] == found):
        return None
    if "." not in found:
        return int(found) > _version_key(declared)[0] if found.isdigit() else None
    return _version_key(found) > _version_key(declared)


def cuda_mismatch(gpu: GpuFacts) -> str | None:
    """The warning when the declared CUDA and the CUDA the layers carry disagree, else None: which is
    newer, the evidence that set the carried one, and what it means for the driver."""
    newer = carried_newer(gpu)
    if newer is None or gpu.inferred is None:
        return None
    declared, found = gpu.cuda_version or "", gpu.inferred.cuda or ""
    source = gpu.inferred.set_by or "its layers"
    if newer and found.split(".")[0] == declared.split(".")[0]:
        major = found.split(".")[0]
        return (
            f"the config declares CUDA {declared}, but the layers carry the newer CUDA {found} ({source}):"
            f" any driver for CUDA {major} runs a CUDA {major}.x runtime (minor-version compatibility), so the"
            " declared requirement still decides; PTX it JIT-compiles needs its own toolkit's driver"
        )
    if newer:
        return (
            f"the config declares CUDA {declared}, but the layers carry the newer CUDA {found} ({source}):"
            f" the image needs a driver for CUDA {found.split('.')[0]}, which NVIDIA_REQUIRE_CUDA does not check"
        )
    return (
        f"the config declares CUDA {declared}, but the layers carry the older CUDA {found} ({source}):"
        " the declared CUDA's driver requirement covers it"
    )
