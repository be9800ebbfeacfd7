"""`gpubadge worker`: scan workers only, in a process of their own (jobs/worker_process.py).

The command loads the job runtime's settings (`jobs.settings.JobSettings`) and imports nothing of
web/ or aiohttp's server: a worker serves no HTTP. With `--metrics-port` it serves /healthz and
/metrics there, so it then loads the service's settings (the listen address, the connection
guard's bounds, the health check's) and web/'s listener for that port alone.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from gpubadge.cli import _positive
from scanner.redaction import process_logging
from scanner.settings import sqlite_file_argument

if TYPE_CHECKING:
    from jobs.metrics import JobMetrics
    from jobs.settings import JobSettings
    from jobs.worker_process import Listener


def worker_parser() -> argparse.ArgumentParser:
    from jobs.settings import port_argument

    parser = argparse.ArgumentParser(
        prog="gpubadge worker",
        description="Run scan workers only: claim jobs from the shared store, scan, record the results."
        " Any number may run against one PostgreSQL (GPUBADGE_DATABASE_URL).",
        epilog="Settings are the same as `gpubadge serve --help` lists.",
    )
    parser.add_argument(
        "--concurrency", type=_positive, help="scans run at once (GPUBADGE_WORKERS, default 8)"
    )
    parser.add_argument(
        "--db", type=sqlite_file_argument, help="SQLite file (GPUBADGE_DB), when no database URL is set"
    )
    parser.add_argument("--config", type=Path, help="settings file, TOML or YAML (GPUBADGE_CONFIG)")
    parser.add_argument(
        "--metrics-port",
        type=port_argument(1),
        help="serve /metrics (scan counters) and /healthz on this port, at GPUBADGE_HOST (default: none)",
    )
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING (default INFO)")
    # `serve` starts its worker processes so (jobs/worker_processes.py): settings on stdin, reports on stdout
    parser.add_argument("--supervised", metavar="ROLE", help=argparse.SUPPRESS)
    parser.add_argument("--no-sweep", action="store_true", help=argparse.SUPPRESS)
    return parser


def load_job_settings(config: Path | None, **overrides: Any) -> JobSettings:
    """The job runtime's settings, as `serve` loads the service's: the file, the environment and
    the command line merged by one rule (`scanner.settings_merge`)."""
    from jobs.settings import JobSettings

    chosen = {key: value for key, value in overrides.items() if value is not None}
    return cast(JobSettings, JobSettings.load(config, **chosen))


def run_worker(argv: list[str]) -> int:
    args = worker_parser().parse_args(argv)
    process_logging(args.log_level, args.supervised or "worker")
    if args.supervised:
        from jobs.worker_process import serve_supervised
        from store import StoreUnavailable

        try:
            serve_supervised(sweep=not args.no_sweep)
        except StoreUnavailable as exc:
            print(f"gpubadge worker: {exc}", file=sys.stderr)
            return 1
        return 0
    overrides = {"db": args.db, "workers": args.concurrency}
    metrics: JobMetrics | None = None
    listener: Listener | None = None
    try:
        if args.metrics_port:  # HTTP on that port: the service's settings, web/'s listener
            from web.commands import load_settings
            from web.metrics import ServiceMetrics
            from web.worker_listener import health_listener

            service_settings = load_settings(args.config, **overrides)
            settings: JobSettings = service_settings
            metrics = ServiceMetrics()
            listener = health_listener(service_settings, metrics, args.metrics_port)
        else:
            settings = load_job_settings(args.config, **overrides)
    except (ValueError, OSError) as exc:
        print(f"gpubadge worker: invalid settings: {exc}", file=sys.stderr)
        return 2
    from jobs.worker_process import serve_workers
    from store import StoreUnavailable

    try:
        serve_workers(settings, metrics=metrics, listener=listener)
    except StoreUnavailable as exc:
        print(f"gpubadge worker: {exc}", file=sys.stderr)
        return 1
    return 0
