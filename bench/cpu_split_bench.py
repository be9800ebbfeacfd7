"""Where a pushed image's CPU goes, role by role: the intake alone, the scans alone, and what `serve`
does while scans finish; issue 44's point 3 (at most 4x the null receiver's CPU per pushed image).

The intake bench (`bench.push_burst_bench.measure_intake`) counts every role's CPU in one window
with the intake and the scans running at once. This bench takes them apart, on SQLite, in one run:

1. **The intake alone.** `images` distinct images (`bench.registry_burst`: a shared base layer and
   one of their own) have their blobs uploaded first; then their manifests are PUT by `clients`
   at once to a local registry that notifies the null receiver and `gpubadge serve --workers 0`
   (the intake, no scans). Window: from the first PUT until both endpoints had every delivery and
   every job is queued. `serve`'s CPU per image against the null receiver's, the registry's beside.
2. **The scans alone.** Then `gpubadge worker` (the same code `serve` runs in its worker processes,
   started by hand) scans the queued jobs, `serve` still up. Window: from the `warm`-th scan done
   (start-up's imports and first claims left out) and its analysis processes started, to the
   last. The worker's CPU per scan (the cached base layer is read from the store, each image's own
   layer from the registry), split into its event loop's thread, its other threads (the store's)
   and its analysis processes; and `serve`'s meanwhile (what finished scans cost it: store
   events, its caches).
3. **The sum**, set against the null receiver's CPU per image and the 4x target.

CPU is read from /proc (utime + stime of each process tree); nothing is subtracted. On a busy
2-core host the split is noisy by about 10% a run; the sum is what the target is about.

Run alone: python3 -m bench.cpu_split_bench [--quick] [--images N]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sqlite3
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.common import CLOCK_TICKS, Figure, Results, ms, process_cpu_seconds, tree_cpu_seconds
from bench.push_burst_bench import EndpointProcess
from bench.registry_burst import put_manifests, stage_images
from fixtures.registry import free_port, notification_endpoint, run_registry
from fixtures.service import run_role_process, run_service_process

TARGET_RATIO = 4.0
REPOSITORY = "bench/cpu-split"


@dataclass
class SplitFigures:
    images: int = 1_200
    clients: int = 8
    warm: int = 100  # scans left out of the worker's window (its start-up)

    @classmethod
    def quick(cls) -> SplitFigures:
        return cls(images=400, warm=50)


@dataclass
class CpuSplit:
    """CPU seconds per image (or per scan), by role and window."""

    intake_serve: float
    intake_null: float
    intake_registry: float
    scans_worker: float
    scans_roles: tuple[float, float, float]  # of which its event loop, its other threads, analysis processes
    scans_serve: float
    scanned: int  # the scans in the worker's window
    scan_seconds: float  # that window's length

    @property
    def total(self) -> float:
        return self.intake_serve + self.scans_worker + self.scans_serve


class _Counter:
    """Arrivals the null receiver printed, counted from its reader thread."""

    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()

    def on_line(self, fields: list[str]) -> None:
        if fields[:1] == ["arrival"]:
            with self._lock:
                self.count += 1


def _until(condition: str, test: Callable[[], bool], timeout: float) -> None:
    """Poll `test()` every 50 ms until it is true; TimeoutError naming `condition` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not test():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{condition}: not after {timeout:.0f} s")
        time.sleep(0.05)


def _roles(pid: int) -> tuple[float, float, float]:
    """A worker's CPU so far: its event loop's thread, its other threads (the store's), and its
    analysis processes."""
    fields = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    loop = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
    process = process_cpu_seconds(pid)
    # /proc is read file by file, not at one instant: a difference may dip below zero by a tick
    return loop, max(0.0, process - loop), max(0.0, tree_cpu_seconds(pid) - process)


def _analysis_settled(pid: int, timeout: float = 10.0) -> None:
    """Until the worker's analysis processes have finished starting (their imports): less than 5 ms of
    their CPU in a quarter second, or `timeout` (they may be busy with layers)."""
    deadline = time.monotonic() + timeout
    before = _roles(pid)[2]
    while time.monotonic() < deadline:
        time.sleep(0.25)
        now = _roles(pid)[2]
        if now - before < 0.005:
            return
        before = now


def _finished(db: sqlite3.Connection) -> int:
    row = db.execute("SELECT count(*) FROM jobs WHERE state IN ('done', 'failed')").fetchone()
    return int(row[0])


def _queued(url: str) -> int:
    with urllib.request.urlopen(f"{url}/healthz", timeout=5) as answer:
        return sum(json.loads(answer.read())["queue"].values())


