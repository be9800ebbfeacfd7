"""Durability of `gpubadge serve`: kill -9 mid-burst, restart on the same database; SIGTERM drains.

A 202 means "queued durably". So every image whose webhook got a 202 must end up
scanned, once, even when the process is killed with SIGKILL in the middle of a burst;
senders whose request failed retry it, as registries do. SIGTERM must exit cleanly
and leave unfinished jobs queued for the next start, never `running` and never lost.
"""

from __future__ import annotations

import asyncio
import collections
import os
import re
import signal
import socket
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from fixtures.notifications import distribution_push
from fixtures.oci import ImageSpec, LayerSpec, file, push_many
from fixtures.registry import LocalRegistry, free_port, run_registry
from fixtures.service import run_service_process
from tests.conftest import Pusher
from tests.faultproxy import FaultProxy, Rule
from tests.test_service_e2e import by_ref, call, wait_job

SECRET = "durability-secret"
BURST = 200


@dataclass
class Burst:
    registry: LocalRegistry
    digests: dict[str, str]  # repository -> manifest digest, all pushed as :latest

    def reference(self, repository: str) -> str:
        return f"{self.registry.host}/{repository}:latest"

    def payload(self, repository: str, host: str | None = None) -> bytes:
        """What `docker-registry` itself sends for a manifest push (v1 envelope, one event)."""
        return distribution_push(host or self.registry.host, repository, self.digests[repository], "latest")


@pytest.fixture(scope="module")
def burst(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Burst]:
    """A registry (access log on, so reads can be counted) holding BURST distinct tiny images."""
    log_config = {"level": "info", "accesslog": {"disabled": False}}
    with run_registry(extra_config={"log": log_config}) as registry:
        base = LayerSpec([file("etc/os-release", "ID=burst\n")])
        specs = {f"burst/img{n:03d}": ImageSpec([base], env={"IMAGE": str(n)}) for n in range(BURST)}
        digests = push_many(specs, registry.host, tmp_path_factory.mktemp("burst"))
        assert len(set(digests.values())) == BURST
        yield Burst(registry, digests)


def service_env(registry: LocalRegistry, **extra: str) -> dict[str, str]:
    return {
        "GPUBADGE_REGISTRIES": registry.host,
        "GPUBADGE_WEBHOOK_SECRET": SECRET,
        "GPUBADGE_WORKERS": "4",
        **extra,
    }


@dataclass
class Sender:
    """Sends webhooks concurrently and remembers which ones a service acknowledged."""

    url: str
    registry_host: str | None = None  # the host the payloads name (a proxy in front of the registry)
    acked: dict[str, list[str]] = field(default_factory=dict)  # repository -> job ids
    failed: set[str] = field(default_factory=set)

    async def send(
        self, burst: Burst, repositories: list[str], on_ack: asyncio.Event, ack_target: int
    ) -> None:
        limit = asyncio.Semaphore(16)
        timeout = aiohttp.ClientTimeout(total=10)
        async with aiohttp.ClientSession(timeout=timeout) as session:

            async def one(repository: str) -> None:
                async with limit:
                    try:
                        async with session.post(
                            f"{self.url}/hooks/distribution",
                            data=burst.payload(repository, self.registry_host),
                            headers={
                                "Authorization": f"Bearer {SECRET}",
                                "Content-Type": "application/vnd.docker.distribution.events.v1+json",
                            },
                        ) as response:
                            body = await response.json()
                            if response.status != 202:
                                raise AssertionError(f"{repository}: {response.status} {body}")
                    except (aiohttp.ClientError, TimeoutError):
                        self.failed.add(repository)
                        return
                self.failed.discard(repository)
                self.acked.setdefault(repository, []).extend(body["jobs"])
                if len(self.acked) >= ack_target:
                    on_ack.set()

            await asyncio.gather(*(one(repository) for repository in repositories))


def rows(db: Path, query: str) -> list[Any]:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as connection:
        return list(connection.execute(query).fetchall())


def config_reads(registry: LocalRegistry) -> collections.Counter[str]:
    """Manifest GETs by digest, from the registry's own access log (one per scan of an image)."""
    return collections.Counter(
        re.findall(r'"GET /v2/burst/[^"/]+/manifests/(sha256:[0-9a-f]{64}) ', registry.log())
    )


