"""CUDA releases and the drivers they need. Pure tables and the rules that read them.

* **A CUDA runtime's driver floor** (minor-version compatibility, Linux): a CUDA 13.x runtime needs
  driver >= 580, 12.x >= 525.60.13, 11.x >= 450.80.02 (11.0: 450.51.05); 10.2 and older have no
  minor-version compatibility and need their own release's driver (`driver_floor`).
* **PTX JIT**: a driver compiles the PTX of its own CUDA version and older. The PTX's ISA says which
  toolkit wrote it (`scanner.layers.fatbin.PTX_ISA_TOOLKITS`, from ISA 3.0, CUDA 4.1, to 9.5, CUDA
  13.5); that toolkit's release driver is the first that JITs it (`ptx_driver_floor`), and a server
  that reports its driver's CUDA version is judged by that exactly (`ptx_cuda_reason`: on an H200
  with CUDA 13.0's driver, PTX from nvcc 13.0 ran and PTX from nvcc 13.5 failed with "the provided
  PTX was compiled with an unsupported toolchain"). An ISA newer than the table comes from a toolkit
  newer than every one known: no known driver is proven to JIT it.
"""

from __future__ import annotations

from scanner.layers.fatbin import NEWEST_PTX_ISA, PTX_ISA_TOOLKITS

Pair = tuple[int, int]

# Minor-version compatibility floors, by CUDA major (NVIDIA's CUDA compatibility guide).
CUDA_DRIVER_FLOORS: dict[int, str] = {13: "580", 12: "525.60.13", 11: "450.80.02"}
CUDA_11_0_FLOOR = "450.51.05"
# The Linux driver each toolkit release shipped with (its release notes, "CUDA Toolkit and Corresponding
# Driver Versions"). Used for 10.2 and older (no minor-version compatibility) and for PTX JIT.
TOOLKIT_DRIVERS: dict[Pair, str] = {
    (7, 0): "346.46",
    (7, 5): "352.31",
    (8, 0): "375.26",
    (9, 0): "384.81",
    (9, 1): "390.46",
    (9, 2): "396.26",
    (10, 0): "410.48",
    (10, 1): "418.39",
    (10, 2): "440.33",
    (11, 0): "450.51.05",
    (11, 1): "455.23",
    (11, 2): "460.27.03",
    (11, 3): "465.19.01",
    (11, 4): "470.42.01",
    (11, 5): "495.29.05",
    (11, 6): "510.39.01",
    (11, 7): "515.43.04",
    (11, 8): "520.61.05",
    (12, 0): "525.60.13",
    (12, 1): "530.30.02",
    (12, 2): "535.54.03",
    (12, 3): "545.23.06",
    (12, 4): "550.54.14",
    (12, 5): "555.42.02",
    (12, 6): "560.28.03",
    (12, 8): "570.26",
    (12, 9): "575.51.03",
    (13, 0): "580.65.06",
    (13, 1): "590.44.01",
}
NEWEST_TOOLKIT = max(PTX_ISA_TOOLKITS.values())


def pair(version: str) -> Pair | None:
    """(major, minor) of "12.8" or "12" (minor 0), or None when it is not a version."""
    major, _, minor = version.partition(".")
    if not major.isdigit():
        return None
    return int(major), int(minor) if minor.isdigit() else 0


def toolkit_driver(cuda: str) -> str | None:
    """The driver the CUDA `cuda` toolkit ("12.8") shipped with, or None where the table has no such release."""
    return TOOLKIT_DRIVERS.get(pair(cuda) or (0, 0))


def _first_driver_for(toolkit: Pair) -> str | None:
    """The first driver of the table that ships with `toolkit` or a later release (12.7's PTX: 12.8's
    driver); None past the table."""
    later = [known for known in TOOLKIT_DRIVERS if known >= toolkit]
    return TOOLKIT_DRIVERS[min(later)] if later else None


