"""Reading GPU code and CUDA evidence is bounded in work, not only in bytes (issue 43, points 2, 4, 5).

The crafted files (`fixtures/hostile_gpu_code.py`) are small and pass every byte bound; read without
bounds in work they cost gigabytes (overlapping `.nv_fatbin` sections), minutes of CPU (converging
entry chains over a cubin whose headers repeat one symbol table) or an exception that failed the
whole image (`e_shoff` >= 2^63, `ast.parse` out of memory, 5,000-digit versions). Here they are
pushed with skopeo into the real registry beside honest evidence and scanned by the real scanner in
its analysis processes: each costs little, ends as a finding on its file or layer naming the bound,
and hides nothing else. A seeded fuzz of the same readers keeps the bounds honest in seconds.
"""

from __future__ import annotations

import contextlib
import random
import shutil
import struct
import subprocess
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from fixtures import hostile_gpu_code as crafted
from fixtures.hostile import member, raw_layer
from fixtures.oci import Entry, ImageSpec, LayerSpec, file
from fixtures.registry import LocalRegistry
from scanner.layers import analysis
from scanner.layers.analysis import AnalysisPool
from scanner.layers.cuda_evidence import collect_layer
from scanner.layers.cudaelf import ElfCudaProbe
from scanner.layers.fatbin import cubin_has_kernel
from scanner.layers.image import CachedLayer
from scanner.layers.limits import AnalysisLimits, LimitExceeded
from scanner.layers.tarstream import TarEntry
from scanner.models import FileArchs, ImageReport, PlatformReport
from scanner.registry.client import RegistryClient
from scanner.scan import Scanner
from scanner.settings import ScannerSettings
from tests.conftest import Pusher, skip_unless_required

SITE = "/usr/lib/python3/dist-packages"
RUNTIME_WHEEL = f"{SITE}/nvidia_cuda_runtime_cu12-12.4.127.dist-info/METADATA"  # honest evidence: CUDA 12.4


def settings(**overrides: object) -> ScannerSettings:
    values: dict[str, object] = {"docker_config": None, "retries": 2, "request_timeout": 20.0}
    values.update(overrides)
    return ScannerSettings(**values)  # type: ignore[arg-type]


async def scan(reference: str, **overrides: object) -> tuple[ImageReport, list[int]]:
    """The report, and the peak resident memory (KiB) of each analysis process that read it."""
    chosen = settings(**overrides)
    async with RegistryClient(chosen) as client:
        scanner = Scanner(client, None, chosen)
        try:
            report = await scanner.scan(reference)
            pool = scanner.layers.pool
            peaks = [_peak_kib(worker.process.pid) for worker in pool._workers if worker.alive]
        finally:
            await scanner.close()
    return report, peaks


def _peak_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmHWM for {pid}")


def only_platform(report: ImageReport) -> PlatformReport:
    assert report.error is None, report.error
    (platform,) = report.platforms
    assert platform.error is None, platform.error
    return platform


def gpu_file(platform: PlatformReport, path: str) -> FileArchs:
    assert platform.gpu.archs is not None, platform.model_dump_json()
    return next(f for f in platform.gpu.archs.files if f.path == path)


def assert_honest_evidence_stands(platform: PlatformReport) -> None:
    """What the crafted files sit beside is still found: glibc, and the CUDA the runtime wheel names."""
    assert platform.libc.flavour == "glibc", platform.libc
    assert platform.gpu.inferred is not None and platform.gpu.inferred.cuda == "12.4", platform.gpu.inferred


def image(*entries: Entry, env: dict[str, str] | None = None) -> ImageSpec:
    spec = crafted.gpu_code_image(file(RUNTIME_WHEEL, b"Name: nvidia-cuda-runtime-cu12\n"), *entries)
    spec.env = env or {}
    return spec


@pytest.fixture(scope="module")
def pushed(push: Pusher, registry: LocalRegistry) -> Iterator[Callable[[str, ImageSpec], str]]:
    def push_as(name: str, spec: ImageSpec) -> str:
        push(spec, f"gpucode/{name}:1")
        return f"{registry.host}/gpucode/{name}:1"

    yield push_as


# ------------------------------------------------------------ point 2: memory per section


