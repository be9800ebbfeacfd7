"""The bounds on what reading untrusted image content may cost, and the error past one.

Every cost of a scan that an image's author controls is bounded here: how many layers,
how long a path or link target, how many symlink hops and path components the libc
analysis resolves, how many tar entries and extended-header bytes a layer may hold, how
many times a layer may inflate and how many bytes a layer and an image may decompress to,
and how long a scan may run. Every read of a layer, whatever consumes it, is under the same
bounds.

Bytes are not the only cost: a few KB of fatbin headers can name the same region thousands of
times. So the reading of GPU code is bounded in work too (`GpuCodeWork`): per file, the fatbin
containers met and walked, the entry headers read and the cubin symbols read; per layer, all of
those together. A file past its bound gets an error of its own (its other evidence stands); a layer
past its bound has the GPU code of its remaining files left unread, and says so. Analysis processes
also run under an address-space limit (`analysis_memory_bytes`): what a bound missed fails as
`LimitExceeded` instead of taking the host's memory. The defaults are set where real images never reach them: NVIDIA's CUDA runtime
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
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict

MiB = 1024 * 1024
GiB = 1024 * MiB

DEFAULT_MAX_LAYERS = 256  # overlayfs mounts about 128 lower dirs; Docker refuses more than 125
# Platform images one index may ask a scan to read: official images list 8 to 10 platforms (twice
# that with attestations, which are never read), multi-OS Windows images a few dozen.
DEFAULT_MAX_INDEX_CHILDREN = 256
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
# GPU code, per file: NVIDIA's libraries reach 2,513 containers met, 128 walked, 3,167 entry headers
# read and 147 cubin symbols (nccl, cuSPARSELt, cuRAND, nvJPEG; bench/RESULTS.md, issue 43), a large
# libtorch_cuda.so some thousands of containers; the bounds leave those 16x and more.
DEFAULT_MAX_FATBIN_CONTAINERS = 65_536  # met in a file's bytes, and again walked over its sections
DEFAULT_MAX_FATBIN_ENTRIES = 262_144  # entry headers read per file, each container's chain counted
DEFAULT_MAX_CUBIN_SYMBOLS = 262_144  # symbols the kernel-free check reads per file
# ... and per layer, all of them together: some 10 GB of CUDA libraries stay under a million.
DEFAULT_MAX_LAYER_GPU_CODE_STEPS = 4_194_304
# Address space of one analysis process (RLIMIT_AS): reading NVIDIA's nccl, cuRAND, cuSPARSELt and
# nvJPEG wheels as one 660 MB layer peaks at 41 MB (gzip or zstd); a zstd frame may ask for a 128 MiB
# window. Two processes at this bound stay inside the worker Deployment's 1 GiB with the service.
DEFAULT_ANALYSIS_MEMORY_BYTES = 384 * MiB
MIN_ANALYSIS_MEMORY_BYTES = 64 * MiB  # an idle analysis process maps about 45 MB
# An image whose layers still to be read are this small is analysed in the scanning process, within
# its `InlineBudget`; past any part of it the analysis starts over in an analysis process. The top
# layer most pushes add (an app's files, a config file, an ENV) is a few KiB; a 64 KiB walk costs
# well under a millisecond, where the hand-over to an analysis process costs about 1.5 ms per image.
DEFAULT_INLINE_ANALYSIS_BYTES = 64 * 1024
DEFAULT_INLINE_ANALYSIS_MS = 5.0
# GPU-code steps of one layer read inline: a file's GPU-code reader keeps its bound as the file's
# finding, so this one is checked when the layer ends, and the image goes to an analysis process.
INLINE_GPU_CODE_STEPS = 1024


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
    max_fatbin_containers: int = DEFAULT_MAX_FATBIN_CONTAINERS
    max_fatbin_entries: int = DEFAULT_MAX_FATBIN_ENTRIES
    max_cubin_symbols: int = DEFAULT_MAX_CUBIN_SYMBOLS
    max_layer_gpu_code_steps: int = DEFAULT_MAX_LAYER_GPU_CODE_STEPS


class InlineBudgetSpent(Exception):
    """An analysis in the scanning process reached its `InlineBudget`: not an error of the image.
    The scan starts the image's analysis over in an analysis process, where only `AnalysisLimits` hold."""


# What became of an image analysed inline (`scanner.layer_reader`, `gpubadge_inline_analyses_total`):
# its verdict came inline, or it reached the inline budget and started over in an analysis process.
INLINE_FINISHED, INLINE_HANDED_OVER = "finished", "handed_over"
INLINE_OUTCOMES = (INLINE_FINISHED, INLINE_HANDED_OVER)


@dataclass(frozen=True)
class InlineBudget:
    """What an image's analysis may cost in the scanning process, on its event loop, before it is
    handed to an analysis process: `bytes` of cached entries taken and layer bytes decompressed;
    `cpu_seconds` of the loop thread's CPU spent in the analysis (checked with the deadline, at every
    decompressed slice and every 4,096 path components, and after every step); and
    `INLINE_GPU_CODE_STEPS` of GPU-code work per layer."""

    bytes: int = DEFAULT_INLINE_ANALYSIS_BYTES
    cpu_seconds: float = DEFAULT_INLINE_ANALYSIS_MS / 1000


class _InlineStep:
    """`ScanBudget.running_inline` of an inline budget."""

    __slots__ = ("_budget",)

    def __init__(self, budget: ScanBudget) -> None:
        self._budget = budget

    def __enter__(self) -> None:
        self._budget._begin_step()

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        self._budget._end_step(failed=kind is not None)


