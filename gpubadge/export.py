"""`gpubadge export sqlite OUT`: every stored report as a SQLite file to query and open in Datasette.

Reads whichever store is configured (`--db`'s SQLite file, else `GPUBADGE_DATABASE_URL`'s
PostgreSQL, else `GPUBADGE_DB`), never changing it, and says which; the fleet is the service's:
the servers of its inventory file (`--inventory`, else `GPUBADGE_INVENTORY_FILE`) with the
agents' over them. It writes `OUT` plus
`<OUT's name>.metadata.json` beside it (see `store.export`). A progress bar shows on a
terminal; the last lines say what was written and how to explore it. Exit status: 0 written,
1 a failure (one clear line; `OUT` unchanged), 2 usage errors.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path

from gpubadge.progress import Bar

_DURATION = re.compile(r"^(\d+)([smhdw])$")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}


def parse_since(text: str) -> datetime:
    """An ISO 8601 time (UTC unless it names a zone), or an age such as `90m`, `24h`, `7d`."""
    match = _DURATION.match(text.strip())
    if match:
        return datetime.now(UTC) - timedelta(**{_UNITS[match.group(2)]: int(match.group(1))})
    try:
        moment = datetime.fromisoformat(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a time: {text!r} (ISO 8601 such as 2026-11-24T18:00:00Z, or an age such as 24h or 7d)"
        ) from None
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def _batch(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 1 <= value <= 100_000:
        raise argparse.ArgumentTypeError("must be between 1 and 100000")
    return value


def build_parser() -> argparse.ArgumentParser:
    from gpubadge.stores import default_db
    from scanner.settings import sqlite_file_argument

    parser = argparse.ArgumentParser(
        prog="gpubadge export", description="Export every stored report for SQL and Datasette."
    )
    formats = parser.add_subparsers(dest="format", required=True, metavar="FORMAT")
    sqlite = formats.add_parser(
        "sqlite",
        help="a SQLite file (sqlite-utils) with a Datasette metadata file beside it",
        description="Write (or update) OUT; then: datasette OUT -m <OUT name>.metadata.json",
    )
    sqlite.add_argument("out", type=Path, metavar="OUT", help="the SQLite file to write or update")
    sqlite.add_argument(
        "--db",
        type=sqlite_file_argument,
        default=None,
        help=f"SQLite store (default $GPUBADGE_DATABASE_URL's PostgreSQL, else $GPUBADGE_DB or {default_db()})",
    )
    sqlite.add_argument(
        "--inventory",
        type=Path,
        default=None,
        help="the service's inventory file, whose servers join the agents' (default $GPUBADGE_INVENTORY_FILE)",
    )
    sqlite.add_argument(
        "--since",
        type=parse_since,
        default=None,
        help="only reports scanned after this time (ISO 8601, or an age: 90m, 24h, 7d)",
    )
    sqlite.add_argument(
        "--batch-size",
        type=_batch,
        default=500,
        help="reports read and written per transaction (default 500)",
    )
    return parser


def main(argv: Sequence[str]) -> int:
    from gpubadge.stores import describe_store, store_location
    from store import StoreUnavailable, open_backend, queries
    from store.export import ExportError, export_sqlite, metadata_path

    try:
        args = build_parser().parse_args(list(argv))
    except SystemExit as exc:
        return int(exc.code or 0)
    try:
        db_path, database_url = store_location(args.db)
    except ValueError as exc:
        print(f"gpubadge export: invalid settings: {exc}", file=sys.stderr)
        return 2
    if database_url is None and not db_path.is_file():
        print(f"gpubadge export: no store at {db_path} (scan something first, or pass --db)", file=sys.stderr)
        return 1
    inventory_file = args.inventory or (
        Path(env) if (env := os.environ.get("GPUBADGE_INVENTORY_FILE")) else None
    )
    try:
        inventory = _inventory(inventory_file) if inventory_file else []
    except ValueError as exc:
        print(f"gpubadge export: {exc}", file=sys.stderr)
        return 1
    store_words = describe_store(db_path, database_url)
    try:
        backend = open_backend(db_path, database_url=database_url, threads=1, upgrade=False)
    except StoreUnavailable as exc:
        print(f"gpubadge export: {store_words}: {exc}", file=sys.stderr)
        return 1
    try:
        bar = Bar(None, sys.stderr)
        if bar.enabled and args.since is None:
            bar.total = backend.run(queries.list_images, limit=1)[
                1
            ]  # exact on SQLite, an estimate on PostgreSQL
        summary = export_sqlite(
            backend,
            args.out,
            since=args.since,
            batch_size=args.batch_size,
            progress=bar,
            source="postgresql" if database_url else f"sqlite:{db_path}",
            inventory=inventory,
        )
        bar.finish()
    except (ExportError, StoreUnavailable) as exc:
        print(f"\ngpubadge export: {exc}" if bar.enabled else f"gpubadge export: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"\ngpubadge export: interrupted; {args.out} is unchanged", file=sys.stderr)
        return 130
    finally:
        backend.close()
    print(f"read {store_words}" + (f" and the inventory {inventory_file}" if inventory_file else ""))
    print(summary.describe())
    if not summary.gpus and inventory_file is None:
        print(
            "no server GPU rows: the store holds no agent's servers; a service whose fleet is a file"
            " (GPUBADGE_INVENTORY_FILE, as the demo's) keeps it there: pass --inventory FILE"
        )
    print(f"explore it: datasette {args.out} -m {metadata_path(args.out)}")
    return 0


def _inventory(path: Path) -> list[str]:
    """The servers of an inventory file, each as its JSON document; ValueError naming the file."""
    from gpubadge.files import load_inventory

    return [server.model_dump_json() for server in load_inventory(path).servers]
