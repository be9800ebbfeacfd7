"""Who may see and do what, over HTTP against a running service (issue 10, web side).

Secrets stay out of the access log, error messages and API answers; reads that would start
work need the API token; per-source webhook secrets refuse the other sources; per-agent tokens
are bound to their server; one GPU UUID cannot be reported by two live servers; hostile
deployment bodies are refused with a reason.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import socket
import sqlite3
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from pydantic import SecretStr

from fixtures import catalog
from fixtures.registry import LocalRegistry, free_port
from fixtures.service import run_service_inprocess
from scanner.redaction import REDACTED, RedactingLogFilter, redact_secrets
from tests.conftest import Pusher
from tests.test_placement import FakeClock
from web.app import create_app
from web.bounded_json import INTEROPERABLE_INTEGER, JsonLimitExceeded, JsonLimits, loads_bounded
from web.fleet.live_fleet import FLEET_INDEX, FleetIndexCache
from web.security import RedactingAccessLogger
from web.settings import ServiceSettings
from web.state import SERVICES

API_TOKEN = "api-token-7c1e5"
TOKEN_A = "agent-a-token-44d1"
TOKEN_B = "agent-b-token-9e02"
FLEET_TOKEN = "fleet-wide-token-31c7"
HOOK_SECRET = "distribution-secret-58aa"


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def basic(token: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"anyone:{token}".encode()).decode()}


def agent(name: str, *gpu_uuids: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    gpus = [
        {
            "index": index,
            "uuid": uuid,
            "name": "NVIDIA H100 80GB HBM3",
            "brand": "NVIDIA",
            "memory_mib": 81559,
            "compute_capability": "9.0",
        }
        for index, uuid in enumerate(gpu_uuids)
    ]
    return {
        "name": name,
        "arch": "amd64",
        "cpus": 8,
        "memory": "32Gi",
        "driver_version": "550.54.15",
        "cuda_driver_version": "12.4",
        "gpus": gpus,
        "labels": labels or {},
    }


@dataclass
class Reply:
    status: int
    body: Any
    text: str
    headers: Any


@dataclass
class Service:
    url: str
    app: web.Application
    clock: FakeClock
    image: str

    async def call(
        self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
    ) -> Reply:
        data = body if isinstance(body, bytes) else (None if body is None else json.dumps(body).encode())
        async with (
            aiohttp.ClientSession() as session,
            session.request(
                method,
                self.url + path,
                data=data,
                headers={"Content-Type": "application/json", **(headers or {})},
                allow_redirects=False,
            ) as response,
        ):
            text = await response.text()
            try:
                parsed = json.loads(text)
            except ValueError:
                parsed = None
            return Reply(response.status, parsed, text, response.headers)

    def advance(self, seconds: float) -> None:
        """Move the fleet's clocks (monotonic and wall) on by `seconds`: an agent not heard since
        is that much more silent. The timed check runs when the first agent is due."""
        self.clock.now += seconds


@pytest.fixture
async def service(tmp_path: Path, registry: LocalRegistry, push: Pusher) -> AsyncIterator[Service]:
    push(catalog.static_scratch(), "sec/static:1")
    settings = ServiceSettings(
        db=tmp_path / "sec.db",
        api_token=SecretStr(API_TOKEN),
        agent_token=SecretStr(FLEET_TOKEN),
        agent_tokens={"node-a": SecretStr(TOKEN_A), "node-b": SecretStr(TOKEN_B)},
        webhook_secrets={"distribution": SecretStr(HOOK_SECRET)},
        json_max_string=4096,
        docker_config=None,
    )
    app = create_app(settings, start_workers=False)  # queued jobs stay queued: the queue is the witness
    clock = FakeClock()
    app[FLEET_INDEX] = FleetIndexCache(check_seconds=5.0, clock=clock, wall=clock.wall)
    runner = web.AppRunner(app, access_log_class=RedactingAccessLogger)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield Service(f"http://127.0.0.1:{port}", app, clock, f"{registry.host}/sec/static:1")
    finally:
        await runner.cleanup()


def distribution_push(host: str, repository: str = "sec/app") -> dict[str, Any]:
    target = {
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "digest": "sha256:" + "2" * 64,
        "repository": repository,
        "tag": "1",
    }
    return {"events": [{"action": "push", "target": target, "request": {"host": host}}]}


async def queued(service: Service) -> int:
    reply = await service.call("GET", "/healthz")
    return sum(reply.body["queue"].values())


# ------------------------------------------------------------------ secrets never shown


async def test_access_log_redacts_secrets_in_urls(
    service: Service, registry: LocalRegistry, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="aiohttp.access")
    reply = await service.call(
        "POST", f"/hooks/distribution?token={HOOK_SECRET}", distribution_push(registry.host)
    )
    assert reply.status == 202, reply.text
    await service.call("GET", "/api/images?page=1&X-Amz-Signature=sig-0a1b2c3d&%74oken=encoded-9z8y")
    await service.call(
        "GET", "/api/images", headers={"Referer": "https://ci.example.com/job?access_token=ref-5f5f5f"}
    )
    lines = [record for record in caplog.records if record.name == "aiohttp.access"]
    assert len(lines) == 3
    text = "\n".join(record.getMessage() for record in lines)
    for secret in (HOOK_SECRET, "sig-0a1b2c3d", "encoded-9z8y", "ref-5f5f5f"):
        assert secret not in text
        assert all(secret not in str(record.__dict__) for record in lines)  # nor in `extra` fields
    assert f"/hooks/distribution?token={REDACTED}" in text
    assert "page=1" in text  # only secrets go


async def test_error_messages_do_not_carry_secrets(service: Service, registry: LocalRegistry) -> None:
    store = service.app[SERVICES].store
    reference = f"{registry.host}/sec/app:1"
    (job_id,) = await store.enqueue([(reference, registry.host)], source="api", max_attempts=1)
    (claimed,) = await store.run(store.backend.claim_jobs, 1, owner="test", lease_seconds=60)
    assert claimed.id == job_id
    presigned = "https://bucket.s3.amazonaws.com/blob?X-Amz-Credential=AKIAEXAMPLE&X-Amz-Signature=0ddba11"
    await store.fail_job(job_id, f"blob download failed: 403 from {presigned}", retry_in=None, owner="test")
    for path in (f"/api/scans/{job_id}", "/api/scans"):
        reply = await service.call("GET", path)
        assert reply.status == 200
        assert "0ddba11" not in reply.text and "AKIAEXAMPLE" not in reply.text, reply.text
        assert "bucket.s3.amazonaws.com/blob" in reply.text  # the rest stays readable
    page = await service.call("GET", "/scans")
    assert "0ddba11" not in page.text and "bucket.s3.amazonaws.com" in page.text
    badge = await service.call("GET", f"/badge/{registry.host}/sec/app/1.svg")  # the reason is in its title
    assert badge.status == 200 and "bucket.s3.amazonaws.com" in badge.text and "0ddba11" not in badge.text
    # A wrong webhook token is not echoed back.
    reply = await service.call(
        "POST", "/hooks/distribution?token=wrong-guess-1234", distribution_push(registry.host)
    )
    assert reply.status == 401 and "wrong-guess-1234" not in reply.text


def test_log_filter_redacts_formatted_messages() -> None:
    record = logging.LogRecord(
        "scanner",
        logging.WARNING,
        __file__,
        1,
        "scan of %s failed: %s",
        ("app:1", "GET https://s3/x?sig=abc123"),
        None,
    )
    assert RedactingLogFilter().filter(record)
    assert record.getMessage() == f"scan of app:1 failed: GET https://s3/x?sig={REDACTED}"
    plain = logging.LogRecord("web", logging.INFO, __file__, 1, "%d jobs", (3,), None)
    assert RedactingLogFilter().filter(plain) and plain.args == (3,)  # untouched when nothing to redact


def test_redaction_keeps_what_a_reader_needs() -> None:
    assert redact_secrets("GET /x?a=1&token=s3&b=2") == f"GET /x?a=1&token={REDACTED}&b=2"
    assert redact_secrets("https://u:pw@h/v2/") == f"https://u:{REDACTED}@h/v2/"
    assert (
        redact_secrets("sent Authorization: Bearer abcdefgh1234") == f"sent Authorization: Bearer {REDACTED}"
    )
    assert redact_secrets("Basic authentication is supported") == "Basic authentication is supported"
    assert redact_secrets("need Authorization: Bearer <token>") == "need Authorization: Bearer <token>"
    assert redact_secrets("cannot reach registry-1.docker.io:443") == "cannot reach registry-1.docker.io:443"


async def test_deployment_env_values_need_the_api_token(service: Service) -> None:
    assert (
        await service.call("POST", "/api/servers", agent("node-b", labels={"pool": "b"}), bearer(TOKEN_B))
    ).status == 200
    request = {
        "image": service.image,
        "labels": {"pool": "b"},
        "env": {"DB_PASSWORD": "hunter2-secret", "MODE": "batch"},
    }
    created = await service.call("POST", "/api/deployments", request, bearer(API_TOKEN))
    assert created.status == 201, created.text
    assert created.body["env"] == {"DB_PASSWORD": "hunter2-secret", "MODE": "batch"}  # the token holder
    deployment_id = created.body["id"]
    masked = {"DB_PASSWORD": REDACTED, "MODE": REDACTED}
    for path in (f"/api/deployments/{deployment_id}", "/api/deployments", "/api/deployments?server=node-b"):
        anonymous = await service.call("GET", path)
        assert anonymous.status == 200
        assert "hunter2-secret" not in anonymous.text
        shown = anonymous.body if "env" in anonymous.body else anonymous.body["deployments"][0]
        assert shown["env"] == masked  # the names stay visible
        wrong = await service.call("GET", path, headers=bearer("not-the-token"))
        assert "hunter2-secret" not in wrong.text
        holder = await service.call("GET", path, headers=bearer(API_TOKEN))
        assert "hunter2-secret" in holder.text
    # The agent gets the values through its authenticated poll, and only there.
    poll = await service.call("GET", "/api/agents/node-b/deployments?wait=0", headers=bearer(TOKEN_B))
    assert poll.status == 200 and poll.body["deployments"][0]["env"]["DB_PASSWORD"] == "hunter2-secret"
    report = await service.call(
        "POST",
        f"/api/deployments/{deployment_id}/status",
        {"state": "running", "logs": "connecting with password hunter2-secret\n"},
        bearer(TOKEN_B),
    )
    assert report.status == 200 and "hunter2-secret" not in report.text
    # The container's output may print the same secrets: it is shown to token holders only.
    anonymous = await service.call("GET", f"/api/deployments/{deployment_id}")
    assert anonymous.body["logs"] == REDACTED and "hunter2-secret" not in anonymous.text
    holder = await service.call("GET", f"/api/deployments/{deployment_id}", headers=bearer(API_TOKEN))
    assert holder.body["logs"] == "connecting with password hunter2-secret\n"
    for page in ("/servers", "/"):
        assert "hunter2-secret" not in (await service.call("GET", page)).text


# ------------------------------------------------------------------ reads that cost work


async def test_eligibility_of_an_unscanned_image_needs_the_token_to_scan(service: Service) -> None:
    request = {"image": service.image}
    before = await queued(service)
    for headers in ({}, bearer("wrong-token-000")):
        reply = await service.call("POST", "/api/eligibility", request, headers)
        assert reply.status == 404, reply.text
        assert "POST /api/scans" in reply.body["error"] and "API token" in reply.body["error"]
    page = await service.call("GET", f"/eligibility?image={service.image}")
    assert page.status == 404 and "has not been scanned yet" in page.text and "Scans page" in page.text
    assert await queued(service) == before
    assert (
        await service.call("GET", f"/api/images/by-ref?ref={service.image}")
    ).status == 404  # nothing scanned
    # Once a scan is queued (by the token holder), the answer says so instead.
    queued_reference = service.image.rsplit(":", 1)[0] + ":queued"  # the tag, never the registry's port
    job = await service.call("POST", "/api/scans", {"ref": queued_reference}, bearer(API_TOKEN))
    assert job.status == 202, job.text
    reply = await service.call("POST", "/api/eligibility", {"image": queued_reference})
    assert reply.status == 404 and "its scan is queued" in reply.body["error"], reply.text
    scanned = await service.call("POST", "/api/eligibility", request, bearer(API_TOKEN))
    assert scanned.status == 200, scanned.text
    again = await service.call("POST", "/api/eligibility", request)  # stored results stay open
    assert again.status == 200 and again.body["image"] == scanned.body["image"]


@pytest.fixture
async def private_service(tmp_path: Path, registry: LocalRegistry, push: Pusher) -> AsyncIterator[Service]:
    push(catalog.static_scratch(), "sec/static:1")
    settings = ServiceSettings(
        db=tmp_path / "private.db",
        api_token=SecretStr(API_TOKEN),
        agent_token=SecretStr(TOKEN_A),
        public_reads=False,
        docker_config=None,
    )
    app = create_app(settings, start_workers=False)
    runner = web.AppRunner(app, access_log_class=RedactingAccessLogger)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield Service(f"http://127.0.0.1:{port}", app, FakeClock(), f"{registry.host}/sec/static:1")
    finally:
        await runner.cleanup()


async def test_private_reads_need_the_token(private_service: Service) -> None:
    service = private_service
    scanned = await service.call("POST", "/api/eligibility", {"image": service.image}, bearer(API_TOKEN))
    assert scanned.status == 200, scanned.text
    badge = f"/badge/{service.image.replace(':1', '/1')}.svg"
    reads = [
        "/api/images",
        f"/api/images/by-ref?ref={service.image}",
        "/api/scans",
        "/api/servers",
        "/api/deployments",
        "/",
        f"/images/{service.image}",
        "/scans",
        "/servers",
        f"/eligibility?image={service.image}",
        badge,
        "/metrics",
    ]
    for path in reads:
        anonymous = await service.call("GET", path)
        assert anonymous.status == 401, (path, anonymous.status)
        challenge = anonymous.headers.get("WWW-Authenticate", "")
        assert challenge.startswith("Bearer" if path.startswith("/api/") else "Basic"), (path, challenge)
        assert (await service.call("GET", path, headers=bearer("wrong"))).status == 401, path
        allowed = await service.call("GET", path, headers=bearer(API_TOKEN))
        assert allowed.status == 200, (path, allowed.status, allowed.text[:200])
        if not path.startswith("/api/"):  # a browser signs in with HTTP Basic, the token as password
            assert (await service.call("GET", path, headers=basic(API_TOKEN))).status == 200, path
    anonymous = await service.call("POST", "/api/eligibility", {"image": service.image})
    assert anonymous.status == 401
    # The UI's scan form answers with the job list: it needs the token as well.
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    posted = await service.call("POST", "/scans", b"ref=alpine&token=wrong", form)
    assert posted.status == 401 and "alpine" not in posted.text
    # Always open: liveness, the API description, the stylesheet, and agents with their own token.
    for path in ("/healthz", "/api/openapi.json", "/static/ui.css"):
        assert (await service.call("GET", path)).status == 200, path
    registered = await service.call("POST", "/api/servers", agent("node-a"), bearer(TOKEN_A))
    assert registered.status == 200
    poll = await service.call("GET", "/api/agents/node-a/deployments?wait=0", headers=bearer(TOKEN_A))
    assert poll.status == 200


def test_private_reads_without_a_token_is_refused(tmp_path: Path) -> None:
    settings = ServiceSettings(db=tmp_path / "x.db", public_reads=False, docker_config=None)
    with pytest.raises(ValueError, match="public_reads=false needs an api_token"):
        create_app(settings)


def test_empty_secrets_are_unset_not_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    """`GPUBADGE_API_TOKEN=` must not become a token that a request without credentials matches."""
    monkeypatch.setenv("GPUBADGE_API_TOKEN", "")
    monkeypatch.setenv("GPUBADGE_WEBHOOK_SECRET", "")
    settings = ServiceSettings(docker_config=None)
    assert settings.api_token is None and settings.webhook_secret is None


# ------------------------------------------------------------------ per-source webhook secrets


async def test_per_source_secrets_refuse_the_other_sources(service: Service, registry: LocalRegistry) -> None:
    before = await queued(service)
    event = distribution_push(registry.host)
    assert (await service.call("POST", "/hooks/distribution", event)).status == 401
    assert (await service.call("POST", "/hooks/distribution", event, bearer("wrong"))).status == 401
    quay = {"repository": "sec/app", "docker_url": f"{registry.host}/sec/app", "updated_tags": ["1"]}
    for source, body in (("quay", quay), ("dockerhub", {}), ("harbor", {}), ("ghcr", {})):
        for headers in ({}, bearer(HOOK_SECRET)):  # not open, and another source's secret does not help
            reply = await service.call("POST", f"/hooks/{source}", body, headers)
            assert reply.status == 401, (source, reply.text)
            assert "no secret is configured" in reply.body["error"]
    assert await queued(service) == before
    accepted = await service.call("POST", "/hooks/distribution", event, bearer(HOOK_SECRET))
    assert accepted.status == 202, accepted.text
    assert await queued(service) == before + 1


def test_startup_log_names_the_open_webhook_sources(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="web.app")

    def startup_lines(**secrets: Any) -> str:
        caplog.clear()
        create_app(ServiceSettings(db=tmp_path / "log.db", docker_config=None, **secrets))
        return "\n".join(record.getMessage() for record in caplog.records if "webhook" in record.getMessage())

    everything_open = startup_lines()
    assert "open sources: distribution, dockerhub, harbor, ghcr, quay, gar, ecr, jfrog" in everything_open
    per_source = startup_lines(webhook_secrets={"ghcr": SecretStr("a"), "jfrog": SecretStr("b")})
    assert "webhook sources open: none" in per_source
    assert "accepted with their own secret: ghcr, jfrog" in per_source
    assert "refused" in per_source and "distribution, dockerhub, harbor, quay, gar, ecr" in per_source
    shared = startup_lines(webhook_secret=SecretStr("s"))
    assert "webhook sources open: none; every source needs its secret" in shared


def test_unknown_webhook_source_in_settings_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown sources gitlab"):
        ServiceSettings(db=tmp_path / "x.db", webhook_secrets={"gitlab": SecretStr("x")}, docker_config=None)


# ------------------------------------------------------------------ agents


async def test_agent_tokens_are_bound_to_their_server(
    service: Service, caplog: pytest.LogCaptureFixture
) -> None:
    assert (await service.call("POST", "/api/servers", agent("node-a"), bearer(TOKEN_A))).status == 200
    registered = await service.call(
        "POST", "/api/servers", agent("node-b", labels={"pool": "b"}), bearer(TOKEN_B)
    )
    assert registered.status == 200
    created = await service.call(
        "POST", "/api/deployments", {"image": service.image, "labels": {"pool": "b"}}, bearer(API_TOKEN)
    )
    assert created.status == 201 and created.body["server"] == "node-b", created.text
    status_path = f"/api/deployments/{created.body['id']}/status"
    # Server A's token, used for server B, on every agent endpoint: 403, nothing changes.
    attempts = [
        ("POST", "/api/servers", agent("node-b", "GPU-stolen")),
        ("POST", "/api/servers/node-b/heartbeat", {}),
        ("GET", "/api/agents/node-b/deployments?wait=0", None),
        ("POST", status_path, {"state": "failed", "reason": "sabotage"}),
    ]
    for method, path, body in attempts:
        reply = await service.call(method, path, body, bearer(TOKEN_A))
        assert reply.status == 403, (path, reply.text)
        assert "belongs to server node-a" in reply.body["error"] and TOKEN_A not in reply.text
        unknown = await service.call(method, path, body, bearer("nobody-s-token"))
        assert unknown.status == 401, (path, unknown.text)
    assert "agent token of server node-a used for server node-b" in caplog.text
    deployment = await service.call("GET", f"/api/deployments/{created.body['id']}")
    assert deployment.body["state"] == "pending"  # the forged report changed nothing
    servers = {s["name"]: s for s in (await service.call("GET", "/api/servers")).body["servers"]}
    assert servers["node-b"]["gpus"] == []  # nor did the forged registration
    # Server B's own token works for B.
    for method, path, body in attempts[1:3]:
        assert (await service.call(method, path, body, bearer(TOKEN_B))).status == 200, path
    assert (await service.call("POST", status_path, {"state": "running"}, bearer(TOKEN_B))).status == 200


async def test_a_gpu_uuid_has_one_live_server(service: Service, caplog: pytest.LogCaptureFixture) -> None:
    assert (
        await service.call("POST", "/api/servers", agent("node-a", "GPU-shared-1"), bearer(TOKEN_A))
    ).status == 200
    claim = await service.call("POST", "/api/servers", agent("node-b", "GPU-shared-1"), bearer(TOKEN_B))
    assert claim.status == 409, claim.text
    assert claim.body["claimed"] == {"GPU-shared-1": "node-a"}
    assert "node-a" in claim.body["error"]
    line = next(r.getMessage() for r in caplog.records if "GPU-shared-1" in r.getMessage())
    assert "node-a" in line and "node-b" in line
    # Registered without it, B still cannot add it by heartbeat.
    assert (await service.call("POST", "/api/servers", agent("node-b"), bearer(TOKEN_B))).status == 200
    beat = await service.call(
        "POST", "/api/servers/node-b/heartbeat", {"gpus": agent("x", "GPU-shared-1")["gpus"]}, bearer(TOKEN_B)
    )
    assert beat.status == 409, beat.text
    servers = {s["name"]: s for s in (await service.call("GET", "/api/servers")).body["servers"]}
    assert [g["uuid"] for g in servers["node-a"]["gpus"]] == ["GPU-shared-1"]
    assert servers["node-b"]["gpus"] == []
    # Not even the fleet-wide token takes a GPU that a live server reports.
    claim = await service.call("POST", "/api/servers", agent("node-b", "GPU-shared-1"), bearer(FLEET_TOKEN))
    assert claim.status == 409 and claim.body["claimed"] == {"GPU-shared-1": "node-a"}, claim.text


async def test_a_gpu_stays_with_the_server_that_reported_it_first_until_an_operator_moves_it(
    service: Service, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 43, point 8: a silent server's GPUs (their UUIDs are listed by the open GET /api/servers)
    are not for the taking by another agent's token; the owner, back, gets them, not a 409."""
    stale_after = service.app[SERVICES].settings.stale_after_seconds
    gpus = ("GPU-owned-1", "GPU-owned-2")
    assert (await service.call("POST", "/api/servers", agent("node-a", *gpus), bearer(TOKEN_A))).status == 200
    assert (await service.call("POST", "/api/servers", agent("node-b"), bearer(TOKEN_B))).status == 200
    service.advance(stale_after + 10)  # A silent: stale, out of the live fleet
    assert (await service.call("POST", "/api/servers/node-b/heartbeat", {}, bearer(TOKEN_B))).status == 200
    servers = {s["name"] for s in (await service.call("GET", "/api/servers")).body["servers"]}
    assert servers == {"node-b"}
    # B's own token, by registration and by heartbeat: refused, stale owner or not, nothing written.
    claim = await service.call("POST", "/api/servers", agent("node-b", gpus[0]), bearer(TOKEN_B))
    assert claim.status == 409 and claim.body["claimed"] == {gpus[0]: "node-a"}, claim.text
    assert "gpubadge fleet release" in claim.body["error"]
    beat = await service.call(
        "POST", "/api/servers/node-b/heartbeat", {"gpus": agent("x", *gpus)["gpus"]}, bearer(TOKEN_B)
    )
    assert beat.status == 409 and beat.body["claimed"] == dict.fromkeys(gpus, "node-a"), beat.text
    servers_now = {s["name"]: s for s in (await service.call("GET", "/api/servers")).body["servers"]}
    assert servers_now["node-b"]["gpus"] == []
    # A, back: its GPUs are still its own.
    back = await service.call("POST", "/api/servers/node-a/heartbeat", {}, bearer(TOKEN_A))
    assert back.status == 200, back.text
    poll = await service.call("GET", "/api/agents/node-a/deployments?wait=0", headers=bearer(TOKEN_A))
    assert poll.status == 200, poll.text
    servers_now = {s["name"]: s for s in (await service.call("GET", "/api/servers")).body["servers"]}
    assert [g["uuid"] for g in servers_now["node-a"]["gpus"]] == list(gpus)

    # The fleet-wide token moves a silent server's GPU (a card moved to another host), and says so.
    service.advance(stale_after + 10)
    assert (await service.call("POST", "/api/servers/node-b/heartbeat", {}, bearer(TOKEN_B))).status == 200
    moved = await service.call("POST", "/api/servers", agent("node-b", gpus[0]), bearer(FLEET_TOKEN))
    assert moved.status == 200, moved.text
    assert any("moved to server node-b from server(s) node-a" in r.getMessage() for r in caplog.records)
    back = await service.call("POST", "/api/servers/node-a/heartbeat", {}, bearer(TOKEN_A))
    assert back.status == 409 and back.body["claimed"] == {gpus[0]: "node-b"}, back.text

    # An operator releases it (the fleet-wide token only), once no live server reports it.
    path = f"/api/gpus/{gpus[0]}/release"
    assert (await service.call("POST", path, {}, bearer(TOKEN_A))).status == 401
    assert (await service.call("POST", path, {}, bearer(API_TOKEN))).status == 401
    live = await service.call("POST", path, {}, bearer(FLEET_TOKEN))
    assert live.status == 409 and "live server node-b" in live.body["error"], live.text
    service.advance(stale_after + 10)  # B silent now
    released = await service.call("POST", path, {}, bearer(FLEET_TOKEN))
    assert released.status == 200 and released.body == {"released": gpus[0], "server": "node-b"}
    assert (await service.call("POST", path, {}, bearer(FLEET_TOKEN))).status == 404
    back = await service.call("POST", "/api/servers/node-a/heartbeat", {}, bearer(TOKEN_A))
    assert back.status == 200, back.text  # released, so A's again
    b_claim = await service.call("POST", "/api/servers", agent("node-b", gpus[0]), bearer(TOKEN_B))
    assert b_claim.status == 409 and b_claim.body["claimed"] == {gpus[0]: "node-a"}

    # Removing a server that is gone releases its GPUs; a live one is refused.
    assert (await service.call("DELETE", "/api/servers/node-a", None, bearer(FLEET_TOKEN))).status == 409
    assert (await service.call("DELETE", "/api/servers/node-a", None, bearer(TOKEN_A))).status == 401
    service.advance(stale_after + 10)
    removed = await service.call("DELETE", "/api/servers/node-a", None, bearer(FLEET_TOKEN))
    assert removed.status == 200 and removed.body == {"removed": "node-a", "released": list(gpus)}, (
        removed.text
    )
    assert (await service.call("DELETE", "/api/servers/node-a", None, bearer(FLEET_TOKEN))).status == 404
    taken = await service.call("POST", "/api/servers", agent("node-b", *gpus), bearer(TOKEN_B))
    assert taken.status == 200, taken.text  # free GPUs: the first to report them owns them
    forgotten = await service.call("POST", "/api/servers/node-a/heartbeat", {}, bearer(TOKEN_A))
    assert forgotten.status == 404  # "register again"


