"""What differs between the two engines for the queries written once in `store.queries`.

The shared queries are written in one neutral SQL: named parameters (`:name`), standard
`INSERT ... ON CONFLICT (key) DO UPDATE` upserts (both engines take them), and a magic `:now`
parameter for "the store's clock". A `Dialect` turns that text into its engine's (once per
distinct text: the translation is cached, so a statement is prepared once), and supplies the
few expressions that cannot be written once: list columns (a JSON array in SQLite, `text[]` in
PostgreSQL), membership and JSON tests, text search, aggregation into a list, timestamps, and
the NOTIFY that tells other replicas of a commit.

`Db` is one connection inside one transaction (or one read), as a query function sees it.
`Query` marks a function of a `Db` as a read or a write, so a backend's `run` knows which
connection and which transaction it needs.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, Concatenate, Generic, ParamSpec, Protocol, TypeVar

P = ParamSpec("P")
T = TypeVar("T")
R = TypeVar("R", covariant=True)  # a query of a dict is a query of a Mapping

Params = Mapping[str, Any]
Row = tuple[Any, ...]

_NAMED = re.compile(r"(?<![:\w]):([A-Za-z_]\w*)")


def iso(moment: datetime) -> str:
    """The one text form of a time that callers see, from either engine."""
    return moment.astimezone(UTC).isoformat(timespec="microseconds")


class Cursorish(Protocol):
    """What both drivers' cursors give back after a statement."""

    @property
    def rowcount(self) -> int: ...

    def fetchone(self) -> Any: ...

    def fetchall(self) -> list[Any]: ...


class Connectionish(Protocol):
    """sqlite3.Connection and psycopg.Connection, as far as the shared queries use them."""

    def execute(self, sql: Any, params: Any = ..., /) -> Any: ...


class Dialect:
    """One engine's spelling of what the shared queries cannot write once."""

    name: str
    # The store's clock: SQLite binds the process's time, PostgreSQL uses the database's.
    clock_is_parameter: bool

    def translate(self, sql: str) -> str:
        """Neutral SQL (`:name` parameters) in this engine's parameter style; cached per text.

        Bounded by the statements' shapes: input only ever travels as parameters, never in the text.
        """
        raise NotImplementedError

    def array(self, values: Iterable[str]) -> Any:
        """A list of strings as a parameter for a list column."""
        raise NotImplementedError

    def array_value(self, value: Any) -> list[str]:
        """A list column (or `agg`'s result) read back."""
        raise NotImplementedError

    def array_has(self, column: str, param: str) -> str:
        """True when the list column holds the parameter's value exactly."""
        raise NotImplementedError

    def array_any(self, column: str, test: str) -> str:
        """True when some element `v` of the list column passes `test` (written over `v`)."""
        raise NotImplementedError

    def in_list(self, column: str, param: str) -> str:
        """`column` is one of a list parameter's values (pass `array(values)`): one statement text
        for any number of values, so it is prepared once."""
        raise NotImplementedError

    def in_rows(self, column: str, subquery: str) -> str:
        """True when `column` is among the values `subquery` returns, written so that an index can
        serve the other arms of an OR around it."""
        raise NotImplementedError

    def json_any(self, document: str, array_key: str, member: Sequence[str]) -> str:
        """True when some element of the JSON document's top-level array `array_key` has a
        non-null object at the path `member`."""
        raise NotImplementedError

    def json_strings(self, document: str, array_key: str, member: str) -> str:
        """Every distinct string of the arrays at `member` of the elements of the JSON document's
        top-level array `array_key` (e.g. every platform's badges), gathered as `agg` does."""
        raise NotImplementedError

    def search(self, columns: Sequence[str], param: str) -> str:
        """A case-insensitive substring match of the (already escaped, %-wrapped) parameter
        against any of `columns`."""
        raise NotImplementedError

    def agg(self, expression: str) -> str:
        """The aggregate that gathers `expression` into a list (read it with `array_value`)."""
        raise NotImplementedError

    def stamp(self, value: Any) -> str | None:
        """A timestamp column read back, in `iso` form."""
        raise NotImplementedError

    def stamp_param(self, moment: datetime) -> Any:
        """A time as a parameter for a timestamp column."""
        raise NotImplementedError

    def epoch(self, column: str) -> str:
        """SQL for a timestamp column as seconds since the epoch (a float, to the millisecond or
        finer): thousands of stamps read as numbers, with no date parsing in Python."""
        raise NotImplementedError

    def stamp_pairs(self, stamps: Mapping[str, float]) -> tuple[str, Params]:
        """A relation `(name, seen)` of many (name, seconds since the epoch) pairs, `seen` a
        timestamp as the engine stores one, and its parameters: a batch of thousands joined in
        one statement, the whole batch in one or two parameters, not one parameter set per row."""
        raise NotImplementedError

    def estimate(self, db: Db, sql: str, params: Params) -> int | None:
        """The planner's row estimate for `sql`, where the engine has one."""
        return None

    def bytewise(self, column: str) -> str:
        """`column` compared byte by byte, so a range of it is a prefix whatever the database's
        locale: SQLite's own collation (BINARY) already is; PostgreSQL's is the locale's unless told."""
        return column

    def read_through(self, table: str, index: str) -> str:
        """`table` in a FROM clause, read along `index` where the planner must be told: SQLite keeps
        no statistics, and would rather sort a million finished jobs found by the state index than
        walk the partial index that already has them in order; PostgreSQL's planner knows better."""
        return table

    def execute_many(self, conn: Any, sql: str, rows: Sequence[Params]) -> None:
        """One translated statement over many parameter sets, as the driver batches them."""
        raise NotImplementedError

    def lock(self, db: Db, key: str) -> None:
        """Serialise this transaction with every other one taking the same `key` until it ends
        (PostgreSQL's advisory lock); SQLite's one writer serialises every write already."""

    def lock_all(self, db: Db, keys: Sequence[str]) -> None:
        """`lock` for each of `keys`, taken in the order given (sort them: two transactions taking
        overlapping keys in one order cannot deadlock)."""
        for key in keys:
            self.lock(db, key)

    def notify(self, db: Db, channel: str, payload: str) -> None:
        """Tell every replica of this commit: PostgreSQL's NOTIFY, sent at commit. On SQLite the
        notice is kept on `db.notices`; the store sends it once the transaction has committed, to
        the processes sharing the file (`store.sqlite_notify`), when it shares its events. As
        PostgreSQL does, a transaction sends one notice for each distinct channel and payload."""
        db.notices[(channel, payload[:7900])] = None


