"""`gpubadge scan | serve | worker | config | db | eligible | constraints | agent | referrers | compat | export |
healthcheck`.

A thin dispatcher: each command parses its own options and imports its package lazily, so
`gpubadge scan` never loads the web service or the exporters, and loads placement's answer
(`placement.image_needs`) only once it prints a scanned platform; the agent never loads web/ at all. Exit status: 0 success, 1 a failure (one clear line each), 2 usage errors
(naming the option), 141 when the reader of the output went away (`| head`), as git's;
`eligible` also uses 3 for "no server can run it".
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from scanner.models import ImageReport, Platform
    from store import AsyncStore
    from store.batch_cache import BatchScanCache

# 128 + SIGPIPE: what a shell reports for `git log | head`'s git, killed by the closed pipe
EXIT_READER_GONE = 141

COMMANDS = (
    ("scan", "scan image references"),
    ("serve", "run the service (webhooks, API, UI)"),
    ("worker", "run scan workers only (scale them apart from the API)"),
    ("config", "print the effective settings and where each comes from (secrets redacted)"),
    ("db", "manage the store's schema (db upgrade, db status)"),
    ("eligible", "list the servers that can run an image"),
    ("constraints", "export an image's eligibility as Kubernetes, DRA, Nomad or Akash constraints"),
    ("agent", "run the node agent"),
    ("fleet", "release GPUs and remove servers from a service's fleet (fleet-wide agent token)"),
    ("referrers", "list the gpubadge reports and NFD artifacts attached to an image as OCI referrers"),
    ("compat", "check nodes against an image's NFD image-compatibility artifact"),
    ("healthcheck", "probe this container's gpubadge role on its port (the image's HEALTHCHECK)"),
    ("export", "export every stored report as a SQLite file for SQL and Datasette"),
)


def _platform(text: str) -> Platform:
    from scanner.models import Platform

    try:
        return Platform.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def version() -> str:
    """The installed package's version (its metadata), else the one pyproject.toml names."""
    from importlib import metadata

    try:
        return metadata.version("gpubadge")
    except metadata.PackageNotFoundError:  # run from a checkout that is not installed
        text = (Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()
        found = next(
            (line for line in text.splitlines() if line.startswith("version = ")), 'version = "unknown"'
        )
        return found.split("=", 1)[1].strip().strip('"')


def build_parser(*, require_command: bool = True) -> argparse.ArgumentParser:
    """The top-level parser: `gpubadge --help` lists the commands; each command parses its own options."""
    parser = argparse.ArgumentParser(
        prog="gpubadge", description="Which container images need an NVIDIA GPU, and where they can run."
    )
    parser.add_argument("--version", action="version", version=f"gpubadge {version()}")
    commands = parser.add_subparsers(dest="command", required=require_command, metavar="COMMAND")
    for name, help_text in COMMANDS:
        sub = commands.add_parser(name, help=help_text, add_help=False)
        sub.add_argument("rest", nargs=argparse.REMAINDER)
    return parser


def scan_parser() -> argparse.ArgumentParser:
    from gpubadge.stores import default_db
    from scanner.settings import sqlite_file_argument

    scan = argparse.ArgumentParser(
        prog="gpubadge scan",
        description="Scan image references. The table and the --json lines both come in the order the"
        " references were given; each --json line is printed as soon as its report and every one before"
        " it are stored.",
    )
    scan.add_argument(
        "references", nargs="+", metavar="REF", help="e.g. alpine, ghcr.io/org/app:1.2, repo@sha256:…"
    )
    scan.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object per reference, one per line, in input order",
    )
    scan.add_argument("--platform", type=_platform, help="scan only this platform (os/arch[/variant])")
    scan.add_argument(
        "--config-only", action="store_true", help="read manifests and configs, skip the layers"
    )
    scan.add_argument(
        "--concurrency", type=_positive, default=8, help="references scanned at once (default 8)"
    )
    scan.add_argument(
        "--db",
        type=sqlite_file_argument,
        default=None,
        help=f"SQLite store (default $GPUBADGE_DATABASE_URL's PostgreSQL, else $GPUBADGE_DB or {default_db()})",
    )
    scan.add_argument("--no-store", action="store_true", help="do not read or write the store")
    scan.add_argument("--config", type=Path, default=None, help="settings file (TOML or YAML)")
    return scan


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list and args_list[0] in dict(COMMANDS):
        return _delegate(args_list[0], args_list[1:])
    try:
        # --help, --version, or a usage error: an unknown option (named, as git names it, before the
        # missing command is mentioned), no command, or an unknown one.
        lenient = build_parser(require_command=False)
        _, unknown = lenient.parse_known_args(args_list)
        if unknown:
            lenient.error(f"unrecognized arguments: {' '.join(unknown)}")
        build_parser().parse_args(args_list)
    except SystemExit as exc:
        return int(exc.code or 0)
    return 2