async def test_a_mig_device_stays_with_its_server_too(service: Service) -> None:
    """Reservations name MIG devices by their own UUIDs: a per-agent token cannot take a silent
    server's MIG device either, whatever parent GPU it reports it under."""
    stale_after = service.app[SERVICES].settings.stale_after_seconds
    owner = agent("node-a", "GPU-a-mig")
    owner["gpus"][0]["mig_devices"] = [{"index": 0, "uuid": "MIG-a-0", "profile": "1g.10gb"}]
    assert (await service.call("POST", "/api/servers", owner, bearer(TOKEN_A))).status == 200
    service.advance(stale_after + 10)
    claimer = agent("node-b", "GPU-b-own")
    claimer["gpus"][0]["mig_devices"] = [{"index": 0, "uuid": "MIG-a-0", "profile": "1g.10gb"}]
    claim = await service.call("POST", "/api/servers", claimer, bearer(TOKEN_B))
    assert claim.status == 409 and claim.body["claimed"] == {"MIG-a-0": "node-a"}, claim.text


async def test_a_registration_burst_does_not_reread_the_fleet_per_registration(service: Service) -> None:
    """Claims hold in memory at once: N registrations, no read of the server table at all."""
    cache = service.app[FLEET_INDEX]
    assert (await service.call("GET", "/api/servers")).status == 200
    await cache.index(service.app)
    reads = cache.inventory_reads
    tokens = {"node-a": TOKEN_A, "node-b": TOKEN_B}
    other = {"node-a": "node-b", "node-b": "node-a"}
    for round_ in range(10):
        for name, token in tokens.items():
            body = agent(name, f"GPU-{name}-{round_}", f"GPU-{name}-{round_}-x")
            assert (await service.call("POST", "/api/servers", body, bearer(token))).status == 200
            # The claim just made holds at once for the other server.
            rival = agent(other[name], f"GPU-{name}-{round_}")
            taken = await service.call("POST", "/api/servers", rival, bearer(tokens[other[name]]))
            assert taken.status == 409, taken.text
            beat = await service.call("POST", f"/api/servers/{name}/heartbeat", {}, bearer(token))
            assert beat.status == 200
    assert cache.inventory_reads == reads  # no re-read of the server table on the way
    servers = {s["name"]: s for s in (await service.call("GET", "/api/servers")).body["servers"]}
    assert [g["uuid"] for g in servers["node-a"]["gpus"]] == ["GPU-node-a-9", "GPU-node-a-9-x"]
    index = await cache.index(service.app)
    assert cache.inventory_reads == reads  # the index takes the registrations from memory
    node_a = index.server("node-a")
    assert node_a is not None and [g.uuid for g in node_a.gpus] == ["GPU-node-a-9", "GPU-node-a-9-x"]


