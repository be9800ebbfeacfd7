"""`gpubadge export sqlite` at scale: wall time and peak RSS for 1M stored reports, against sqlite-utils' CLI.

The store (SQLite) is bulk-loaded with N copies of a realistic GPU report (8 layers, two of
them per image or shared by a thousand images, six NVIDIA/CUDA variables) under distinct
digests, by one SQL statement per 100k rows; setup is never inside a measured window.

- ours: `gpubadge export sqlite OUT --db STORE` as a user runs it (a child process), into a
  fresh file: six tables, keys, indexes, FTS, Datasette metadata. Peak RSS is the child's own
  `ru_maxrss`; measured at N and at N/10, so a flat figure shows memory does not grow with N.
- peer: `sqlite-utils insert PEER reports dump.jsonl --nl --pk digest` over the same reports
  dumped as JSON lines beforehand: what a user gets from sqlite-utils' CLI alone (one table of
  nested JSON, no FTS, no links), streamed as well. Ratio = peer / ours (CPU seconds).

Run alone: python3 -m bench.export_bench [--quick] [--reports N]
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import REPO_ROOT, Figure, Results
from scanner.models import GpuFacts, ImageReport, LayerInfo, LibcVerdict, PlatformReport
from store.sqlite import SqliteStore

LOAD_STEP = 100_000
# Runs a command's main in this process and prints its own peak RSS (KiB) on stderr's last line.
_MEASURED = (
    "import resource, sys\n"
    "from {module} import {function} as main\n"
    "code = {call}\n"
    "usage = resource.getrusage(resource.RUSAGE_SELF)\n"
    "print('cpu_s', usage.ru_utime + usage.ru_stime, 'maxrss_kib', usage.ru_maxrss, file=sys.stderr)\n"
    "sys.exit(code or 0)\n"
)


def template() -> ImageReport:
    """A realistic GPU report: what `gpubadge scan` stores for a CUDA image."""
    env = {
        "NVIDIA_VISIBLE_DEVICES": "all",
        "NVIDIA_DRIVER_CAPABILITIES": "compute,utility",
        "NVIDIA_REQUIRE_CUDA": "cuda>=12.2 brand=tesla,driver>=470,driver<471",
        "CUDA_VERSION": "12.2.2",
        "NV_CUDA_LIB_VERSION": "12.2.2-1",
        "NVIDIA_PRODUCT_NAME": "CUDA",
    }
    layers = [
        LayerInfo(
            digest=f"sha256:{n:064x}",
            size=(n + 1) * 10_000_000,
            media_type="application/vnd.oci.image.layer.v1.tar+gzip",
        )
        for n in range(8)
    ]
    platform = PlatformReport(
        platform="linux/amd64",
        digest="sha256:" + "0" * 64,
        config_digest="sha256:" + "c" * 64,
        gpu=GpuFacts(
            required=True,
            cuda_version="12.2",
            requirements=[env["NVIDIA_REQUIRE_CUDA"]],
            effective_requirements=[env["NVIDIA_REQUIRE_CUDA"]],
            env=env,
            signals=["NVIDIA_VISIBLE_DEVICES", "NVIDIA_REQUIRE_CUDA"],
            visible_devices="all",
            driver_capabilities="compute,utility",
            runtime_gpu_request=True,
        ),
        libc=LibcVerdict(
            flavour="glibc",
            evidence="/lib64/ld-linux-x86-64.so.2",
            distro="Ubuntu 22.04.4 LTS",
            layers_read=2,
            layers_total=8,
            bytes_read=30_000_000,
            bytes_total=360_000_000,
        ),
        badges=["nvidia-gpu", "cuda-12.2", "glibc"],
        layers=layers,
        created="2026-10-01T00:00:00Z",
        bytes_fetched=30_001_000,
    )
    return ImageReport(
        reference="bench.example/team/app:v1",
        digest="sha256:" + "0" * 64,
        platforms=[platform],
        registry="bench.example",
        repository="team/app",
        tag="v1",
        media_type="application/vnd.oci.image.manifest.v1+json",
        bytes_fetched=30_002_000,
    )


_BULK = """
WITH RECURSIVE n(i) AS (SELECT :start UNION ALL SELECT i + 1 FROM n WHERE i < :stop)
INSERT INTO reports (digest, registry, repository, reference, media_type, gpu_required, cuda_versions,
                     libc_flavours, platforms, distro, scanned_at, report)
