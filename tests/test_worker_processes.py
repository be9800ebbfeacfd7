"""`serve` scans in worker processes (issue 44, point 2), and users lose nothing by it.

Each test runs the real `gpubadge serve` with its scans in supervised `gpubadge worker` children
(jobs/worker_processes.py), on SQLite and on PostgreSQL: /metrics counts every scan whichever
child ran it, each child's log lines name it (and lose their secrets), a child killed mid-scan is
started again and its scan finishes, and the children run at a lower CPU priority than the API.
A standalone `gpubadge worker --metrics-port` asks for the API token on /metrics when reads are
private.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from bench.registry_burst import put_manifests, stage_images
from fixtures.registry import LocalRegistry, free_port
from fixtures.service import RunningService, run_role_process, run_service_process, wait_healthy
from scanner.redaction import REDACTED
from tests.faultproxy import FaultProxy, Rule
from tests.test_service_e2e import call, metric_values

TOKEN = "worker-processes-token"
SIGNATURE = "5ecre7519"  # the signature of a pre-signed storage URL a failing scan quotes


def worker_processes(pid: int) -> list[int]:
    """The live children of `serve` that are its worker processes."""
    found = []
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        command = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
        if b"--supervised" in command:
            found.append(int(child))
    return sorted(found)


def niceness(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[16])


def scan_request(service: RunningService, reference: str) -> str:
    reply = call("POST", f"{service.url}/api/scans", json.dumps({"ref": reference}).encode())
    assert reply.status in (200, 201, 202), reply.text
    return str(reply.body["id"])


def wait_job(service: RunningService, job_id: str, wait: float = 30) -> dict[str, object]:
    reply = call("GET", f"{service.url}/api/scans/{job_id}?wait={wait:g}", timeout=wait + 10)
    assert reply.status == 200, reply.text
    return dict(reply.body)


def scans_counted(service: RunningService) -> float:
    return sum(metric_values(call("GET", f"{service.url}/metrics").text, "gpubadge_scans_total").values())


@pytest.fixture
def database(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[dict[str, str]]:
    """The service's store: a SQLite file, or a fresh PostgreSQL database."""
    if request.param == "postgres":
        yield {"GPUBADGE_DATABASE_URL": request.getfixturevalue("postgres_url")}
    else:
        yield {}


@pytest.mark.parametrize("database", ["sqlite", "postgres"], indirect=True)
def test_every_scan_of_every_worker_process_is_counted_and_named(
    registry: LocalRegistry, database: dict[str, str], tmp_path: Path
) -> None:
    staged = stage_images(tmp_path / "layout", registry.url, "workers/app", 8)
    put_manifests(registry.url, "workers/app", staged, 4)
    env = {"GPUBADGE_WORKER_PROCESSES": "2", "GPUBADGE_WORKERS": "2", **database}
    with run_service_process(tmp_path / "w.db", env=env) as service:
        assert service.process is not None
        children = worker_processes(service.process.pid)
        assert len(children) == 2
        # below the API's priority, so webhook answers never wait for a core behind scans
        assert all(niceness(child) == niceness(service.process.pid) + 5 for child in children)
        jobs = [scan_request(service, f"{registry.host}/workers/app:{image.tag}") for image in staged]
        finished = [wait_job(service, job) for job in jobs]
        assert all(job["state"] == "done" for job in finished), finished
        assert scans_counted(service) == len(staged)  # what both children scanned, in serve's /metrics
        exposition = call("GET", f"{service.url}/metrics").text
        assert metric_values(exposition, "gpubadge_worker_processes") == {"": 2.0}
        received = metric_values(exposition, "gpubadge_registry_received_bytes_total")
        assert received.get(f'{{registry="{registry.host}"}}', 0) > 0  # counted in the children
        # small images: each analysed inline, counted in the child that ran it; one whose loop thread spent
        # inline_analysis_ms of CPU (other scans' work on that loop counts too, as on a busy 2-core host)
        # is handed over to an analysis process, and counted so
        inline = metric_values(exposition, "gpubadge_inline_analyses_total")
        assert set(inline) == {'{outcome="finished"}', '{outcome="handed_over"}'}, inline
        assert sum(inline.values()) == len(staged) and inline['{outcome="finished"}'] >= 1, inline
        health = call("GET", f"{service.url}/healthz").body
        assert health["status"] == "ok" and health["workers"] == "running in 2 worker processes", health