async def test_overlapping_fatbin_sections_cost_one_walk(pushed: Callable[[str, ImageSpec], str]) -> None:
    """40 section headers over one region of 65,536 empty containers took an analysis process to 2.9 GB
    before; sections naming the same bytes are walked once and containers share one record per content."""
    reference = pushed("sections", image(file("/usr/lib/libsections.so", crafted.overlapping_sections(40))))
    report, peaks = await scan(reference, analysis_processes=1)
    platform = only_platform(report)
    assert_honest_evidence_stands(platform)
    found = gpu_file(platform, "/usr/lib/libsections.so")
    assert found.error is None and found.sections == [".nv_fatbin"]
    assert [(c.count, c.kernels) for c in found.containers] == [(65_536, False)]
    assert peaks and max(peaks) < 256 * 1024, peaks  # KiB


async def test_shifted_overlapping_sections_stop_at_the_container_bound(
    pushed: Callable[[str, ImageSpec], str],
) -> None:
    """4,000 sections each one container further in (the largest such file: 3 KB gzipped, some 300 GB
    read naively): the walks stop at `max_fatbin_containers`, an error on that file only."""
    content = crafted.overlapping_sections(4000, shifted=True)
    reference = pushed("shifted", image(file("/usr/lib/libshifted.so", content)))
    report, peaks = await scan(reference, analysis_processes=1)
    platform = only_platform(report)
    assert_honest_evidence_stands(platform)
    error = gpu_file(platform, "/usr/lib/libshifted.so").error
    assert error is not None and error.endswith("(GPUBADGE_MAX_FATBIN_CONTAINERS)"), error
    assert "walked over its sections; the limit is 65,536" in error
    assert peaks and max(peaks) < 256 * 1024, peaks


def test_the_sections_beside_the_fatbin_ones_are_told_apart_in_linear_work() -> None:
    """The same file's other sections are looked through for containers the library loads itself:
    choosing them compared every section with every fatbin section (4,000 x 4,000 model comparisons,
    5.6 s of CPU here); by identity it is linear."""
    content = crafted.overlapping_sections(4000, shifted=True)
    started = time.process_time()
    probe = ElfCudaProbe(len(content))
    probe.feed(content)
    facts = probe.finish()
    assert facts is not None and facts.fatbin is not None and facts.fatbin.error is not None
    assert time.process_time() - started < 3.5  # 1.1-1.2 s alone here, 2.1 s beside a busy test worker


# ------------------------------------------------------------ point 4: CPU per container


async def test_converging_chains_read_a_shared_cubin_once(pushed: Callable[[str, ImageSpec], str]) -> None:
    """Three files of 64 containers converging on one 64 KiB cubin that repeats its symbol table in
    every section header: 13 s of CPU each before (a 5,433-byte layer of 14 took 185 s), so the scan
    crossed a 20 s wall-time bound; now each distinct cubin and symbol table is read once."""
    files = [file(f"/usr/lib/libconverge{n}.so", crafted.converging_cubins()) for n in range(3)]
    reference = pushed("converging", image(*files))
    report, _ = await scan(reference, analysis_processes=1, max_scan_seconds=20.0)
    platform = only_platform(report)
    assert_honest_evidence_stands(platform)
    for n in range(3):
        assert gpu_file(platform, f"/usr/lib/libconverge{n}.so").error is not None  # its section is a lie


async def test_each_per_file_work_bound_is_an_error_on_that_file(
    pushed: Callable[[str, ImageSpec], str],
) -> None:
    """Entry headers re-walked by converging chains, and symbol tables that differ by a byte each: past
    `max_fatbin_entries` / `max_cubin_symbols` the file's GPU code is an error naming the bound."""
    chains = crafted.converging_cubins(containers=500, cubin_size=2048, tail_entries=4000)
    symbols = crafted.converging_cubins(containers=1, cubin_size=64 * 1024, distinct_symtabs=True)
    reference = pushed(
        "per-file", image(file("/usr/lib/libchains.so", chains), file("/usr/lib/libsymbols.so", symbols))
    )
    report, _ = await scan(reference, analysis_processes=1)
    platform = only_platform(report)
    assert_honest_evidence_stands(platform)
    errors = {
        path: gpu_file(platform, path).error for path in ("/usr/lib/libchains.so", "/usr/lib/libsymbols.so")
    }
    assert (errors["/usr/lib/libchains.so"] or "").endswith("(GPUBADGE_MAX_FATBIN_ENTRIES)"), errors
    assert (errors["/usr/lib/libsymbols.so"] or "").endswith("(GPUBADGE_MAX_CUBIN_SYMBOLS)"), errors
    assert not report.retryable or report.error is None  # nothing failed, so nothing is retried


