"""PostgreSQL's webhook intake through a local journal (GPUBADGE_INTAKE_JOURNAL, store/intake_mover.py).

Against a real PostgreSQL: a delivery is committed to the journal and answered without waiting for
the server (here a move held up by a lock the test takes), its jobs reach `jobs` exactly once
whatever stops where (a journal left by a process that died before its move, or after it), an id
given to a delivery whose reference already had an active job names that job, and the service's
intake port and main port both commit there.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest

import jobs.intake
from fixtures.registry import free_port
from jobs.intake import JobIntake, QueueFull
from store import AsyncStore, EnqueueBatch, queries
from store.intake_journal import IntakeJournal
from store.postgres import PostgresStore
from tests.test_intake_port import ports

WAIT = 10.0  # seconds any one step may take here
FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "webhooks"
V2 = {"Content-Type": "application/vnd.docker.distribution.events.v2+json"}


@pytest.fixture
def journaled(postgres_url: str, tmp_path: Path) -> Iterator[Any]:
    """journaled() -> a PostgreSQL store whose intake journals to this test's file; each call
    opens it again, as another process on the same host would."""
    opened: list[PostgresStore] = []

    def open_store() -> PostgresStore:
        opened.append(
            PostgresStore(
                postgres_url, pool_size=4, connect_timeout=WAIT, intake_journal=tmp_path / "journal"
            )
        )
        return opened[-1]

    try:
        yield open_store
    finally:
        for store in opened:
            store.close()


@contextlib.contextmanager
def moves_held(store: PostgresStore, url: str, journal: Path) -> Iterator[psycopg.Connection[Any]]:
    """`store`'s intake started, and the lock its mover takes for a pass (`queries.journal_moves`)
    held by another connection until the block ends: passes wait meanwhile; readers never do."""
    store.start_intake()
    with sqlite3.connect(journal) as conn:
        (journal_id,) = conn.execute("SELECT journal FROM journal_meta").fetchone()
    with psycopg.connect(url) as holder:
        holder.execute(
            "SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", [f"intake journal {journal_id}"]
        )
        yield holder
        holder.rollback()


def rows(url: str, sql: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(url, autocommit=True) as conn:
        return conn.execute(sql).fetchall()


def batch(*tags: str) -> EnqueueBatch:
    return EnqueueBatch([(f"registry.test/app:{tag}", "registry.test") for tag in tags], "test", 3)


def test_deliveries_are_answered_while_the_move_waits_and_move_once_it_can(
    journaled: Any, postgres_url: str, tmp_path: Path
) -> None:
    store = journaled()
    with moves_held(store, postgres_url, tmp_path / "journal") as holder:
        started = time.monotonic()
        ids = [store.record_intake([batch(f"t{n}")])[0][0] for n in range(20)]
        answered = time.monotonic() - started
        assert answered < 2.0, answered  # twenty local commits; no round trip, no wait for the lock
        assert holder.execute("SELECT count(*) FROM jobs").fetchone() == (0,)  # not moved yet
        assert store.queued_for_intake(100) == 20  # the queue's cap counts them meanwhile
    # every read of the queue in this process waits for the move first
    assert all((job := store.job(job_id)) is not None and job.state == "queued" for job_id in ids)
    assert rows(postgres_url, "SELECT count(*) FROM jobs") == [(20,)]
    assert sorted(row[0] for row in rows(postgres_url, "SELECT id FROM jobs")) == sorted(ids)


def test_a_journal_left_unmoved_by_a_dead_process_moves_once_at_the_next_start(
    journaled: Any, postgres_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = journaled()  # the schema is in place; its journal opens at its intake's start
    # what a process that died between its 202 and its mover's pass leaves: rows in its journal
    journal = IntakeJournal(tmp_path / "journal")
    ids = [
        job_id
        for batch_ids in journal.record([batch("a", "b"), batch("c")], None, datetime.now(UTC))
        for job_id in batch_ids
    ]
    journal.close()
    assert rows(postgres_url, "SELECT count(*) FROM jobs") == [(0,)]
    with caplog.at_level("INFO", logger="store.intake_mover"):
        store.start_intake()  # moved before anyone reads the queue
    assert sorted(row[0] for row in rows(postgres_url, "SELECT id FROM jobs")) == sorted(ids)
    assert "moved 3 jobs an earlier run left in the intake journal into PostgreSQL" in caplog.messages
    store.close()
    # the rows are still in the file (trimmed only between answers), but marked moved in PostgreSQL
    assert len(IntakeJournal(tmp_path / "journal").rows(0, 100)) == 3
    again = journaled()
    again.start_intake()
    again.record_intake([batch("d")])
    assert again.job(ids[0]) is not None
    assert rows(postgres_url, "SELECT count(*) FROM jobs") == [(4,)]  # a, b, c once each, and d
    assert rows(postgres_url, "SELECT seq FROM intake_moved") == [(4,)]


def test_an_id_given_beside_an_active_job_names_that_job(journaled: Any, postgres_url: str) -> None:
    store = journaled()
    [[active]] = store.enqueue_many([batch("busy")])  # an API scan request: straight to PostgreSQL
    [[given]] = store.record_intake([batch("busy")])  # the journal does not ask the server
    assert given != active
    job = store.job(given)  # moved by now: an alias of the active job
    assert job is not None and job.id == active
    assert rows(postgres_url, "SELECT count(*) FROM jobs") == [(1,)]
    assert rows(postgres_url, f"SELECT job_id FROM job_aliases WHERE id = '{given}'") == [(active,)]
    # the alias goes with its job (retention's deletes)
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute("DELETE FROM jobs")
    assert rows(postgres_url, "SELECT count(*) FROM job_aliases") == [(0,)]


def test_a_reference_delivered_twice_before_its_move_is_one_job(
    journaled: Any, postgres_url: str, tmp_path: Path
) -> None:
    store = journaled()
    with moves_held(store, postgres_url, tmp_path / "journal"):
        [[first]] = store.record_intake([batch("x")])
        [[second]] = store.record_intake([batch("x")])  # this process knows its own row
        other = IntakeJournal(tmp_path / "journal")  # another process on the same journal does not
        [[third]] = other.record([batch("x")], None, datetime.now(UTC))
        other.close()
    assert first == second != third
    store.record_intake([batch("y")])  # journaled after the third: once this process reads it, both moved
    job = store.job(first)
    assert job is not None and job.id == first
    moved = store.job(third)  # moved after the first: an alias of it
    assert moved is not None and moved.id == first
    assert rows(postgres_url, "SELECT count(*) FROM jobs WHERE reference LIKE '%:x'") == [(1,)]


async def test_the_queue_cap_counts_journaled_jobs(journaled: Any) -> None:
    intake = JobIntake(AsyncStore(journaled()), max_queued=25)
    outcomes = await asyncio.gather(
        *(
            intake.enqueue([(f"r/app-{n}:{i}", "r") for i in range(3)], source="test", max_attempts=3)
            for n in range(12)
        ),
        return_exceptions=True,
    )
    accepted = [ids for ids in outcomes if isinstance(ids, list)]
    assert len(accepted) == 8 and sum(isinstance(outcome, QueueFull) for outcome in outcomes) == 4
    assert intake.journaled  # committed on the intake's thread, to the journal
    assert await intake.store.run(queries.queued_jobs, cap=100) == 24
    await intake.close()


def push(tag: str) -> bytes:
    event = json.loads((FIXTURES / "distribution_push_v2.json").read_bytes())
    event["events"] = [{**item, "target": {**item["target"], "tag": tag}} for item in event["events"]]
    return json.dumps(event).encode()


async def test_the_service_journals_webhooks_on_both_ports(tmp_path: Path, postgres_url: str) -> None:
    async with ports(tmp_path, database_url=postgres_url, intake_journal=tmp_path / "journal") as at:
        assert at.services.intake.journaled
        found: list[str] = []
        for base in (at.intake, at.main):
            status, body, _ = await at.post(base, "/hooks/distribution", push(f"t{len(found)}"), V2)
            assert status == 202
            found += body["jobs"]
        for job_id in found:  # `/api/scans/{id}` answers for them at once (moved, or read from the journal)
            async with at.session.get(f"{at.main}/api/scans/{job_id}") as reply:
                assert reply.status == 200 and (await reply.json())["state"] == "queued"
        assert (tmp_path / "journal").exists()
        async with at.session.get(f"{at.main}/metrics") as reply:
            assert "\ngpubadge_intake_journal_unmoved_jobs 0.0\n" in await reply.text()
    # a clean stop leaves nothing unmoved
    assert sorted(row[0] for row in rows(postgres_url, "SELECT id FROM jobs")) == sorted(found)


def test_a_journal_without_postgresql_is_refused_naming_the_setting(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "gpubadge.cli", "serve", "--db", str(tmp_path / "x.db")],
        env={"GPUBADGE_INTAKE_JOURNAL": str(tmp_path / "journal"), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert "intake_journal is for PostgreSQL" in done.stderr and "Traceback" not in done.stderr


def test_a_journal_that_cannot_be_opened_stops_serve_in_one_line(tmp_path: Path, postgres_url: str) -> None:
    """Start-up fails on the journal (here its directory is a file, which stops root too): one line
    naming the path and the remedy, no traceback, and nothing left running."""
    (tmp_path / "not-a-directory").write_text("")
    journal = tmp_path / "not-a-directory" / "journal.sqlite"
    api, intake = free_port(), free_port()
    done = subprocess.run(
        [sys.executable, "-m", "gpubadge.cli", "serve", "--port", str(api), "--intake-port", str(intake)],
        env={
            "GPUBADGE_DATABASE_URL": postgres_url,
            "GPUBADGE_INTAKE_JOURNAL": str(journal),
            "GPUBADGE_WORKERS": "1",
            "PATH": "/usr/bin:/bin",
        },
        capture_output=True,
        text=True,
        timeout=60,  # the store and the workers started before the journal stop too: it exits
    )
    assert done.returncode == 1, done.stderr
    assert done.stderr.splitlines()[-1].startswith(
        f"gpubadge serve: the intake journal {journal} cannot be opened"
    )
    assert "Traceback" not in done.stderr


class TcpRelay:
    """A TCP relay to `upstream` on a free loopback port that a test can cut (every connection
    closed, new ones closed at once: the server out of reach) and mend."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.cut_off = threading.Event()
        self.open: set[socket.socket] = set()
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self.cut_off.is_set():
                client.close()
                continue
            server = socket.create_connection(self.upstream)
            with self.lock:
                self.open |= {client, server}
            for source, sink in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        for end in (source, sink):
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        self.cut_off.set()
        with self.lock:
            ends, self.open = self.open, set()
        for end in ends:
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)

    def mend(self) -> None:
        self.cut_off.clear()

    def close(self) -> None:
        self.cut()
        self.listener.close()


