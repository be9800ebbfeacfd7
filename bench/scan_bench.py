"""Scanner benchmarks against a real loopback registry, side by side with `skopeo inspect --config`.

Each tool runs the way a user would run it: skopeo as one process per image with
N processes at once, gpubadge as ONE `gpubadge scan` process over all references
with `--concurrency N`. Measured: wall time, client CPU (process start included),
the registry's CPU, requests per image, bytes read for the libc verdict, the reads
of a shared base layer, and peak RSS while streaming a very large layer.

Run alone: python3 -m bench.scan_bench [--quick]
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
import zlib
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import (
    Figure,
    Results,
    gpubadge_command,
    measure,
    ms,
    process_tree,
    push_tags,
    ratio,
    run_section,
)
from fixtures.oci import (
    LAYER_MEDIA_TYPES,
    OCI_CONFIG,
    OCI_MANIFEST,
    Entry,
    ImageSpec,
    LayerSpec,
    LayoutWriter,
    fake_elf,
    file,
    push_layout,
)
from fixtures.real_shapes import GzipSink
from fixtures.registry import ACCESS_LOG, Access, logged, run_registry

GLIBC_LOADER = "/lib64/ld-linux-x86-64.so.2"
MiB = 1024 * 1024


@dataclass
class ScanFigures:
    """Quick mode shrinks the workloads (figures are still honest, just noisier)."""

    images: int = 500
    concurrency: int = 8
    rounds: int = 3
    front_layer_mib: int = 32
    shared_images: int = 10
    shared_base_mib: int = 16
    huge_layer_mib: int = 1024

    @classmethod
    def quick(cls) -> ScanFigures:
        return cls(
            images=100, rounds=1, front_layer_mib=24, shared_images=6, shared_base_mib=8, huge_layer_mib=256
        )


# --- image building ------------------------------------------------------------------------------


def base_entries() -> list[Entry]:
    """A tiny glibc root filesystem: what the libc verdict looks for, and little else."""
    return [
        file("bin/sh", fake_elf(GLIBC_LOADER), 0o755),
        file(GLIBC_LOADER.lstrip("/"), fake_elf(None), 0o755),
        file("etc/os-release", 'ID=debian\nVERSION_ID="12"\nPRETTY_NAME="Debian GNU/Linux 12"\n'),
    ]


def config_only_layout(root: Path, count: int) -> list[str]:
    """`count` distinct images (distinct configs and manifests) over one small shared layer."""
    layout = LayoutWriter(root)
    base = LayerSpec(base_entries())
    tags = []
    for n in range(count):
        env = {"APP_BUILD": str(n), "PATH": "/usr/local/bin:/usr/bin:/bin"}
        if n % 4 == 0:  # a quarter are CUDA images, as in a GPU platform's registry
            env |= {"CUDA_VERSION": "12.2.2", "NVIDIA_REQUIRE_CUDA": "cuda>=12.2 brand=tesla,driver>=470"}
        tag = f"v{n}"
        layout.tag(layout.image(ImageSpec([base], env=env)), tag)
        tags.append(tag)
    return tags


class _RandomFile(io.RawIOBase):
    """`size` bytes of incompressible data, produced on demand (never held in memory)."""

    def __init__(self, size: int) -> None:
        self.left = size

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        count = min(len(buffer), self.left, MiB)
        buffer[:count] = os.urandom(count)
        self.left -= count
        return count


@dataclass
class StreamedLayer:
    digest: str
    diff_id: str
    size: int


def write_streamed_layer(
    layout: LayoutWriter,
    before: Sequence[Entry],
    filler_bytes: int,
    after: Sequence[Entry],
    level: int = 1,
) -> StreamedLayer:
    """A gzip layer: `before`, one `filler_bytes` random file, then `after`; streamed to disk."""
    blobs = layout.root / "blobs" / "sha256"
    partial = blobs / f"partial-{os.getpid()}-{len(os.listdir(blobs))}"
    with partial.open("wb") as out:
        sink = GzipSink(out, level)
        with tarfile.open(fileobj=sink, mode="w|", format=tarfile.PAX_FORMAT) as archive:
            for entry in before:
                _add(archive, entry)
            info = tarfile.TarInfo("opt/data/blob.bin")
            info.size, info.mode, info.mtime = filler_bytes, 0o644, 0
            archive.addfile(info, io.BufferedReader(_RandomFile(filler_bytes), buffer_size=MiB))
            for entry in after:
                _add(archive, entry)
        sink.finish()
    digest = "sha256:" + sink.blob_hash.hexdigest()
    partial.rename(blobs / digest.removeprefix("sha256:"))
    return StreamedLayer(digest, "sha256:" + sink.raw_hash.hexdigest(), sink.size)


def _add(archive: tarfile.TarFile, entry: Entry) -> None:
    info = tarfile.TarInfo(entry.path.lstrip("/"))
    info.size, info.mode, info.mtime = len(entry.content), entry.mode, 0
    archive.addfile(info, io.BytesIO(entry.content))


def small_layer(layout: LayoutWriter, entries: Sequence[Entry]) -> StreamedLayer:
    """A small gzip layer built in memory (fine for kilobytes)."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as archive:
        for entry in entries:
            _add(archive, entry)
    data = raw.getvalue()
    blob = zlib.compressobj(6, zlib.DEFLATED, 31)
    compressed = blob.compress(data) + blob.flush()
    digest = layout.blob(compressed)
    return StreamedLayer(digest, "sha256:" + hashlib.sha256(data).hexdigest(), len(compressed))


