"""Scale-out on one PostgreSQL: 2 API processes and 2 worker processes, one worker killed mid-burst.

Every process is a real `gpubadge serve --workers 0` or `gpubadge worker`, every image
was pushed by skopeo into the real registry, every webhook is the payload
`docker-registry` itself sends. What must hold: every image is scanned and listed by
both APIs, none fails, each has one stored report; the killed worker's jobs come back
through their leases; no SQLite file is written; and two APIs taking deploys at once
never reserve one GPU twice.
"""

from __future__ import annotations

import asyncio
import collections
import json
import signal
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import psycopg
import pytest
import yaml

from fixtures.notifications import distribution_push
from fixtures.oci import ImageSpec, LayerSpec, file, push_many
from fixtures.registry import LocalRegistry, free_port, run_registry
from fixtures.service import RunningService, run_role_process, run_service_process, wait_healthy
from store import queries
from tests.test_service_e2e import call, metric_values, wait_job

SECRET = "scale-secret"
API_TOKEN = "scale-api-token"
IMAGES = 300
LEASE_SECONDS = 3  # a killed worker's jobs return within a lease, plus a third of one


@dataclass
class Pushed:
    registry: LocalRegistry
    digests: dict[str, str]  # repository -> manifest digest, pushed as :latest

    def payload(self, repository: str) -> bytes:
        """A Distribution v1 notification envelope for one manifest push, as the registry sends it."""
        return distribution_push(self.registry.host, repository, self.digests[repository], "latest")


@pytest.fixture(scope="module")
def pushed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pushed]:
    with run_registry() as registry:
        base = LayerSpec([file("etc/os-release", "ID=scale\n")])
        specs = {
            f"scale/img{n:03d}": ImageSpec(
                [base], env={"IMAGE": str(n), **({"CUDA_VERSION": "12.4.1"} if n % 3 == 0 else {})}
            )
            for n in range(IMAGES)
        }
        digests = push_many(specs, registry.host, tmp_path_factory.mktemp("scale"))
        assert len(set(digests.values())) == IMAGES
        yield Pushed(registry, digests)


def role_env(database_url: str, registry: LocalRegistry, **extra: str) -> dict[str, str]:
    return {
        "GPUBADGE_DATABASE_URL": database_url,
        "GPUBADGE_REGISTRIES": registry.host,
        "GPUBADGE_WEBHOOK_SECRET": SECRET,
        "GPUBADGE_API_TOKEN": API_TOKEN,
        "GPUBADGE_LEASE_SECONDS": str(LEASE_SECONDS),
        **extra,
    }


def sql(url: str, query: str, params: list[Any] | None = None) -> list[tuple[Any, ...]]:
    with psycopg.connect(url, connect_timeout=10) as conn:
        return list(conn.execute(query.encode(), params or []).fetchall())


async def deliver(session: aiohttp.ClientSession, api: str, body: bytes) -> list[str]:
    """One webhook delivery; a registry retries until it gets its 2xx, and so does this (bounded)."""
    for attempt in range(5):
        try:
            async with session.post(
                f"{api}/hooks/distribution",
                data=body,
                headers={
                    "Authorization": f"Bearer {SECRET}",
                    "Content-Type": "application/vnd.docker.distribution.events.v1+json",
                },
            ) as response:
                reply = await response.json()
                assert response.status == 202, reply
                jobs: list[str] = reply["jobs"]
                return jobs
        except (aiohttp.ClientError, TimeoutError):
            if attempt == 4:
                raise
            await asyncio.sleep(0.2 * (attempt + 1))
    raise AssertionError("unreachable")