# ------------------------------------------------------------------ hostile deployment bodies


def deep(levels: int) -> Any:
    value: Any = 1
    for _ in range(levels):
        value = [value]
    return value


BAD_DEPLOYMENTS: dict[str, tuple[bytes | dict[str, Any], str]] = {
    "not-json": (b"{image:", "not JSON"),
    "not-object": (b"[1, 2]", "expected"),
    "empty": (b"", "not JSON"),
    "no-image": ({"gpus": 1}, "expected"),
    "deep-nesting": ({"image": "x", "labels": {"a": deep(100)}}, "nested deeper than 32"),
    "very-deep-nesting": (
        b'{"image": "x", "env": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        "nested deeper",
    ),
    "huge-number": ({"image": "x", "gpus": 10**30}, "out of range"),
    "huge-float": (b'{"image": "x", "cpus": 1e999}', "out of range"),
    "nan": (b'{"image": "x", "cpus": NaN}', "not a JSON number"),
    "huge-string": ({"image": "x", "env": {"A": "v" * 5000}}, "longer than 4096"),
    "huge-key": ({"image": "x", "labels": {"k" * 5000: "v"}}, "longer than 4096"),
    "env-not-object": ({"image": "x", "env": ["A=1"]}, "env"),
    "env-bad-name": ({"image": "x", "env": {"1A": "x"}}, "invalid environment variable name"),
    "env-gpu-override": ({"image": "x", "env": {"NVIDIA_VISIBLE_DEVICES": "all"}}, "NVIDIA_VISIBLE_DEVICES"),
    "command-not-list": ({"image": "x", "command": "rm -rf /"}, "command"),
    "unknown-field": ({"image": "x", "gpus_please": 2}, "gpus_please"),
    "negative-gpus": ({"image": "x", "gpus": -1}, "gpus"),
    "memory-object": ({"image": "x", "memory": {"size": 1}}, "memory"),
    "memory-too-large": ({"image": "x", "memory": "9" * 400 + "Gi"}, "too large"),
    "bad-reference": ({"image": "Not A Ref"}, "reference"),
}