def test_deliveries_are_taken_while_postgresql_is_out_of_reach_and_move_once_it_is_back(
    postgres_url: str, tmp_path: Path
) -> None:
    server = urllib.parse.urlsplit(postgres_url)
    relay = TcpRelay((server.hostname or "127.0.0.1", server.port or 5432))
    through_relay = postgres_url.replace(f"{server.hostname}:{server.port}", f"127.0.0.1:{relay.port}")
    store = PostgresStore(through_relay, pool_size=2, connect_timeout=2, intake_journal=tmp_path / "journal")
    try:
        store.start_intake()
        relay.cut()
        started = time.monotonic()
        ids = [store.record_intake([batch(f"away{n}")])[0][0] for n in range(5)]
        assert time.monotonic() - started < 2.0  # answered from the journal, not after a timeout
        assert rows(postgres_url, "SELECT count(*) FROM jobs") == [(0,)]
        assert store.intake_unmoved() == 5  # what /metrics shows (gpubadge_intake_journal_unmoved_jobs)
        relay.mend()
        deadline = time.monotonic() + 60  # the pool's reconnection and the mover's back-off, bounded
        while rows(postgres_url, "SELECT count(*) FROM jobs") != [(5,)]:
            assert time.monotonic() < deadline, "the journaled jobs never reached PostgreSQL"
            time.sleep(0.05)
        assert sorted(row[0] for row in rows(postgres_url, "SELECT id FROM jobs")) == sorted(ids)
        store.job(ids[0])  # the mover's mark follows its commit: this waits for it
        assert store.intake_unmoved() == 0
    finally:
        store.close()
        relay.close()