@contextlib.asynccontextmanager
async def leaky_registry() -> AsyncIterator[str]:
    """A registry that refuses every manifest with an error code quoting a pre-signed URL (anyone's
    registry may say anything): the scan's error, logged by the worker process, carries it."""

    async def refuse(request: web.Request) -> web.Response:
        code = f"DENIED see https://bucket.s3.amazonaws.com/x?X-Amz-Signature={SIGNATURE}"
        return web.json_response({"errors": [{"code": code}]}, status=400)

    async def ping(request: web.Request) -> web.Response:
        return web.json_response({})

    app = web.Application()
    app.router.add_get("/v2/", ping)
    app.router.add_route("*", "/v2/{name:.+}/manifests/{reference}", refuse)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def test_a_worker_process_logs_name_it_and_lose_their_secrets(tmp_path: Path) -> None:
    async with leaky_registry() as host:
        env = {"GPUBADGE_WORKER_PROCESSES": "1", "GPUBADGE_MAX_ATTEMPTS": "1"}
        with run_service_process(tmp_path / "log.db", env=env) as service:
            assert service.process is not None
            (child,) = worker_processes(service.process.pid)
            async with aiohttp.ClientSession() as session:
                async with session.post(
                    f"{service.url}/api/scans", json={"ref": f"{host}/leak/app:1"}
                ) as reply:
                    job_id = (await reply.json())["id"]
                async with session.get(f"{service.url}/api/scans/{job_id}?wait=30") as reply:
                    job = await reply.json()
            assert job["state"] == "failed", job

            def logged() -> list[str]:  # the worker logs the failure once it is recorded
                return [
                    line for line in service.log().splitlines() if "leak/app:1" in line and "failed" in line
                ]

            deadline = asyncio.get_running_loop().time() + 10
            while not (lines := logged()):
                assert asyncio.get_running_loop().time() < deadline, service.log()[-2000:]
                await asyncio.sleep(0.05)
            # the worker process wrote it, named as serve names it; the signature is gone, the rest stays
            assert re.search(rf" WARNING worker-1\[{child}\] jobs\.workers: scan ", lines[0]), lines[0]
            assert SIGNATURE not in service.log() and f"X-Amz-Signature={REDACTED}" in lines[0], lines[0]


async def test_a_worker_process_killed_mid_scan_is_started_again_and_its_scan_finishes(
    registry: LocalRegistry, tmp_path: Path
) -> None:
    staged = stage_images(tmp_path / "layout", registry.url, "workers/killed", 1, prefix="k")
    put_manifests(registry.url, "workers/killed", staged, 1)
    async with FaultProxy(f"http://{registry.host}") as proxy:
        proxy.add(Rule("hang", method="GET", path=r"/manifests/", times=None))
        env = {
            "GPUBADGE_WORKER_PROCESSES": "1",
            "GPUBADGE_REGISTRIES": proxy.host,
            "GPUBADGE_LEASE_SECONDS": "30",
        }
        with run_service_process(tmp_path / "kill.db", env=env) as service:
            assert service.process is not None
            (doomed,) = worker_processes(service.process.pid)
            timeout = aiohttp.ClientTimeout(total=60)
            async with aiohttp.ClientSession(timeout=timeout) as session:
                reference = f"{proxy.host}/workers/killed:{staged[0].tag}"
                async with session.post(f"{service.url}/api/scans", json={"ref": reference}) as reply:
                    job_id = (await reply.json())["id"]
                await proxy.wait_for_in_flight(1, timeout=20)  # the child is mid-scan
                os.kill(doomed, signal.SIGKILL)
                deadline = asyncio.get_running_loop().time() + 30
                while (started := worker_processes(service.process.pid)) in ([], [doomed]):
                    assert asyncio.get_running_loop().time() < deadline, "no worker process started again"
                    await asyncio.sleep(0.05)
                proxy.release.set()
                async with session.get(f"{service.url}/api/scans/{job_id}?wait=30") as reply:
                    job = await reply.json()
                # the new child found the dead one's lease at its start and ran the job again at once
                assert job["state"] == "done" and job["attempts"] == 2, job
                async with session.get(f"{service.url}/metrics") as reply:
                    exposition = await reply.text()
            assert metric_values(exposition, "gpubadge_worker_process_restarts_total") == {"": 1.0}
            assert metric_values(exposition, "gpubadge_worker_processes") == {"": 1.0}
            assert started != [doomed] and len(started) == 1
            assert f"worker-1 (pid {doomed}) was killed by signal 9" in service.log(), service.log()[-2000:]


