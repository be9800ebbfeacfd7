"""One query, written once for both engines: every stored report, a page at a time.

`report_page` is what an export of the whole store runs (`store.export`): keyset pages in
digest order, so each page is a range scan of the primary key whatever the store's size, and
reports saved while an export runs never shift a page (an offset would skip or repeat them).
The backends differ only in their placeholder mark and the form of `since` (ISO text in
SQLite, where `scanned_at` is that text; a datetime in PostgreSQL's timestamptz).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from scanner.models import ImageReport


class _Connection(Protocol):
    """What a sqlite3 and a psycopg connection both offer: `execute(sql, params)` -> a cursor."""

    def execute(self, sql: str, params: Sequence[Any], /) -> Any: ...


def report_page(
    conn: _Connection, mark: str, *, after: str, since: object | None, limit: int
) -> list[ImageReport]:
    """Up to `limit` reports with a digest above `after`, in digest order; with `since`, only
    those scanned after it. `mark` is the engine's placeholder (`?` or `%s`)."""
    where = f"digest > {mark}"
    params: list[object] = [after]
    if since is not None:
        where += f" AND scanned_at > {mark}"
        params.append(since)
    rows = conn.execute(
        f"SELECT report FROM reports WHERE {where} ORDER BY digest LIMIT {mark}", [*params, limit]
    ).fetchall()
    return [ImageReport.model_validate_json(row[0]) for row in rows]
