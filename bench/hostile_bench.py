"""Hostile-content run: the read API's latency while hostile images scan, next to an idle service.

    python3 -m bench.hostile_bench [--quick]

Setup (unmeasured): the hostile shapes of `fixtures/hostile.py` (tarfile-built, PAX
headers) are pushed with skopeo into a loopback registry, and `gpubadge serve` starts as
a process. Then, in one run, for each service configuration:

1. idle: two clients poll GET /healthz and GET /api/images over HTTP for a few seconds;
2. hostile: every shape is submitted (POST /api/scans) and the same clients poll until
   every scan has ended; each scan's time to end is taken from the bench's own polling.

Figures: p50/p99 of the read API idle and under hostile scans, their ratio (goal: p99
within 2x, and no answer over 1 s), the slowest answer, and each hostile scan's time to
end. The peer is the same service with `GPUBADGE_ANALYSIS_PROCESSES=0` (layer parsing on
the event loop, as before this work), run in the same bench run.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from bench.common import Figure, Results, percentile, run_section
from fixtures import hostile
from fixtures.oci import ImageSpec, push_image
from fixtures.registry import LocalRegistry, run_registry
from fixtures.service import run_service_process

SECTION = "hostile"
API_GOAL_MS = 1000.0


@dataclass(frozen=True)
class BenchShape:
    name: str
    build: Callable[[], ImageSpec]
    outcome: str  # what the scan should end with, for the table


def bench_shapes(quick: bool) -> list[BenchShape]:
    """The issue's shapes at their real sizes under default bounds (smaller with --quick)."""
    layers = 100 if quick else 250
    bomb_mib = 96 if quick else 600  # full: past the old 512 MiB per-layer bound, now read through
    shapes = [
        BenchShape("long-pax-link", hostile.long_pax_link, "failed: GPUBADGE_MAX_PATH_BYTES"),
        BenchShape("huge-pax-record", hostile.huge_pax_record, "failed: GPUBADGE_MAX_TAR_HEADER_BYTES"),
        BenchShape("deep-path", hostile.deep_path, "failed: GPUBADGE_MAX_PATH_BYTES"),
        BenchShape("symlink-loop", hostile.symlink_loop, "glibc"),
        BenchShape("long-symlink-chain", hostile.long_symlink_chain, "musl"),
        BenchShape("deep-link-chain", hostile.deep_link_chain, "failed: GPUBADGE_MAX_PATH_COMPONENTS"),
        BenchShape("many-whiteouts", lambda: hostile.many_whiteouts(100_000), "musl"),
        BenchShape("winding-link", hostile.winding_shell_link, "musl"),
        BenchShape(f"{layers}-tiny-layers", lambda: hostile.many_legal_layers(layers), "musl"),
        # zeros under the inflation ratio's 1 GiB floor are a legal (sparse-looking) layer
        BenchShape(f"gzip-bomb-{bomb_mib}mib", lambda: hostile.gzip_bomb(bomb_mib), "glibc"),
    ]
    if not quick:
        shapes += [
            BenchShape("300-layers", lambda: hostile.many_layers(300), "failed: GPUBADGE_MAX_LAYERS"),
            # past the floor, 1,000x inflation is a bomb: stopped at the ratio, within one slice
            BenchShape(
                "gzip-bomb-1200mib", lambda: hostile.gzip_bomb(1200), "failed: GPUBADGE_MAX_INFLATION_RATIO"
            ),
        ]
    return shapes


def push_shapes(registry: LocalRegistry, shapes: list[BenchShape], workdir: Path) -> dict[str, str]:
    def one(shape: BenchShape) -> tuple[str, str]:
        reference = f"{registry.host}/hostile/{shape.name}:1"
        push_image(shape.build(), reference, workdir / shape.name)
        return shape.name, reference

    with ThreadPoolExecutor(3) as pool:
        return dict(pool.map(one, shapes))


@dataclass
class Poller:
    """Clients that GET /healthz and /api/images in a loop, recording each answer's wall time."""

    url: str
    clients: int = 2
    latencies_ms: list[float] = field(default_factory=list)
    failures: int = 0
    failure_kinds: dict[str, int] = field(default_factory=dict)  # "path status" -> count
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _loop(self) -> None:
        paths = ("/healthz", "/api/images?limit=50")
        turn = 0
        while not self._stop.is_set():
            path = paths[turn % 2]
            turn += 1
            started = time.perf_counter()
            status = "error"
            try:
                with urllib.request.urlopen(f"{self.url}{path}", timeout=30) as response:
                    response.read()
                    status = str(response.status)
            except urllib.error.HTTPError as exc:
                status = f"{exc.code} {exc.read()[:120]!r}"
            except OSError as exc:
                status = type(exc).__name__
            elapsed = (time.perf_counter() - started) * 1000
            with self._lock:
                self.latencies_ms.append(elapsed)
                if status != "200":
                    self.failures += 1
                    kind = f"{path.split('?')[0]} {status}"
                    self.failure_kinds[kind] = self.failure_kinds.get(kind, 0) + 1
            time.sleep(0.01)  # a steady reader, not a flood: ~50 requests/s per client at most

    def __enter__(self) -> Poller:
        for _ in range(self.clients):
            thread = threading.Thread(target=self._loop, daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=60)


def _json(method: str, url: str, body: dict[str, str] | None = None) -> dict[str, object]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        result: dict[str, object] = json.loads(response.read())
        return result


@dataclass
class RunFigures:
    idle_ms: list[float]
    busy_ms: list[float]
    failures: int
    failure_kinds: dict[str, int]
    scan_seconds: dict[str, float]
    outcomes: dict[str, str]