async def test_kill_9_mid_burst_loses_no_acknowledged_push(burst: Burst, tmp_path: Path) -> None:
    db = tmp_path / "gpubadge.db"
    port = free_port()
    env = service_env(burst.registry)
    repositories = sorted(burst.digests)
    sender = Sender(f"http://127.0.0.1:{port}")
    halfway = asyncio.Event()
    reads_before = config_reads(burst.registry)

    with run_service_process(db, env=env, port=port) as first:
        assert first.process is not None
        sending = asyncio.create_task(sender.send(burst, repositories, halfway, ack_target=BURST // 3))
        await asyncio.wait_for(halfway.wait(), timeout=30)
        first.process.send_signal(signal.SIGKILL)  # mid-burst: requests are in flight
        await asyncio.wait_for(sending, timeout=30)
        assert first.process.wait(timeout=10) == -signal.SIGKILL
    acked_by_first = set(sender.acked)
    assert BURST // 3 <= len(acked_by_first) < BURST, "the kill must land mid-burst"
    assert sender.failed, "some deliveries must have failed with the kill"

    with run_service_process(db, env=env, port=port) as second:
        # Registries redeliver what failed; bounded: three rounds at most.
        for _ in range(3):
            if not sender.failed:
                break
            await asyncio.wait_for(sender.send(burst, sorted(sender.failed), asyncio.Event(), BURST + 1), 30)
        assert not sender.failed
        assert set(sender.acked) == set(repositories)

        for repository in repositories:
            for job_id in sender.acked[repository]:
                job = await asyncio.to_thread(wait_job, second.url, job_id, 30.0)
                assert job["state"] == "done", job
        view = by_ref(second.url, burst.reference("burst/img000"), wait=0)
        assert view.status == 200 and view.body["digest"] == burst.digests["burst/img000"]
        listing = call("GET", f"{second.url}/api/images?registry={burst.registry.host}&limit=200").body
        assert listing["total"] == BURST

    # One report per digest, every job done, nothing left queued or running.
    reports = dict(rows(db, "SELECT repository, digest FROM reports"))
    assert reports == burst.digests
    states = dict(rows(db, "SELECT state, count(*) FROM jobs GROUP BY state"))
    assert set(states) == {"done"}, states
    per_reference = collections.Counter(ref for (ref,) in rows(db, "SELECT dedupe_key FROM jobs"))
    assert len(per_reference) == BURST
    # A job runs twice only if the kill caught it mid-scan: at most the scans in flight, 2 x WORKERS (4
    # before their config facts, 4 more reading layers). One killed while reading layers reads them
    # again (issue 43): its pending report is no answer once its job runs again.
    reads = config_reads(burst.registry) - reads_before
    assert set(reads) == set(burst.digests.values())
    rescanned = [digest for digest, count in reads.items() if count > 1]
    assert len(rescanned) <= 2 * 4, rescanned


async def test_sigterm_drains_and_requeues(burst: Burst, tmp_path: Path) -> None:
    """SIGTERM: running scans get `drain_seconds`; one stuck on a hanging registry is requeued."""
    db = tmp_path / "gpubadge.db"
    port = free_port()
    repositories = sorted(burst.digests)[:40]
    stuck = repositories[5]
    async with FaultProxy(burst.registry.url) as proxy:
        proxy.add(Rule("hang", method="GET", path=rf"^/v2/{stuck}/manifests/"))
        env = service_env(burst.registry, GPUBADGE_REGISTRIES=proxy.host, GPUBADGE_DRAIN_SECONDS="1")
        sender = Sender(f"http://127.0.0.1:{port}", registry_host=proxy.host)
        with run_service_process(db, env=env, port=port) as service:
            process = service.process
            assert process is not None
            await asyncio.wait_for(
                sender.send(burst, repositories, asyncio.Event(), len(repositories) + 1), 30
            )
            assert set(sender.acked) == set(repositories)
            await proxy.wait_for_in_flight(1, timeout=15)  # the stuck scan is under way
            first_job = sender.acked[repositories[0]][0]
            assert (await asyncio.to_thread(wait_job, service.url, first_job, 15.0))["state"] == "done"
            process.send_signal(signal.SIGTERM)
            try:
                returncode = await asyncio.to_thread(process.wait, 15)
            except subprocess.TimeoutExpired:
                pytest.fail("gpubadge serve did not exit within 15 s of SIGTERM")
            assert returncode == 0, service.log()[-2000:]

        states = dict(rows(db, "SELECT state, count(*) FROM jobs GROUP BY state"))
        assert "running" not in states, states
        assert states.get("done", 0) + states.get("queued", 0) == len(repositories), states
        stuck_job = sender.acked[stuck][0]
        assert rows(db, f"SELECT state FROM jobs WHERE id = '{stuck_job}'") == [("queued",)]

        proxy.release.set()  # the registry answers again; the next start finishes everything
        with run_service_process(db, env=env, port=port) as again:
            for repository in repositories:
                job = await asyncio.to_thread(wait_job, again.url, sender.acked[repository][0], 30.0)
                assert job["state"] == "done", job
    assert len(rows(db, "SELECT digest FROM reports")) == len(repositories)


def test_jobs_of_a_dead_local_worker_resume_at_the_next_start(
    registry: LocalRegistry, push: Pusher, tmp_path: Path
) -> None:
    """A process on this host that died with jobs running (kill -9) holds leases an hour long here:
    the next start hands them back at once, not when they lapse; a live process keeps its own."""
    from store import SqliteStore

    push(ImageSpec([LayerSpec([file("etc/os-release", "ID=resumed\n")])]), "durable/resumed:1")
    push(ImageSpec([LayerSpec([file("etc/os-release", "ID=kept\n")])]), "durable/kept:1")
    dead_pid = subprocess.Popen(["true"])  # a pid that no longer exists once it is reaped
    dead_pid.wait()
    db = tmp_path / "gpubadge.db"
    store = SqliteStore(db)
    try:
        host = socket.gethostname()
        (dead_job,) = store.enqueue([(f"{registry.host}/durable/resumed:1", registry.host)])
        assert [
            job.id for job in store.claim_jobs(1, owner=f"{host}/{dead_pid.pid}/dead0000", lease_seconds=3600)
        ] == [dead_job]
        (live_job,) = store.enqueue([(f"{registry.host}/durable/kept:1", registry.host)])
        live_owner = f"{host}/{os.getpid()}/live0000"  # this test's process: alive
        assert [job.id for job in store.claim_jobs(1, owner=live_owner, lease_seconds=3600)] == [live_job]
    finally:
        store.close()
    with run_service_process(db, env=service_env(registry)) as service:
        assert wait_job(service.url, dead_job, 20.0)["state"] == "done"
        kept = wait_job(service.url, live_job, 0)
        assert kept["state"] == "running" and kept["attempts"] == 1, kept


def test_sigterm_answers_held_long_polls_and_exits_at_once(tmp_path: Path) -> None:
    """A caller's `?wait=60` (by-ref, public or with the token) must not hold SIGTERM back for a
    minute: each held poll answers with what holds now, and `serve` exits at once."""
    token = "sigterm-token"
    env = {"GPUBADGE_WORKERS": "0", "GPUBADGE_API_TOKEN": token}
    with run_service_process(tmp_path / "polls.db", env=env) as service:
        process = service.process
        assert process is not None
        host, port = service.url.removeprefix("http://").split(":")
        heads = [
            "GET /api/images/by-ref?ref=127.0.0.1:9/never/scanned:1&wait=60 HTTP/1.1\r\nHost: t\r\n\r\n",
            f"GET /api/images/by-ref?ref=127.0.0.1:9/never/scanned:2&wait=60 HTTP/1.1\r\nHost: t\r\n"
            f"Authorization: Bearer {token}\r\n\r\n",
        ]
        polls = []
        for head in heads:
            connection = socket.create_connection((host, int(port)), timeout=1.0)
            connection.sendall(head.encode())
            polls.append(connection)
        for connection in polls:  # held: no answer within a second
            with pytest.raises(TimeoutError):
                connection.recv(1)
        stopped = time.monotonic()
        process.send_signal(signal.SIGTERM)
        for connection in polls:
            connection.settimeout(10.0)
            answer = connection.recv(4096)
            assert answer.startswith(b"HTTP/1.1 "), answer[:80]
            connection.close()
        try:
            returncode = process.wait(10)
        except subprocess.TimeoutExpired:
            pytest.fail("gpubadge serve did not exit within 10 s of SIGTERM with polls held")
        assert returncode == 0, service.log()[-2000:]
        assert time.monotonic() - stopped < 5.0