SELECT printf('sha256:%064x', i), 'bench.example', 'team/app' || (i % 5000),
       'bench.example/team/app' || (i % 5000) || ':v' || i, 'application/vnd.oci.image.manifest.v1+json',
       i % 3 = 0, '["12.2"]', '["glibc"]', '["linux/amd64"]', 'Ubuntu 22.04.4 LTS', :scanned_at,
       json_set(:report,
                '$.digest', printf('sha256:%064x', i),
                '$.reference', 'bench.example/team/app' || (i % 5000) || ':v' || i,
                '$.repository', 'team/app' || (i % 5000),
                '$.tag', 'v' || i,
                '$.platforms[0].digest', printf('sha256:%064x', i),
                '$.platforms[0].gpu.required', json(CASE WHEN i % 3 = 0 THEN 'true' ELSE 'false' END),
                '$.platforms[0].layers[6].digest', printf('sha256:%064x', 2000000000 + i % 1000),
                '$.platforms[0].layers[7].digest', printf('sha256:%064x', 1000000000 + i))
FROM n
"""


def load_store(path: Path, count: int) -> None:
    """A migrated gpubadge store holding `count` reports (setup: bulk SQL, not the code under test)."""
    SqliteStore(path).close()
    report = template()
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as conn:
        for start in range(1, count + 1, LOAD_STEP):
            conn.execute("BEGIN")
            conn.execute(
                _BULK,
                {
                    "start": start,
                    "stop": min(count, start + LOAD_STEP - 1),
                    "report": report.model_dump_json(),
                    "scanned_at": report.scanned_at.isoformat(timespec="microseconds"),
                },
            )
            conn.execute("COMMIT")
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")


def run_measured(module: str, function: str, call: str, timeout: float) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds, peak RSS in MiB) of `call` (`module.function` imported as `main`) in a
    fresh child. CPU is the figure to compare on a shared machine: wall time follows the load."""
    code = _MEASURED.format(module=module, function=function, call=call)
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    elapsed = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"{module} failed: {done.stderr[-500:]}")
    words = done.stderr.strip().splitlines()[-1].split()
    return elapsed, float(words[1]), int(words[3]) // 1024


def export(store: Path, out: Path, timeout: float) -> tuple[float, float, int]:
    args = ["sqlite", str(out), "--db", str(store)]
    return run_measured("gpubadge.export", "main", f"main({args!r})", timeout)


def peer_insert(store: Path, workdir: Path, timeout: float) -> tuple[float, float, int]:
    dump = workdir / "dump.jsonl"
    with contextlib.closing(sqlite3.connect(store)) as conn, dump.open("w") as sink:
        for (report,) in conn.execute("SELECT report FROM reports"):
            sink.write(report + "\n")
    args = ["insert", str(workdir / "peer.db"), "reports", str(dump), "--nl", "--pk", "digest"]
    try:
        return run_measured("sqlite_utils.cli", "cli", f"main.main({args!r}, standalone_mode=False)", timeout)
    finally:
        dump.unlink()


def run_all(results: Results, quick: bool, reports: int | None = None) -> None:
    big = reports or (20_000 if quick else 1_000_000)
    small = max(1, big // 10)
    workdir = Path(tempfile.mkdtemp(prefix="gpubadge-bench-export-"))
    timeout = 3600.0
    try:
        measured: dict[int, tuple[float, float, int]] = {}
        for count in (small, big):
            store = workdir / f"store-{count}.db"
            started = time.perf_counter()
            load_store(store, count)
            results.detail(
                f"export: loaded {count:,} reports in {time.perf_counter() - started:.0f} s (setup)"
            )
            out = workdir / f"export-{count}.db"
            measured[count] = export(store, out, timeout)
            size = out.stat().st_size
            out.unlink()
            seconds, cpu, rss = measured[count]
            results.detail(
                f"export: {count:,} reports in {seconds:.1f} s ({count / seconds:,.0f}/s), CPU {cpu:.1f} s"
                f" ({count / cpu:,.0f}/CPU-s), peak RSS {rss} MiB, file {size / 2**20:,.0f} MiB"
            )
            if count == big:
                peer_seconds, peer_cpu, peer_rss = peer_insert(store, workdir, timeout)
                results.add(
                    Figure(
                        "export",
                        f"export {big:,} stored reports to SQLite: wall (CPU)",
                        f"{seconds:.0f} s ({cpu:.0f} s CPU, {big / cpu:,.0f} reports per CPU-s)",
                        peer=f"sqlite-utils insert --nl: {peer_seconds:.0f} s ({peer_cpu:.0f} s CPU), one table of raw JSON",
                        ratio=peer_cpu / cpu,
                    )
                )
                results.add(
                    Figure(
                        "export",
                        f"export {big:,} stored reports: peak RSS (vs {small:,})",
                        f"{rss} MiB (vs {measured[small][2]} MiB)",
                        peer=f"sqlite-utils insert --nl: {peer_rss} MiB",
                        ratio=peer_rss / rss,
                        target="bounded: flat from N/10 to N",
                        met=rss <= measured[small][2] * 1.5,
                    )
                )
            store.unlink()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="20,000 reports")
    parser.add_argument("--reports", type=int, default=None, help="reports to export (default 1,000,000)")
    args = parser.parse_args()
    run_all(Results(), args.quick, args.reports)


if __name__ == "__main__":
    main()
