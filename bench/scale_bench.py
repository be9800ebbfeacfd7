"""Scale-out benchmarks on PostgreSQL: worker scaling, push->badge across replicas, listing at 1M reports.

Everything runs as users run it: `gpubadge worker` and `gpubadge serve --workers 0`
processes on a real PostgreSQL (Debian's, started by fixtures/postgres.py), images
pushed by skopeo into Debian's docker-registry, and HTTP wall time measured from
outside. Setup (pushing, bulk-loading reports) is never inside a measured window.

- Scan throughput with 1, 2 and 4 worker processes on the same N queued images; the
  ratio to one worker says how far it scales, the CPU split says what stops it.
- Push->badge p50/p99 with 2 API processes and 2 workers behind a round-robin
  balancer, against the single-process SQLite service, in the same run.
- `GET /api/images` and `POST /api/eligibility` latency at 1M stored reports against
  10k, on PostgreSQL.

Run alone: python3 -m bench.scale_bench [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import psycopg

from bench.common import Figure, Results, ms, percentile, process_cpu_seconds
from bench.service_bench import push_layout_images, push_then_wait
from fixtures.balancer import run_balancer
from fixtures.oci import ImageSpec, LayerSpec, file, push_many
from fixtures.postgres import LocalPostgres, run_postgres
from fixtures.registry import LocalRegistry, free_port, run_registry
from fixtures.service import run_role_process, run_service_process, wait_healthy
from store.postgres import PostgresStore

WORKER_CONCURRENCY = 4
FLEET_FILE = Path(__file__).resolve().parent.parent / "fixtures" / "fleet.yaml"


@dataclass
class ScaleFigures:
    images: int = 500
    worker_counts: tuple[int, ...] = (1, 2, 4)
    pushes: int = 50
    rounds: int = 3
    big_reports: int = 1_000_000
    small_reports: int = 10_000
    requests: int = 200

    @classmethod
    def quick(cls) -> ScaleFigures:
        return cls(images=120, rounds=1, big_reports=200_000, small_reports=10_000, requests=60)


def pg_env(url: str, registry: LocalRegistry | None = None, **extra: str) -> dict[str, str]:
    env = {"GPUBADGE_DATABASE_URL": url, **extra}
    if registry is not None:
        env["GPUBADGE_REGISTRIES"] = registry.host
    return env


def queue_counts(url: str) -> dict[str, int]:
    with psycopg.connect(url) as conn:
        return {
            row[0]: int(row[1]) for row in conn.execute("SELECT state, count(*) FROM jobs GROUP BY state")
        }


def wait_queue_drained(url: str, expected: int, timeout: float) -> None:
    """Bounded: until `expected` jobs are done (or any failed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        counts = queue_counts(url)
        if counts.get("failed"):
            raise RuntimeError(f"scan jobs failed: {counts}")
        if counts.get("done", 0) >= expected:
            return
        time.sleep(0.05)
    raise TimeoutError(f"queue not drained after {timeout}s: {queue_counts(url)}")


# --- worker scaling ------------------------------------------------------------------------------


def bench_worker_scaling(
    results: Results, figures: ScaleFigures, postgres: LocalPostgres, workdir: Path
) -> None:
    n = figures.images
    print(f"scan throughput: {n} images, {figures.worker_counts} worker processes on PostgreSQL", flush=True)
    with run_registry() as registry:
        base = LayerSpec([file("etc/os-release", 'ID=debian\nVERSION_ID="12"\n')])
        specs = {
            f"scale/img{i:04d}": ImageSpec(
                [base, LayerSpec([file(f"app/{i}.txt", f"image {i}\n")])],
                env={"CUDA_VERSION": "12.2.2"} if i % 2 else {},
            )
            for i in range(n)
        }
        digests = push_many(specs, registry.host, workdir / "scale-push")
        rates: dict[int, float] = {}
        notes: dict[int, str] = {}
        for count in figures.worker_counts:
            database = f"scale{count}"
            url = postgres.create_database(database)
            # the per-registry politeness cap is lifted: the figure is what the processes can do
            env = pg_env(
                url, registry, GPUBADGE_WORKERS=str(WORKER_CONCURRENCY), GPUBADGE_PER_REGISTRY_SCANS="64"
            )
            references = [(f"{registry.host}/{name}:latest", registry.host) for name in digests]
            with contextlib.ExitStack() as stack:
                workers = [
                    stack.enter_context(
                        run_role_process(
                            ("worker", "--concurrency", str(WORKER_CONCURRENCY)),
                            workdir / f"w{count}-{k}.db",
                            env,
                            workdir / f"w{count}-{k}.log",
                        )
                    )
                    for k in range(count)
                ]
                # Process start-up stays outside the window: wait until every worker is LISTENing.
                wait_listeners(url, count, timeout=120)
                registry_cpu = process_cpu_seconds(registry.process.pid)
                postgres_cpu = postgres_cpu_seconds(postgres)
                worker_cpu = sum(process_cpu_seconds(worker.pid) for worker in workers)
                store = PostgresStore(url, pool_size=1)
                try:
                    started = time.perf_counter()
                    store.enqueue(references, source="bench")  # one commit, one NOTIFY: all N at once
                    wait_queue_drained(url, n, timeout=600)
                    elapsed = time.perf_counter() - started
                finally:
                    store.close()
                worker_cpu = sum(process_cpu_seconds(worker.pid) for worker in workers) - worker_cpu
                registry_cpu = process_cpu_seconds(registry.process.pid) - registry_cpu
                postgres_cpu = postgres_cpu_seconds(postgres) - postgres_cpu
            rates[count] = n / elapsed
            notes[count] = (
                f"{count} worker(s) x {WORKER_CONCURRENCY}: {rates[count]:.0f} images/s; CPU s: workers"
                f" {worker_cpu:.1f}, registry {registry_cpu:.1f}, PostgreSQL {postgres_cpu:.1f}"
                f" over {elapsed:.1f} s wall on {os.cpu_count()} cores"
            )
            results.detail(notes[count])
            postgres.drop_database(database)
    one = rates[figures.worker_counts[0]]
    for count in figures.worker_counts[1:]:
        results.add(
            Figure(
                "scale",
                f"scan throughput, {count} workers vs 1 (PostgreSQL, {n} images)",
                f"{rates[count]:.0f}/s",
                peer=f"{one:.0f}/s",
                ratio=rates[count] / one,
                note=notes[count],
            )
        )


def wait_listeners(url: str, count: int, timeout: float) -> None:
    """Bounded: until `count` sessions of this database are parked in LISTEN (one per worker)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with psycopg.connect(url) as conn:
            row = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                " AND query ILIKE 'LISTEN%'"
            ).fetchone()
        if row and row[0] >= count:
            return
        time.sleep(0.05)
    raise TimeoutError(f"{count} workers not listening after {timeout}s")


def postgres_cpu_seconds(postgres: LocalPostgres) -> float:
    """CPU of the postmaster and every backend (children of the postmaster)."""
    total = 0.0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(entry.name) == postgres.process.pid or int(stat[1]) == postgres.process.pid:
                total += process_cpu_seconds(int(entry.name))
    return total


# --- push -> badge across replicas ---------------------------------------------------------------


def bench_push_to_badge(
    results: Results, figures: ScaleFigures, postgres: LocalPostgres, workdir: Path
) -> None:
    print(
        f"push -> badge: {figures.pushes} concurrent pushes, 2 APIs + 2 workers vs one SQLite process",
        flush=True,
    )
    samples: dict[str, list[float]] = {"postgres": [], "sqlite": []}
    for variant in ("sqlite", "postgres"):
        front_port = free_port()
        # The registry notifies the front door: the balancer (PostgreSQL) or the one process (SQLite).
        with contextlib.ExitStack() as stack:
            if variant == "sqlite":
                service = stack.enter_context(run_service_process(workdir / "push.db", port=front_port))
                registry = stack.enter_context(run_registry(notify_url=f"{service.url}/hooks/distribution"))
                service_urls = [service.url]
            else:
                registry = stack.enter_context(
                    run_registry(notify_url=f"http://127.0.0.1:{front_port}/hooks/distribution")
                )
                url = postgres.create_database("push")
                env = pg_env(url, GPUBADGE_REGISTRIES=registry.host, GPUBADGE_WORKERS=str(WORKER_CONCURRENCY))
                apis = [
                    stack.enter_context(
                        run_service_process(
                            workdir / f"push-api{k}.db", env=env, args=("serve", "--workers", "0")
                        )
                    )
                    for k in range(2)
                ]
                for k in range(2):
                    stack.enter_context(
                        run_role_process(
                            ("worker", "--concurrency", str(WORKER_CONCURRENCY)),
                            workdir / f"push-w{k}.db",
                            env,
                            workdir / f"push-w{k}.log",
                        )
                    )
                ports = [int(api.url.rsplit(":", 1)[1]) for api in apis]
                stack.enter_context(run_balancer([("127.0.0.1", p) for p in ports], port=front_port))
                service_urls = [api.url for api in apis]
            repo = f"{registry.host}/bench/push"
            for round_number in range(figures.rounds):
                root = workdir / f"push-{variant}-{round_number}"
                tags = push_layout_images(root, figures.pushes, round_number)
                # each badge is awaited on the *other* replica than the balancer's next pick, often
                jobs = [
                    (root, tag, f"{repo}:{tag}", service_urls[n % len(service_urls)])
                    for n, tag in enumerate(tags)
                ]
                with ThreadPoolExecutor(figures.pushes) as pool:
                    outcomes = list(pool.map(lambda job: push_then_wait(*job), jobs))
                samples[variant] += [latency for _, latency in outcomes]
        if variant == "postgres":
            postgres.drop_database("push")
    pg, lite = samples["postgres"], samples["sqlite"]
    pg_p99, lite_p99 = percentile(pg, 0.99), percentile(lite, 0.99)
    results.add(
        Figure(
            "scale",
            f"push -> badge, {figures.pushes} concurrent pushes: 2 APIs + 2 workers (PostgreSQL)"
            " vs 1 process (SQLite)",
            f"p50 {ms(percentile(pg, 0.5))}, p99 {ms(pg_p99)}",
            peer=f"p50 {ms(percentile(lite, 0.5))}, p99 {ms(lite_p99)}",
            ratio=lite_p99 / pg_p99 if pg_p99 else None,
            target="p99 < 300 ms and no worse than SQLite",
            met=pg_p99 < 0.3 and pg_p99 <= lite_p99 * 1.1,
            note=f"{len(pg)} pushes each; latency from skopeo's exit to the badge answering"
            " (long-poll on an API replica, not necessarily the one that took the webhook)",
        )
    )


# --- listing and eligibility at 1M reports -------------------------------------------------------

_BULK_REPORTS = """
INSERT INTO reports (digest, registry, repository, reference, media_type, gpu_required, cuda_versions,
                     libc_flavours, platforms, distro, scanned_at, report)
SELECT 'sha256:' || lpad(to_hex(n), 64, '0'), 'bench.example', 'team/app' || (n %% 5000),
       'bench.example/team/app' || (n %% 5000) || ':v' || n,
       'application/vnd.oci.image.manifest.v1+json', n %% 3 = 0,
       CASE WHEN n %% 3 = 0 THEN ARRAY['12.' || (n %% 5)] ELSE ARRAY[]::text[] END,
       CASE WHEN n %% 7 = 0 THEN ARRAY['musl'] ELSE ARRAY['glibc'] END, ARRAY['linux/amd64'],
       'Debian GNU/Linux 12', now() - make_interval(secs => n), %(report)s
FROM generate_series(%(start)s::int, %(stop)s::int) AS n
"""


def bulk_load(url: str, count: int, template: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        step = 100_000
        for start in range(1, count + 1, step):
            conn.execute(
                _BULK_REPORTS.encode(),
                {"report": template, "start": start, "stop": min(count, start + step - 1)},
            )
        # the images that eligibility queries name: tags resolve them as pushes would have
        conn.execute(
            "INSERT INTO tags (registry, repository, tag, digest, first_seen, last_seen)"
            " SELECT 'bench.example', 'team/app' || (n % 5000), 'v' || n, 'sha256:' || lpad(to_hex(n), 64, '0'),"
            " now(), now() FROM generate_series(1, 300) AS n"
        )
        conn.execute("VACUUM ANALYZE reports")  # what autovacuum gives a live database


def http_latencies(url: str, requests: int, body: bytes | None = None) -> list[float]:
    latencies = []
    for _ in range(requests):
        request = urllib.request.Request(
            url, data=body, headers={"Content-Type": "application/json"}, method="POST" if body else "GET"
        )
        started = time.perf_counter()
        with urllib.request.urlopen(request, timeout=30) as response:
            response.read()
        latencies.append(time.perf_counter() - started)
    return latencies


def bench_listing_at_scale(
    results: Results, figures: ScaleFigures, postgres: LocalPostgres, workdir: Path
) -> None:
    print(
        f"listing: {figures.big_reports:,} vs {figures.small_reports:,} stored reports on PostgreSQL",
        flush=True,
    )
    template = sample_report_json()
    measured: dict[int, dict[str, list[float]]] = {}
    for count in (figures.small_reports, figures.big_reports):
        database = f"list{count}"
        url = postgres.create_database(database)
        env = pg_env(url, GPUBADGE_INVENTORY_FILE=str(FLEET_FILE), GPUBADGE_REGISTRIES="bench.example")
        with run_service_process(
            workdir / f"{database}.db", env=env, args=("serve", "--workers", "0")
        ) as api:
            loading = time.perf_counter()
            bulk_load(url, count, template)
            results.detail(f"bulk-loaded {count:,} reports in {time.perf_counter() - loading:.1f} s (setup)")
            wait_healthy(api.url, api.process)
            queries = {
                "first page": "/api/images?limit=50",
                "gpu filter": "/api/images?gpu=true&limit=50",
                "repository search": "/api/images?q=app4242&limit=50",
                "page 20": "/api/images?limit=50&page=20",
            }
            measured[count] = {}
            for name, path in queries.items():
                http_latencies(api.url + path, 5)  # warm the caches as a live service has them
                measured[count][name] = http_latencies(api.url + path, figures.requests)
            # n = 42 is a CUDA 12.2 glibc image (n % 3 == 0): placement over the sample fleet
            eligibility = json.dumps({"image": "bench.example/team/app42:v42", "gpus": 1}).encode()
            http_latencies(api.url + "/api/eligibility", 5, eligibility)
            measured[count]["POST /api/eligibility"] = http_latencies(
                api.url + "/api/eligibility", figures.requests, eligibility
            )
        postgres.drop_database(database)
    small, big = measured[figures.small_reports], measured[figures.big_reports]
    for name in small:
        big_p99, small_p99 = percentile(big[name], 0.99), percentile(small[name], 0.99)
        results.add(
            Figure(
                "scale",
                f"{name if name.startswith('POST') else f'GET /api/images ({name})'} p99 at {figures.big_reports:,} vs {figures.small_reports:,} reports",
                f"p50 {ms(percentile(big[name], 0.5))}, p99 {ms(big_p99)}",
                peer=f"p50 {ms(percentile(small[name], 0.5))}, p99 {ms(small_p99)}",
                ratio=small_p99 / big_p99 if big_p99 else None,
                target="p99 within 2x",
                met=big_p99 <= 2 * small_p99,
            )
        )


def sample_report_json() -> str:
    """A stored report body of realistic size (what `gpubadge scan --json` prints for a CUDA image)."""
    from scanner.models import GpuFacts, ImageReport, LibcVerdict, PlatformReport

    platform = PlatformReport(
        platform="linux/amd64",
        digest="sha256:" + "b" * 64,
        gpu=GpuFacts(required=True, cuda_version="12.2"),
        libc=LibcVerdict(flavour="glibc", distro="Ubuntu 22.04.4 LTS"),
    )
    return ImageReport(
        reference="bench.example/team/app:v1",
        digest="sha256:" + "a" * 64,
        registry="bench.example",
        repository="team/app",
        platforms=[platform],
    ).model_dump_json()


def run_all(results: Results, quick: bool, parts: set[str] | None = None) -> None:
    figures = ScaleFigures.quick() if quick else ScaleFigures()
    workdir = Path(tempfile.mkdtemp(prefix="gpubadge-bench-scale-"))
    chosen = parts or {"workers", "push", "listing"}
    try:
        with run_postgres() as postgres:
            if "workers" in chosen:
                bench_worker_scaling(results, figures, postgres, workdir)
            if "push" in chosen:
                bench_push_to_badge(results, figures, postgres, workdir)
            if "listing" in chosen:
                bench_listing_at_scale(results, figures, postgres, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller workloads")
    parser.add_argument(
        "--only", action="append", choices=["workers", "push", "listing"], help="run only these parts"
    )
    args = parser.parse_args()
    run_all(Results(), args.quick, set(args.only) if args.only else None)


if __name__ == "__main__":
    main()