# Commands that talk to registries or a service as clients: aiohttp imported without reading the
# trust store, read at their first TLS handshake instead (scanner/registry/tls.py). The service's
# roles import it the ordinary way.
CLIENT_COMMANDS = frozenset({"scan", "eligible", "constraints", "referrers", "compat", "fleet"})


# The commands that load the service's settings name each GPUBADGE_ variable that no role reads, once,
# at start. `scan`, `worker` and `agent` load no web module (start-up cost; the agent reaches the
# service over HTTP only), so they do not know the service's settings: the API beside them, fed the
# same variables, names them, and so does `gpubadge config`.
SETTINGS_COMMANDS = frozenset({"serve", "config", "db"})


def _warn_unknown_settings(command: str) -> None:
    if command not in SETTINGS_COMMANDS:
        return
    from web.settings import unknown_settings

    for sentence in unknown_settings(os.environ):
        print(f"gpubadge {command}: warning: {sentence}", file=sys.stderr)


def _delegate(command: str, rest: list[str]) -> int:
    _warn_unknown_settings(command)
    if command in CLIENT_COMMANDS:
        from scanner.registry.tls import import_aiohttp

        import_aiohttp()
    if command == "scan":
        # Start-up allocates much and frees little: the collector's 97 passes over it cost 25-30 ms
        # of a scan's CPU. Off until `run_scan` freezes what was imported; on again for the scan.
        gc.disable()
        try:
            args = scan_parser().parse_args(rest)
            return run_scan(args)
        except SystemExit as exc:
            return int(exc.code or 0)
        finally:
            gc.enable()
    if command == "serve":
        from web.commands import run_serve

        return run_serve(rest)
    if command == "worker":
        from gpubadge.worker import run_worker

        return run_worker(rest)
    if command == "config":
        from gpubadge.config import main as run_config

        return run_config(rest)
    if command == "db":
        from web.commands import run_db

        return run_db(rest)
    if command == "eligible":
        from gpubadge.eligible import main as run_eligible

        return run_eligible(rest)
    if command == "referrers":
        from gpubadge.list_referrers import main as run_referrers

        return run_referrers(rest)
    if command == "compat":
        from gpubadge.compat import main as run_compat

        return run_compat(rest)
    if command == "export":
        from gpubadge.export import main as run_export

        return run_export(rest)
    if command == "constraints":
        from gpubadge.constraints import main as run_constraints

        return run_constraints(rest)
    if command == "fleet":
        from gpubadge.fleet import main as run_fleet

        return run_fleet(rest)
    if command == "healthcheck":
        from gpubadge.healthcheck import main as run_healthcheck

        return run_healthcheck(rest)
    from agent.main import run_agent

    return run_agent(rest)


class Output:
    """Standard output for a command whose reader may go away (`| head`, a closed pager).

    `write` and `flush` never raise for a closed pipe: the first failure calls `on_gone` (a scan
    stops scanning, still storing what it scanned) and later writes are dropped."""

    def __init__(self, stream: TextIO, on_gone: Callable[[], object] | None = None) -> None:
        self.stream, self.on_gone, self.gone = stream, on_gone, False

    def write(self, text: str) -> None:
        if not self.gone:
            try:
                self.stream.write(text)
            except BrokenPipeError:
                self._went_away()

    def flush(self) -> None:
        if not self.gone:
            try:
                self.stream.flush()
            except BrokenPipeError:
                self._went_away()

    def _went_away(self) -> None:
        self.gone = True
        silence_stdout()
        if self.on_gone is not None:
            self.on_gone()


