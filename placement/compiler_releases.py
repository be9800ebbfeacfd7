"""Which CUDA release's compilers (`ptxas`, `nvcc`) know which GPU architecture. Pure.

A compiler knows the architectures of its CUDA release and no later one: a `ptxas` of CUDA 12.8 stops
with "Value 'sm_121a' is not defined for option 'gpu-name'" on a GB10, and so does that release's
`nvcc`. NVIDIA's release notes, and each `ptxas` triton 3.0.0 to 3.9.0 ships, and nvcc 13.0's and
13.5's, run on a PTX file for every architecture here, agree: 12.8 brought sm_100, sm_101 and sm_120;
12.9 sm_103 and sm_121; 13.0 renamed sm_101 to sm_110, brought sm_88 and dropped what came before
sm_75; 13.4 brought sm_107. The lists NVIDIA's NVRTC 12.6, 12.8, 12.9, 13.0 and 13.5 give (`nvrtcGetSupportedArchs`)
agree too. An architecture from sm_80 on that the table does not list is taken as known to none. The
judges of the run-time compilers (Triton, FlashInfer, tvm-ffi, torch's `cpp_extension`, CuPy, JAX,
numba-cuda) read it.
"""

from __future__ import annotations

from scanner.layers.fatbin import PTX_ISA_TOOLKITS

CC = tuple[int, int]
Release = tuple[int, int]

# The first CUDA release whose compilers know each architecture, and for sm_101, the last.
FIRST_RELEASE: dict[CC, Release] = {
    (8, 0): (11, 0), (8, 6): (11, 1), (8, 7): (11, 4), (8, 9): (11, 8), (9, 0): (11, 8),
    (10, 0): (12, 8), (10, 1): (12, 8), (12, 0): (12, 8), (10, 3): (12, 9), (12, 1): (12, 9), (11, 0): (13, 0),
    (8, 8): (13, 0), (10, 7): (13, 4),
}  # fmt: skip
LAST_RELEASE: dict[CC, Release] = {(10, 1): (12, 9)}  # CUDA 13.0 calls Thor sm_110
# The oldest architecture each major's compilers know.
OLDEST: dict[int, CC] = {11: (3, 5), 12: (5, 0), 13: (7, 5)}
FIRST_LISTED: CC = min(FIRST_RELEASE)  # from here on, only the architectures listed are claimed known


def release(text: str) -> Release | None:
    """`"12.8"` -> (12, 8); None for anything else."""
    major, _, minor = text.partition(".")
    return (int(major), int(minor)) if major.isdigit() and minor.isdigit() else None


def compiles_for(cuda: Release, cc: CC) -> bool:
    """Whether the compilers of CUDA release `cuda` (its `ptxas`, its `nvcc`) build code for compute
    capability `cc`."""
    if cc >= FIRST_LISTED and cc not in FIRST_RELEASE:
        return False  # no release known here names it
    oldest = OLDEST.get(cuda[0], OLDEST[max(OLDEST)] if cuda[0] > max(OLDEST) else (3, 0))
    if cc < oldest:
        return False
    return FIRST_RELEASE.get(cc, (0, 0)) <= cuda <= LAST_RELEASE.get(cc, (99, 99))


def releases_knowing(cuda: Release, cc: CC) -> str | None:
    """The releases whose compilers know `cc` ("CUDA 12.9 or later", "CUDA 12 or earlier" where the major of
    `cuda` dropped it), said for an image whose copy, of release `cuda`, does not; None where no release
    here names `cc`."""
    first, last = FIRST_RELEASE.get(cc), LAST_RELEASE.get(cc)
    if cc < OLDEST.get(cuda[0], (0, 0)):  # a major that dropped it: an older one knows it
        return f"CUDA {cuda[0] - 1} or earlier"
    if first is None:
        return None
    since = f"{first[0]}.{first[1]}"
    return f"CUDA {since} to {last[0]}.{last[1]}" if last else f"CUDA {since} or later"


def toolkit_remedy(cuda: Release, cc: CC) -> str:
    """What gives a build through `$CUDA_HOME` an `nvcc` that knows `cc`, where the one of release `cuda` does not."""
    releases = releases_knowing(cuda, cc)
    return "CUDA_HOME can name " + (
        f"a toolkit whose nvcc knows it ({releases})" if releases else "a newer toolkit"
    )


def written_isa(compiler: Release) -> str | None:
    """The PTX ISA NVRTC or libNVVM of release `compiler` writes: the newest ISA of a toolkit no newer than it
    ("8.7" for CUDA 12.8, "8.5" for 12.6, which brought none), as NVIDIA's NVRTC and libNVVM of 12.6 to 13.0
    do; None for a release newer than every toolkit the table of ISAs knows."""
    if compiler > max(PTX_ISA_TOOLKITS.values()):
        return None
    isa = max(isa for isa, toolkit in PTX_ISA_TOOLKITS.items() if toolkit <= compiler)
    return f"{isa[0]}.{isa[1]}"