async def test_the_layer_bound_leaves_later_files_unread_and_says_so(
    pushed: Callable[[str, ImageSpec], str],
) -> None:
    """Files each under the per-file bounds add up past `max_layer_gpu_code_steps`: the file that
    crosses it and every later fatbin are listed as not read, the report warns, the rest stands."""
    chains = crafted.converging_cubins(containers=20, cubin_size=2048, tail_entries=1000)  # ~20,000 entries
    files = [file(f"/usr/lib/libmany{n:02}.so", chains) for n in range(8)]
    reference = pushed("per-layer", image(*files))
    report, _ = await scan(reference, analysis_processes=1, max_layer_gpu_code_steps=50_000)
    platform = only_platform(report)
    assert_honest_evidence_stands(platform)
    assert platform.gpu.archs is not None
    errors = [f.error or "" for f in platform.gpu.archs.files if f.path.startswith("/usr/lib/libmany")]
    assert len(errors) == 8
    assert sum("(GPUBADGE_MAX_LAYER_GPU_CODE_STEPS)" in error for error in errors) >= 5, errors
    assert any(error.startswith("not read: ") for error in errors), errors
    warnings = [w for w in platform.warnings if "GPUBADGE_MAX_LAYER_GPU_CODE_STEPS" in w]
    assert warnings and "was not read" in warnings[0], platform.warnings


async def test_thousands_of_extensions_and_load_sites_cost_lookups(
    pushed: Callable[[str, ImageSpec], str],
) -> None:
    """4,000 extension modules with a fatbin each, beside 100,000 import statements: how each is loaded
    was a pass over every site per module (4 x 10^8 comparisons, minutes of CPU, past a 20 s scan);
    now the sites are indexed as they are read and each module's state is a few lookups."""
    extension = crafted.smallest_gpu_library()
    imports = b"".join(b"import pkg.m%d\n" % n for n in range(20_000))
    files = [file(f"{SITE}/pkg/{name}.abi3.so", extension) for name in ("_a", "_b", "_c")]
    files += [file(f"{SITE}/pkg/_e{n}.abi3.so", extension) for n in range(3997)]
    files += [file(f"{SITE}/pkg/imports{n}.py", imports) for n in range(5)]
    files.append(
        file(
            f"{SITE}/pkg/__init__.py",
            b"from . import _a\ntry:\n    from . import _b\nexcept ImportError:\n    pass\n",
        )
    )
    reference = pushed("load-sites", image(*files))
    report, _ = await scan(reference, analysis_processes=1, max_scan_seconds=20.0)
    platform = only_platform(report)
    assert_honest_evidence_stands(platform)
    assert gpu_file(platform, f"{SITE}/pkg/_a.abi3.so").imported == "required"
    assert gpu_file(platform, f"{SITE}/pkg/_b.abi3.so").imported == "optional"
    assert gpu_file(platform, f"{SITE}/pkg/_c.abi3.so").imported is None
    assert platform.gpu.archs is not None and platform.gpu.archs.files_not_listed == 4000 - 512
    assert (
        "deep scan: 3,488 more files with GPU code were neither listed nor judged (the report keeps 512, in path order)"
        in platform.warnings
    )


def chained_library(template: bytes, number: int) -> bytes:
    """`libcudart.so.1.<number>`, linking (DT_NEEDED) `libcudart.so.1.<number + 1>`: the names of a
    library gcc built, patched in place (five digits each, so every offset stands)."""
    return template.replace(b"libcudart.so.1.10001", b"libcudart.so.1.%05d" % (number + 1)).replace(
        b"libcudart.so.1.10000", b"libcudart.so.1.%05d" % number
    )