def test_a_workers_metrics_port_needs_the_token_when_reads_are_private(tmp_path: Path) -> None:
    port = free_port()
    env = {"GPUBADGE_PUBLIC_READS": "false", "GPUBADGE_API_TOKEN": TOKEN}
    with run_role_process(
        ["worker", "--metrics-port", str(port)], tmp_path / "m.db", env, tmp_path / "m.log"
    ) as process:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, process)  # /healthz stays open for probes
        refused = call("GET", f"{url}/metrics")
        assert refused.status == 401 and "gpubadge_scans_total" not in refused.text
        allowed = call("GET", f"{url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
        assert allowed.status == 200 and "gpubadge_scans_total" in allowed.text


def test_auto_is_one_worker_process_per_two_usable_cores_within_the_containers_quota(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from jobs import settings as job_settings
    from jobs.settings import JobSettings, usable_cores

    quota = tmp_path / "cpu.max"
    quota.write_text("150000 100000\n")  # `docker run --cpus 1.5`: two cores' worth, rounded up
    assert usable_cores(quota) == min(2, len(os.sched_getaffinity(0)))
    quota.write_text("max 100000\n")  # no quota: the affinity decides
    assert usable_cores(quota) == len(os.sched_getaffinity(0))
    for cores, processes in ((1, 1), (2, 1), (4, 2), (16, 8), (64, 8)):
        monkeypatch.setattr(job_settings, "usable_cores", lambda cores=cores: cores)
        assert JobSettings(worker_processes="auto").worker_process_count() == processes
    assert JobSettings(worker_processes=0).worker_process_count() == 0  # scans in the API's process
    with pytest.raises(ValueError, match="worker_processes"):
        JobSettings(worker_processes=-1)


def test_idle_scheduling_runs_scans_and_their_analysis_only_on_cpu_time_nothing_else_wants(
    registry: LocalRegistry, tmp_path: Path
) -> None:
    staged = stage_images(tmp_path / "layout", registry.url, "idle/app", 2)
    put_manifests(registry.url, "idle/app", staged, 2)
    env = {"GPUBADGE_WORKER_PROCESSES": "1", "GPUBADGE_WORKER_SCHEDULING": "idle"}
    with run_service_process(tmp_path / "idle.db", env=env) as service:
        assert service.process is not None
        [child] = worker_processes(service.process.pid)
        assert os.sched_getscheduler(service.process.pid) == os.SCHED_OTHER  # the API keeps its share
        assert os.sched_getscheduler(child) == os.SCHED_IDLE
        jobs = [scan_request(service, f"{registry.host}/idle/app:{image.tag}") for image in staged]
        assert all(wait_job(service, job)["state"] == "done" for job in jobs)  # an idle host runs them
        analysis = Path(f"/proc/{child}/task/{child}/children").read_text().split()
        assert analysis, "the worker's analysis processes are started before its first claim"
        assert all(os.sched_getscheduler(int(pid)) == os.SCHED_IDLE for pid in analysis)


def test_idle_scheduling_refused_by_the_host_falls_back_to_niceness_and_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from jobs import worker_process
    from jobs.settings import JobSettings

    asked: list[int] = []

    def refused(pid: int, policy: int, parameters: object) -> None:
        asked.append(policy)
        raise PermissionError(1, "Operation not permitted")

    niced: list[int] = []
    monkeypatch.setattr(os, "sched_setscheduler", refused)
    monkeypatch.setattr(os, "nice", niced.append)  # never lower the test process itself
    with caplog.at_level("WARNING"):
        worker_process.yield_cpu_to_the_api(JobSettings(worker_scheduling="idle", worker_nice=7))
    assert (asked, niced) == ([os.SCHED_IDLE], [7])
    assert "GPUBADGE_WORKER_SCHEDULING=idle is not available here" in caplog.text
    asked.clear()
    niced.clear()
    worker_process.yield_cpu_to_the_api(JobSettings())  # the default: niceness, SCHED_IDLE never asked
    assert (asked, niced) == ([], [5])
    with pytest.raises(ValueError, match="worker_scheduling"):
        JobSettings(worker_scheduling="fast")
