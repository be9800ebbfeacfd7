"""The JSON API of a running `gpubadge serve`: scans on request, listings and filters,
failed jobs and retries, long-polls, metrics and the OpenAPI document.

Images are pushed to the session's real registry with skopeo and scanned through
POST /api/scans; nothing is written to the store except by the service itself.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from fixtures import catalog
from fixtures.oci import ImageSpec
from fixtures.registry import LocalRegistry
from fixtures.service import RunningService, run_service_process
from tests.conftest import Pusher
from tests.faultproxy import FaultProxy, Rule
from tests.test_service_e2e import Reply, by_ref, call, metric_values, wait_job

TOKEN = "api-token-3c9e1b"
AUTH = {"Authorization": f"Bearer {TOKEN}"}

SAMPLES: dict[str, ImageSpec] = {
    "api/cuda:12": catalog.cuda_ubuntu(),
    "api/alpine-gpu:1": catalog.alpine_gpu(),
    "api/plain:1": catalog.plain_glibc(),
    "api/static:1": catalog.static_scratch(),
    "api/legacy:10": catalog.legacy_cuda(),
}


@pytest.fixture(scope="module")
def service(registry: LocalRegistry, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningService]:
    env = {
        "GPUBADGE_REGISTRIES": registry.host,
        "GPUBADGE_API_TOKEN": TOKEN,
        "GPUBADGE_MAX_ATTEMPTS": "2",
        "GPUBADGE_RETRY_BACKOFF": "0.05",
    }
    with run_service_process(tmp_path_factory.mktemp("api") / "api.db", env=env) as running:
        yield running


def scan(service: RunningService, ref: str) -> dict[str, object]:
    reply = call("POST", f"{service.url}/api/scans", {"ref": ref}, AUTH)
    assert reply.status == 202, reply.text
    assert reply.body["state"] in ("queued", "running", "done")
    return reply.body  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def scanned(service: RunningService, registry: LocalRegistry, push: Pusher) -> dict[str, str]:
    """The sample images, pushed and scanned through the API: name -> digest."""
    digests = {name: push(spec, name) for name, spec in SAMPLES.items()}
    jobs = {name: scan(service, f"{registry.host}/{name}")["id"] for name in SAMPLES}
    for name, job_id in jobs.items():
        job = wait_job(service.url, str(job_id))
        assert (job["state"], job["digest"]) == ("done", digests[name]), job
    return digests


def names(reply: Reply) -> list[str]:
    assert reply.status == 200, reply.text
    return sorted(f"{image['repository']}:{image['tags'][0]}" for image in reply.body["images"])


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ("gpu=true", ["api/alpine-gpu:1", "api/cuda:12", "api/legacy:10"]),
        ("gpu=false", ["api/plain:1", "api/static:1"]),
        ("libc=musl", ["api/alpine-gpu:1"]),
        ("libc=no-libc", ["api/static:1"]),
        ("libc=glibc&gpu=false", ["api/plain:1"]),
        ("cuda=12", ["api/cuda:12"]),
        ("cuda=10.0", ["api/legacy:10"]),
        ("q=alpine", ["api/alpine-gpu:1"]),
        ("q=%25", []),  # a literal percent sign, not a wildcard
        ("registry=elsewhere.example", []),
    ],
)
def test_listing_filters(
    service: RunningService, scanned: dict[str, str], query: str, expected: list[str]
) -> None:
    assert names(call("GET", f"{service.url}/api/images?{query}")) == expected


def test_listing_pages_and_registry(
    service: RunningService, registry: LocalRegistry, scanned: dict[str, str]
) -> None:
    pages = [
        call("GET", f"{service.url}/api/images?registry={registry.host}&limit=2&page={n}")
        for n in (1, 2, 3, 4)
    ]
    assert [reply.body["total"] for reply in pages] == [5, 5, 5, 5]
    seen = [image["digest"] for reply in pages for image in reply.body["images"]]
    assert [len(reply.body["images"]) for reply in pages] == [2, 2, 1, 0]
    assert sorted(seen) == sorted(scanned.values())
    for bad in ("gpu=maybe", "limit=ten", "page=x"):
        reply = call("GET", f"{service.url}/api/images?{bad}")
        assert reply.status == 400 and "error" in reply.body, (bad, reply.text)


def test_by_ref_answers_by_tag_and_by_digest(
    service: RunningService, registry: LocalRegistry, scanned: dict[str, str]
) -> None:
    digest = scanned["api/cuda:12"]
    by_tag = by_ref(service.url, f"{registry.host}/api/cuda:12", wait=0)
    by_digest = by_ref(service.url, f"{registry.host}/api/cuda@{digest}", wait=0)
    assert by_tag.status == by_digest.status == 200
    assert by_tag.body["digest"] == by_digest.body["digest"] == digest
    assert by_tag.body["platforms"][0]["gpu"]["cuda_version"] == "12.2"


def test_scan_request_long_poll_sees_the_result(
    service: RunningService, registry: LocalRegistry, push: Pusher
) -> None:
    digest = push(catalog.alpine_gpu(), "api/fresh:1")
    job = scan(service, f"{registry.host}/api/fresh:1")
    view = by_ref(service.url, f"{registry.host}/api/fresh:1", wait=15)
    assert view.status == 200 and view.body["digest"] == digest
    assert wait_job(service.url, str(job["id"]))["state"] == "done"
    listed = call("GET", f"{service.url}/api/scans?state=done&limit=200").body["jobs"]
    assert job["id"] in {entry["id"] for entry in listed}


def test_missing_image_fails_after_max_attempts_then_retry_succeeds(
    service: RunningService, registry: LocalRegistry, push: Pusher
) -> None:
    ref = f"{registry.host}/api/late:1"
    job = scan(service, ref)
    failed = wait_job(service.url, str(job["id"]))
    assert failed["state"] == "failed", failed
    assert failed["attempts"] == 2  # GPUBADGE_MAX_ATTEMPTS
    assert "not found" in failed["error"] and "api/late" in failed["error"], failed["error"]
    assert call("GET", f"{service.url}/api/scans/{job['id']}").body["error"] == failed["error"]
    failed_list = call("GET", f"{service.url}/api/scans?state=failed").body["jobs"]
    assert job["id"] in {entry["id"] for entry in failed_list}

    unauthorised = call("POST", f"{service.url}/api/scans/{job['id']}/retry", b"")
    assert unauthorised.status == 401
    assert call("POST", f"{service.url}/api/scans/nosuchjob/retry", b"", AUTH).status == 404

    digest = push(catalog.plain_glibc(), "api/late:1")  # the image shows up late, as after replication lag
    retried = call("POST", f"{service.url}/api/scans/{job['id']}/retry", b"", AUTH)
    assert retried.status == 202
    assert retried.body["error"] is None
    assert retried.body["state"] in ("queued", "running", "done")
    done = wait_job(service.url, str(job["id"]))
    assert (done["state"], done["digest"]) == ("done", digest), done
    assert by_ref(service.url, ref, wait=0).body["digest"] == digest


def test_metrics_after_activity(
    service: RunningService, registry: LocalRegistry, scanned: dict[str, str]
) -> None:
    # A webhook and a failing scan, so that every family has samples.
    digest = scanned["api/plain:1"]
    event = {
        "action": "push",
        "target": {
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": digest,
            "repository": "api/plain",
            "tag": "1",
        },
        "request": {"host": registry.host},
    }
    assert call("POST", f"{service.url}/hooks/distribution", {"events": [event]}).status == 202
    failing = scan(service, f"{registry.host}/api/never:1")
    assert wait_job(service.url, str(failing["id"]))["state"] == "failed"

    reply = call("GET", f"{service.url}/metrics")
    assert reply.status == 200 and reply.headers["Content-Type"].startswith("text/plain")
    text = reply.text
    scans = metric_values(text, "gpubadge_scans_total")
    assert scans['{outcome="ok"}'] >= len(SAMPLES) and scans['{outcome="error"}'] >= 2
    queue = metric_values(text, "gpubadge_queue_jobs")
    assert set(queue) == {f'{{state="{s}"}}' for s in ("queued", "running", "done", "failed")}
    assert queue['{state="failed"}'] >= 1
    assert metric_values(text, "gpubadge_scan_duration_seconds_count")[""] >= len(SAMPLES)
    webhook = metric_values(text, "gpubadge_webhook_duration_seconds_count")
    assert webhook['{source="distribution"}'] >= 1
    assert metric_values(text, "gpubadge_webhooks_total")['{source="distribution",status="202"}'] >= 1
    assert metric_values(text, "gpubadge_registry_errors_total")[f'{{registry="{registry.host}"}}'] >= 2
    # The loopback registry sends no ratelimit-remaining header: the family is declared, without samples.
    assert "# TYPE gpubadge_registry_ratelimit_remaining gauge" in text


def test_openapi_document_lists_the_api(service: RunningService) -> None:
    reply = call("GET", f"{service.url}/api/openapi.json")
    assert reply.status == 200
    document = json.loads(reply.text)
    assert document["openapi"].startswith("3.")
    paths = set(document["paths"])
    for path in (
        "/hooks/{source}",
        "/api/images",
        "/api/images/by-ref",
        "/api/scans",
        "/api/scans/{job_id}",
        "/api/scans/{job_id}/retry",
        "/healthz",
        "/metrics",
        "/api/servers",
        "/api/servers/{name}/heartbeat",
        "/api/eligibility",
        "/api/deployments",
        "/api/deployments/{id}",
        "/api/deployments/{id}/status",
        "/api/agents/{name}/deployments",
    ):
        assert path in paths, path
    assert "post" in document["paths"]["/api/scans"]
    deploy = document["paths"]["/api/deployments"]["post"]
    body = deploy["requestBody"]["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]
    fields = set(document["components"]["schemas"][body]["properties"])
    assert {"image", "gpus", "gpu_models", "command", "env"} <= fields
    assert deploy["responses"]["201"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/Deployment"
    }


def test_openapi_documents_every_route_and_every_schema_it_names(tmp_path: Path) -> None:
    """A route added without its OpenAPI entry, or a `$ref` to a schema never registered, fails here."""
    from web.api_description import DECLARED
    from web.api_description import openapi_document as describe_api
    from web.app import create_app, openapi_document
    from web.settings import ServiceSettings

    app = create_app(ServiceSettings(db=tmp_path / "routes.db"), start_workers=False)
    document = openapi_document()
    declared = app[DECLARED]
    assert describe_api(declared) == document  # what the app serves is what its modules declare
    routes = {
        (route.method.lower(), route.resource.canonical)
        for route in app.router.routes()
        if route.resource is not None
        and route.method != "HEAD"
        and route.resource.canonical.startswith(("/api", "/hooks", "/healthz", "/metrics"))
    }
    documented = {(method, path) for path, item in document["paths"].items() for method in item}
    assert routes - documented == set()
    assert documented - routes == set()
    names = set(document["components"]["schemas"])
    refs = set(re.findall(r'"#/components/schemas/([^"]+)"', json.dumps(document)))
    assert refs and refs <= names


def test_healthz_reports_queue(service: RunningService) -> None:
    reply = call("GET", f"{service.url}/healthz")
    assert reply.status == 200 and reply.body["status"] == "ok"
    assert set(reply.body["queue"]) >= {"queued", "running", "done", "failed"}


async def test_rate_limit_remaining_is_exported(
    registry: LocalRegistry, push: Pusher, tmp_path: Path
) -> None:
    """A registry that sends Docker Hub's `ratelimit-remaining` header: the gauge shows it."""
    push(catalog.plain_glibc(), "api/limited:1")
    async with FaultProxy(registry.url) as proxy:
        proxy.add(
            Rule(
                "add_headers", path=r"/manifests/", times=None, headers={"ratelimit-remaining": "97;w=21600"}
            )
        )
        env = {"GPUBADGE_REGISTRIES": proxy.host}
        with run_service_process(tmp_path / "limited.db", env=env) as limited:
            reply = await asyncio.to_thread(
                call, "POST", f"{limited.url}/api/scans", {"ref": f"{proxy.host}/api/limited:1"}
            )
            assert reply.status == 202, reply.text
            job = await asyncio.to_thread(wait_job, limited.url, reply.body["id"])
            assert job["state"] == "done", job
            metrics = await asyncio.to_thread(call, "GET", f"{limited.url}/metrics")
    gauge = metric_values(metrics.text, "gpubadge_registry_ratelimit_remaining")
    assert gauge == {f'{{registry="{proxy.host}"}}': 97.0}