@functools.lru_cache(maxsize=1024)
def _json_array(values: tuple[str, ...]) -> str:
    """A list column's JSON text. Cached: a store's list values repeat (a handful of platform
    sets, libc flavours and CUDA versions), and each report writes three of them."""
    return json.dumps(values)


class SqliteDialect(Dialect):
    name = "sqlite"
    clock_is_parameter = True

    def read_through(self, table: str, index: str) -> str:
        return f"{table} INDEXED BY {index}"

    @functools.cache  # noqa: B019 - one instance per process; the cache is the point
    def translate(self, sql: str) -> str:
        return sql  # named parameters are SQLite's own style

    def array(self, values: Iterable[str]) -> Any:
        return _json_array(tuple(values))

    def array_value(self, value: Any) -> list[str]:
        return list(json.loads(value)) if value else []

    def array_has(self, column: str, param: str) -> str:
        return f"EXISTS (SELECT 1 FROM json_each({column}) WHERE value = :{param})"

    def array_any(self, column: str, test: str) -> str:
        return f"EXISTS (SELECT 1 FROM (SELECT value AS v FROM json_each({column})) WHERE {test})"

    def in_list(self, column: str, param: str) -> str:
        return f"{column} IN (SELECT value FROM json_each(:{param}))"

    def in_rows(self, column: str, subquery: str) -> str:
        return f"{column} IN ({subquery})"  # computed once; SQLite's search scans the table anyway

    def json_any(self, document: str, array_key: str, member: Sequence[str]) -> str:
        path = "$." + ".".join(member)
        return (
            f"EXISTS (SELECT 1 FROM json_each({document}, '$.{array_key}') p"
            f" WHERE json_type(p.value, '{path}') = 'object')"
        )

    def json_strings(self, document: str, array_key: str, member: str) -> str:
        return (
            f"(SELECT json_group_array(DISTINCT b.value) FROM json_each({document}, '$.{array_key}') p,"
            f" json_each(p.value, '$.{member}') b)"
        )

    def search(self, columns: Sequence[str], param: str) -> str:
        # SQLite's LIKE is case-insensitive for ASCII
        return "(" + " OR ".join(f"{column} LIKE :{param} ESCAPE '\\'" for column in columns) + ")"

    def agg(self, expression: str) -> str:
        return f"json_group_array({expression})"

    def stamp(self, value: Any) -> str | None:
        return None if value is None else str(value)

    def stamp_param(self, moment: datetime) -> Any:
        return iso(moment)

    def epoch(self, column: str) -> str:
        return f"(julianday({column}) - 2440587.5) * 86400.0"  # julianday keeps milliseconds

    def stamp_pairs(self, stamps: Mapping[str, float]) -> tuple[str, Params]:
        # one JSON array of [name, stamp] pairs, walked once (two arrays joined on their keys
        # would be a nested loop: 140 ms for 1,650 stamps)
        relation = (
            "(SELECT json_extract(value, '$[0]') AS name, json_extract(value, '$[1]') AS seen"
            " FROM json_each(:pairs))"
        )
        stamp = self.stamp_param
        pairs = [[name, stamp(datetime.fromtimestamp(moment, UTC))] for name, moment in stamps.items()]
        return relation, {"pairs": json.dumps(pairs)}

    def execute_many(self, conn: Any, sql: str, rows: Sequence[Params]) -> None:
        conn.executemany(sql, rows)


