"""Which CUDA release each `ptxas` an image carries is, read from its bytes. Pure, bounded.

Triton compiles its kernels on the GPU at hand: LLVM writes PTX for `sm_{capability}` and the
`ptxas` it runs assembles it (its own copies under `triton/backends/nvidia/bin/`, or the one
`TRITON_PTXAS_PATH` names). A `ptxas` knows the architectures of its CUDA release and no later one:
triton 3.4.0's (CUDA 12.8) stops with "Value 'sm_121a' is not defined for option 'gpu-name'" on a
GB10. So the scan records, for every file named `ptxas` or `ptxas-blackwell`, the release its
version banner names (`Cuda compilation tools, release 12.8, V12.8.93`, as `ptxas --version`
prints it); placement (`placement.triton_compiler`) decides which GPUs that release compiles for.

FlashInfer compiles its kernels with `nvcc` at first use (`placement.flashinfer_compiler`), and an
`nvcc` knows the architectures of its release as its `ptxas` does; its banner is the same, so every
file named `nvcc` is read the same way.

The banner lies in the program's read-only data (at 21.9 MB of triton 3.4.0's 31.9 MB copy), so the
sink reads the file as the walk streams it, carrying a needle's length across chunks, and stops at
the first banner. A file with no banner has no release (`""`), and is judged by nothing.
"""

from __future__ import annotations

import posixpath
import re

PTXAS_NAMES = frozenset({"ptxas", "ptxas-blackwell"})  # triton 3.3 to 3.9 ship both
BANNER = b"Cuda compilation tools, release "
_RELEASE = re.compile(rb"(\d{1,3})\.(\d{1,3})\b")
_TAIL = len(BANNER) + 8  # bytes carried across chunks: a banner and its release split by a chunk's end


NVCC_NAME = "nvcc"


def is_ptxas(path: str) -> bool:
    """Whether the file at `path` is named as CUDA's PTX assembler."""
    return posixpath.basename(path) in PTXAS_NAMES


def is_nvcc(path: str) -> bool:
    """Whether the file at `path` is named as CUDA's compiler driver."""
    return posixpath.basename(path) == NVCC_NAME


class ReleaseReader:
    """Fed a `ptxas` file's content in order; `release` is the CUDA release its banner names
    ("12.8"), or None until (and unless) one is found."""

    __slots__ = ("_carry", "release")

    def __init__(self) -> None:
        self._carry = b""
        self.release: str | None = None

    def feed(self, data: bytes | memoryview) -> bool:
        """Read one chunk; False once the release is known (nothing more is wanted)."""
        window = self._carry + bytes(data)
        at = window.find(BANNER)
        if at >= 0:
            found = _RELEASE.match(window, at + len(BANNER))
            if found is not None and found.end() < len(window):  # a release cut by the chunk's end waits
                self.release = f"{int(found.group(1))}.{int(found.group(2))}"
                return False
            if len(window) - at < _TAIL:  # the release is in the next chunk
                self._carry = window[at:]
                return True
        self._carry = window[-_TAIL:]
        return True