def silence_stdout() -> None:
    """Point standard output at /dev/null: what is still buffered, and the interpreter's last
    flush, go nowhere instead of raising BrokenPipeError once more."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    finally:
        os.close(devnull)


def run_scan(args: argparse.Namespace) -> int:
    from gpubadge.progress import Bar
    from scanner.registry.client import RegistryClient
    from scanner.scan import Scanner, ScanOptions, scan_many
    from scanner.settings import ScannerSettings

    try:
        settings = ScannerSettings.load(args.config)
    except (ValueError, OSError) as exc:  # as serve and worker: an ambiguous merge is refused
        print(f"gpubadge scan: invalid settings: {exc}", file=sys.stderr)
        return 2
    store: AsyncStore | None = None
    if not args.no_store:
        from gpubadge.stores import store_location
        from store import StoreUnavailable, open_store

        try:
            db_path, database_url = store_location(args.db)
        except ValueError as exc:
            print(f"gpubadge scan: invalid settings: {exc}", file=sys.stderr)
            return 2
        try:
            store = open_store(db_path, database_url=database_url)
        except StoreUnavailable as exc:
            print(f"gpubadge scan: {exc} (or pass --no-store)", file=sys.stderr)
            return 1
    options = ScanOptions(platform=args.platform, config_only=args.config_only)
    # a bar only for batches long enough to wait on, and never over --json's lines
    progress = Bar(len(args.references), sys.stderr) if not args.json and len(args.references) >= 4 else None
    out = Output(sys.stdout)
    flush_scheduled = False
    ready: dict[int, ImageReport] = {}  # --json: reports done before an earlier one, by position
    next_line = 0

    def flush_stdout() -> None:
        nonlocal flush_scheduled
        flush_scheduled = False
        out.flush()

    def emit(position: int, report: ImageReport) -> None:
        """Print the report's line once every earlier reference's line is printed (input order);
        the lines printed in one turn of the loop (a committed batch) reach the pipe in one write,
        before the loop waits for anything else."""
        nonlocal flush_scheduled, next_line
        if progress:
            progress.step()
        if not args.json:
            return
        ready[position] = report
        while next_line in ready:
            out.write(json_line(ready.pop(next_line)) + "\n")
            next_line += 1
        if not flush_scheduled:
            flush_scheduled = True
            asyncio.get_running_loop().call_soon(flush_stdout)

    def emit_stored(position: int, report: ImageReport, error: BaseException | None) -> None:
        if error is not None and report.error is None:  # a failed scan is never stored anyway
            print(f"gpubadge: {report.reference}: not stored: {error}", file=sys.stderr)
        emit(position, report)

    store_failures: list[BaseException] = []

    async def run() -> list[ImageReport]:
        cache: BatchScanCache | None = None
        if store is not None:
            from store.batch_cache import BatchScanCache

            cache = BatchScanCache(store)
        try:
            async with RegistryClient(settings) as client:
                scanner = Scanner(client, cache, settings)
                if cache is not None:  # what the tags and the store held, read once for the whole list
                    await cache.preload(args.references)

                def done(position: int, report: ImageReport) -> None:
                    if cache is None:
                        emit(position, report)
                    else:  # printed once stored: what the user saw is in the store
                        cache.when_committed(functools.partial(emit_stored, position, report))

                scanning = asyncio.ensure_future(
                    scan_many(scanner, args.references, options, args.concurrency, done)
                )
                out.on_gone = scanning.cancel  # the reader left: scan no more; what was scanned is stored
                try:
                    return await scanning
                except asyncio.CancelledError:
                    if not out.gone:
                        raise
                    return []
                finally:
                    await scanner.close()
                    if cache is not None and (failure := await cache.close()) is not None:
                        store_failures.append(failure)
        finally:
            if store is not None:
                await store.close()

    # What is imported by now (modules, pydantic schemas) lives as long as the process. Frozen out of
    # the collector's reach, it is not walked again by the full collection a scan of a list triggers
    # (`serve` freezes at start too). 500-image config-only scan: collector time 66-70 ms -> 34-38 ms.
    # The few cycles start-up left behind (about 2,000 objects) are frozen with it, not collected:
    # one full collection of the start-up heap costs more (about 35 ms) than they weigh.
    gc.freeze()
    gc.enable()
    try:
        reports = asyncio.run(run())
    except KeyboardInterrupt:
        return 130
    if progress:
        progress.finish()
    if out.gone:
        return EXIT_READER_GONE
    if not args.json:
        print_table(reports, out)
        out.flush()
        if out.gone:
            return EXIT_READER_GONE
    failures = len(store_failures)  # a commit that failed: its reports said so
    for report in reports:
        # A platform's error (its layers could not be read) is a failure too; its facts still print.
        problems = (
            [report.error]
            if report.error
            else [f"{p.platform}: {p.error}" for p in report.platforms if p.error]
        )
        for problem in problems:
            print(f"gpubadge: {report.reference}: {problem}", file=sys.stderr)
        failures += bool(problems)
    return 1 if failures else 0


def json_line(report: ImageReport) -> str:
    """One `--json` line: the report, and for a scanned image `needs`, placement's answer to "does it
    need a GPU?" (placement.image_needs: gpu, carried CUDA, driver floor), as the API's by-ref has it."""
    line = report.model_dump_json()
    if report.error is not None:
        return line
    from placement.image_needs import image_needs

    return f'{line[:-1]},"needs":{image_needs(report).model_dump_json()}}}'


