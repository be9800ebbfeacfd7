"""Deep scan (CUDA found in layers) throughput, against `gzip -dc | tar -t` on the same blob.

The layer is built like a CUDA wheel layer: copies of NVIDIA's real libnvjpeg.so.12 (a 9 MB
ELF with a 6 MB fatbin, downloaded by pip at set-up, never committed) at distinct paths, the
wheel's other files, torch/version.py and thousands of small Python files, tar'd and
compressed with `gzip -6` (Docker's default level) to one blob on disk.

Measured, one run, each side as a whole process (start-up included):
* the floor: `sh -c 'gzip -dc BLOB | tar -t >/dev/null'` (two processes in a pipe);
* each side runs twice, alternating, and keeps its best wall time (the machine is shared);
* ours: `python -m bench.deep_bench --walk BLOB`, the deep scan's layer walk (decompress, parse
  every tar header, read the small files, stream every ELF through the probe) fed 1 MiB chunks
  from the file, as the registry stream feeds it. Peak RSS is the child's ru_maxrss.
* a second image sharing the layer, through a real registry (pushed by skopeo): bytes of the
  shared layer read again by the deep scan (goal: 0).

Run alone: python3 -m bench.deep_bench [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from bench.common import Figure, Results

MiB = 1 << 20
SITE = "usr/local/lib/python3.11/site-packages"


def build_blob(directory: Path, target_bytes: int) -> Path:
    """A gzip layer of about `target_bytes` decompressed bytes; returns the blob's path."""
    from tests.nvidia_wheels import NVJPEG_CU12, wheel_members

    members = wheel_members(NVJPEG_CU12)
    library = members["nvidia/nvjpeg/lib/libnvjpeg.so.12"]
    tar_path = directory / "layer.tar"
    written = 0
    with tarfile.open(tar_path, "w", format=tarfile.PAX_FORMAT) as archive:

        def add(path: str, data: bytes) -> None:
            nonlocal written
            info = tarfile.TarInfo(path)
            info.size = len(data)
            info.mode = 0o644
            archive.addfile(info, _Reader(data))
            written += len(data) + 512

        for path, data in members.items():
            add(f"{SITE}/{path}", data)
        add(f"{SITE}/torch/version.py", b"__version__ = '2.1.2+cu121'\ncuda: Optional[str] = '12.1'\n")
        small = b"import os\n" + b"# python source line of a package\n" * 300
        index = 0
        while written < target_bytes:
            for _ in range(200):  # ~2 MB of small files per library copy, like site-packages
                add(f"{SITE}/pkg{index % 50}/module{index}.py", small + str(index).encode())
                index += 1
            add(f"{SITE}/vendor{index}/lib/libnvjpeg.so.12", library)
    blob = directory / "layer.tar.gz"
    with blob.open("wb") as out:
        subprocess.run(["gzip", "-6", "-c", str(tar_path)], stdout=out, check=True)
    tar_path.unlink()
    return blob


class _Reader:
    def __init__(self, data: bytes) -> None:
        self._data = memoryview(data)
        self._at = 0

    def read(self, size: int = -1) -> bytes:
        end = len(self._data) if size < 0 else min(len(self._data), self._at + size)
        chunk = bytes(self._data[self._at : end])
        self._at = end
        return chunk


def walk_blob(blob: Path) -> dict[str, object]:
    """The child: the deep scan's layer walk over a blob read in 1 MiB chunks."""
    from scanner.inferred import CudaEntryCollector, combine
    from scanner.limits import AnalysisLimits, ScanBudget
    from scanner.tarstream import StreamStats
    from scanner.walk import LayerWalk

    limits = AnalysisLimits(max_layer_bytes=64 << 30, max_image_bytes=64 << 30, max_scan_seconds=3600)
    collector = CudaEntryCollector()
    stats = StreamStats()
    walk = LayerWalk(
        "application/vnd.oci.image.layer.v1.tar+gzip",
        [collector],
        max_decompressed=limits.max_layer_bytes,
        budget=ScanBudget(limits),
        stats=stats,
    )
    with blob.open("rb") as handle:
        while chunk := handle.read(MiB):
            if not walk.feed(chunk):
                break
        else:
            walk.close()
    evidence = collector.layer.finish(complete=stats.reached_end)
    inferred, archs = combine([evidence])
    return {
        "decompressed": stats.decompressed_bytes,
        "entries": stats.entries,
        "cuda": inferred.cuda if inferred else None,
        "fatbin_files": len(archs.files) if archs else 0,
        "maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
    }