def assemble_image(layout: LayoutWriter, layers: Sequence[StreamedLayer], tag: str) -> str:
    """Config + manifest over already-written layers (bottom first); tags it; returns the digest."""
    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {"Env": [f"BENCH_TAG={tag}"]},
        "rootfs": {"type": "layers", "diff_ids": [layer.diff_id for layer in layers]},
        "created": "2026-01-01T00:00:00Z",
    }
    manifest = {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "config": layout.descriptor(OCI_CONFIG, json.dumps(config, sort_keys=True).encode()),
        "layers": [
            {"mediaType": LAYER_MEDIA_TYPES["gzip"], "digest": layer.digest, "size": layer.size}
            for layer in layers
        ],
    }
    descriptor = layout.descriptor(OCI_MANIFEST, json.dumps(manifest, sort_keys=True).encode())
    layout.tag(descriptor, tag)
    digest: str = descriptor["digest"]
    return digest


# --- running the tools ---------------------------------------------------------------------------


def run_skopeo_inspect(refs: Sequence[str], parallel: int) -> int:
    """`skopeo inspect --config` once per reference, `parallel` processes at a time; returns failures."""

    def one(ref: str) -> int:
        result = subprocess.run(
            ["skopeo", "inspect", "--config", "--tls-verify=false", f"docker://{ref}"],
            capture_output=True,
            timeout=120,
        )
        return result.returncode

    with ThreadPoolExecutor(parallel) as pool:
        return sum(1 for code in pool.map(one, refs) if code != 0)