def driver_floor(cuda: str) -> tuple[str, str] | None:
    """(minimum driver, the rule in words) for a CUDA runtime version ("12.1" or "12"), or None."""
    found = pair(cuda)
    if found is None:
        return None
    major, minor = found
    if major in CUDA_DRIVER_FLOORS:
        if (major, minor) == (11, 0) and "." in cuda:
            return CUDA_11_0_FLOOR, "CUDA 11.0 needs driver >= 450.51.05"
        floor = CUDA_DRIVER_FLOORS[major]
        return floor, f"CUDA {major}.x needs driver >= {floor} (minor-version compatibility)"
    if major > max(CUDA_DRIVER_FLOORS):
        floor = CUDA_DRIVER_FLOORS[max(CUDA_DRIVER_FLOORS)]
        return floor, f"CUDA {cuda} is newer than this table; it needs at least driver {floor}"
    own = TOOLKIT_DRIVERS.get((major, minor))
    if own is None:
        return None
    return own, f"CUDA {major}.{minor} has no minor-version compatibility and needs its own driver >= {own}"


def ptx_toolkit_of(isa: str | None) -> tuple[Pair, bool] | None:
    """(the toolkit that wrote PTX of ISA `isa`, whether the table knows it exactly): an ISA newer than
    the table comes from a toolkit newer than the newest known (returned as one minor past it, not
    exact); an ISA older than the table from CUDA 4.1 or before. None when `isa` is not a version."""
    found = pair(isa) if isa and "." in isa else None
    if found is None:
        return None
    if found in PTX_ISA_TOOLKITS:
        return PTX_ISA_TOOLKITS[found], True
    if found > NEWEST_PTX_ISA:
        return (NEWEST_TOOLKIT[0], NEWEST_TOOLKIT[1] + 1), False
    return min(PTX_ISA_TOOLKITS.values()), False


def ptx_driver_floor(isa: str | None) -> tuple[str, str] | None:
    """(minimum driver, rule) to JIT PTX of an ISA version, from the toolkit that produced it. For a
    toolkit newer than `TOOLKIT_DRIVERS`, the newest driver there: a floor, not the whole need (the
    server's own CUDA version settles it, `ptx_cuda_reason`)."""
    found = ptx_toolkit_of(isa)
    if found is None:
        return None
    toolkit, exact = found
    if not exact and toolkit > NEWEST_TOOLKIT:
        floor = TOOLKIT_DRIVERS[max(TOOLKIT_DRIVERS)]
        return (
            floor,
            f"PTX ISA {isa} is newer than every toolkit known here (CUDA {NEWEST_TOOLKIT[0]}.{NEWEST_TOOLKIT[1]}"
            f" writes {NEWEST_PTX_ISA[0]}.{NEWEST_PTX_ISA[1]}); JIT needs a driver newer than those, at least {floor}",
        )
    own = _first_driver_for(toolkit)
    if own is None:
        floor = TOOLKIT_DRIVERS[max(TOOLKIT_DRIVERS)]
        return (
            floor,
            f"PTX ISA {isa} comes from CUDA {toolkit[0]}.{toolkit[1]}; JIT needs at least driver {floor}",
        )
    if not exact:
        return (
            own,
            f"PTX ISA {isa} is older than CUDA {toolkit[0]}.{toolkit[1]}; any driver from {own} JITs it",
        )
    return (
        own,
        f"PTX ISA {isa} comes from CUDA {toolkit[0]}.{toolkit[1]}, whose driver {own} is the first to JIT it",
    )


def ptx_cuda_reason(isa: str | None, driver_cuda: str | None) -> str | None:
    """Why a driver of CUDA version `driver_cuda` (NVML's, `nvidia-smi`'s "CUDA Version") cannot
    JIT-compile PTX of ISA `isa`, or None. A driver compiles the PTX of its own CUDA and older."""
    found = ptx_toolkit_of(isa)
    supports = pair(driver_cuda) if driver_cuda else None
    if found is None or supports is None:
        return None
    toolkit, exact = found
    if toolkit <= supports:
        return None
    written = (
        f"comes from CUDA {toolkit[0]}.{toolkit[1]}"
        if exact
        else f"is newer than every toolkit known here (CUDA {NEWEST_TOOLKIT[0]}.{NEWEST_TOOLKIT[1]} writes"
        f" {NEWEST_PTX_ISA[0]}.{NEWEST_PTX_ISA[1]})"
    )
    return (
        f"PTX ISA {isa} {written}, and this server's driver supports CUDA {supports[0]}.{supports[1]}:"
        " a driver JIT-compiles only the PTX of its own CUDA version or older"
    )