@pytest.mark.parametrize("case", sorted(BAD_DEPLOYMENTS))
async def test_bad_deployment_bodies_are_400(service: Service, case: str) -> None:
    body, reason = BAD_DEPLOYMENTS[case]
    if isinstance(body, dict) and body.get("image") == "x":
        body = {**body, "image": service.image}
    reply = await service.call("POST", "/api/deployments", body, bearer(API_TOKEN))
    assert reply.status == 400, (case, reply.status, reply.text[:300])
    assert reason.lower() in reply.body["error"].lower(), (case, reply.body["error"])
    assert len(reply.text) < 1000  # the offending value is not echoed back whole
    listed = await service.call("GET", "/api/deployments", headers=bearer(API_TOKEN))
    assert listed.body["deployments"] == []
    assert (await service.call("GET", "/healthz")).status == 200


async def test_hostile_bodies_on_the_other_json_endpoints(service: Service) -> None:
    # 10,000 levels (20 KB: under GPUBADGE_MAX_SERVER_BYTES, so the servers' endpoints parse it too)
    hostile = b'{"name": "node-a", "x": ' + b"[" * 10_000 + b"]" * 10_000 + b"}"
    cases = [
        ("/api/scans", API_TOKEN),
        ("/api/eligibility", API_TOKEN),
        ("/api/servers", TOKEN_A),
        ("/api/servers/node-a/heartbeat", TOKEN_A),
    ]
    for path, token in cases:
        reply = await service.call("POST", path, hostile, bearer(token))
        assert reply.status == 400, (path, reply.text)
        assert "nested deeper than" in reply.body["error"]
        big = await service.call(
            "POST", path, b'{"name": "node-a", "n": 1' + b"0" * 5000 + b"}", bearer(token)
        )
        assert big.status == 400 and "out of range" in big.body["error"], (path, big.text)


