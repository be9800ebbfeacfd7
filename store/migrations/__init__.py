"""Versioned schema migrations, one numbered SQL file per step and engine.

`store/migrations/<engine>/NNNN_name.sql` brings a database from the version before it to
NNNN. Both engines share the numbering, so version N means the same logical schema
on SQLite and on PostgreSQL. Each database records what it has applied in a small
`schema_migrations` table; `apply_pending` (the one migration loop, for both engines)
applies the rest inside the backend's transaction at start (and `gpubadge db upgrade` on
demand), so a failed step leaves the database at the version before it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Literal

from store.dialect import POSTGRES, SQLITE, Connectionish, Db

Engine = Literal["sqlite", "postgres"]
_FILE_NAME = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")
# The record of applied migrations; only the column type of its time differs per engine.
_RECORD_TABLE = {
    "sqlite": "CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER PRIMARY KEY,"
    " name TEXT NOT NULL, applied_at TEXT NOT NULL)",
    "postgres": "CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER PRIMARY KEY,"
    " name TEXT NOT NULL, applied_at TIMESTAMPTZ NOT NULL DEFAULT now())",
}


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str

    def statements(self) -> list[str]:
        """The script split into statements (SQLite's executescript would commit mid-transaction).

        A dollar-quoted block (PostgreSQL's `DO $$ ... $$`) is one statement, semicolons and all,
        and so is a SQLite trigger, from `CREATE TRIGGER` to the `END` of its body.
        """
        lines = [line for line in self.sql.splitlines() if not line.lstrip().startswith("--")]
        text = "\n".join(lines)
        statements: list[str] = []
        for number, part in enumerate(text.split("$$")):
            if number % 2:  # inside $$ ... $$: glue to the statement being built
                statements[-1] += f"$${part}$$"
                continue
            pieces = part.split(";")
            if statements and not statements[-1].rstrip().endswith(";") and number:
                statements[-1] += pieces.pop(0)
            statements.extend(pieces)
        whole: list[str] = []
        for statement in (statement.strip() for statement in statements):
            if statement and whole and _open_trigger(whole[-1]):
                whole[-1] += f";\n{statement}"  # SQLite's trigger body: statements up to its END
            elif statement:
                whole.append(statement)
        return whole


def _open_trigger(statement: str) -> bool:
    """A SQLite `CREATE TRIGGER ... BEGIN` whose body's `END` is still to come."""
    words = statement.upper().split()
    return words[:2] == ["CREATE", "TRIGGER"] and "BEGIN" in words and words[-1] != "END"


@cache
def migrations(engine: Engine) -> tuple[Migration, ...]:
    """Every migration for `engine`, in order; the numbering must run 1, 2, 3… without gaps."""
    found: list[Migration] = []
    for entry in resources.files(__package__).joinpath(engine).iterdir():
        match = _FILE_NAME.match(entry.name)
        if match:
            found.append(Migration(int(match[1]), match[2], entry.read_text(encoding="utf-8")))
    found.sort(key=lambda migration: migration.version)
    numbers = [migration.version for migration in found]
    # Ascending from 1, each number once. A gap is allowed: branches developed side by side are
    # each given their numbers up front, so one may hold 10 before 8 and 9 are merged; a database
    # applies whatever it has not recorded, in order, whenever the missing ones arrive.
    if not numbers or numbers[0] != 1 or len(set(numbers)) != len(numbers):
        raise RuntimeError(f"{engine} migrations must start at 1 and use each number once: {numbers}")
    return tuple(found)


def latest_version(engine: Engine) -> int:
    """The highest version of `engine`'s migrations: a database at it lacks none of them."""
    return migrations(engine)[-1].version


def apply_pending(conn: Connectionish, engine: Engine, *, legacy: int | None = None) -> list[Migration]:
    """Bring the database on `conn` to the latest version, inside the caller's transaction.

    Creates `schema_migrations` if missing, runs every migration it does not record, in order,
    statement by statement (never through a parameter translation: the scripts are SQL as written),
    and records each with the store's clock. `legacy` (SQLite's `PRAGMA user_version` of a file
    versioned before the table existed) counts that many first migrations as applied when the
    table records none; they are recorded, not run. Returns the migrations run.
    """
    db = Db(conn, SQLITE if engine == "sqlite" else POSTGRES)
    db.execute(_RECORD_TABLE[engine])
    recorded = {row[0] for row in db.all("SELECT version FROM schema_migrations")}
    applied = set(range(1, legacy + 1)) if legacy is not None and not recorded else recorded
    ran: list[Migration] = []
    for migration in migrations(engine):
        if migration.version not in applied:
            for statement in migration.statements():
                conn.execute(statement)
            ran.append(migration)
        if migration.version not in recorded:
            db.execute(
                "INSERT INTO schema_migrations (version, name, applied_at) VALUES (:version, :name, :now)",
                {"version": migration.version, "name": migration.name},
            )
    return ran