@pytest.fixture(scope="module")
def link_template(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """A 4.8 KB shared object named `libcudart.so.1.10000` that links `libcudart.so.1.10001`."""
    if shutil.which("gcc") is None:
        skip_unless_required("gcc is not installed (make deps-system installs it)")
    work: Path = tmp_path_factory.mktemp("chain")
    (work / "empty.c").write_text("\n")
    flags = ["gcc", "-shared", "-nostdlib", "-s", "-fPIC", "-Wl,--no-as-needed"]
    for name, needs in (("libcudart.so.1.10001", []), ("libcudart.so.1.10000", ["libcudart.so.1.10001"])):
        command = [*flags, f"-Wl,-soname,{name}", "-o", str(work / name), str(work / "empty.c")]
        subprocess.run([*command, *[str(work / need) for need in needs]], check=True)
    return (work / "libcudart.so.1.10000").read_bytes()


async def test_a_long_chain_of_linked_libraries_is_resolved_once(
    pushed: Callable[[str, ImageSpec], str], link_template: bytes
) -> None:
    """Two layers of 4,000 libraries named like CUDA's runtime, each linking the next, the last linking
    one the image lacks: each file's way to the missing one was walked and spelt out anew (31 s of CPU
    per merge of the layers, cubic in the chain's length); now every library's way is known after one
    walk back from the missing one, and shown to its fourth hop."""
    layers = [
        LayerSpec(
            [
                file(f"/usr/lib/libcudart.so.1.{n:05d}", chained_library(link_template, n))
                for n in range(start, start + 4000)
            ]
        )
        for start in (10000, 14000)
    ]
    spec = image()
    spec.layers += layers
    reference = pushed("chain", spec)
    report, _ = await scan(reference, analysis_processes=1, max_scan_seconds=20.0)
    platform = only_platform(report)
    assert_honest_evidence_stands(platform)
    assert (
        platform.gpu.inferred is not None and platform.gpu.inferred.cuda == "12.4"
    )  # no dead library speaks


# ------------------------------------------------------------ point 2: address space


async def test_analysis_processes_run_under_the_address_space_setting() -> None:
    """Each analysis process holds RLIMIT_AS at `analysis_memory_bytes`; a MemoryError in a session
    answers the limit error naming that setting (not an internal error, which would be retried)."""
    error = analysis._error_of(MemoryError())
    assert error["kind"] == "limit" and error["setting"] == "analysis_memory_bytes"
    assert "(GPUBADGE_ANALYSIS_MEMORY_BYTES)" in error["message"]
    pool = AnalysisPool(1, memory_bytes=300 << 20)
    try:
        session = await pool.open("amd64", 1, AnalysisLimits(), time.monotonic() + 30, cuda=False)
        await session.use_cached(CachedLayer().model_dump_json())  # the process is serving: its limit is set
        session.close()
        limits = Path(f"/proc/{pool._workers[0].process.pid}/limits").read_text()
    finally:
        await pool.close()
    line = next(line for line in limits.splitlines() if line.startswith("Max address space"))
    assert line.split()[3:5] == [str(300 << 20), str(300 << 20)], line


async def test_a_layer_past_the_address_space_fails_naming_it_and_is_not_retried(
    pushed: Callable[[str, ImageSpec], str],
) -> None:
    """A 64 MiB PAX record (allowed here by a raised header bound) cannot fit in a 96 MiB address
    space: the layer fails with the setting named, for good, and the process serves the next scan."""
    big = raw_layer([member("etc/motd", content=b"hi", pax={"comment": "x" * (64 << 20)})])
    reference = pushed("address-space", ImageSpec([big]))
    small = pushed("after-address-space", image())
    chosen = settings(analysis_processes=1, analysis_memory_bytes=96 << 20, max_tar_header_bytes=1 << 30)
    async with RegistryClient(chosen) as client:
        scanner = Scanner(client, None, chosen)
        try:
            report = await scanner.scan(reference)
            (platform,) = report.platforms
            assert platform.error is not None and platform.error.endswith("(GPUBADGE_ANALYSIS_MEMORY_BYTES)")
            assert report.retryable is False
            again = await scanner.scan(small)  # the same process, still serving
            assert_honest_evidence_stands(only_platform(again))
        finally:
            await scanner.close()


# ------------------------------------------------------------ point 5: one file, one finding


async def test_one_crafted_file_never_fails_the_image(pushed: Callable[[str, ImageSpec], str]) -> None:
    """A cubin with e_shoff = 2^63 (OverflowError), a torch/version.py Python's parser runs out of memory
    on, and 5,000-digit versions in torch, a toolkit's version.txt and conda-meta each failed the layer,
    and with it libc and every piece of CUDA evidence; now each is its file's finding at most."""
    digits = crafted.long_version()
    reference = pushed(
        "one-file",
        image(
            file("/usr/lib/libshoff.so", crafted.cubin_with_huge_section_offset()),
            file("/usr/lib/libouter.so", crafted.huge_section_offset((1 << 64) - 1)),
            file(f"{SITE}/torch/version.py", crafted.deep_torch_version()),
            file("/opt/py/lib/python3/site-packages/torch/version.py", f"cuda = '{digits}.1'\n".encode()),
            file("/usr/local/cuda/version.txt", f"CUDA Version {digits}.1\n".encode()),
            file(
                "/opt/conda/conda-meta/cuda-version-12.4-0.json",
                f'{{"name": "cuda-version", "version": "{digits}"}}'.encode(),
            ),
        ),
    )
    report, _ = await scan(reference, analysis_processes=1)
    platform = only_platform(report)
    assert_honest_evidence_stands(platform)
    shoff = gpu_file(platform, "/usr/lib/libshoff.so")
    assert shoff.error is None and [c.kernels for c in shoff.containers] == [
        True
    ]  # unreadable: may hold kernels
    problems = [w for w in platform.warnings if f"{SITE}/torch/version.py: not read: " in w]
    assert len(problems) == 1 and ("MemoryError" in problems[0] or "RecursionError" in problems[0])
    assert not any("Traceback" in w or "internal error" in w for w in platform.warnings)


async def test_a_5000_digit_version_in_the_config_is_no_version(
    pushed: Callable[[str, ImageSpec], str],
) -> None:
    """CUDA_VERSION, NVIDIA_REQUIRE_CUDA and the v1 label with 5,000 digits each raised ValueError
    (int()'s digit limit) and failed the scan; they are reported as the values they are."""
    digits = crafted.long_version()
    env = {"CUDA_VERSION": digits, "NVIDIA_REQUIRE_CUDA": f"cuda>={digits}.0"}
    reference = pushed("config-digits", image(env=env))
    report, _ = await scan(reference, analysis_processes=1)
    platform = only_platform(report)
    assert_honest_evidence_stands(platform)
    assert platform.gpu.required and platform.gpu.cuda_version is None


def test_a_5000_digit_requirement_reaches_placement_as_the_runtime_reads_it() -> None:
    """Such an image now scans, so its requirement reaches placement: the runtime's comparison is an
    error there (strtoumax saturates), exports take it for no version, and nothing raises."""
    from placement.exports.core import parse_version
    from placement.nvidia_require import DeviceFacts, evaluate_text, legacy_cuda_requirement

    digits = crafted.long_version()
    device = DeviceFacts(cuda="12.4", driver="550.54.15", arch="9.0", brand="tesla")
    verdict = evaluate_text(f"cuda>={digits}.0 brand=tesla,driver>={digits},driver<{digits}", device)
    assert verdict.outcome == "error", verdict
    assert evaluate_text(f"cuda>={'0' * 5000}12.4", device).outcome == "satisfied"  # leading zeros: 12.4
    assert parse_version(f"{digits}.0") is None and parse_version("12.4") == (12, 4)
    with pytest.raises(ValueError, match="invalid CUDA_VERSION"):
        legacy_cuda_requirement(digits)


# ------------------------------------------------------------ a fuzz of the bounds, in seconds


SEEDS: list[tuple[str, bytes]] = [
    ("sections", crafted.overlapping_sections(64, containers=256, shifted=True)),
    ("converging", crafted.converging_cubins(containers=8, cubin_size=4096, tail_entries=16)),
    ("symbols", crafted.converging_cubins(containers=2, cubin_size=4096, distinct_symtabs=True)),
    ("shoff", crafted.cubin_with_huge_section_offset()),
]
EXTREMES = (0, 1, 0x7F, 0xFFFF, 2**31 - 1, 2**32 - 1, 2**63, 2**64 - 1)


def mutate(data: bytes, rng: random.Random) -> bytes:
    """One mutation of the kinds the adversarial pass used: byte flips, extreme header fields,
    truncation, a region repeated."""
    buffer = bytearray(data)
    choice = rng.randrange(4)
    if choice == 0:
        for _ in range(rng.randint(1, 8)):
            buffer[rng.randrange(len(buffer))] = rng.randrange(256)
    elif choice == 1:
        width, code = rng.choice([(2, "<H"), (4, "<I"), (8, "<Q")])
        at = rng.randrange(0, max(1, len(buffer) - width))
        value = rng.choice(EXTREMES) % (1 << (8 * width))
        buffer[at : at + width] = struct.pack(code, value)
    elif choice == 2:
        del buffer[rng.randrange(1, len(buffer)) :]
    else:
        start = rng.randrange(len(buffer))
        piece = buffer[start : start + rng.randint(16, 4096)]
        buffer[start:start] = piece * rng.randint(1, 8)
    return bytes(buffer)


def test_mutated_gpu_code_never_raises_and_stays_bounded() -> None:
    """800 seeded mutations of the crafted files through the ELF probe, the kernel-free check and the
    layer collector (small bounds, so each path is crossed): no exception escapes, each file's work
    stays under its bounds, and memory stays small."""
    from scanner.layers.limits import GpuCodeWork  # imported here: the other tests run against any scanner

    rng = random.Random(43)
    limits = AnalysisLimits(
        max_fatbin_containers=4096,
        max_fatbin_entries=8192,
        max_cubin_symbols=8192,
        max_layer_gpu_code_steps=60_000,
    )
    tracemalloc.start()
    try:
        started = time.process_time()
        for round_ in range(800):
            name, seed = SEEDS[round_ % len(SEEDS)]
            data = mutate(seed, rng)
            work = GpuCodeWork(limits)
            probe = ElfCudaProbe(len(data), work)
            for start in range(0, len(data), 4096):
                if not probe.feed(data[start : start + 4096]):
                    break
            probe.finish()
            assert (
                work.entries <= limits.max_fatbin_entries + 1
                and work.symbols <= limits.max_cubin_symbols + 4096
            )
            with contextlib.suppress(LimitExceeded):
                cubin_has_kernel(data[: 64 << 10], GpuCodeWork(limits))
            collect_layer(
                [
                    (TarEntry(path=f"/usr/lib/{name}.so", kind="file", size=len(data), mode=0o644), data),
                    (
                        TarEntry(path=f"{SITE}/torch/version.py", kind="file", size=len(data), mode=0o644),
                        data[:4096],
                    ),
                ],
                limits,
            )
        cpu = time.process_time() - started
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, peak
    assert cpu < 60, cpu  # a generous ceiling for a loaded machine: seconds on a quiet one


PYTHON_SEED = b"""import os
from . import _core  # its own package
from .backends import fast as _fast
try:
    import pkg._fa3
except ImportError:
    _fa3 = None
with contextlib.suppress(ImportError):
    from pkg import _fp4
class Registry:
    import pkg.models.llama
    def load(self, name):
        import importlib
        return importlib.import_module(f"pkg.models.{name}")
def plugin():
    return "pkg.platforms.cuda.CudaPlatform", 'pkg.platforms.rocm'
if TYPE_CHECKING:
    from ..other import thing, (a, b)
torch.ops.load_library(glob.glob("_C*.so")[0])
ctypes.CDLL(os.path.join(here, "libpkg_kernels.so"))
"""


def test_mutated_python_sources_never_raise_and_stay_bounded() -> None:
    """1,000 seeded mutations of a source that holds every kind of load site the reading knows (module
    level, guarded, lazy, relative, by path, quoted names), each read as ten modules of one layer, and
    every extension's state asked: no exception escapes, and the work stays small."""
    from scanner.layers.python_loads import LoadSites

    rng = random.Random(44)
    started = time.process_time()
    for _ in range(1000):
        data = mutate(PYTHON_SEED, rng)
        loads = LoadSites()
        for number in range(10):
            loads.add_source(f"{SITE}/pkg/{'sub/' * number}m{number}.py", data)
            loads.add_source(f"{SITE}/pkg/{'sub/' * number}__init__.py", data[::-1])
        for extension in ("_core", "_fa3", "_fp4", "_C_x", "libpkg_kernels", "backends/fast", "models/llama"):
            assert loads.state(f"{SITE}/pkg/{extension}.abi3.so") in ("required", "optional", None)
    assert time.process_time() - started < 30  # a generous ceiling for a loaded machine
