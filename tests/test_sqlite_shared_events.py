"""Processes sharing one SQLite file wake each other, as PostgreSQL's replicas do (store.sqlite_notify).

The store-level tests use two stores on one file with real UNIX datagram sockets; the last one
runs a real `gpubadge serve --workers 0` and a real `gpubadge worker` on one SQLite file, with
images pushed by skopeo into a real registry: the API's commit wakes the worker at once (not
at its next idle poll, 5 s), and the worker's stored badge answers the API's long-poll at once
(not at its next re-check).
"""

from __future__ import annotations

import asyncio
import socket
import stat
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from fixtures.notifications import distribution_push
from fixtures.oci import ImageSpec, LayerSpec, file, push_many
from fixtures.registry import free_port, run_registry
from fixtures.service import run_role_process, run_service_process, wait_healthy
from store import AsyncStore, EnqueueBatch, SqliteStore, queries
from store.events import (
    ALL_CHANNELS,
    JOB_CHANNELS,
    JOB_SETTLED_CHANNEL,
    JOBS_QUEUED_CHANNEL,
    REFERENCE_CHANNEL,
)
from store.sqlite_notify import DATAGRAM_MAX, notify_directory
from tests.test_service_e2e import call


class Heard:
    """A listener's socket (`SqliteStore.bind_listener`), read by the test itself, each read bounded."""

    def __init__(self, store: SqliteStore, channels: Sequence[str] = ALL_CHANNELS) -> None:
        self.listener = store.bind_listener(channels)
        self.listener.receiver.settimeout(5)

    def next(self) -> tuple[str, str]:
        channel, _, payload = self.listener.receiver.recv(DATAGRAM_MAX).decode().partition("\n")
        return channel, payload

    def empty(self) -> bool:
        """Nothing more was sent to it (a sender's datagram is queued here by the time sendto returns)."""
        self.listener.receiver.setblocking(False)
        try:
            self.listener.receiver.recv(DATAGRAM_MAX)
        except BlockingIOError:
            return True
        finally:
            self.listener.receiver.settimeout(5)
        return False

    def close(self) -> None:
        self.listener.close()


def test_a_commit_reaches_every_process_sharing_the_file_its_own_included(tmp_path: Path) -> None:
    db = tmp_path / "queue.db"
    api, worker = SqliteStore(db, shared_events=True), SqliteStore(db, shared_events=True)
    heard_by_api, heard_by_worker = Heard(api), Heard(worker)
    try:
        [job_id] = api.enqueue([("reg.example/team/app:1", "reg.example")])
        assert heard_by_worker.next() == (JOBS_QUEUED_CHANNEL, "")
        assert heard_by_api.next() == (JOBS_QUEUED_CHANNEL, "")  # as PostgreSQL's own NOTIFY
        [job] = worker.claim_jobs(1, owner="w1", lease_seconds=30)
        assert job.id == job_id
        assert worker.finish_job(job.id, digest="sha256:" + "a" * 64, owner="w1")
        assert heard_by_api.next() == (JOB_SETTLED_CHANNEL, f"{job_id} reg.example/team/app:1")
        assert not worker.finish_job(job.id, digest=None, owner="w1")  # nothing written, nothing told
        assert heard_by_worker.next() == (JOB_SETTLED_CHANNEL, f"{job_id} reg.example/team/app:1")
        assert heard_by_api.empty() and heard_by_worker.empty()
    finally:
        heard_by_api.close()
        heard_by_worker.close()
        api.close()
        worker.close()
    assert list(notify_directory(db).iterdir()) == []  # each listener removed its socket


def test_a_process_that_only_scans_hears_the_queue_and_no_stored_report(tmp_path: Path) -> None:
    """A worker process holds no long poll: a reference's change (a report stored, a tag moved) would
    only wake its loop, once per worker process, for each one written."""
    db = tmp_path / "queue.db"
    api, worker = SqliteStore(db, shared_events=True), SqliteStore(db, shared_events=True)
    heard_by_api, heard_by_worker = Heard(api), Heard(worker, JOB_CHANNELS)
    try:
        assert sum(entry.name.endswith(".jobs") for entry in notify_directory(db).iterdir()) == 1
        worker.run(queries.mark_gone, "reg.example", "team/app", tag="1", digest=None)
        assert heard_by_api.next() == (REFERENCE_CHANNEL, "reg.example/team/app:1")
        assert heard_by_worker.empty()
        api.enqueue([("reg.example/team/app:2", "reg.example")])
        assert heard_by_worker.next() == (JOBS_QUEUED_CHANNEL, "")
        assert heard_by_api.next() == (JOBS_QUEUED_CHANNEL, "")
        with pytest.raises(ValueError, match="every channel or the queue's alone"):
            worker.bind_listener([REFERENCE_CHANNEL])
    finally:
        heard_by_api.close()
        heard_by_worker.close()
        api.close()
        worker.close()


def test_a_listener_whose_process_died_is_removed_and_the_others_still_hear(tmp_path: Path) -> None:
    db = tmp_path / "queue.db"
    store = SqliteStore(db, shared_events=True)
    heard = Heard(store)
    dead = notify_directory(db) / "4242.dead"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as gone:
        gone.bind(str(dead))  # closed without removing its file, as a killed process leaves it
    try:
        store.enqueue([("reg.example/a:1", "reg.example")])
        assert heard.next() == (JOBS_QUEUED_CHANNEL, "")
        # The live listener may be sent the notice before the dead one is tried. The mover thread
        # announces one pass after another, so a second notice heard means the first send is over.
        store.enqueue([("reg.example/a:2", "reg.example")])
        assert heard.next() == (JOBS_QUEUED_CHANNEL, "")
        assert not dead.exists()
    finally:
        heard.close()
        store.close()