def run_gpubadge_scan(
    refs: Sequence[str], *args: str, env: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    """One `gpubadge scan --json` process over all references; returns the reports."""
    result = subprocess.run(
        gpubadge_command("scan", "--json", *args, *refs),
        capture_output=True,
        text=True,
        timeout=600,
        # The libc pass's figures; the deep scan (every layer read whole) has bench/deep_bench.py.
        env={**os.environ, "GPUBADGE_DEEP_SCAN": "never", **(env or {})},
    )
    reports = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    if len(reports) != len(refs):
        raise RuntimeError(
            f"gpubadge scan gave {len(reports)} reports for {len(refs)} refs: {result.stderr[-2000:]}"
        )
    return reports


def errors_of(reports: Sequence[dict[str, Any]]) -> list[str]:
    return [f"{r['reference']}: {r['error']}" for r in reports if r.get("error")]


def describe_requests(lines: Sequence[Access]) -> str:
    kinds: Counter[str] = Counter()
    for line in lines:
        what = "ping" if line.path.rstrip("/") == "/v2" else line.path.split("/")[-2]
        kinds[f"{line.method} {what}"] += 1
    return ", ".join(f"{count}x {kind}" for kind, count in sorted(kinds.items()))


# --- the benchmarks ------------------------------------------------------------------------------


def bench_requests(results: Results, workdir: Path) -> float:
    """Requests per image, counted by the library and by the registry; returns skopeo's per image."""
    print("requests per image (registry access log + RequestStats)", flush=True)
    layout = LayoutWriter(workdir / "requests-layout")
    app = LayerSpec([*base_entries(), file("app/run", "#!/bin/sh\necho hi\n", 0o755)])
    layout.tag(layout.image(ImageSpec([app], env={"CUDA_VERSION": "12.2.2"})), "single")
    arches = ["amd64", "arm64", "ppc64le"]
    for k in (2, 3):
        specs = [ImageSpec([app], architecture=arch) for arch in arches[:k]]
        layout.tag(layout.multi_platform(specs, attestation=True), f"index{k}")
    skopeo_per_image = 0.0
    with run_registry(extra_config=ACCESS_LOG) as registry:
        push_tags(layout.root, ["single", "index2", "index3"], f"{registry.host}/bench/requests", parallel=3)
        cases = [
            ("single-platform by tag", "single", 1),
            ("index, 2 platforms", "index2", 2),
            ("index, 3 platforms", "index3", 3),
        ]
        for title, tag, k in cases:
            ref = f"{registry.host}/bench/requests:{tag}"
            budget = 3 if k == 1 else 2 + 2 * k
            with logged(registry, f"ours-{tag}") as ours_lines:
                (report,) = run_gpubadge_scan([ref], "--config-only", "--no-store")
            with logged(registry, f"full-{tag}") as full_lines:
                (full,) = run_gpubadge_scan([ref], "--no-store")
            with logged(registry, f"peer-{tag}") as peer_lines:
                failures = run_skopeo_inspect([ref], 1)
            if report.get("error") or full.get("error") or failures:
                raise RuntimeError(f"scan of {ref} failed: {report.get('error') or full.get('error')}")
            counted = int(report["requests"])
            seen = len(ours_lines)
            results.add(
                Figure(
                    "requests",
                    f"requests per image, config-only, {title}",
                    f"{seen} (RequestStats {counted})",
                    f"{len(peer_lines)} (skopeo inspect --config, one platform only)",
                    ratio(len(peer_lines), seen) if k == 1 else None,
                    f"<= {budget}",
                    seen <= budget and counted <= budget,
                )
            )
            results.detail(f"{title}: gpubadge config-only: {describe_requests(ours_lines)}")
            results.detail(f"{title}: skopeo inspect --config: {describe_requests(peer_lines)}")
            results.detail(
                f"{title}: gpubadge full scan (layers too): {len(full_lines)} requests "
                f"(RequestStats {full['requests']}): {describe_requests(full_lines)}"
            )
            if k == 1:
                skopeo_per_image = float(len(peer_lines))
    return skopeo_per_image


@dataclass
class Run:
    wall_s: float
    client_cpu_s: float
    registry_cpu_s: float
    requests: int


def best_run(runs: Sequence[Run]) -> Run:
    """The fastest round: other work on a shared machine only ever adds time."""
    return min(runs, key=lambda run: run.wall_s)


def timed_scan(refs: Sequence[str], registry_pid: int, *args: str) -> Run:
    """One `gpubadge scan --json ARGS REFS` process, measured; any scan error stops the bench."""
    with measure(registry_pid) as window:
        reports = run_gpubadge_scan(refs, *args)
    if errors_of(reports):
        raise RuntimeError(f"gpubadge scan errors: {errors_of(reports)[:3]}")
    return Run(
        window.wall_s, window.children_cpu_s, window.watched_cpu_s, sum(int(r["requests"]) for r in reports)
    )


def bench_config_only(
    results: Results, figures: ScanFigures, workdir: Path, skopeo_requests_per_image: float
) -> None:
    n, concurrency = figures.images, figures.concurrency
    print(
        f"config-only scan of {n} fresh images, {concurrency} at a time, vs skopeo inspect --config",
        flush=True,
    )
    root = workdir / "config-layout"
    tags = config_only_layout(root, n)
    with run_registry() as registry:
        push_s = push_tags(root, tags, f"{registry.host}/bench/config", parallel=6)
        results.detail(f"setup: pushed {n} images with skopeo in {push_s:.1f} s (not measured)")
        refs = [f"{registry.host}/bench/config:{tag}" for tag in tags]
        pid = registry.process.pid
        run_skopeo_inspect(refs[:concurrency], concurrency)  # warm-up (page cache, registry)
        run_gpubadge_scan(refs[:concurrency], "--config-only", "--no-store")
        peer_runs, our_runs, stored_runs = [], [], []
        for round_number in range(figures.rounds):
            with measure(pid) as peer:
                failures = run_skopeo_inspect(refs, concurrency)
            if failures:
                raise RuntimeError(f"skopeo inspect failed for {failures} references")
            peer_runs.append(
                Run(peer.wall_s, peer.children_cpu_s, peer.watched_cpu_s, int(skopeo_requests_per_image * n))
            )
            base = ("--config-only", "--concurrency", str(concurrency))
            our_runs.append(timed_scan(refs, pid, *base, "--no-store"))
            # The default: every report stored (a fresh SQLite file, as a first run makes).
            database = workdir / f"config-store-{round_number}.db"
            stored_runs.append(timed_scan(refs, pid, *base, "--db", str(database)))
    peer_run, our_run, stored_run = best_run(peer_runs), best_run(our_runs), best_run(stored_runs)
    cpu_ratio = ratio(peer_run.client_cpu_s, our_run.client_cpu_s)
    stored_ratio = ratio(peer_run.client_cpu_s, stored_run.client_cpu_s)
    wall_ratio = ratio(peer_run.wall_s, our_run.wall_s)
    cores = os.cpu_count() or 1
    results.add(
        Figure(
            "config-only",
            f"client CPU (user+sys, process start included), {n} images, --no-store",
            f"{our_run.client_cpu_s:.2f} s",
            f"{peer_run.client_cpu_s:.2f} s",
            cpu_ratio,
            ">= 10x less",
            cpu_ratio is not None and cpu_ratio >= 10,
        )
    )
    per_report = (stored_run.client_cpu_s - our_run.client_cpu_s) / n
    results.add(
        Figure(
            "config-only",
            f"client CPU, {n} images, the default store (every report and tag stored in SQLite)",
            f"{stored_run.client_cpu_s:.2f} s",
            f"{peer_run.client_cpu_s:.2f} s",
            stored_ratio,
            ">= 10x less",
            stored_ratio is not None and stored_ratio >= 10,
            note=f"the store's own cost: {per_report * 1000:.2f} ms CPU/report over --no-store",
        )
    )
    results.add(
        Figure(
            "config-only",
            f"wall time, {n} images, concurrency {concurrency}",
            f"{our_run.wall_s:.2f} s",
            f"{peer_run.wall_s:.2f} s",
            wall_ratio,
            ">= 2.5x less",
            wall_ratio is not None and wall_ratio >= 2.5,
        )
    )
    for label, run in (("ours", our_run), ("peer", peer_run)):
        per_request = run.registry_cpu_s / run.requests if run.requests else 0.0
        results.detail(
            f"{label}: registry CPU {run.registry_cpu_s:.2f} s for {run.requests} requests "
            f"({ms(per_request)}/request); client CPU {run.client_cpu_s:.2f} s; wall {run.wall_s:.2f} s"
        )
    floor = our_run.registry_cpu_s / cores
    results.add(
        Figure(
            "config-only",
            f"wall-time floor set by the registry's own CPU on {cores} cores (ours)",
            f"{floor:.2f} s",
            f"{peer_run.registry_cpu_s / cores:.2f} s",
            note=f"ours: {our_run.registry_cpu_s / max(1, our_run.requests) * 1000:.2f} ms registry CPU/request",
        )
    )
    rounds = ", ".join(f"{r.wall_s:.2f}s/{r.client_cpu_s:.2f}s" for r in our_runs)
    stored_rounds = ", ".join(f"{r.wall_s:.2f}s/{r.client_cpu_s:.2f}s" for r in stored_runs)
    results.detail(f"rounds with the default store (wall/client CPU): {stored_rounds}")
    peer_rounds = ", ".join(f"{r.wall_s:.2f}s/{r.client_cpu_s:.2f}s" for r in peer_runs)
    results.detail(f"rounds (wall/client CPU): ours {rounds}; skopeo {peer_rounds}")


def bench_front_bytes(results: Results, figures: ScanFigures, workdir: Path) -> None:
    print(
        f"bytes read for the libc verdict: {figures.front_layer_mib} MiB layer, evidence at the front",
        flush=True,
    )
    layout = LayoutWriter(workdir / "front-layout")
    big = write_streamed_layer(layout, base_entries(), figures.front_layer_mib * MiB, [])
    app = small_layer(layout, [file("app/run", "#!/bin/sh\nexec /app/server\n", 0o755)])
    assemble_image(layout, [big, app], "front")
    with run_registry(extra_config=ACCESS_LOG) as registry:
        push_layout(layout.root, "front", f"{registry.host}/bench/front:front", timeout=600)
        ref = f"{registry.host}/bench/front:front"
        with logged(registry, "front") as lines:
            (report,) = run_gpubadge_scan([ref], "--no-store")
    if report.get("error"):
        raise RuntimeError(f"scan failed: {report['error']}")
    libc = report["platforms"][0]["libc"]
    fraction = libc["bytes_read"] / libc["bytes_total"]
    sent = sum(line.size for line in lines if line.method == "GET" and "/blobs/" in line.path)
    results.add(
        Figure(
            "libc bytes",
            f"bytes read for the libc verdict / all layer bytes ({libc['flavour']}, evidence at the front)",
            f"{fraction * 100:.2f}% ({libc['bytes_read'] / 1024:.0f} KiB of {libc['bytes_total'] / MiB:.1f} MiB)",
            "100% (a pull reads every layer)",
            ratio(1.0, fraction),
            "<= 5%",
            fraction <= 0.05 and libc["flavour"] == "glibc",
            note=f"on the wire: the registry wrote {sent / 1024:.0f} KiB ({sent / libc['bytes_total'] * 100:.1f}%) "
            "into the loopback socket buffers before the early close",
        )
    )
    results.detail(
        f"front: verdict {libc['flavour']} from {libc['evidence']}; registry-side blob bytes {sent / 1024:.0f} KiB"
    )


def bench_shared_base(results: Results, figures: ScanFigures, workdir: Path) -> None:
    n = figures.shared_images
    print(
        f"shared base layer: {n} images over one {figures.shared_base_mib} MiB base (evidence at its end)",
        flush=True,
    )
    layout = LayoutWriter(workdir / "shared-layout")
    base = write_streamed_layer(layout, [], figures.shared_base_mib * MiB, base_entries())
    tags = []
    for i in range(n):
        top = small_layer(layout, [file(f"app/build-{i}.txt", f"build {i}\n")])
        assemble_image(layout, [base, top], f"app{i}")
        tags.append(f"app{i}")
    with run_registry(extra_config=ACCESS_LOG) as registry:
        push_tags(layout.root, tags, f"{registry.host}/bench/shared", parallel=4)
        refs = [f"{registry.host}/bench/shared:{tag}" for tag in tags]
        db = workdir / "shared.db"
        with logged(registry, "shared") as lines:
            reports = run_gpubadge_scan(refs, "--db", str(db), "--concurrency", "8")
    if errors_of(reports):
        raise RuntimeError(f"scan errors: {errors_of(reports)[:3]}")
    # One read of the layer may be several range requests (growing ranges, scanner/registry/blobs.py);
    # what counts is the bytes the registry's log says it sent for the layer, against its size.
    base_gets = [line for line in lines if line.method == "GET" and line.path.endswith(base.digest)]
    served = sum(line.size for line in base_gets)
    flavours = Counter(r["platforms"][0]["libc"]["flavour"] for r in reports)
    results.add(
        Figure(
            "libc bytes",
            f"reads of a shared {figures.shared_base_mib} MiB base layer, {n} images in one scan",
            f"{served / MiB:.1f} MiB sent by the registry ({len(base_gets)} range GET(s))",
            f"{n} reads / {n * base.size / MiB:.1f} MiB (one per image)",
            ratio(n * base.size, served),
            "1 read (<= the layer's size)",
            0 < served <= base.size and flavours == Counter({"glibc": n}),
            note=f"verdicts: {dict(flavours)}",
        )
    )


def bench_peak_rss(results: Results, figures: ScanFigures, workdir: Path) -> None:
    size = figures.huge_layer_mib * MiB
    free = shutil.disk_usage(workdir).free
    if free < 3 * size:
        results.detail(
            f"peak RSS: skipped, {free / 2**30:.1f} GiB free on {workdir} (need {3 * size / 2**30:.1f})"
        )
        return
    print(f"peak RSS while scanning a {figures.huge_layer_mib} MiB layer (evidence at its end)", flush=True)
    layout = LayoutWriter(workdir / "huge-layout")
    tiny = small_layer(layout, base_entries())
    assemble_image(layout, [tiny], "tiny")
    huge = write_streamed_layer(layout, [], size, base_entries())
    assemble_image(layout, [huge], "huge")
    env: dict[str, str] = {}  # the default bounds read it through
    with run_registry() as registry:
        push_tags(layout.root, ["tiny"], f"{registry.host}/bench/huge")
        push_layout(layout.root, "huge", f"{registry.host}/bench/huge:huge", timeout=600)
        shutil.rmtree(layout.root)  # the registry holds its own copy now
        baseline_kib, _, _ = scan_rss(f"{registry.host}/bench/huge:tiny", env)
        peak_kib, report, seconds = scan_rss(f"{registry.host}/bench/huge:huge", env)
    libc = report["platforms"][0]["libc"]
    results.add(
        Figure(
            "memory",
            f"peak RSS of `gpubadge scan` (with its analysis processes) streaming a {figures.huge_layer_mib} MiB layer",
            f"{peak_kib / 1024:.0f} MB",
            target="< 150 MB",
            met=peak_kib / 1024 < 150 and libc["bytes_read"] >= huge.size * 0.99,
            note=(
                f"baseline (tiny image) {baseline_kib / 1024:.0f} MB; read {libc['bytes_read'] / MiB:.0f} MiB "
                f"of {huge.size / MiB:.0f} MiB in {seconds:.1f} s; verdict {libc['flavour']}"
            ),
        )
    )


def _status_kib(pid: int, field: str) -> int:
    """A `/proc/<pid>/status` figure in KiB (VmRSS, VmHWM); 0 once the process is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def scan_rss(ref: str, env: dict[str, str]) -> tuple[int, dict[str, Any], float]:
    """Scan in a child process; returns the peak RSS of its process tree (KiB: the scan process and
    its analysis processes together, sampled every 20 ms from /proc), the report, and seconds.

    Not `ru_maxrss` from wait4: Linux carries it across fork and exec, so a child of the bench
    process (large after other sections) would report the bench's own size."""
    import time

    started = time.perf_counter()
    peak_kib = 0
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        process = subprocess.Popen(
            gpubadge_command("scan", "--json", "--no-store", ref),
            stdout=out,
            stderr=err,
            env={**os.environ, "GPUBADGE_DEEP_SCAN": "never", **env},  # the libc pass (see above)
        )
        while process.poll() is None:
            tree = _status_kib(process.pid, "VmRSS") + sum(
                _status_kib(child, "VmRSS") for child in process_tree(process.pid)[1:]
            )
            peak_kib = max(peak_kib, tree, _status_kib(process.pid, "VmHWM"))
            time.sleep(0.02)
        seconds = time.perf_counter() - started
        out.seek(0)
        err.seek(0)
        lines = [line for line in out.read().decode().splitlines() if line.startswith("{")]
        if not lines:
            raise RuntimeError(f"gpubadge scan {ref} printed no report: {err.read().decode()[-2000:]}")
    report = json.loads(lines[0])
    if report.get("error"):
        raise RuntimeError(f"scan of {ref} failed: {report['error']}")
    return peak_kib, report, seconds


def bench_startup(results: Results, workdir: Path, runs: int = 10) -> None:
    """The CPU of a `gpubadge scan` process that scans nothing (a malformed reference, the default
    store): what every scan pays before its first request, side by side with `skopeo inspect`'s
    own start-up against the same kind of reference; and what `python -X importtime` says costs most."""
    env = {**os.environ, "GPUBADGE_DB": str(workdir / "startup.db")}
    ours: list[float] = []
    peer: list[float] = []
    for _ in range(runs):
        with measure() as window:
            subprocess.run(gpubadge_command("scan", "UPPER//x"), env=env, capture_output=True, timeout=60)
        ours.append(window.children_cpu_s)
        with measure() as window:
            subprocess.run(["skopeo", "inspect", "docker://UPPER//x"], capture_output=True, timeout=60)
        peer.append(window.children_cpu_s)
    results.add(
        Figure(
            "config-only",
            f"start-up CPU of one `gpubadge scan` process (fastest of {runs})",
            f"{min(ours) * 1000:.0f} ms",
            f"skopeo inspect: {min(peer) * 1000:.0f} ms",
            ratio(min(peer), min(ours)),
        )
    )
    importtime = subprocess.run(
        gpubadge_command("scan", "UPPER//x"),
        env={**env, "PYTHONPROFILEIMPORTTIME": "1"},  # python -X importtime, for any interpreter
        capture_output=True,
        text=True,
        timeout=60,
    ).stderr
    by_package: Counter[str] = Counter()
    for line in importtime.splitlines():
        fields = line.removeprefix("import time:").split("|")
        if len(fields) == 3 and fields[0].strip().isdigit():
            by_package[fields[2].strip().split(".")[0]] += int(fields[0])
    top = ", ".join(f"{name} {micros / 1000:.0f} ms" for name, micros in by_package.most_common(6))
    results.detail(f"start-up imports by package (python -X importtime, self time, one run): {top}")


def run_all(results: Results, quick: bool) -> None:
    figures = ScanFigures.quick() if quick else ScanFigures()
    workdir = Path(tempfile.mkdtemp(prefix="gpubadge-bench-"))
    try:
        skopeo_per_image = bench_requests(results, workdir)
        bench_startup(results, workdir)
        bench_config_only(results, figures, workdir, skopeo_per_image)
        bench_front_bytes(results, figures, workdir)
        bench_shared_base(results, figures, workdir)
        bench_peak_rss(results, figures, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    run_section(run_all, __doc__)