def test_json_limits_are_exact_at_their_edges() -> None:
    limits = JsonLimits(max_depth=4, max_number=INTEROPERABLE_INTEGER, max_string=8)
    assert loads_bounded(b"[[[{}]]]", limits) == [[[{}]]]  # four levels: allowed
    with pytest.raises(JsonLimitExceeded, match="deeper than 4"):
        loads_bounded(b"[[[[[]]]]]", limits)
    assert loads_bounded(str(2**53).encode(), limits) == 2**53
    assert loads_bounded(str(-(2**53)).encode(), limits) == -(2**53)
    for text in (str(2**53 + 1), "9" * 5000, "1e16", "-1e400"):
        with pytest.raises(JsonLimitExceeded, match="out of range"):
            loads_bounded(text.encode(), limits)
    assert loads_bounded(b'{"12345678": "abcdefgh"}', limits) == {"12345678": "abcdefgh"}
    for text in (b'"abcdefghi"', b'{"123456789": 1}', b'[["x", "ninechars"]]'):
        with pytest.raises(JsonLimitExceeded, match="longer than 8"):
            loads_bounded(text, limits)
    with pytest.raises(ValueError, match="Expecting"):  # not JSON: the caller's own message
        loads_bounded(b"{", limits)


# ------------------------------------------------------------------ /healthz


