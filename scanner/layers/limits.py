"""The bounds on what reading untrusted image content may cost, and the error past one.

Every cost of a scan that an image's author controls is bounded here: how many layers,
how long a path or link target, how many symlink hops and path components the libc
analysis resolves, how many tar entries and extended-header bytes a layer may hold, how
many times a layer may inflate and how many bytes a layer and an image may decompress to,
and how long a scan may run. Every read of a layer, whatever consumes it, is under the same
bounds. The defaults are set where real images never reach them: NVIDIA's CUDA runtime
layer inflates to about 2.5 GB and the largest NGC framework images to about 25 GB in all,
real layers inflate 2 to 5 times (a few sparse files do more, within their first GiB),
while a crafted layer costs a bounded, small amount of CPU and memory.

Each bound is a `ScannerSettings` field of the same name (env `GPUBADGE_<NAME>`), so an
error can name the setting an operator would raise. Crossing one raises `LimitExceeded`:
the scan ends failed, for good (retrying the same bytes cannot pass), and the badge says
"unknown" with the message, e.g. "image has 1,500 layers; the limit is 256
(GPUBADGE_MAX_LAYERS)".
"""

from __future__ import annotations

import time

from pydantic import BaseModel, ConfigDict

MiB = 1024 * 1024
GiB = 1024 * MiB

DEFAULT_MAX_LAYERS = 256  # overlayfs mounts about 128 lower dirs; Docker refuses more than 125
DEFAULT_MAX_PATH_BYTES = 4096  # Linux PATH_MAX
DEFAULT_MAX_SYMLINK_HOPS = 40  # Linux MAXSYMLINKS
DEFAULT_MAX_PATH_COMPONENTS = 200_000
DEFAULT_MAX_LAYER_ENTRIES = 2_000_000
DEFAULT_MAX_TAR_HEADER_BYTES = 1 * MiB
DEFAULT_MAX_LAYER_RECORDS = 20_000
DEFAULT_MAX_LAYER_BYTES = 32 * GiB
DEFAULT_MAX_IMAGE_BYTES = 128 * GiB
DEFAULT_MAX_INFLATION_RATIO = 100
INFLATION_RATIO_FLOOR = 1 * GiB  # a layer's first GiB is never judged by its ratio
DEFAULT_MAX_SCAN_SECONDS = 1800.0  # a 25 GB image over a slow link; slow drips are cut sooner


def setting_env(name: str) -> str:
    """The environment variable of a scanner setting."""
    return f"GPUBADGE_{name.upper()}"


class LimitExceeded(Exception):
    """Image content crossed a configured bound. The message names the bound and its value."""

    def __init__(self, what: str, limit: int | float, setting: str) -> None:
        shown = f"{limit:,}" if isinstance(limit, int) else f"{limit:g} s"
        super().__init__(f"{what}; the limit is {shown} ({setting_env(setting)})")
        self.limit = limit
        self.setting = setting


class AnalysisLimits(BaseModel):
    """The content bounds of one scan, as sent to an analysis process (see the module docstring)."""

    model_config = ConfigDict(frozen=True)

    max_layers: int = DEFAULT_MAX_LAYERS
    max_path_bytes: int = DEFAULT_MAX_PATH_BYTES
    max_symlink_hops: int = DEFAULT_MAX_SYMLINK_HOPS
    max_path_components: int = DEFAULT_MAX_PATH_COMPONENTS
    max_layer_entries: int = DEFAULT_MAX_LAYER_ENTRIES
    max_tar_header_bytes: int = DEFAULT_MAX_TAR_HEADER_BYTES
    max_layer_records: int = DEFAULT_MAX_LAYER_RECORDS
    max_layer_bytes: int = DEFAULT_MAX_LAYER_BYTES
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_inflation_ratio: int = DEFAULT_MAX_INFLATION_RATIO  # decompressed/compressed, past the floor
    inflation_ratio_floor: int = INFLATION_RATIO_FLOOR
    max_scan_seconds: float = DEFAULT_MAX_SCAN_SECONDS


class ScanBudget:
    """What one platform image's analysis has spent so far, against its `AnalysisLimits`.

    Shared by every layer of one image, so the per-image bounds (bytes decompressed, path
    components resolved, wall time) hold however the work is spread over layers.
    `deadline` is a `time.monotonic()` value; on Linux that clock is system-wide, so an
    analysis process can check a deadline set by the scanning process.
    """

    def __init__(self, limits: AnalysisLimits, deadline: float | None = None) -> None:
        self.limits = limits
        self.deadline = deadline if deadline is not None else time.monotonic() + limits.max_scan_seconds
        self.decompressed_bytes = 0
        self.path_components = 0

    def spend_bytes(self, count: int) -> None:
        self.decompressed_bytes += count
        if self.decompressed_bytes > self.limits.max_image_bytes:
            raise LimitExceeded(
                f"image decompresses to more than {self.limits.max_image_bytes:,} bytes",
                self.limits.max_image_bytes,
                "max_image_bytes",
            )

    def spend_components(self, count: int) -> None:
        self.path_components += count
        if self.path_components % 4096 < count:  # the clock now and then: resolution is a tight loop
            self.check_time()
        if self.path_components > self.limits.max_path_components:
            raise LimitExceeded(
                f"resolving paths took more than {self.limits.max_path_components:,} path components",
                self.limits.max_path_components,
                "max_path_components",
            )

    def check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise scan_too_slow(self.limits.max_scan_seconds)


def scan_too_slow(seconds: float) -> LimitExceeded:
    return LimitExceeded(f"the scan ran for more than {seconds:g} s", seconds, "max_scan_seconds")
