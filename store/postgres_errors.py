"""PostgreSQL's errors in words that never name where the server is: for logs (`describe_error`)
and for answers to anyone (`error_cause`). Shared by `store.postgres` and `store.postgres_intake`."""

from __future__ import annotations

from psycopg_pool import PoolTimeout


def describe_error(exc: BaseException) -> str:
    """An error in words, without the connection string (it may hold a password)."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text[:300]


def error_cause(exc: BaseException) -> str:
    """An error's kind without where it happened, for answers to anyone: the server's error class and
    SQLSTATE (`QueryCanceled, SQLSTATE 57014`), never a host, port or message text, which can name them."""
    state = getattr(exc, "sqlstate", None)
    if state:
        return f"{type(exc).__name__}, SQLSTATE {state}"
    if isinstance(exc, PoolTimeout):
        return "no connection within the timeout"
    return "the connection failed"