def run_configuration(
    references: dict[str, str], registry: LocalRegistry, workdir: Path, processes: int, idle_seconds: float
) -> RunFigures:
    env = {
        "GPUBADGE_REGISTRIES": json.dumps([{"host": registry.host}]),
        "GPUBADGE_MAX_ATTEMPTS": "1",
        "GPUBADGE_ANALYSIS_PROCESSES": str(processes),
        "DOCKER_CONFIG": str(workdir / "docker"),
    }
    db = workdir / f"service-{processes}.db"
    with run_service_process(db, env=env) as service:
        with Poller(service.url) as idle:
            time.sleep(idle_seconds)
        submitted: dict[str, tuple[str, float]] = {}
        with Poller(service.url) as busy:
            for name, reference in references.items():
                job = _json("POST", f"{service.url}/api/scans", {"ref": reference})
                submitted[name] = (str(job["id"]), time.perf_counter())
            ended: dict[str, float] = {}
            outcomes: dict[str, str] = {}
            deadline = time.perf_counter() + 900
            while len(ended) < len(submitted) and time.perf_counter() < deadline:
                # One listing per 100 ms, so that watching the jobs adds little load of its own.
                listing = _json("GET", f"{service.url}/api/scans?limit=500")["jobs"]
                now = time.perf_counter()
                by_id = {str(job["id"]): job for job in listing} if isinstance(listing, list) else {}
                for name, (job_id, started) in submitted.items():
                    job = by_id.get(job_id)
                    if name not in ended and job is not None and job["state"] in ("done", "failed"):
                        ended[name] = now - started
                        outcomes[name] = _outcome(service.url, references[name], job)
                time.sleep(0.1)
        kinds = {**idle.failure_kinds}
        for kind, count in busy.failure_kinds.items():
            kinds[kind] = kinds.get(kind, 0) + count
        return RunFigures(
            idle.latencies_ms, busy.latencies_ms, idle.failures + busy.failures, kinds, ended, outcomes
        )


def _outcome(url: str, reference: str, job: dict[str, object]) -> str:
    if job["state"] == "failed":
        error = str(job.get("error") or "")
        return "failed: " + (error.rsplit("(", 1)[-1].rstrip(")") if "the limit is" in error else error[:80])
    query = urllib.parse.urlencode({"ref": reference})
    report = _json("GET", f"{url}/api/images/by-ref?{query}")
    platforms = report.get("platforms")
    if isinstance(platforms, list) and platforms:
        return str(platforms[0]["libc"]["flavour"])
    return "done"


def _latency(samples: list[float]) -> str:
    return f"p50 {percentile(samples, 0.5):.1f} ms, p99 {percentile(samples, 0.99):.1f} ms"


def run_all(results: Results, quick: bool) -> None:
    shapes = bench_shapes(quick)
    workdir = Path(tempfile.mkdtemp(prefix="gpubadge-bench-hostile-"))
    idle_seconds = 3.0 if quick else 8.0
    try:
        with run_registry() as registry:
            print(
                f"hostile: pushing {len(shapes)} hostile images with skopeo (setup, unmeasured)", flush=True
            )
            references = push_shapes(registry, shapes, workdir)
            ours = run_configuration(references, registry, workdir, processes=2, idle_seconds=idle_seconds)
            peer = run_configuration(references, registry, workdir, processes=0, idle_seconds=idle_seconds)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    for label, figures in (("ours", ours), ("peer", peer)):
        for kind, count in sorted(figures.failure_kinds.items()):
            results.detail(f"{label}: {count} answers were not 200: {kind}")
    ours_ratio = percentile(ours.busy_ms, 0.99) / percentile(ours.idle_ms, 0.99)
    peer_ratio = percentile(peer.busy_ms, 0.99) / percentile(peer.idle_ms, 0.99)
    worst_ours, worst_peer = max(ours.busy_ms), max(peer.busy_ms)
    results.add(
        Figure(
            SECTION,
            f"read API, idle ({len(ours.idle_ms)} / {len(peer.idle_ms)} answers)",
            _latency(ours.idle_ms),
            peer=_latency(peer.idle_ms),
        )
    )
    results.add(
        Figure(
            SECTION,
            f"read API while {len(shapes)} hostile scans run ({len(ours.busy_ms)} / {len(peer.busy_ms)} answers)",
            _latency(ours.busy_ms) + f", max {worst_ours:.0f} ms",
            peer=_latency(peer.busy_ms) + f", max {worst_peer:.0f} ms",
            ratio=percentile(peer.busy_ms, 0.99) / percentile(ours.busy_ms, 0.99),
            target="p99 < 250 ms, none > 1 s",
            met=percentile(ours.busy_ms, 0.99) < 250 and worst_ours < API_GOAL_MS and ours.failures == 0,
            note=f"{ours.failures} failed answers" if ours.failures else "",
        )
    )
    results.add(
        Figure(
            SECTION,
            "read API p99 under hostile scans / idle p99",
            f"{ours_ratio:.2f}x",
            peer=f"{peer_ratio:.2f}x",
            target="<= 2x",
            met=ours_ratio <= 2.0,
        )
    )
    for shape in shapes:
        seconds, peer_seconds = ours.scan_seconds.get(shape.name), peer.scan_seconds.get(shape.name)
        results.add(
            Figure(
                SECTION,
                f"scan of {shape.name} ends",
                f"{seconds:.2f} s" if seconds is not None else "did not end",
                peer=f"{peer_seconds:.2f} s" if peer_seconds is not None else "did not end",
                note=ours.outcomes.get(shape.name, "?"),
                target=shape.outcome,
                met=ours.outcomes.get(shape.name) == shape.outcome,
            )
        )


if __name__ == "__main__":
    run_section(run_all, __doc__)
