"""Fill the test cache beside the suite: `python -m tests.prefetch`, started by `tests/conftest.py`.

A fresh clone's suite otherwise waits, test module after test module, for PyPI: NVIDIA's wheels
(`tests/nvidia_wheels.py`), the packages' wheel members (`tests/pypi_members.py`) and the walk of each
package layer (`tests/gpu_packages.py`). This process fetches and builds the same entries, through
the same functions, at the lowest CPU priority, in the order the suite meets them, while the suite
runs its other tests. Every entry is taken under its cache lock (`nvidia_wheels.cache_lock`), so a
test that needs one this process is still making waits for it instead of making it again, and a
test that finds one done reads it. Nothing here decides a test's outcome: a failure is left for the
test that needs the entry to meet and report (this process says it on stderr and goes on).
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable

from tests.gpu_packages import (
    VLLM_055,
    VLLM_061,
    VLLM_085,
    VLLM_FLASH_ATTN_261,
    bitsandbytes_043_cuda121,
    cccl_parallel_cu13,
    cuobjdump_12_4,
    layer_evidence,
    package_layers,
    python_sources,
)
from tests.nvidia_wheels import (
    CUDA_13_0,
    CUDA_13_5,
    CUDA_RUNTIME_12_4,
    CUDA_RUNTIME_13,
    CUOBJDUMP,
    CURAND_CU12,
    CUSPARSELT_CU12,
    NCCL_CU12,
    NVJPEG_CU12,
    NVJPEG_CU13,
    PTXAS_12_8,
    TORCHAO_070,
    cuobjdump,
    nvcc,
    wheel_path,
)
from tests.test_carried_cuda import cuda_base_layer, torch27_libs_layer

DISABLE = "GPUBADGE_PREFETCH"  # "0": the suite fetches what it needs as it goes


def steps() -> list[tuple[str, Callable[[], object]]]:
    """(what, how) in the order the test modules need them (alphabetical, as pytest runs them)."""
    wheels = [
        # test_carried_cuda, test_deep_scan, test_fatbin, test_gpu_dispatch, test_gpu_modules
        CUDA_RUNTIME_12_4,
        CUDA_RUNTIME_13,
        CURAND_CU12,
        CUSPARSELT_CU12,
        NCCL_CU12,
        TORCHAO_070,
        NVJPEG_CU12,
        NVJPEG_CU13,
        *CUDA_13_0.wheels,
        PTXAS_12_8,
        CUOBJDUMP,
    ]
    found: list[tuple[str, Callable[[], object]]] = [
        (wheel.filename, lambda wheel=wheel: wheel_path(wheel)) for wheel in wheels[:5]
    ]
    # test_carried_cuda's two big layers (their wheels' files, tar'd and compressed once)
    found += [("torch27-libs layer", torch27_libs_layer), ("cuda-12.4-base layer", cuda_base_layer)]
    found += [(wheel.filename, lambda wheel=wheel: wheel_path(wheel)) for wheel in wheels[5:]]
    found += [("nvcc 13.0", lambda: nvcc(CUDA_13_0)), ("cuobjdump", cuobjdump)]
    found.append(("cuobjdump 12.4", cuobjdump_12_4))  # test_gpu_packages
    found.append(("bitsandbytes 0.43.3's CUDA 12.1 build", bitsandbytes_043_cuda121))
    found.append(("cuda-cccl 1.2.1's libcccl.c.parallel.so", cccl_parallel_cu13))
    found.append(
        (
            "vLLM 0.5.5's, 0.6.1's, vllm-flash-attn 2.6.1's and vLLM 0.8.5's sources",
            lambda: python_sources(VLLM_055, VLLM_061, VLLM_FLASH_ATTN_261, VLLM_085),
        )
    )
    for number, layer in enumerate(package_layers()):
        found.append((f"package layer {number}", lambda layer=layer: layer_evidence(layer)))
    found.append(("nvcc 13.5", lambda: nvcc(CUDA_13_5)))  # test_nvcc_programs
    return found


def main() -> int:
    os.nice(19)
    for what, step in steps():
        try:
            step()
        except Exception:
            print(f"prefetch: {what} failed; the test that needs it will fetch it again", file=sys.stderr)
            traceback.print_exc(limit=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