def wait_until(predicate: Any, timeout: float, what: str) -> None:
    """Bounded wait on an observable condition (a database count, a process state)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {timeout}s")
        time.sleep(0.02)


def list_all(api: str, registry_host: str) -> dict[str, str]:
    """Every listed image (repository -> digest), following pagination."""
    found: dict[str, str] = {}
    page = 1
    while True:
        reply = call("GET", f"{api}/api/images?registry={registry_host}&limit=100&page={page}")
        assert reply.status == 200, reply.text
        for image in reply.body["images"]:
            found[image["repository"]] = image["digest"]
        if page * 100 >= reply.body["total"]:
            return found
        page += 1


async def test_two_apis_two_workers_one_killed_every_image_scanned_once(
    pushed: Pushed, postgres_url: str, tmp_path: Path
) -> None:
    # One registry: its cap is every worker slot (the default, half the workers, leaves each
    # worker so few jobs at a time that the kill could land between two of them).
    env = role_env(postgres_url, pushed.registry, GPUBADGE_PER_REGISTRY_SCANS="8")
    sqlite_paths = [tmp_path / f"{role}.db" for role in ("api0", "api1", "worker0", "worker1")]
    repositories = sorted(pushed.digests)
    with ExitStack() as stack:
        apis: list[RunningService] = [
            stack.enter_context(
                run_service_process(
                    sqlite_paths[n],
                    env=env,
                    args=("serve", "--workers", "0"),
                    log_path=tmp_path / f"api{n}.log",
                )
            )
            for n in range(2)
        ]
        metrics_ports = [free_port(), free_port()]
        workers = [
            stack.enter_context(
                run_role_process(
                    ("worker", "--concurrency", "4", "--metrics-port", str(metrics_ports[n])),
                    sqlite_paths[2 + n],
                    env,
                    tmp_path / f"worker{n}.log",
                )
            )
            for n in range(2)
        ]
        # Both claim before the first push: a worker that started after the victim died would hand its
        # jobs back at start (a dead local owner), not through their leases, which this test is about.
        for port, worker in zip(metrics_ports, workers, strict=True):
            await asyncio.to_thread(wait_healthy, f"http://127.0.0.1:{port}", worker, 60.0)
        victim, metrics_port = workers[0], metrics_ports[1]
        acked: dict[str, list[str]] = {}
        timeout = aiohttp.ClientTimeout(total=20)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            limit = asyncio.Semaphore(24)

            async def one(n: int, repository: str) -> None:
                async with limit:
                    acked[repository] = await deliver(session, apis[n % 2].url, pushed.payload(repository))

            sending = asyncio.gather(*(one(n, repo) for n, repo in enumerate(repositories)))

            def done_count() -> int:
                return int(sql(postgres_url, "SELECT count(*) FROM jobs WHERE state = 'done'")[0][0])

            def victim_holds_jobs() -> bool:
                held = sql(
                    postgres_url,
                    "SELECT count(*) FROM jobs WHERE state = 'running' AND lease_owner LIKE %s",
                    [f"%/{victim.pid}/%"],
                )
                return bool(held[0][0])

            def stopped_holding_jobs() -> bool:
                """Stops the victim, and leaves it stopped only if it holds jobs then: its jobs cannot
                end between this look and the kill."""
                if done_count() < IMAGES // 3 or not victim_holds_jobs():
                    return False
                victim.send_signal(signal.SIGSTOP)
                if victim_holds_jobs():
                    return True
                victim.send_signal(signal.SIGCONT)
                return False

            # a third of the way through, with scans of its own under way, one worker dies with SIGKILL
            await asyncio.to_thread(
                wait_until, stopped_holding_jobs, 90, "a third scanned, the victim holding jobs"
            )
            victim.send_signal(signal.SIGKILL)
            assert victim.wait(timeout=10) == -signal.SIGKILL
            done_at_kill = done_count()
            # read after the kill: a scan the victim finished just before it died is not orphaned
            orphaned = {
                row[0]
                for row in sql(
                    postgres_url,
                    "SELECT id FROM jobs WHERE state = 'running' AND lease_owner LIKE %s",
                    [f"%/{victim.pid}/%"],
                )
            }
            await asyncio.wait_for(sending, timeout=60)
        assert set(acked) == set(repositories)
        assert orphaned, "the kill must land while the worker held jobs"
        assert IMAGES // 3 <= done_at_kill < IMAGES, "the kill must land a third of the way through"

        # Every acknowledged job ends done; each wait goes to the API that did not take the webhook,
        # so `?wait=` must hear of jobs finished by a worker process it never talked to.
        for n, repository in enumerate(repositories):
            for job_id in acked[repository]:
                job = await asyncio.to_thread(wait_job, apis[(n + 1) % 2].url, job_id, 60.0)
                assert job["state"] == "done", job
        for job_id in orphaned:  # the dead worker's scans came back through their leases
            attempts = sql(postgres_url, "SELECT attempts, state FROM jobs WHERE id = %s", [job_id])
            assert attempts[0][1] == "done" and attempts[0][0] >= 2, attempts

        # the survivor's own /metrics counts its scans and the dead worker's lapsed leases
        exposition = call("GET", f"http://127.0.0.1:{metrics_port}/metrics").text
        scans = metric_values(exposition, "gpubadge_scans_total")
        assert sum(scans.values()) > 0, exposition
        assert metric_values(exposition, "gpubadge_lease_expiries_total").get('{outcome="queued"}', 0) >= 1
        listings = [await asyncio.to_thread(list_all, api.url, pushed.registry.host) for api in apis]
        expected = {repository: digest for repository, digest in pushed.digests.items()}
        assert listings[0] == expected and listings[1] == expected

    reports = sql(postgres_url, "SELECT repository, digest FROM reports")
    assert len(reports) == IMAGES and dict(reports) == pushed.digests  # one report per digest
    states = dict(sql(postgres_url, "SELECT state, count(*) FROM jobs GROUP BY state"))
    assert set(states) == {"done"}, states  # nothing failed, nothing left behind
    per_reference = collections.Counter(row[0] for row in sql(postgres_url, "SELECT dedupe_key FROM jobs"))
    assert len(per_reference) == IMAGES
    assert not [path for path in sqlite_paths if path.exists()], "a SQLite file was written"
    tables = {
        row[0] for row in sql(postgres_url, "SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
    }
    assert {"reports", "jobs", "reservations", "schema_migrations"} <= tables


def gpu(index: int, server: str) -> dict[str, Any]:
    return {
        "index": index,
        "uuid": f"GPU-{server}-{index}",
        "name": "NVIDIA H100 80GB HBM3",
        "brand": "NVIDIA",
        "memory_mib": 81559,
        "compute_capability": "9.0",
    }


async def test_two_apis_taking_50_deploys_each_never_reserve_one_gpu_twice(
    pushed: Pushed, postgres_url: str, tmp_path: Path
) -> None:
    fleet = {
        "servers": [
            {
                "name": f"node-{s}",
                "arch": "amd64",
                "cpus": 64,
                "memory": "512Gi",
                "driver_version": "550.54.15",
                "cuda_driver_version": "12.4",
                "gpus": [gpu(i, f"node-{s}") for i in range(4)],
            }
            for s in range(6)
        ]
    }
    inventory = tmp_path / "fleet.yaml"
    inventory.write_text(yaml.safe_dump(fleet))
    env = role_env(postgres_url, pushed.registry, GPUBADGE_INVENTORY_FILE=str(inventory))
    image = f"{pushed.registry.host}/scale/img000:latest"  # a CUDA 12.4 image
    with ExitStack() as stack:
        apis = [
            stack.enter_context(
                run_service_process(
                    tmp_path / f"api{n}.db",
                    env=env,
                    args=("serve", "--workers", "0"),
                    log_path=tmp_path / f"d{n}.log",
                )
            )
            for n in range(2)
        ]
        headers = {"Authorization": f"Bearer {API_TOKEN}"}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            for api in apis:  # the image is scanned before the burst (outside the race)
                async with session.post(
                    f"{api.url}/api/eligibility", json={"image": image, "gpus": 1}, headers=headers
                ) as response:
                    assert response.status == 200, await response.text()

            async def deploy(api: RunningService) -> tuple[int, Any]:
                async with session.post(
                    f"{api.url}/api/deployments", json={"image": image, "gpus": 1}, headers=headers
                ) as response:
                    return response.status, await response.json()

            results = await asyncio.gather(*(deploy(apis[n % 2]) for n in range(100)))
            statuses = collections.Counter(status for status, _ in results)
            assert set(statuses) <= {201, 409}, statuses
            assert 1 <= statuses[201] <= 24, statuses
            # Then one at a time, alternating APIs, until no GPU is left: every GPU the burst did not
            # take is still reservable exactly once (a lost race never leaks or double-books a GPU).
            for n in range(30):
                status, body = await deploy(apis[n % 2])
                if status == 409:
                    break
                assert status == 201, body
                results.append((status, body))
            else:
                raise AssertionError("more deploys succeeded than there are GPUs")
    granted = [gpu_id for status, body in results if status == 201 for gpu_id in body["gpus"]]
    assert len(granted) == len(set(granted)), "one GPU was reserved twice"
    assert len(granted) == 24  # 6 nodes x 4 GPUs, each reserved by exactly one deploy
    reserved = sql(postgres_url, "SELECT gpu_uuid, deployment_id FROM reservations")
    assert sorted(row[0] for row in reserved) == sorted(granted)
    assert {body["id"] for status, body in results if status == 201} == {row[1] for row in reserved}


async def test_an_agent_polling_one_api_hears_of_a_deploy_taken_by_the_other(
    pushed: Pushed, postgres_url: str, tmp_path: Path
) -> None:
    agent_token = "scale-agent-token"
    env = role_env(postgres_url, pushed.registry, GPUBADGE_AGENT_TOKEN=agent_token)
    image = f"{pushed.registry.host}/scale/img000:latest"  # a CUDA 12.4 image
    server = {
        "name": "solo",
        "arch": "amd64",
        "cpus": 32,
        "memory": "256Gi",
        "driver_version": "550.54.15",
        "cuda_driver_version": "12.4",
        "gpus": [gpu(0, "solo")],
    }
    with ExitStack() as stack:
        first, second = (
            stack.enter_context(
                run_service_process(
                    tmp_path / f"a{n}.db",
                    env=env,
                    args=("serve", "--workers", "0"),
                    log_path=tmp_path / f"a{n}.log",
                )
            )
            for n in range(2)
        )
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=90)) as session:
            agent = {"Authorization": f"Bearer {agent_token}"}
            async with session.post(f"{second.url}/api/servers", json=server, headers=agent) as response:
                assert response.status in (200, 201), await response.text()

            def last_heartbeat() -> Any:
                return sql(postgres_url, "SELECT last_heartbeat FROM server_heartbeats WHERE name = 'solo'")[
                    0
                ][0]

            before = last_heartbeat()

            async def poll() -> Any:
                """Poll as the agent does: again after each empty answer (an idle poll ends at its
                server's own point of the cycle, so maybe before the deployment is placed)."""
                while True:
                    async with session.get(
                        f"{second.url}/api/agents/solo/deployments?wait=60", headers=agent
                    ) as reply:
                        assert reply.status == 200
                        answer = await reply.json()
                    if answer["deployments"]:
                        return answer

            polling = asyncio.create_task(poll())
            # the poll has reached the second API (it heartbeats first), and nothing is there for it yet
            await asyncio.to_thread(
                wait_until, lambda: last_heartbeat() != before, 30, "the agent's poll arrived"
            )
            async with session.post(
                f"{first.url}/api/deployments",
                json={"image": image, "gpus": 1},
                headers={"Authorization": f"Bearer {API_TOKEN}"},
            ) as response:
                created = await response.json()
                assert response.status == 201, created
            # without the other replica's NOTIFY no poll of the second API would hear of it: that API
            # knows which servers have work and reads the store for no other
            answer = await asyncio.wait_for(polling, timeout=30)
    assert [deployment["id"] for deployment in answer["deployments"]] == [created["id"]]


def test_gpubadge_scan_writes_to_the_configured_postgresql_and_no_sqlite_file(
    pushed: Pushed, postgres_url: str, tmp_path: Path
) -> None:
    import os
    import subprocess
    import sys

    reference = f"{pushed.registry.host}/scale/img003:latest"
    env = {
        **os.environ,
        "GPUBADGE_DATABASE_URL": postgres_url,
        "GPUBADGE_REGISTRIES": pushed.registry.host,
        "XDG_DATA_HOME": str(tmp_path / "data"),  # where the default SQLite file would go
        "HOME": str(tmp_path / "home"),
    }
    env.pop("GPUBADGE_DB", None)
    done = subprocess.run(
        [sys.executable, "-m", "gpubadge.cli", "scan", "--json", reference],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["digest"] == pushed.digests["scale/img003"]
    stored = sql(postgres_url, "SELECT digest FROM reports WHERE repository = 'scale/img003'")
    assert stored == [(pushed.digests["scale/img003"],)]
    assert not list(tmp_path.rglob("*.db")), "a SQLite file was written"


def test_an_api_only_replica_stays_ready_while_no_worker_runs(
    pushed: Pushed, postgres_url: str, tmp_path: Path
) -> None:
    """Readiness on /healthz must not pull every API replica out of the load balancer because the
    workers (another Deployment) are down: the stall is reported, the replica stays ready."""
    env = role_env(postgres_url, pushed.registry, GPUBADGE_STALL_SECONDS="0.2")
    with run_service_process(tmp_path / "api.db", env=env, args=("serve", "--workers", "0")) as api:
        queued = call(
            "POST",
            f"{api.url}/api/scans",
            {"ref": f"{pushed.registry.host}/scale/img001:latest"},
            headers={"Authorization": f"Bearer {API_TOKEN}"},
        )
        assert queued.status == 202, queued.text

        def stalled() -> bool:
            return "stalled" in call("GET", f"{api.url}/healthz").body

        wait_until(stalled, 30, "the stall reported")
        health = call("GET", f"{api.url}/healthz")
        assert health.status == 200 and health.body["workers"] == "none in this process"
        assert "no worker has made progress" in health.body["stalled"]


def test_a_worker_exits_cleanly_on_sigterm_and_hands_back_its_jobs(
    pushed: Pushed, postgres_url: str, tmp_path: Path
) -> None:
    """SIGTERM (a rollout): no new claims, running scans get the drain time, the rest go back at once."""
    from store.postgres import PostgresStore

    env = role_env(postgres_url, pushed.registry, GPUBADGE_DRAIN_SECONDS="0.1")
    store = PostgresStore(postgres_url, pool_size=1)
    try:
        store.enqueue(
            [(f"{pushed.registry.host}/scale/img{n:03d}:latest", pushed.registry.host) for n in range(60)]
        )
        with run_role_process(
            ("worker", "--concurrency", "4"), tmp_path / "w.db", env, tmp_path / "w.log"
        ) as worker:
            wait_until(lambda: store.run(queries.queue_depth)["running"] > 0, 60, "the worker claimed jobs")
            worker.send_signal(signal.SIGTERM)
            assert worker.wait(timeout=30) == 0, (tmp_path / "w.log").read_text()[-2000:]
        depth = store.run(queries.queue_depth)
        assert depth["running"] == 0 and depth["failed"] == 0, depth  # nothing left leased to a dead process
        assert depth["queued"] + depth["done"] == 60, depth
        assert not store.lease_owners()
    finally:
        store.close()
    assert not (tmp_path / "w.db").exists()