async def test_healthz_tells_anyone_no_path_host_name_or_pid(tmp_path: Path) -> None:
    """Open to anyone (kubelet, a load balancer): the status and the reasons in words, never where.
    The API token's holder gets the database's path and the workers' identity, as the log has them."""
    db = tmp_path / "where-the-database-lives" / "health.db"
    settings = ServiceSettings(
        db=db,
        api_token=SecretStr(API_TOKEN),
        workers=1,
        health_timeout=0.5,
        sqlite_busy_timeout=0.5,
        docker_config=None,
    )
    places = [str(db.parent), socket.gethostname(), f"/{os.getpid()}/"]
    async with run_service_inprocess(settings) as running, aiohttp.ClientSession() as session:

        async def healthz(headers: dict[str, str] | None = None) -> tuple[int, str]:
            async with session.get(f"{running.url}/healthz", headers=headers or {}) as reply:
                return reply.status, await reply.text()

        status, anyone = await healthz()
        assert status == 200 and json.loads(anyone)["workers"] == "running in 1 worker process"
        assert not [place for place in places if place in anyone], anyone
        status, operator = await healthz(bearer(API_TOKEN))
        (owner,) = json.loads(operator)[
            "workers"
        ]  # the worker process's lease owner (jobs/worker_processes.py)
        assert status == 200 and owner.startswith(f"{socket.gethostname()}/")
        # The database locked by another process: 503, the cause in SQLite's words, not the file's path.
        blocker = sqlite3.connect(db, isolation_level=None)
        blocker.execute("BEGIN EXCLUSIVE")
        try:
            status, anyone = await healthz()
            status_operator, operator = await healthz(bearer(API_TOKEN))
            # A write of the store itself (a deleted image): the intake's own commits go to its journal.
            gone = {
                "events": [
                    {
                        "action": "delete",
                        "target": {"repository": "app", "tag": "1"},
                        "request": {"host": "127.0.0.1:9"},
                    }
                ]
            }
            async with session.post(f"{running.url}/hooks/distribution", json=gone) as reply:
                refused = reply.status, await reply.text()
        finally:
            blocker.execute("ROLLBACK")
            blocker.close()
        assert status == 503 and "database is locked" in anyone, anyone
        assert not [place for place in places if place in anyone], anyone
        assert status_operator == 503 and str(db) in operator
        assert refused[0] == 503 and "database is locked" in refused[1], refused  # an API answer: the same
        assert str(db.parent) not in refused[1]