def cuda_cell(declared: str | None, carried: str | None) -> str:
    """The CUDA column: what the image declares, and what its layers carry where that differs."""
    if carried and carried != declared and not (declared or "").startswith(f"{carried}."):
        return f"{declared} (carries {carried})" if declared else f"{carried} (carried)"
    return declared or carried or "-"


def print_table(reports: Sequence[ImageReport], out: TextIO | Output) -> None:
    """A readable table: one row per platform, failures marked plainly. GPU, CUDA and DRIVER are
    placement's answer in its one vocabulary (placement.image_needs): `required` (declares an NVIDIA
    GPU), `optional` (carries CUDA, declares none: runs on a CPU too) or `none`; the CUDA declared
    and carried; the lowest driver that runs it on any GPU brand (`+ brands`: older drivers on some)."""
    from scanner.facts.badges import libc_label

    header = ("REFERENCE", "PLATFORM", "GPU", "CUDA", "DRIVER", "LIBC", "DISTRO", "BADGES")
    rows: list[tuple[str, ...]] = []
    for report in reports:
        if report.error:
            rows.append((report.reference, "-", "-", "-", "-", "-", "-", f"error: {report.error}"))
            continue
        for platform in report.platforms:
            from placement.image_needs import platform_needs  # only once a scanned platform is printed

            needs = platform_needs(platform)
            driver = "-"
            if needs.driver is not None:
                driver = f">={needs.driver.floor}" if needs.driver.floor else "any"
                if not needs.driver.runs:
                    driver = "none runs it"
                elif needs.driver.exceptions:
                    driver += " + brands"
            rows.append(
                (
                    report.reference,
                    platform.platform,
                    needs.gpu,
                    cuda_cell(needs.declared_cuda, needs.carried_cuda),
                    driver,
                    libc_label(platform.libc).replace("_", " "),
                    platform.libc.distro or "-",
                    " ".join(platform.badges),
                )
            )
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header) - 1)]
    for row in [header, *rows]:
        cells = [cell.ljust(widths[i]) for i, cell in enumerate(row[:-1])]
        out.write("  ".join([*cells, row[-1]]).rstrip() + "\n")


def console() -> None:
    """The `gpubadge` program: `main`, then, after `scan`, an exit without the interpreter's teardown.

    By the time `main` returns, a scan has closed its store, its registry sessions and its
    analysis processes; its output is flushed here. Tearing down the interpreter's modules and
    objects after that changes nothing on disk or on screen, and costs a `gpubadge scan` process
    about 60 ms of CPU (measured: 0.43 s against 0.36 s for a three-image scan). Other commands
    exit the ordinary way. A reader that went away (`gpubadge config | head -1`) ends any command
    quietly with status 141, as it ends git: no traceback.
    """
    try:
        status = main()
        sys.stdout.flush()
    except BrokenPipeError:
        silence_stdout()
        status = EXIT_READER_GONE
    if sys.argv[1:2] == ["scan"]:
        try:
            sys.stderr.flush()
        finally:
            os._exit(status)
    raise SystemExit(status)


if __name__ == "__main__":
    console()
