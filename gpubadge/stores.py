"""Which store a command reads and writes: shared by `gpubadge scan` and `gpubadge export`.

`--db` when given; else the service's PostgreSQL when GPUBADGE_DATABASE_URL is set (reports land
where the service reads them, and no SQLite file is written); else the SQLite file at GPUBADGE_DB,
by default `scanner.settings.default_db_path()`, the same file `gpubadge serve` and `gpubadge
config` use.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlsplit


def default_db() -> Path:
    """The SQLite store when neither `--db` nor GPUBADGE_DB says otherwise."""
    from scanner.settings import default_db_path

    return default_db_path()


def store_location(db: Path | None) -> tuple[Path, str | None]:
    """The store a command uses: (SQLite path, PostgreSQL URL or None); see the module. ValueError
    when GPUBADGE_DB holds a URL (`--db` is refused so by its argparse type)."""
    from scanner.settings import sqlite_file_problem

    if db is not None:
        return db, None
    env_db = os.environ.get("GPUBADGE_DB")
    if env_db and (problem := sqlite_file_problem(env_db)) is not None:
        raise ValueError(f"GPUBADGE_DB: {problem}")
    return Path(env_db) if env_db else default_db(), os.environ.get("GPUBADGE_DATABASE_URL") or None


def describe_store(db_path: Path, database_url: str | None) -> str:
    """The store in words, for messages: the PostgreSQL host and database (never its credentials),
    or the SQLite file's absolute path."""
    if database_url:
        parts = urlsplit(database_url)
        host = parts.hostname or "localhost"
        port = f":{parts.port}" if parts.port else ""
        return f"PostgreSQL {host}{port}{parts.path or ''} (GPUBADGE_DATABASE_URL)"
    return f"SQLite {db_path.absolute()}"