class PostgresDialect(Dialect):
    name = "postgres"
    clock_is_parameter = False

    @functools.cache  # noqa: B019 - one instance per process; the cache is the point
    def translate(self, sql: str) -> str:
        escaped = sql.replace("%", "%%")
        return _NAMED.sub(lambda m: "now()" if m[1] == "now" else f"%({m[1]})s", escaped)

    def array(self, values: Iterable[str]) -> Any:
        return list(values)

    def array_value(self, value: Any) -> list[str]:
        return list(value) if value else []

    def array_has(self, column: str, param: str) -> str:
        return f"{column} @> ARRAY[:{param}]::text[]"  # the GIN index answers it

    def array_any(self, column: str, test: str) -> str:
        return f"EXISTS (SELECT 1 FROM unnest({column}) AS v WHERE {test})"

    def in_list(self, column: str, param: str) -> str:
        return f"{column} = ANY(:{param})"

    def bytewise(self, column: str) -> str:
        return f'({column} COLLATE "C")'  # as indexes that serve ranges of it are declared

    def in_rows(self, column: str, subquery: str) -> str:
        # An array computed once (an InitPlan) and looked up through the column's index: beside a
        # trigram match in an OR, both arms are bitmap index scans. `IN (subquery)` there is a filter
        # run on every row, so the OR reads the whole table (1.2 s at 1,000,000 reports).
        return f"{column} = ANY(ARRAY({subquery}))"

    def json_any(self, document: str, array_key: str, member: Sequence[str]) -> str:
        path = " -> ".join(f"'{key}'" for key in member)
        return (
            f"EXISTS (SELECT 1 FROM jsonb_array_elements({document}::jsonb -> '{array_key}') p"
            f" WHERE jsonb_typeof(p -> {path}) = 'object')"
        )

    def json_strings(self, document: str, array_key: str, member: str) -> str:
        return (
            f"(SELECT array_agg(DISTINCT b ORDER BY b) FROM jsonb_array_elements({document}::jsonb"
            f" -> '{array_key}') p, jsonb_array_elements_text(coalesce(p -> '{member}', '[]'::jsonb)) b)"
        )

    def search(self, columns: Sequence[str], param: str) -> str:
        # One expression, so the trigram index `reports_search` (migration 0003) serves it when it
        # is spelt exactly as there; chr(31) keeps a match from spanning two fields.
        return "(" + " || chr(31) || ".join(columns) + f") ILIKE :{param}"

    def agg(self, expression: str) -> str:
        return f"array_agg({expression} ORDER BY {expression})"

    def stamp(self, value: Any) -> str | None:
        return None if value is None else iso(value)

    def stamp_param(self, moment: datetime) -> Any:
        return moment

    def epoch(self, column: str) -> str:
        return f"EXTRACT(EPOCH FROM {column})::float8"

    def stamp_pairs(self, stamps: Mapping[str, float]) -> tuple[str, Params]:
        relation = (
            "(SELECT name, to_timestamp(seconds) AS seen"
            " FROM unnest(CAST(:pair_names AS text[]), CAST(:pair_seen AS float8[])) AS u(name, seconds))"
        )
        return relation, {"pair_names": list(stamps), "pair_seen": list(stamps.values())}

    def execute_many(self, conn: Any, sql: str, rows: Sequence[Params]) -> None:
        with conn.cursor() as cursor:  # psycopg sends the batch in one pipeline
            cursor.executemany(sql, rows)

    def estimate(self, db: Db, sql: str, params: Params) -> int | None:
        plan = db.one(f"EXPLAIN (FORMAT JSON) {sql}", params)
        return int(plan[0][0]["Plan"]["Plan Rows"]) if plan else None

    def lock(self, db: Db, key: str) -> None:
        db.one("SELECT pg_advisory_xact_lock(hashtextextended(:key, 0))", {"key": key})

    def lock_all(self, db: Db, keys: Sequence[str]) -> None:
        if len(keys) <= 1:
            super().lock_all(db, keys)
            return
        # One round trip; the target list (volatile) is evaluated after the sort, so in key order.
        db.all(
            "SELECT pg_advisory_xact_lock(hashtextextended(k, 0)) FROM unnest(CAST(:keys AS text[])) AS k ORDER BY k",
            {"keys": self.array(keys)},
        )

    def notify(self, db: Db, channel: str, payload: str) -> None:
        # NOTIFY's payload limit is 8000 bytes; every payload here is bounded far below it
        db.one("SELECT pg_notify(:channel, :payload)", {"channel": channel, "payload": payload[:7900]})


