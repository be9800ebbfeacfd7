"""What a statement costs in rows of a table, read from the engine's own plan: the plan-shape checks of
the store's tests, on either backend."""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from store.dialect import Db
from store.sqlite import SqliteStore

_NAMED = re.compile(r"%\((\w+)\)s")


@contextmanager
def recorded_statements(wanted: Callable[[str], bool]) -> Iterator[list[tuple[str, dict[str, Any]]]]:
    """The statements the store runs meanwhile (`Db.execute`, in any thread) whose SQL, as a query writes
    it, `wanted` picks: each as its engine receives it, translated, with its parameters (the clock's too),
    ready for `rows_read`."""
    statements: list[tuple[str, dict[str, Any]]] = []
    execute = Db.execute

    def recording(self: Db, sql: str, params: Any = None) -> Any:
        if wanted(sql):
            statements.append((self.dialect.translate(sql), self._params(params or {})))
        return execute(self, sql, params)

    Db.execute = recording  # type: ignore[method-assign]
    try:
        yield statements
    finally:
        Db.execute = execute  # type: ignore[method-assign]


@contextmanager
def engine_statements(backend: Any) -> Iterator[list[tuple[str, Any]]]:
    """Every statement `backend`'s writes send to the engine meanwhile, however the store words them
    (`Db` or the driver's own `execute`): on SQLite the writer's statements with their values bound
    (its trace), on PostgreSQL each `execute` of any pooled connection with its parameters; each
    ready for `rows_read`."""
    statements: list[tuple[str, Any]] = []
    if isinstance(backend, SqliteStore):
        writer = backend._writer
        writer.set_trace_callback(lambda sql: statements.append((sql, {})))
        try:
            yield statements
        finally:
            writer.set_trace_callback(None)
        return
    import psycopg

    execute = psycopg.Connection.execute

    def recording(self: Any, query: Any, params: Any = None, **kwargs: Any) -> Any:
        if isinstance(query, str):
            statements.append((query, params))
        return execute(self, query, params, **kwargs)

    psycopg.Connection.execute = recording  # type: ignore[method-assign]
    try:
        yield statements
    finally:
        psycopg.Connection.execute = execute  # type: ignore[method-assign]


def rows_read(
    backend: Any,
    sql: str,
    params: dict[str, Any] | Sequence[Any] | None = None,
    *,
    table: str = "jobs",
    generic: bool = False,
) -> int | str:
    """On SQLite, `sql`'s plan, one step after another (" | "), which a test reads for its searches and
    scans (SQLite keeps no statistics to count rows by). On PostgreSQL, the rows of `table` it actually
    read, found and filtered, over every plan node. `generic`: the plan a prepared statement settles on
    from its sixth run, which knows its parameters' types but not their values, after statistics are
    gathered (as autovacuum would have); `sql` is then in psycopg's `%(name)s` style."""
    params = params if params is not None else {}
    if isinstance(backend, SqliteStore):
        with sqlite3.connect(backend.path) as peer:
            return " | ".join(str(row[3]) for row in peer.execute(f"EXPLAIN QUERY PLAN {sql}", params))
    import psycopg
    from psycopg.sql import Literal

    with psycopg.connect(backend._url, autocommit=True) as peer:
        if generic:
            assert isinstance(params, dict), "a generic plan is asked with named parameters"
            names = list(dict.fromkeys(_NAMED.findall(sql)))
            numbered = _NAMED.sub(lambda match: f"${names.index(match[1]) + 1}", sql)
            peer.execute(f"ANALYZE {table}")
            peer.execute("SET plan_cache_mode = force_generic_plan")
            peer.execute(f"PREPARE statement AS {numbered}")
            values = ", ".join(Literal(params[name]).as_string(peer) for name in names)
            arguments = f"({values})" if names else ""
            found = peer.execute(f"EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE statement{arguments}").fetchone()
        else:
            found = peer.execute(f"EXPLAIN (ANALYZE, FORMAT JSON) {sql}", params).fetchone()
    assert found is not None
    read, pending = 0, [found[0][0]["Plan"]]
    while pending:
        node = pending.pop()
        pending.extend(node.get("Plans", []))
        if node.get("Relation Name") == table:
            read += int(node["Actual Rows"]) * int(node.get("Actual Loops", 1))
            read += int(node.get("Rows Removed by Filter", 0))
            read += int(node.get("Rows Removed by Index Recheck", 0))
    return read
