"""`gpubadge serve` and `gpubadge db`: argument parsing around the service's roles (`gpubadge worker`,
which runs no HTTP unless asked for a metrics port, is gpubadge/worker.py)."""

from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import socket
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from jobs.settings import port_argument
from scanner.redaction import process_logging
from scanner.settings import sqlite_file_argument
from web.settings import ServiceSettings

if TYPE_CHECKING:
    from aiohttp import web

    from store import StoreBackend
    from web.intake_listener import IntakeListener


def serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpubadge serve",
        description="Run the service: registry webhooks, the scan queue, the JSON API and the web UI.",
        epilog="Settings (environment variables; the same names, lower-case and without the prefix,"
        " work in the --config file):\n" + ServiceSettings.describe(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--host", help="listen address (GPUBADGE_HOST, default 127.0.0.1)")
    parser.add_argument("--port", type=port_argument(0), help="listen port (GPUBADGE_PORT, default 8080)")
    parser.add_argument(
        "--intake-port",
        type=port_argument(0),
        help="registries' webhooks, answered on threads of their own (GPUBADGE_INTAKE_PORT, default 8081; 0: none)",
    )
    parser.add_argument(
        "--db",
        type=sqlite_file_argument,
        help="SQLite file (GPUBADGE_DB, default ~/.local/share/gpubadge/gpubadge.db)",
    )
    parser.add_argument("--config", type=Path, help="settings file, TOML or YAML (GPUBADGE_CONFIG)")
    parser.add_argument(
        "--workers",
        type=_count,
        help="scans run at once in this process (GPUBADGE_WORKERS, default 8); 0 serves the API only",
    )
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING (default INFO)")
    return parser


def db_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpubadge db",
        description="Manage the store's schema: GPUBADGE_DATABASE_URL's PostgreSQL, else the SQLite file"
        " named by --db (GPUBADGE_DB alone does not count: an image's default must not be migrated by mistake).",
    )
    commands = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    for name, text in (
        ("upgrade", "apply every pending migration (they also run at start)"),
        ("status", "print the applied and pending migrations"),
        (
            "rescan-outdated",
            "queue a scan of every stored image an older gpubadge analysis read (after an upgrade), by"
            " digest, at most --limit per run and never past GPUBADGE_MAX_QUEUED_SCANS",
        ),
    ):
        sub = commands.add_parser(name, help=text, description=text)
        sub.add_argument(
            "--db",
            type=sqlite_file_argument,
            help="SQLite file; required when GPUBADGE_DATABASE_URL is not set",
        )
        sub.add_argument("--config", type=Path, help="settings file, TOML or YAML (GPUBADGE_CONFIG)")
        if name == "rescan-outdated":
            sub.add_argument(
                "--limit",
                type=_count,
                default=10_000,
                help="most scans queued at once (default 10000); past it the rest are left for another run",
            )
            sub.add_argument(
                "--follow",
                action="store_true",
                help="go on past --limit: wait until the queue has drained to half of it, then queue"
                " more, until every outdated image is queued (one pass over the reports)",
            )
    return parser


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError("must be 0 or more")
    return value


def load_settings(config: Path | None, **overrides: Any) -> ServiceSettings:
    chosen = {key: value for key, value in overrides.items() if value is not None}
    settings = cast(ServiceSettings, ServiceSettings.load(config, **chosen))
    settings.check_consistent()
    return settings


# The interpreter lock's switch interval in `serve` (Python's default is 5 ms). The store's thread
# converts rows in Python (a batch of heartbeat stamps, the stamps another replica wrote), and while
# it holds the lock a request ready on the event loop waits up to a whole interval for it: with a
# fleet's traffic that wait was a visible share of the eligibility tail. Each webhook delivery
# crosses to the intake's commit thread and back, and each crossing waits for the lock the same
# way while the loop serves anything else: at 1 ms the two hand-overs were 0.6 ms of a delivery's
# answer at p50 under a push burst, at 0.2 ms 0.35 ms (bench/push_burst_bench.py). Scans no longer
# run in this process (jobs/worker_processes.py), so the hand-overs cost little beside it.
GIL_SWITCH_SECONDS = 0.0002


