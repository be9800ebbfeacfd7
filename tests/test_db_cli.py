"""`gpubadge db status | upgrade` on both engines, as an operator runs them before a rollout."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path

import pytest

from store.migrations import latest_version, migrations


def gpubadge_db(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`gpubadge db ARGS` with `env` over this process's environment; an empty value unsets a name."""
    return subprocess.run(
        [sys.executable, "-m", "gpubadge.cli", "db", *args],
        env={key: value for key, value in {**os.environ, **env}.items() if value},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.parametrize("engine", ["sqlite", "postgres"])
def test_status_changes_nothing_and_upgrade_applies_every_migration(
    engine: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    db = tmp_path / "gpubadge.db"
    env = {"GPUBADGE_DB": str(db)}
    flags = ["--db", str(db)]
    if engine == "postgres":
        env["GPUBADGE_DATABASE_URL"] = request.getfixturevalue("postgres_url")
        flags = []
    status = gpubadge_db("status", *flags, env=env)
    assert status.returncode == 0, status.stderr
    assert status.stdout.count("pending") == len(migrations(engine)) and "applied" not in status.stdout
    upgrade = gpubadge_db("upgrade", *flags, env=env)
    assert upgrade.returncode == 0, upgrade.stderr
    assert f"schema at version {latest_version(engine)}" in upgrade.stdout
    again = gpubadge_db("status", *flags, env=env)
    assert again.stdout.count("applied") == len(migrations(engine)) and "pending" not in again.stdout
    assert db.exists() == (engine == "sqlite")  # with a database URL, no SQLite file is written


def test_an_unreachable_database_is_a_clear_error_without_its_password(tmp_path: Path) -> None:
    from fixtures.registry import free_port

    url = f"postgresql://gpubadge:hunter2-secret@127.0.0.1:{free_port()}/gpubadge"
    done = gpubadge_db("upgrade", env={"GPUBADGE_DATABASE_URL": url, "GPUBADGE_SQLITE_BUSY_TIMEOUT": "2"})
    assert done.returncode == 1
    assert "cannot open the PostgreSQL store" in done.stderr and "hunter2-secret" not in done.stderr
    # a server that may yet start is waited for, said once, and the last try's words end it
    assert done.stderr.count("PostgreSQL does not answer yet") == 1, done.stderr
    assert done.stderr.strip().splitlines()[-1].endswith("Connection refused"), done.stderr


def test_a_url_the_server_refuses_fails_at_once_in_its_words(postgres_url: str) -> None:
    """An unknown database or role is not waited for (the store's timeout is 30 s here): the
    server's own words, at once, without the password."""
    parts = urllib.parse.urlsplit(postgres_url)
    wrong = {
        'database "nosuchdb" does not exist': parts._replace(path="/nosuchdb"),
        'role "nosuchrole" does not exist': parts._replace(
            netloc=f"nosuchrole:hunter2-secret@{parts.hostname}:{parts.port}"
        ),
        "server does not support SSL": parts._replace(query="sslmode=require"),
    }
    for words, url in wrong.items():
        started = time.monotonic()
        done = gpubadge_db(
            "status", env={"GPUBADGE_DATABASE_URL": url.geturl(), "GPUBADGE_SQLITE_BUSY_TIMEOUT": "30"}
        )
        assert done.returncode == 1
        assert time.monotonic() - started < 15  # one try, not the 30 s wait
        assert words in done.stderr and "hunter2-secret" not in done.stderr
        assert "does not answer yet" not in done.stderr


def test_upgrade_needs_a_database_named_by_the_user_not_a_default(tmp_path: Path) -> None:
    """GPUBADGE_DB alone (the image sets it) is no choice: an init job with nothing set must fail."""
    db = tmp_path / "gpubadge.db"
    env = {"GPUBADGE_DB": str(db), "GPUBADGE_DATABASE_URL": ""}
    for action in ("upgrade", "status"):
        done = gpubadge_db(action, env=env)
        assert done.returncode == 2
        assert "GPUBADGE_DATABASE_URL" in done.stderr and "--db" in done.stderr
    assert not db.exists()
