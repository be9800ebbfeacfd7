"""A jobs table of a million finished jobs: what /healthz, /metrics and the jobs page cost, before and
after the counts stopped reading finished jobs, and how retention brings the table back down.

For each engine (SQLite, PostgreSQL) one database is made by the *before* checkout's `gpubadge db
upgrade`, filled with ROWS finished jobs (95 % done, 5 % failed, one a second back in time), and served by that checkout's `gpubadge serve --workers 0`: /healthz, /metrics and /scans
are each asked REQUESTS times, one at a time. The *after* checkout (this one) then upgrades the same
database (migration 0010: the finished-jobs index and the tallies, timed) and is asked the same.
Last, with the after checkout's `serve --workers 0` taking webhook deliveries, a `gpubadge worker`
starts with the default retention (GPUBADGE_JOB_RETENTION_COUNT=100,000): the time until the table
is down to the cap, and the deliveries' latency while it sweeps against the same deliveries before.

Run: python3 -m bench.job_table_bench --before DIR [--rows N] [--engines sqlite,postgres]
(DIR: a checkout of the code before, e.g. `git archive 07fd130 | tar -x -C DIR`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sqlite3
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

from bench.common import REPO_ROOT, ms, percentile
from bench.service_bench import distribution_event, send_webhooks
from fixtures.postgres import run_postgres
from fixtures.process import stop_process
from fixtures.registry import free_port
from fixtures.service import wait_healthy

REQUESTS = 20
KEEP = 100_000  # the default GPUBADGE_JOB_RETENTION_COUNT
DELIVERIES = 300


def cli(root: Path, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """A `gpubadge` command of the checkout at `root` (run there: `python -m` puts the working
    directory ahead of PYTHONPATH)."""
    return subprocess.run(
        [sys.executable, "-m", "gpubadge.cli", *args],
        env={**os.environ, **env, "PYTHONPATH": str(root)},
        cwd=root,
        capture_output=True,
        text=True,
        timeout=3600,
        check=True,
    )


@contextlib.contextmanager
def role(
    root: Path, args: list[str], db: Path, env: dict[str, str], log: Path
) -> Iterator[subprocess.Popen[bytes]]:
    """A `gpubadge` role of the checkout at `root`, as a child process; SIGTERM, then SIGKILL, at exit."""
    full_env = {**os.environ, "GPUBADGE_DB": str(db), **env, "PYTHONPATH": str(root)}
    with log.open("ab") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "gpubadge.cli", *args, "--log-level", "WARNING"],
            env=full_env,
            cwd=root,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        yield process
    finally:
        stop_process(process, grace=20)


def rows(count: int) -> Iterator[tuple[str, ...]]:
    start = datetime.now(UTC) - timedelta(hours=1)
    for n in range(count):
        moment = (start - timedelta(seconds=n)).isoformat(timespec="microseconds")
        reference = f"registry.example/bench/app-{n % 5000}:{n}"
        yield (
            uuid.uuid4().hex,
            reference,
            "registry.example",
            reference,
            "failed" if n % 20 == 0 else "done",
            moment,
        )


INSERT = (
    "INSERT INTO jobs (id, reference, registry, dedupe_key, state, attempts, max_attempts, not_before,"
    " created_at, updated_at) VALUES ({p}, {p}, {p}, {p}, {p}, 1, 5, {t}, {t}, {t})"
)


def seed(engine: str, where: str, count: int) -> float:
    started = time.perf_counter()
    if engine == "sqlite":
        with contextlib.closing(sqlite3.connect(where)) as conn, conn:
            batch: list[tuple[str, ...]] = []
            for row in rows(count):
                batch.append(row)
                if len(batch) == 50_000:
                    conn.executemany(INSERT.format(p="?", t="?"), [(*r, r[5], r[5]) for r in batch])
                    batch = []
            conn.executemany(INSERT.format(p="?", t="?"), [(*r, r[5], r[5]) for r in batch])
    else:
        import psycopg

        with psycopg.connect(where) as server, server.cursor() as cursor:
            columns = "id, reference, registry, dedupe_key, state, attempts, max_attempts, not_before, created_at, updated_at"
            with cursor.copy(f"COPY jobs ({columns}) FROM STDIN") as copy:
                for r in rows(count):
                    copy.write_row((*r[:5], 1, 5, r[5], r[5], r[5]))
            server.execute("ANALYZE jobs")
    return time.perf_counter() - started


def get(url: str) -> tuple[float, int]:
    started = time.perf_counter()
    try:
        with urllib.request.urlopen(url, timeout=60) as response:
            response.read()
            status = response.status
    except urllib.error.HTTPError as exc:
        status = exc.code
    return time.perf_counter() - started, status


def measure(root: Path, engine_env: dict[str, str], db: Path, log: Path) -> dict[str, str]:
    port = free_port()
    env = {**engine_env, "GPUBADGE_PORT": str(port), "GPUBADGE_HEALTH_TIMEOUT": "30"}
    figures: dict[str, str] = {}
    with role(root, ["serve", "--workers", "0"], db, env, log) as process:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, process, timeout=120)
        with urllib.request.urlopen(f"{url}/healthz", timeout=60) as response:
            figures["queue"] = json.dumps(json.load(response)["queue"])  # the table this process reads
        print(f"    queue: {figures['queue']}", flush=True)
        for path in ("/healthz", "/metrics", "/scans"):
            timings = [get(url + path) for _ in range(REQUESTS)]
            seconds = sorted(t for t, _ in timings)
            statuses = sorted({s for _, s in timings})
            figures[path] = f"p50 {ms(percentile(seconds, 0.5))}, max {ms(seconds[-1])} (HTTP {statuses})"
            print(f"    {path}: {figures[path]}", flush=True)
    return figures


def finished(url: str) -> int:
    with urllib.request.urlopen(f"{url}/healthz", timeout=60) as response:
        queue = json.load(response)["queue"]
    return int(queue["done"]) + int(queue["failed"])


def retention(root: Path, engine_env: dict[str, str], db: Path, tmp: Path) -> dict[str, str]:
    port = free_port()
    env = {**engine_env, "GPUBADGE_PORT": str(port), "GPUBADGE_MAX_ATTEMPTS": "1"}
    figures: dict[str, str] = {}
    with role(root, ["serve", "--workers", "0"], db, env, tmp / "api.log") as api:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, api, timeout=120)
        hook = f"{url}/hooks/distribution"
        sent = 0

        def deliver(count: int) -> list[float]:
            nonlocal sent
            bodies = [distribution_event("127.0.0.1:9", n) for n in range(sent, sent + count)]
            sent += count
            return asyncio.run(send_webhooks(hook, bodies, 1))

        idle = sorted(deliver(DELIVERIES))
        figures["deliveries, no sweep"] = f"p50 {ms(percentile(idle, 0.5))}, p99 {ms(percentile(idle, 0.99))}"
        before = finished(url)
        started = time.perf_counter()
        during: list[float] = []
        with role(root, ["worker", "--concurrency", "1"], db, env, tmp / "worker.log"):
            deadline = time.monotonic() + 1800
            while finished(url) >= before and time.monotonic() < deadline:  # the first batch is gone
                time.sleep(0.05)
            while (left := finished(url)) > KEEP + sent and time.monotonic() < deadline:
                during.extend(deliver(100))  # deliveries all through the sweep
            swept = time.perf_counter() - started
        during.sort()
        figures["deliveries, sweeping"] = (
            f"p50 {ms(percentile(during, 0.5))}, p99 {ms(percentile(during, 0.99))} ({len(during)} deliveries)"
        )
        figures["sweep"] = (
            f"{before:,} -> {left:,} finished jobs in {swept:.1f} s from the worker's start"
            f" ({(before - left) / swept:,.0f} jobs/s)"
        )
    for name, value in figures.items():
        print(f"    {name}: {value}", flush=True)
    return figures


def run_engine(engine: str, before: Path, count: int, tmp: Path, url: str | None) -> dict[str, object]:
    db = tmp / f"{engine}.db"
    engine_env = {"GPUBADGE_DATABASE_URL": url} if url else {}
    where = url or str(db)
    db_flags = [] if url else ["--db", str(db)]
    print(f"  {engine}: schema by the checkout before", flush=True)
    cli(before, "db", "upgrade", *db_flags, env=engine_env)
    seconds = seed(engine, where, count)
    print(f"  {engine}: {count:,} finished jobs seeded in {seconds:.0f} s", flush=True)
    result: dict[str, object] = {"rows": count}
    print(f"  {engine}: before ({before})", flush=True)
    result["before"] = measure(before, engine_env, db, tmp / f"{engine}-before.log")
    started = time.perf_counter()
    cli(REPO_ROOT, "db", "upgrade", *db_flags, env=engine_env)
    result["migration 0010"] = f"{time.perf_counter() - started:.1f} s"
    print(f"  {engine}: migration 0010 took {result['migration 0010']}; after ({REPO_ROOT})", flush=True)
    result["after"] = measure(REPO_ROOT, engine_env, db, tmp / f"{engine}-after.log")
    result["retention"] = retention(REPO_ROOT, engine_env, db, tmp)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="a checkout of the code before")
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--engines", default="sqlite,postgres")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    results: dict[str, object] = {}
    with tempfile.TemporaryDirectory(prefix="gpubadge-jobs-bench-") as folder:
        tmp = Path(folder)
        for engine in args.engines.split(","):
            if engine == "postgres":
                with run_postgres() as server:
                    results[engine] = run_engine(
                        engine, args.before, args.rows, tmp, server.database_url("gpubadge")
                    )
            else:
                results[engine] = run_engine(engine, args.before, args.rows, tmp, None)
    print(json.dumps(results, indent=2))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