async def test_the_service_answers_webhooks_at_once_while_postgresql_is_out_of_reach(
    postgres_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The queue cap's recount, the one read of the server left on a journaled delivery's path, runs
    beside the answers while the server is away, not in front of them."""
    monkeypatch.setattr(jobs.intake, "RECOUNT_SECONDS", 0.0)  # every delivery finds the count stale
    server = urllib.parse.urlsplit(postgres_url)
    relay = TcpRelay((server.hostname or "127.0.0.1", server.port or 5432))
    through_relay = postgres_url.replace(f"{server.hostname}:{server.port}", f"127.0.0.1:{relay.port}")
    try:
        async with ports(
            tmp_path, database_url=through_relay, intake_journal=tmp_path / "journal", sqlite_busy_timeout=5
        ) as at:
            status, _, _ = await at.post(at.intake, "/hooks/distribution", push("before"), V2)
            assert status == 202
            relay.cut()
            for n in range(3):
                started = time.monotonic()
                status, body, _ = await at.post(at.intake, "/hooks/distribution", push(f"away{n}"), V2)
                assert status == 202 and len(body["jobs"]) == 1
                assert time.monotonic() - started < 2.0  # not the store's 5 s timeout
            relay.mend()
            deadline = time.monotonic() + 60
            while rows(postgres_url, "SELECT count(*) FROM jobs WHERE reference LIKE '%:away%'") != [(3,)]:
                assert time.monotonic() < deadline, "the journaled jobs never reached PostgreSQL"
                await asyncio.sleep(0.05)
    finally:
        relay.close()