def run_serve(argv: list[str]) -> int:
    args = serve_parser().parse_args(argv)
    process_logging(args.log_level, "serve")
    try:
        settings = load_settings(
            args.config,
            host=args.host,
            port=args.port,
            intake_port=args.intake_port,
            db=args.db,
            workers=args.workers,
        )
    except (ValueError, OSError) as exc:
        print(f"gpubadge serve: invalid settings: {exc}", file=sys.stderr)
        return 2
    taken = listen_problem(settings.host, settings.port)
    if taken is not None:  # before anything starts: nothing to stop, one line to read
        print(f"gpubadge serve: {taken}", file=sys.stderr)
        return 1
    from web.intake_listener import IntakeListener

    intake: IntakeListener | None = None
    if settings.intake_port:
        intake = IntakeListener(settings)
        try:
            intake.bind(settings.host, settings.intake_port)
        except OSError as exc:
            if exc.errno not in LISTEN_ERRNOS:
                raise
            words = listen_words(settings.host, settings.intake_port, exc, INTAKE_PORT_SETTING)
            print(f"gpubadge serve: the intake port: {words}", file=sys.stderr)
            return 1
    from jobs import garbage_collection
    from jobs.event_loop import LoopLagMonitor, new_event_loop
    from store import StoreUnavailable
    from web.app import create_app
    from web.guards.connections import connection_limits, run_guarded_app
    from web.security import RedactingAccessLogger
    from web.state import services_of_app

    _raise_fd_limit(settings.long_poll_max)  # first: the connection cap and its shares are sized from it
    try:
        app = create_app(settings)
    except StoreUnavailable as exc:
        print(f"gpubadge serve: {exc}", file=sys.stderr)
        return 1
    if intake is not None:
        app.on_startup.append(_starting(intake))
        app.on_shutdown.append(_stopping(intake))
    collection = garbage_collection.TimedCollection()
    app.on_startup.append(lambda _: collection.start())
    app.on_cleanup.append(lambda _: collection.stop())
    monitor = LoopLagMonitor(settings.loop_stall_seconds, services_of_app(app).metrics.loop_lag.observe)
    app.on_startup.append(lambda _: monitor.start())
    app.on_cleanup.append(lambda _: monitor.stop())
    sys.setswitchinterval(GIL_SWITCH_SECONDS)
    try:
        run_guarded_app(
            app,
            host=settings.host,
            port=settings.port,
            limits=connection_limits(settings),
            print=lambda message: logging.info("%s", message),
            access_log_class=RedactingAccessLogger,
            loop=new_event_loop(),
        )
    except OSError as exc:  # taken between the check and the bind: the same one line
        if exc.errno not in LISTEN_ERRNOS:
            raise
        print(f"gpubadge serve: {listen_words(settings.host, settings.port, exc)}", file=sys.stderr)
        return 1
    except StoreUnavailable as exc:  # at start-up (the intake's journal, the store's first reads): one line
        print(f"gpubadge serve: {exc}", file=sys.stderr)
        return 1
    return 0


LISTEN_ERRNOS = frozenset({errno.EADDRINUSE, errno.EACCES, errno.EADDRNOTAVAIL})


INTAKE_PORT_SETTING = "--intake-port or GPUBADGE_INTAKE_PORT (0: no intake port)"


def _starting(intake: IntakeListener) -> Callable[[web.Application], Awaitable[None]]:
    async def start(app: web.Application) -> None:
        from web.state import services_of_app

        intake.start(services_of_app(app))

    return start


def _stopping(intake: IntakeListener) -> Callable[[web.Application], Awaitable[None]]:
    async def stop(_: web.Application) -> None:  # on_shutdown: before the store closes (on_cleanup)
        import asyncio

        await asyncio.to_thread(intake.close)

    return stop


def listen_words(host: str, port: int, exc: OSError, setting: str = "--port or GPUBADGE_PORT") -> str:
    """Why `serve` cannot listen on host:port, and what to do, in one line (`setting` chooses the port)."""
    where = f"{host}:{port}"
    if exc.errno == errno.EADDRINUSE:
        return (
            f"port {port} is already in use on {host} (another program, or another gpubadge, listens"
            f" there): stop it, or choose another port with {setting}"
        )
    if exc.errno == errno.EACCES:
        return f"not allowed to listen on {where} (ports below 1024 need root): choose another port with {setting}"
    return f"cannot listen on {where}: {exc.strerror or exc}; check --host or GPUBADGE_HOST"


def listen_problem(host: str, port: int) -> str | None:
    """Whether `serve` could listen on host:port, tried as aiohttp binds (SO_REUSEADDR, every address
    the host name resolves to): None when it could, else `listen_words`."""
    try:
        addresses = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as exc:
        return f"cannot listen on {host}:{port}: {exc}; check --host or GPUBADGE_HOST"
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                if exc.errno in LISTEN_ERRNOS:
                    return listen_words(host, port, exc)
                raise
    return None


FD_RESERVE = 1024  # descriptors kept for everything but long polls: other clients, the store, files


