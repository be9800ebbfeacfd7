"""Crafted GPU code: what each of issue 43's reproductions costs one layer's analysis, before and after.

    python3 -m bench.gpu_code_bench [--quick]
    GPUBADGE_BENCH_BEFORE=/path/to/old/checkout python3 -m bench.gpu_code_bench

Each case is one gzip layer (`fixtures/hostile_gpu_code.py`: a glibc shell and loader beside the
crafted files), built once here and walked by `ImageAnalysis` with the deep scan on, exactly as an
analysis process walks it, in a fresh Python process per case and checkout, so its peak resident
memory is the case's own. Figures: CPU
seconds, peak RSS, and what the layer ended as. The peer is the same case run with the checkout named
by GPUBADGE_BENCH_BEFORE (the code before issue 43), in the same run; cases that would ask the old code
for hundreds of GB are not run there, and say so. Without it, only this checkout's figures are shown.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.common import REPO_ROOT, Figure, Results, run_section
from fixtures import hostile_gpu_code as crafted
from fixtures.oci import Entry, compress, file, tar_bytes

SECTION = "gpucode"
SITE = "/usr/lib/python3/dist-packages"

# Runs in the child, with the tree under test first on its path: walk the layer in the file, report.
CHILD = r"""
import json, resource, sys, time
from scanner.layers.image import ImageAnalysis
from scanner.layers.limits import AnalysisLimits

with open(sys.argv[1], "rb") as layer:
    blob = layer.read()
analysis = ImageAnalysis("amd64", 1, AnalysisLimits(), time.monotonic() + 3600, cuda=True)
started = time.process_time()
try:
    walk = analysis.begin_layer("application/vnd.oci.image.layer.v1.tar+gzip")
    for at in range(0, len(blob), 65536):
        if not walk.feed(blob[at : at + 65536]):
            break
    else:
        walk.close()
    analysis.finish_layer()
    verdict = analysis.verdict(bytes_read=len(blob), bytes_total=len(blob))
    errors = [f.error for f in (verdict.archs.files if verdict.archs else []) if f.error]
    outcome = f"libc {verdict.libc.flavour}"
    if errors:
        outcome += f"; {len(errors)} file(s) with an error, e.g. " + errors[0][-70:]
    if verdict.warnings:
        outcome += "; warns " + verdict.warnings[0][-70:]
except Exception as exc:
    outcome = f"layer failed: {type(exc).__name__}: {str(exc)[:80]}"
print(json.dumps({
    "cpu": time.process_time() - started,
    "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    "outcome": outcome,
}))
"""


@dataclass(frozen=True)
class Case:
    name: str
    entries: Callable[[], list[Entry]]  # the crafted files of the layer
    before: bool = True  # run on the old code too (False: it would ask for hundreds of GB there)


def cases(quick: bool) -> list[Case]:
    files = 3 if quick else 7
    return [
        Case(
            "40 .nv_fatbin sections over 65,536 empty containers",
            lambda: [file("/usr/lib/libsections.so", crafted.overlapping_sections(40))],
        ),
        Case(
            "4,000 such sections (the largest file the byte bounds allow)",
            lambda: [file("/usr/lib/libsections.so", crafted.overlapping_sections(4000))],
            before=False,
        ),
        Case(
            "4,000 sections, each one container further in",
            lambda: [file("/usr/lib/libshifted.so", crafted.overlapping_sections(4000, shifted=True))],
            before=False,
        ),
        Case(
            f"{files} files of 64 containers converging on one 64 KiB cubin",
            lambda: [file(f"/usr/lib/lib{n}.so", crafted.converging_cubins()) for n in range(files)],
        ),
        Case(
            "500 containers converging on 4,000 shared entries",
            lambda: [file("/usr/lib/libchains.so", crafted.converging_cubins(500, 2048, 4000))],
        ),
        Case(
            "a cubin with e_shoff = 2^63",
            lambda: [file("/usr/lib/libshoff.so", crafted.cubin_with_huge_section_offset())],
        ),
        Case(
            "a torch/version.py ast.parse runs out of memory on",
            lambda: [file(f"{SITE}/torch/version.py", crafted.deep_torch_version())],
        ),
        Case(
            "a 5,000-digit version in torch/version.py",
            lambda: [file(f"{SITE}/torch/version.py", f"cuda = '{crafted.long_version()}.1'".encode())],
        ),
    ]


def run_case(tree: str, blob_path: Path) -> dict[str, float | str]:
    """Walk the layer at `blob_path` in a fresh interpreter with `tree` first on its path."""
    env = {**os.environ, "PYTHONPATH": tree}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(blob_path)],
        env=env,
        cwd=tree,  # `-c` puts the working directory first on the path
        capture_output=True,
        text=True,
        timeout=3600,
        check=False,
    )
    if done.returncode != 0:
        return {"outcome": f"exit {done.returncode}: {done.stderr.strip()[-120:]}"}
    answer: dict[str, float | str] = json.loads(done.stdout.strip().splitlines()[-1])
    return answer


def _cost(figures: dict[str, float | str]) -> str:
    if "cpu" not in figures:
        return str(figures["outcome"])
    return f"{float(figures['cpu']):.2f} s CPU, {float(figures['peak_mib']):.0f} MiB peak"


def run_all(results: Results, quick: bool) -> None:
    before = os.environ.get("GPUBADGE_BENCH_BEFORE")
    with tempfile.TemporaryDirectory() as workdir:
        for number, case in enumerate(cases(quick)):
            blob = compress(tar_bytes(crafted.gpu_code_layer(*case.entries()).entries), "gzip")
            blob_path = Path(workdir) / f"layer{number}.tar.gz"
            blob_path.write_bytes(blob)
            ours = run_case(str(REPO_ROOT), blob_path)
            peer = run_case(before, blob_path) if before and case.before else None
            ratio = None
            if peer and "cpu" in peer and "cpu" in ours:
                ratio = max(float(peer["cpu"]), 0.005) / max(float(ours["cpu"]), 0.005)
            results.add(
                Figure(
                    SECTION,
                    f"{case.name} ({len(blob):,} B layer)",
                    _cost(ours),
                    peer=_cost(peer)
                    if peer
                    else ("not run: asks the old code for ~300 GB" if before else ""),
                    ratio=ratio,
                    note=f"ours: {ours['outcome']}" + (f" | before: {peer['outcome']}" if peer else ""),
                )
            )


if __name__ == "__main__":
    run_section(run_all, __doc__)