def test_a_path_too_long_for_a_socket_path_listens_through_the_directorys_descriptor(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    db = deep / "queue.db"
    assert len(str(notify_directory(db) / "4242.0123abcd")) > 107  # too long for sun_path
    store = SqliteStore(db, shared_events=True)
    heard = Heard(store)
    try:
        [entry] = list(notify_directory(db).iterdir())
        assert stat.S_ISSOCK(entry.lstat().st_mode)  # the socket itself, no link to elsewhere
        store.enqueue([("reg.example/a:1", "reg.example")])
        assert heard.next() == (JOBS_QUEUED_CHANNEL, "")
    finally:
        heard.close()
        store.close()
    assert list(notify_directory(db).iterdir()) == []


def test_a_store_that_does_not_share_its_events_tells_nobody(tmp_path: Path) -> None:
    db = tmp_path / "queue.db"
    shared, alone = SqliteStore(db, shared_events=True), SqliteStore(db)
    heard = Heard(shared)
    try:
        alone.enqueue([("reg.example/a:1", "reg.example")])
        shared.enqueue([("reg.example/b:1", "reg.example")])
        assert heard.next() == (JOBS_QUEUED_CHANNEL, "")  # the shared store's own commit
        assert heard.empty()  # and only that one
        with pytest.raises(RuntimeError, match="shared_events"):
            alone.bind_listener()
    finally:
        heard.close()
        shared.close()
        alone.close()


async def test_the_service_reads_other_processes_notices_on_its_event_loop_with_no_thread(
    tmp_path: Path,
) -> None:
    db = tmp_path / "queue.db"
    store = AsyncStore(SqliteStore(db, shared_events=True))
    other = SqliteStore(db, shared_events=True)  # another process's commits, as far as the socket can tell
    try:
        await store.start_events()
        assert store.events.cross_process
        # a thread between the socket and the loop would cost a wake-up and a hand-over per notice
        assert not [thread for thread in threading.enumerate() if thread.name == "sqlite-listen"]
        queued = asyncio.Event()
        store.events.on_queued(queued.set)
        settled: list[str] = []
        store.events.on_settled(lambda: settled.append("settled"))
        before = store.events.queued_count
        [job_id] = await asyncio.to_thread(other.enqueue, [("reg.example/team/app:1", "reg.example")])
        async with asyncio.timeout(5):
            await queued.wait()
        assert store.events.queued_count == before + 1
        [job] = await asyncio.to_thread(other.claim_jobs, 1, owner="w1", lease_seconds=30)
        assert await asyncio.to_thread(other.finish_job, job.id, digest="sha256:" + "a" * 64, owner="w1")
        done = await store.wait_for_job(job_id, timeout=5)  # keyed by the job: only its settle wakes it
        assert done is not None and done.state == "done"
        assert settled == ["settled"]
    finally:
        await store.close()
        other.close()
    assert list(notify_directory(db).iterdir()) == []  # the listener removed its socket


SECRET = "shared-sqlite-secret"


def test_an_api_process_and_a_worker_process_on_one_sqlite_file_wake_each_other(tmp_path: Path) -> None:
    with run_registry() as registry:
        specs = {
            f"shared/app{n}": ImageSpec(
                [LayerSpec([file("etc/os-release", f"ID=shared{n}\n")])], env={"CUDA_VERSION": "12.4.1"}
            )
            for n in range(3)
        }
        digests = push_many(specs, registry.host, tmp_path / "images")
        db = tmp_path / "shared.db"
        env = {
            "GPUBADGE_REGISTRIES": registry.host,
            "GPUBADGE_WEBHOOK_SECRET": SECRET,
            "GPUBADGE_WORKERS": "0",
        }
        worker_env = {**env, "GPUBADGE_WORKERS": "2"}
        metrics_port = free_port()
        with (
            run_service_process(db, env=env) as api,
            run_role_process(
                ["worker", "--metrics-port", str(metrics_port)], db, worker_env, tmp_path / "worker.log"
            ) as worker,
        ):
            # the worker claims before the first push: its start-up is not what the bound below times
            wait_healthy(f"http://127.0.0.1:{metrics_port}", worker, 60.0)
            for repository, digest in digests.items():
                started = time.monotonic()
                delivered = call(
                    "POST",
                    f"{api.url}/hooks/distribution",
                    distribution_push(registry.host, repository, digest, "latest"),
                    headers={"Authorization": f"Bearer {SECRET}"},
                )
                assert delivered.status == 202, delivered.text
                reference = f"{registry.host}/{repository}:latest"
                badge = call(
                    "GET", f"{api.url}/api/images/by-ref?ref={reference}&wait=20&until=facts", timeout=30
                )
                seconds = time.monotonic() - started
                assert badge.status == 200, badge.text
                assert badge.body["digest"] == digest
                # Without the shared events the worker claims at its next idle poll (every 5 s)
                # and the API's long poll answers at its next re-check (every 1 s).
                assert seconds < 2.0, f"{reference}: badge {seconds:.2f} s after the webhook"


async def test_a_file_beside_which_no_socket_can_be_made_falls_back_to_rechecks(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    db = tmp_path / "queue.db"
    notify_directory(db).write_text("not a directory")  # where the listeners' sockets would go
    store = AsyncStore(SqliteStore(db, shared_events=True))
    try:
        await store.start_events()  # the service starts all the same
        assert not store.events.cross_process
        assert "re-checks" in caplog.text
        [job_id] = store.blocking.enqueue_many([EnqueueBatch([("reg.example/a:1", "reg.example")], None, 5)])[
            0
        ]
        assert job_id
    finally:
        await store.close()