def _raise_fd_limit(long_poll_max: int) -> None:
    """Take the hard open-file limit as this process's own (each held long poll is a socket), and
    say so when `long_poll_max` does not fit in it beside FD_RESERVE for everything else."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
    if long_poll_max + FD_RESERVE > soft:
        logging.warning(
            "GPUBADGE_LONG_POLL_MAX=%d and %d other descriptors exceed the open-file limit (%d):"
            " past it, new connections fail; lower the setting or raise the limit",
            long_poll_max,
            FD_RESERVE,
            soft,
        )


FOLLOW_POLL_SECONDS = 1.0  # how often `rescan-outdated --follow` looks at the queue while it waits


def _rescan_outdated(backend: StoreBackend, settings: ServiceSettings, limit: int, follow: bool) -> int:
    import time

    from jobs.outdated_reports import queue_outdated_scans
    from scanner.models import ANALYSIS_VERSION

    def wait_for_room(drained: Callable[[], bool]) -> None:
        print(f"{limit:,} scans waiting; going on once the queue has drained to {limit // 2:,}", flush=True)
        while not drained():
            time.sleep(FOLLOW_POLL_SECONDS)

    found = queue_outdated_scans(
        backend,
        limit=limit,
        max_queued=settings.max_queued_scans,
        max_attempts=settings.max_attempts,
        wait_for_room=wait_for_room if follow and limit > 0 else None,
    )
    print(
        f"{found.reports:,} stored images read; {found.outdated:,} read by an analysis older than this"
        f" one ({ANALYSIS_VERSION}): {found.queued:,} scans queued now, {found.waiting:,} already waiting"
    )
    if found.left:
        print(
            f"{found.left:,} not queued (past --limit {limit:,} or the queue's cap of"
            f" {settings.max_queued_scans:,}): run it again once the queue has drained, or with --follow"
        )
    return 0


def run_db(argv: list[str]) -> int:
    """`gpubadge db upgrade | status | rescan-outdated`: the schema of whichever store the settings
    select, and the scans that bring its reports up to this version's analysis."""
    args = db_parser().parse_args(argv)
    # the migrations' progress is `upgrade`'s and `status`'s output; the sweep prints its own counts
    logging.basicConfig(level="WARNING" if args.action == "rescan-outdated" else "INFO", format="%(message)s")
    try:
        settings = load_settings(args.config, db=args.db)
    except (ValueError, OSError) as exc:
        print(f"gpubadge db: invalid settings: {exc}", file=sys.stderr)
        return 2
    if settings.database_url is None and args.db is None:
        # GPUBADGE_DB alone does not count: the image sets it, so an init job that forgot its database
        # would otherwise migrate a throwaway file inside its container and report success.
        print(
            f"gpubadge db {args.action}: no database named: set GPUBADGE_DATABASE_URL (PostgreSQL),"
            " or pass --db FILE to use a SQLite file",
            file=sys.stderr,
        )
        return 2
    from store import StoreUnavailable, open_backend
    from store.migrations import migrations

    engine = "postgres" if settings.database_url else "sqlite"
    where = "PostgreSQL" if settings.database_url else str(settings.db)
    if args.action == "status" and engine == "sqlite" and not settings.db.exists():
        print(f"{where}: no database yet; every migration is pending", file=sys.stderr)
        for migration in migrations(engine):
            print(f"{migration.version:04d} {migration.name:<24} pending")
        return 0
    if args.action == "rescan-outdated" and engine == "sqlite" and not settings.db.exists():
        print(f"{where}: no database yet; nothing to scan again")
        return 0
    try:
        backend = open_backend(
            settings.db,
            busy_timeout=settings.sqlite_busy_timeout,
            threads=1,
            database_url=settings.database_url.get_secret_value() if settings.database_url else None,
            # the sweep reads and queues as the service does, which migrates at every start too
            upgrade=args.action in ("upgrade", "rescan-outdated"),
        )
    except StoreUnavailable as exc:
        print(f"gpubadge db: {exc}", file=sys.stderr)
        return 1
    try:
        if args.action == "rescan-outdated":
            try:
                return _rescan_outdated(backend, settings, args.limit, args.follow)
            except StoreUnavailable as exc:
                print(f"gpubadge db: {exc}", file=sys.stderr)
                return 1
        current = backend.schema_version()
    finally:
        backend.close()
    if args.action == "upgrade":
        print(f"{where}: schema at version {current}")
        return 0
    for migration in migrations(engine):
        mark = "applied" if migration.version <= current else "pending"
        print(f"{migration.version:04d} {migration.name:<24} {mark}")
    return 0
