"""The deep walk over layers of real GPU packages, against `gzip -dc | tar -t` on the same blob (issue 42).

Two layers, built from the pinned wheels of tests/gpu_packages.py (read from PyPI by range requests,
cached, never committed) as `pip install` lays them out, each tar'd and compressed with `gzip -6`
(Docker's default level) to a blob on disk:
* **vLLM 0.33.0**: its 3,231 Python sources (their extension imports are read), its 13 libraries
  (690 MiB, 118 fatbin containers in the largest) and its RECORD;
* **flashinfer-cubin 0.6.13**: its 15,970 standalone `.cubin` files (1.9 GB).

Measured, one run, each side as a whole process (start-up included), each run twice alternating
and its best wall time kept (the machine is shared):
* the floor: `sh -c 'gzip -dc BLOB | tar -t >/dev/null'`;
* ours: `python -m bench.package_bench --walk BLOB`, the walk an analysis process runs (decompress,
  every header, the small files, every ELF and module file streamed through its reader), under the
  analysis processes' own address-space limit (`analysis_memory_bytes`); peak RSS is its VmHWM;
* for flashinfer-cubin, ours again with module files read as any other file (`--plain`), as the
  walk read them before: what reading 15,970 cubins costs (goal: at most 10 % more).

Run alone: python3 -m bench.package_bench
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import Figure, Results
from bench.deep_bench import peak_rss_kib, timed

MiB = 1 << 20


def build_blob(name: str, parts_of: str, directory: Path) -> Path:
    """The gzip blob of one package layer, built from the cached members (and kept beside them: its
    gzip -6 takes minutes)."""
    from tests import gpu_packages
    from tests.nvidia_wheels import CACHE

    kept = CACHE / "bench" / f"{name}.tar.gz"
    if kept.exists():
        return kept

    parts = {
        "vllm": lambda: [gpu_packages.python_package(gpu_packages.VLLM)],
        "flashinfer-cubin": lambda: [
            gpu_packages.members(
                gpu_packages.FLASHINFER_CUBIN, lambda n: n.endswith((".cubin", ".py", "RECORD")), "cubins"
            )
        ],
    }[parts_of]()
    tar_path = directory / f"{name}.tar"
    with tar_path.open("wb") as out:
        for chunk in gpu_packages._tar(parts):
            out.write(chunk)
    subprocess.run(["gzip", "-6", "-f", str(tar_path)], check=True)
    kept.parent.mkdir(parents=True, exist_ok=True)
    tar_path.with_suffix(".tar.gz").replace(kept)
    return kept


def walk_blob(blob: Path, plain: bool) -> dict[str, object]:
    """The child: one walk of a blob read in 1 MiB chunks with every consumer, as an analysis process
    runs it under its address-space limit. `plain`: module files read as any other file."""
    import time

    from scanner.layers import cuda_evidence
    from scanner.layers.analysis import limit_address_space
    from scanner.layers.image import ImageAnalysis
    from scanner.layers.limits import DEFAULT_ANALYSIS_MEMORY_BYTES, AnalysisLimits

    if plain:
        cuda_evidence.module_kind = lambda path: None  # type: ignore[assignment]
    limit_address_space(DEFAULT_ANALYSIS_MEMORY_BYTES)
    analysis = ImageAnalysis("amd64", 1, AnalysisLimits(), time.monotonic() + 3600, cuda=True)
    walk = analysis.begin_layer("application/vnd.oci.image.layer.v1.tar+gzip")
    with blob.open("rb") as handle:
        while chunk := handle.read(MiB):
            if not walk.feed(chunk):
                break
        else:
            walk.close()
    analysis.finish_layer()
    verdict = analysis.verdict(bytes_read=0, bytes_total=0)
    archs = verdict.archs
    return {
        "decompressed": walk.stats.decompressed_bytes,
        "entries": walk.stats.entries,
        "cuda": verdict.inferred.cuda if verdict.inferred else None,
        "code_files": len(archs.files) if archs else 0,
        "module_files": sum(f.files for f in archs.files if f.kind == "modules") if archs else 0,
        "maxrss_kib": peak_rss_kib(),
    }


def _best(
    command: list[str], floor: list[str], env: dict[str, str]
) -> tuple[tuple[float, float, str], tuple[float, float, str]]:
    timed(floor)  # warm the page cache
    floors, runs = [], []
    for _ in range(2):
        floors.append(timed(floor))
        runs.append(timed(command, env))
    return min(floors), min(runs)


def run_all(results: Results, quick: bool) -> None:
    section = "GPU packages"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    with tempfile.TemporaryDirectory(prefix="gpubadge-packages-") as work:
        for name in ("vllm", "flashinfer-cubin"):
            blob = build_blob(name, name, Path(work))
            floor = ["sh", "-c", f"gzip -dc {blob} | tar -t >/dev/null"]
            ours = [sys.executable, "-m", "bench.package_bench", "--walk", str(blob)]
            (floor_wall, floor_cpu, _), (wall, cpu, out) = _best(ours, floor, env)
            child = json.loads(out)
            size = int(child["decompressed"])
            results.add(
                Figure(
                    section,
                    f"deep walk of the {name} layer ({size / MiB:.0f} MiB, {blob.stat().st_size / MiB:.0f} MiB gzip)",
                    f"{wall:.2f} s ({size / MiB / wall:.0f} MiB/s)",
                    f"{floor_wall:.2f} s gzip -dc | tar -t",
                    round(floor_wall / wall, 2),
                    "at or faster than the floor",
                    wall <= floor_wall,
                    f"CPU ours {cpu:.2f} s vs floor {floor_cpu:.2f} s; CUDA {child['cuda']}, {child['code_files']}"
                    f" files of GPU code ({child['module_files']} module files); peak RSS"
                    f" {int(child['maxrss_kib']) / 1024:.0f} MB under the analysis processes' address-space limit",
                )
            )
            if name == "flashinfer-cubin":
                plain = [*ours, "--plain"]
                runs = [timed(plain, env), timed(ours, env), timed(plain, env), timed(ours, env)]
                before = min(runs[0], runs[2])[0]
                after = min(runs[1], runs[3])[0]
                results.add(
                    Figure(
                        section,
                        "reading flashinfer-cubin's 15,970 cubins (wall, against the walk that skips them)",
                        f"{after:.2f} s",
                        f"{before:.2f} s read as plain files",
                        round(before / after, 2),
                        "at most 10 % more",
                        after <= before * 1.10,
                        "runs: "
                        + ", ".join(f"{r[0]:.2f}" for r in runs)
                        + " (plain, modules, plain, modules)",
                    )
                )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--walk", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--plain", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.walk:
        print(json.dumps(walk_blob(args.walk, args.plain)))
        return 0
    results = Results()
    run_all(results, args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