def timed(command: list[str], env: dict[str, str] | None = None) -> tuple[float, float, str]:
    """(wall seconds, CPU seconds of the children, stdout) for one command."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=True, env=env)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, done.stdout


async def shared_layer_reads() -> tuple[int, int, int]:
    """(bytes read for image A, bytes of the shared layer read again for image B, its size)."""
    from fixtures.oci import ImageSpec, LayerSpec, file, push_image
    from fixtures.registry import run_registry
    from scanner.analysis import AnalysisPool
    from scanner.deep import DeepReader
    from scanner.reference import parse_reference
    from scanner.registry import RegistryClient
    from scanner.settings import ScannerSettings
    from tests.test_deep_scan import wheel_layer

    shared = wheel_layer()
    with run_registry() as registry, tempfile.TemporaryDirectory() as work:
        push_image(ImageSpec([shared]), f"{registry.host}/bench/a:1", Path(work) / "a")
        extra = LayerSpec([file("/app/main.py", "print(1)\n")])
        push_image(ImageSpec([shared, extra]), f"{registry.host}/bench/b:1", Path(work) / "b")
        settings = ScannerSettings(docker_config=None)
        pool = AnalysisPool(settings.analysis_processes)
        try:
            async with RegistryClient(settings) as client:
                reader = DeepReader(client, None, settings.deep_scan_limits(), pool)
                first_ref = parse_reference(f"{registry.host}/bench/a:1")
                first = await reader.scan(first_ref, (await client.manifest(first_ref)).layers)
                second_ref = parse_reference(f"{registry.host}/bench/b:1")
                layers = (await client.manifest(second_ref)).layers
                second = await reader.scan(second_ref, layers)
                return first.bytes_read, second.bytes_read - layers[1].size, layers[0].size
        finally:
            await pool.close()


def run_all(results: Results, quick: bool) -> None:
    section = "Deep scan"
    target = (256 if quick else 1024) * MiB
    with tempfile.TemporaryDirectory(prefix="gpubadge-deep-") as work:
        blob = build_blob(Path(work), target)
        size = blob.stat().st_size
        results.detail(f"deep-scan layer: {target // MiB} MiB decompressed, {size / MiB:.0f} MiB gzip")
        floor_command = ["sh", "-c", f"gzip -dc {blob} | tar -t >/dev/null"]
        ours_command = [sys.executable, "-m", "bench.deep_bench", "--walk", str(blob)]
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
        timed(floor_command)  # warm the page cache
        # Alternate the two, twice, and keep each side's best: the machine is shared, load comes and goes.
        floors = [timed(floor_command) for _ in range(1)]
        runs = [timed(ours_command, env)]
        floors.append(timed(floor_command))
        runs.append(timed(ours_command, env))
        floor_wall, floor_cpu, _ = min(floors)
        ours_wall, ours_cpu, out = min(runs)
        child = json.loads(out)
        results.detail(
            "deep-scan walls (s): floor "
            + ", ".join(f"{f[0]:.2f}" for f in floors)
            + "; ours "
            + ", ".join(f"{r[0]:.2f}" for r in runs)
        )
    speed = floor_wall / ours_wall
    rss_mb = int(child["maxrss_kib"]) / 1024
    results.add(
        Figure(
            section,
            f"deep scan of a {target // MiB} MiB gzip layer (wall, process start included)",
            f"{ours_wall:.2f} s ({target / MiB / ours_wall:.0f} MiB/s)",
            f"{floor_wall:.2f} s gzip -dc | tar -t",
            round(speed, 2),
            ">= 0.8x the floor's speed",
            speed >= 0.8,
            f"CPU ours {ours_cpu:.2f} s vs floor {floor_cpu:.2f} s; found CUDA {child['cuda']},"
            f" {child['fatbin_files']} files with fatbins, {child['entries']} entries",
        )
    )
    results.add(Figure(section, "deep scan peak RSS", f"{rss_mb:.0f} MB", "", None, "< 150 MB", rss_mb < 150))
    first, again, shared = asyncio.run(shared_layer_reads())
    results.add(
        Figure(
            section,
            "second image sharing the layer: bytes of it read again",
            f"{again} B",
            "",
            None,
            "0 B",
            again == 0,
            f"first image read {first} B; the shared layer is {shared} B compressed",
        )
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--walk", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.walk:
        print(json.dumps(walk_blob(args.walk)))
        return 0
    results = Results()
    run_all(results, args.quick)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