class ScanBudget:
    """What one platform image's analysis has spent so far, against its `AnalysisLimits`.

    Shared by every layer of one image, so the per-image bounds (bytes decompressed, path
    components resolved, wall time) hold however the work is spread over layers.
    `deadline` is a `time.monotonic()` value; on Linux that clock is system-wide, so an
    analysis process can check a deadline set by the scanning process. `inline`: the analysis
    runs on the scanning process's event loop, within that budget too (`InlineBudgetSpent`);
    `running_inline` brackets each step it takes there, so only the analysis's own CPU counts.
    """

    def __init__(
        self, limits: AnalysisLimits, deadline: float | None = None, inline: InlineBudget | None = None
    ) -> None:
        self.limits = limits
        self.deadline = deadline if deadline is not None else time.monotonic() + limits.max_scan_seconds
        self.decompressed_bytes = 0
        self.path_components = 0
        self.inline = inline
        self.inline_bytes = 0  # cached entries taken and bytes decompressed, when inline
        self.inline_cpu = 0.0  # the loop thread's CPU spent in finished steps, when inline
        self._step_started: float | None = None  # thread CPU time at the start of the running step
        self._inline_step: AbstractContextManager[None] = _InlineStep(self) if inline else nullcontext()

    @property
    def running_inline(self) -> AbstractContextManager[None]:
        """A context for one step of an inline analysis (a chunk fed, a cache entry taken, the
        verdict): its CPU counts against the inline budget, checked at its end. A no-op otherwise.
        One object per budget, reused: a step costs two reads of the thread's CPU clock."""
        return self._inline_step

    def _begin_step(self) -> None:
        self._step_started = time.thread_time()

    def _end_step(self, failed: bool) -> None:
        assert self._step_started is not None
        self.inline_cpu += time.thread_time() - self._step_started
        self._step_started = None
        if not failed:
            self._check_inline_cpu(0.0)

    def spend_inline_bytes(self, count: int) -> None:
        """`count` more bytes handled inline (a cache entry, decompressed layer bytes)."""
        if self.inline is None:
            return
        self.inline_bytes += count
        if self.inline_bytes > self.inline.bytes:
            raise InlineBudgetSpent(f"more than {self.inline.bytes:,} bytes")

    def _check_inline_cpu(self, running: float) -> None:
        assert self.inline is not None
        if self.inline_cpu + running > self.inline.cpu_seconds:
            raise InlineBudgetSpent(f"more than {self.inline.cpu_seconds * 1000:g} ms of CPU")

    def spend_bytes(self, count: int) -> None:
        self.spend_inline_bytes(count)
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
        if self._step_started is not None:
            self._check_inline_cpu(time.thread_time() - self._step_started)


def scan_too_slow(seconds: float) -> LimitExceeded:
    return LimitExceeded(f"the scan ran for more than {seconds:g} s", seconds, "max_scan_seconds")


class LayerGpuCodeWork:
    """The GPU-code work of one layer so far (containers, entry headers, symbols: steps), against
    `max_layer_gpu_code_steps`. Once past it, `exceeded` holds the error and stays set."""

    def __init__(self, limit: int = DEFAULT_MAX_LAYER_GPU_CODE_STEPS) -> None:
        self.limit = limit
        self.steps = 0
        self.exceeded: LimitExceeded | None = None

    def spend(self, count: int) -> None:
        self.steps += count
        if self.steps > self.limit and self.exceeded is None:
            self.exceeded = LimitExceeded(
                f"reading this layer's GPU code took more than {self.limit:,} steps"
                " (fatbin containers, entry headers and cubin symbols visited)",
                self.limit,
                "max_layer_gpu_code_steps",
            )
        if self.exceeded is not None:
            raise self.exceeded


class GpuCodeWork:
    """The work of reading one file's GPU code, counted as it is done: fatbin containers met and
    walked, entry headers read, cubin symbols read, each against its per-file bound, and every
    step into the layer's total (`LayerGpuCodeWork`). A crossed bound raises `LimitExceeded`; the
    reader makes it the file's error and does no more work on the file."""

    def __init__(self, limits: AnalysisLimits | None = None, layer: LayerGpuCodeWork | None = None) -> None:
        self.limits = limits or AnalysisLimits()
        self.layer = layer
        self.met = 0
        self.walked = 0
        self.entries = 0
        self.symbols = 0

    def meet_container(self) -> None:
        self.met += 1
        self._count(1, self.met, "max_fatbin_containers", "fatbin containers")

    def walk_containers(self, count: int) -> None:
        self.walked += count
        self._count(count, self.walked, "max_fatbin_containers", "fatbin containers walked over its sections")

    def read_entry(self) -> None:
        self.entries += 1
        self._count(1, self.entries, "max_fatbin_entries", "fatbin entry headers read")

    def read_symbols(self, count: int) -> None:
        self.symbols += count
        self._count(count, self.symbols, "max_cubin_symbols", "cubin symbols read")

    def _count(self, spent: int, total: int, setting: str, what: str) -> None:
        """`spent` more steps, `total` of one kind in this file: past the layer's or the file's bound, raise."""
        if self.layer is not None:
            self.layer.spend(spent)
        limit: int = getattr(self.limits, setting)
        if total > limit:
            raise LimitExceeded(f"the file has more than {limit:,} {what}", limit, setting)

    @property
    def exhausted(self) -> LimitExceeded | None:
        """The layer's bound, when an earlier file already crossed it: no GPU code is read any more."""
        return self.layer.exceeded if self.layer is not None else None
