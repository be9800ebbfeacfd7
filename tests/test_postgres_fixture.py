"""The PostgreSQL fixture: a real server per session, a fresh database per test."""

from __future__ import annotations

import psycopg

from fixtures.postgres import LocalPostgres


def test_each_test_gets_an_empty_database_on_a_real_server(
    postgres_server: LocalPostgres, postgres_url: str
) -> None:
    with psycopg.connect(postgres_url, connect_timeout=10) as conn:
        assert conn.info.server_version >= 120000
        tables = conn.execute("SELECT count(*) FROM pg_tables WHERE schemaname = 'public'").fetchone()
        assert tables == (0,)
        # the server listens on loopback only
        assert conn.execute("SELECT inet_server_addr()::text").fetchone() == ("127.0.0.1/32",)
    assert postgres_server.process.poll() is None
