"""The table of webhook senders (web/hooks), the start-up log that reads it, and the 202 that
follows the commit.

Each sender is one record in `hooks.SENDERS`: these tests check that every sender module's
record is in the table, that the settings and the start-up log name every sender (ACR, which is
refused without a secret, included), and, against a real `gpubadge serve` and its SQLite file,
that a delivery is answered only once its job is committed.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import pkgutil
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from fixtures.service import run_service_inprocess, run_service_process
from store.intake_journal import journal_path
from tests.test_service_e2e import call
from web import hooks
from web.hooks.common import Sender
from web.settings import ServiceSettings

SECRET = "sender-table-secret-5c1e"


def sender_modules() -> dict[str, object]:
    """Every module of web/hooks/ that defines a `SENDER` record."""
    found = {}
    for info in pkgutil.iter_modules(hooks.__path__):
        module = importlib.import_module(f"web.hooks.{info.name}")
        if hasattr(module, "SENDER"):
            found[info.name] = module
    return found


def test_every_sender_module_is_in_the_table_once() -> None:
    modules = sender_modules()
    assert set(modules) == {
        "distribution",
        "dockerhub",
        "harbor",
        "ghcr",
        "quay",
        "gar",
        "ecr",
        "jfrog",
        "acr",
    }
    for name, module in modules.items():
        record = module.SENDER  # type: ignore[attr-defined]
        assert isinstance(record, Sender)
        assert hooks.SENDERS[record.name] is record, name
    assert len(hooks.SENDERS) == len(modules)
    assert tuple(hooks.SENDERS) == hooks.SOURCES


def test_what_each_record_names_exists() -> None:
    settings = ServiceSettings(jfrog_registry="artifactory.example.com")
    for record in hooks.SENDERS.values():
        if record.default_registry_setting is not None:
            assert record.default_registry_setting in ServiceSettings.model_fields, record.name
    assert settings.webhook_default_registry(hooks.SENDERS["jfrog"]) == "artifactory.example.com"
    assert settings.webhook_default_registry(hooks.SENDERS["distribution"]) is None
    assert [record.name for record in hooks.SENDERS.values() if record.needs_secret] == ["acr"]
    # Every sender in the table may be given its own secret (ACR included), and nothing else.
    ServiceSettings(webhook_secrets=dict.fromkeys(hooks.SOURCES, "s"))
    with pytest.raises(ValueError, match="unknown sources gitlab"):
        ServiceSettings(webhook_secrets={"gitlab": "s"})


@pytest.mark.parametrize(
    ("secrets", "open_sources", "refused"),
    [
        ({}, [s for s in hooks.SOURCES if s != "acr"], ["acr"]),
        ({"webhook_secrets": {"ghcr": SECRET}}, [], [s for s in hooks.SOURCES if s != "ghcr"]),
        ({"webhook_secrets": {"acr": SECRET}}, [], [s for s in hooks.SOURCES if s != "acr"]),
        ({"webhook_secret": SECRET}, [], []),
    ],
    ids=["no-secret", "ghcr-only", "acr-only", "shared"],
)
def test_doors_follow_the_table(
    secrets: dict[str, object], open_sources: list[str], refused: list[str]
) -> None:
    settings = ServiceSettings(**secrets)  # type: ignore[arg-type]
    assert settings.open_webhook_sources() == open_sources
    assert settings.refused_webhook_sources() == refused
    assert [s for s in hooks.SOURCES if settings.webhook_refused(s)] == refused


def doors_logged(caplog: pytest.LogCaptureFixture) -> str:
    lines = [r.getMessage() for r in caplog.records if r.name == "web.app" and "webhook" in r.getMessage()]
    assert len(lines) == 1, lines
    return lines[0]


async def test_start_up_log_names_acr_as_refused_without_its_secret(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="web.app")
    settings = ServiceSettings(db=tmp_path / "open.db", workers=0)
    async with run_service_inprocess(settings) as service:
        line = doors_logged(caplog)
        assert "refused" in line and line.rpartition("refused")[2].count("acr") == 1, line
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{service.url}/hooks/acr", data=b"{}") as reply,
        ):
            error = (await reply.json())["error"]
        assert reply.status == 401 and "webhook_secrets.acr" in error, error

    caplog.clear()
    settings = ServiceSettings(db=tmp_path / "per-source.db", workers=0, webhook_secrets={"ghcr": SECRET})
    async with run_service_inprocess(settings):
        line = doors_logged(caplog)
        refused = line.rpartition("refused")[2]
        assert all(source in refused for source in hooks.SOURCES if source != "ghcr"), line
        assert "acr" in refused and SECRET not in line


# ------------------------------------------------------------------ the 202 follows the commit


@contextlib.contextmanager
def write_lock_held(db: Path) -> Iterator[sqlite3.Connection]:
    """Hold SQLite's write lock from another connection, as another process's writer would."""
    connection = sqlite3.connect(db, isolation_level=None, timeout=10)
    connection.execute("BEGIN IMMEDIATE")
    try:
        yield connection
    finally:
        connection.execute("ROLLBACK")
        connection.close()


def job_count(db: Path) -> int:
    """Jobs committed: in the store, and in the intake's journal beside it (not yet moved)."""
    with contextlib.closing(sqlite3.connect(db, timeout=10)) as connection:
        (count,) = connection.execute("SELECT count(*) FROM jobs").fetchone()
    with contextlib.closing(sqlite3.connect(journal_path(db), timeout=10)) as connection:
        (journaled,) = connection.execute("SELECT count(*) FROM intake").fetchone()
    return int(count) + int(journaled)


def test_the_202_is_sent_only_after_the_commit(tmp_path: Path) -> None:
    db = tmp_path / "commit.db"
    env = {"GPUBADGE_WORKERS": "0", "GPUBADGE_WEBHOOK_SECRET": SECRET, "GPUBADGE_SQLITE_BUSY_TIMEOUT": "20"}
    digest = "sha256:" + "7" * 64
    event = {
        "events": [
            {
                "action": "push",
                "target": {
                    "mediaType": "application/vnd.oci.image.manifest.v1+json",
                    "digest": digest,
                    "repository": "commit/first",
                    "tag": "v1",
                },
                "request": {"host": "127.0.0.1:5999"},
            }
        ]
    }
    headers = {"Authorization": f"Bearer {SECRET}"}
    with run_service_process(db, env=env) as service:
        url = f"{service.url}/hooks/distribution"
        before = job_count(db)
        answered = threading.Event()
        replies = []

        def deliver() -> None:
            replies.append(call("POST", url, json.dumps(event).encode(), headers, timeout=60))
            answered.set()

        with write_lock_held(journal_path(db)):  # the intake's journal (store.intake_journal)
            sender = threading.Thread(target=deliver)
            sender.start()
            # The commit cannot happen while the lock is held, so neither may the answer.
            assert not answered.wait(2.0), replies
            assert job_count(db) == before
        assert answered.wait(30.0), "no answer after the lock was released"
        sender.join(5)
        [reply] = replies
        assert reply.status == 202, reply.text
        [job_id] = reply.body["jobs"]
        job = call("GET", f"{service.url}/api/scans/{job_id}").body
        assert job["reference"] == f"127.0.0.1:5999/commit/first:v1@{digest}", job
        # The store's own writer, held by another process, holds no answer back: the journal takes it.
        with write_lock_held(db):
            event["events"][0]["target"]["tag"] = "v2"
            reply = call("POST", url, json.dumps(event).encode(), headers, timeout=5)
            assert reply.status == 202, reply.text