def measure_split(figures: SplitFigures, workdir: Path) -> CpuSplit:
    """The three windows of the module docstring, in one run."""
    null_port, intake_port = free_port(), free_port()
    arrivals = _Counter()
    null = EndpointProcess(["bench.null_receiver", "--port", str(null_port)], arrivals.on_line)
    endpoints = [
        notification_endpoint(f"http://127.0.0.1:{null_port}/") | {"name": "null"},
        notification_endpoint(f"http://127.0.0.1:{intake_port}/hooks/distribution") | {"name": "gpubadge"},
    ]
    db_path = workdir / "split.db"
    try:
        with (
            run_registry(extra_config={"notifications": {"endpoints": endpoints}}) as registry,
            run_service_process(
                db_path, args=("serve", "--workers", "0"), intake_port=intake_port
            ) as service,
        ):
            assert service.process is not None
            staged = stage_images(workdir / "layout", registry.url, REPOSITORY, figures.images)
            serve0, null0 = tree_cpu_seconds(service.process.pid), tree_cpu_seconds(null.pid)
            registry0 = tree_cpu_seconds(registry.process.pid)
            put_manifests(registry.url, REPOSITORY, staged, figures.clients)
            _until("every delivery at the null receiver", lambda: arrivals.count >= figures.images, 120)
            _until("every job queued", lambda: _queued(service.url) >= figures.images, 120)
            serve1, null1 = tree_cpu_seconds(service.process.pid), tree_cpu_seconds(null.pid)
            registry1 = tree_cpu_seconds(registry.process.pid)
            with (
                sqlite3.connect(db_path) as jobs,
                run_role_process(["worker"], db_path, None, workdir / "worker.log") as worker,
            ):
                _until(f"{figures.warm} scans done", lambda: _finished(jobs) >= figures.warm, 120)
                _analysis_settled(worker.pid)
                started, done = time.monotonic(), _finished(jobs)
                roles0 = _roles(worker.pid)
                worker0, serve2 = tree_cpu_seconds(worker.pid), tree_cpu_seconds(service.process.pid)
                _until("every scan done", lambda: _finished(jobs) >= figures.images, 300)
                worker1, serve3 = tree_cpu_seconds(worker.pid), tree_cpu_seconds(service.process.pid)
                roles1 = _roles(worker.pid)
                seconds, scanned = time.monotonic() - started, figures.images - done
    finally:
        null.stop()
    count = figures.images
    return CpuSplit(
        intake_serve=(serve1 - serve0) / count,
        intake_null=(null1 - null0) / count,
        intake_registry=(registry1 - registry0) / count,
        scans_worker=(worker1 - worker0) / scanned,
        scans_roles=(
            (roles1[0] - roles0[0]) / scanned,
            (roles1[1] - roles0[1]) / scanned,
            (roles1[2] - roles0[2]) / scanned,
        ),
        scans_serve=(serve3 - serve2) / scanned,
        scanned=scanned,
        scan_seconds=seconds,
    )


def add_figures(results: Results, figures: SplitFigures, split: CpuSplit) -> None:
    null = split.intake_null
    results.add(
        Figure(
            "cpu-split",
            f"intake alone: serve's CPU per pushed image, {figures.images} manifests PUT by {figures.clients}"
            " clients, SQLite, no scans",
            ms(split.intake_serve),
            peer=f"null receiver {ms(null)}",
            ratio=null / split.intake_serve if split.intake_serve > 0 else None,
            note=f"the registry's own CPU {ms(split.intake_registry)} per image",
        )
    )
    results.add(
        Figure(
            "cpu-split",
            f"scans alone: `gpubadge worker`'s CPU per scan (analysis processes included), {split.scanned} scans",
            ms(split.scans_worker),
            note=f"its event loop {ms(split.scans_roles[0])}, its store's threads {ms(split.scans_roles[1])},"
            f" analysis processes {ms(split.scans_roles[2])}; {split.scanned / split.scan_seconds:.0f} scans/s;"
            f" serve's CPU meanwhile {ms(split.scans_serve)} per scan",
        )
    )
    results.add(
        Figure(
            "cpu-split",
            "CPU per pushed image, the roles summed (intake + scan + serve while scans finish)",
            ms(split.total),
            peer=f"null receiver {ms(null)}",
            ratio=null / split.total if split.total > 0 else None,
            target=f"<= {TARGET_RATIO:g}x the null receiver's",
            met=split.total <= TARGET_RATIO * null,
            note=f"intake {ms(split.intake_serve)} + scan {ms(split.scans_worker)} + serve meanwhile"
            f" {ms(split.scans_serve)}; {split.total / null:.1f}x the null receiver's"
            if null > 0
            else "",
        )
    )


def run_all(results: Results, quick: bool, figures: SplitFigures | None = None) -> None:
    figures = figures or (SplitFigures.quick() if quick else SplitFigures())
    print(f"cpu split: {figures.images} images, {figures.clients} pushers", flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="gpubadge-bench-split-"))
    try:
        split = measure_split(figures, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    add_figures(results, figures, split)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="400 images instead of 1,200")
    parser.add_argument("--images", type=int, help="images pushed and scanned")
    args = parser.parse_args()
    figures = SplitFigures.quick() if args.quick else SplitFigures()
    if args.images:
        figures.images = max(args.images, figures.warm + 1)
    results = Results()
    run_all(results, args.quick, figures)
    for figure in results.figures:
        print(f"  {figure.name}: {figure.note}")


if __name__ == "__main__":
    main()