SQLITE = SqliteDialect()
POSTGRES = PostgresDialect()


class Db:
    """One connection inside one transaction (a write) or one read, speaking neutral SQL."""

    __slots__ = ("_conn", "_now", "dialect", "notices")

    def __init__(self, conn: Connectionish, dialect: Dialect) -> None:
        self._conn = conn
        self.dialect = dialect
        self._now: str | None = None
        # SQLite: what `notify` asked for, sent after commit; a dict, so each distinct notice once
        self.notices: dict[tuple[str, str], None] = {}

    def _params(self, params: Params) -> Params:
        if not self.dialect.clock_is_parameter:
            return params
        if self._now is None:  # one instant for the whole transaction, as PostgreSQL's now()
            self._now = iso(datetime.now(UTC))
        return {**params, "now": self._now}

    def execute(self, sql: str, params: Params | None = None) -> Cursorish:
        cursor: Cursorish = self._conn.execute(self.dialect.translate(sql), self._params(params or {}))
        return cursor

    def one(self, sql: str, params: Params | None = None) -> Row | None:
        row: Row | None = self.execute(sql, params).fetchone()
        return row

    def all(self, sql: str, params: Params | None = None) -> list[Row]:
        return list(self.execute(sql, params).fetchall())

    def many(self, sql: str, rows: Sequence[Params]) -> None:
        """One statement for many parameter sets: prepared once, sent as one batch."""
        if not rows:
            return
        self.dialect.execute_many(
            self._conn, self.dialect.translate(sql), [self._params(row) for row in rows]
        )

    def notify(self, channel: str, payload: str) -> None:
        self.dialect.notify(self, channel, payload)


class Query(Generic[P, R]):
    """A function of a `Db`, marked as a read or a write: what `StoreBackend.run` runs.

    A read runs on a connection that never waits for writers; a write runs in one write
    transaction (SQLite: the shared writer, `BEGIN IMMEDIATE`), committed when it returns.
    """

    __slots__ = ("function", "name", "write")

    def __init__(self, function: Callable[Concatenate[Db, P], R], *, write: bool) -> None:
        self.function: Callable[Concatenate[Db, P], R] = function
        self.write = write
        self.name = function.__name__

    def __call__(self, db: Db, *args: P.args, **kwargs: P.kwargs) -> R:
        return self.function(db, *args, **kwargs)

    def __repr__(self) -> str:
        return f"<{'write' if self.write else 'read'} query {self.name}>"


def reads(function: Callable[Concatenate[Db, P], T]) -> Query[P, T]:
    """Mark a query function as a read."""
    return Query(function, write=False)


def writes(function: Callable[Concatenate[Db, P], T]) -> Query[P, T]:
    """Mark a query function as a write (one transaction)."""
    return Query(function, write=True)
