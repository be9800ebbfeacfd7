"""Azure Container Registry webhooks (web/hooks/acr.py), as a unit and over HTTP.

Payloads in fixtures/webhooks/acr/ follow MicrosoftDocs' webhook reference (the documented
digests are elided with `xxxx`, so the fixtures use sha256 of a readable name). The HTTP
tests run `gpubadge serve` against the session's real registry; the pushed image comes
from skopeo, and the ACR event names it the way ACR would.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fixtures import catalog
from fixtures.registry import LocalRegistry
from fixtures.service import RunningService, run_service_process
from tests.conftest import Pusher
from tests.test_service_e2e import call, metric_values, wait_job
from web.hooks import WebhookAuthError, WebhookError
from web.hooks.acr import authenticate, normalise

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "webhooks" / "acr"
SECRET = "acr-hook-secret-0b7d"
ACR_HOST = "myregistry.azurecr.io"
IGNORED = ["delete", "chart_push", "chart_delete", "ping", "quarantine"]


def load(name: str) -> dict[str, Any]:
    payload: dict[str, Any] = json.loads((FIXTURES / f"{name}.json").read_text())
    return payload


def digest_of(name: str) -> str:
    return "sha256:" + hashlib.sha256(name.encode()).hexdigest()


def as_body(payload: dict[str, Any]) -> bytes:
    return json.dumps(payload).encode()


# ------------------------------------------------------------------ unit


def test_documented_push_keys_the_scan_on_the_digest() -> None:
    [request] = normalise(as_body(load("push")))
    assert (request.registry, request.repository, request.tag, request.digest, request.action) == (
        ACR_HOST,
        "hello-world",
        "v1",
        digest_of("acr-hello-world"),
        "push",
    )
    assert request.source == "acr"
    assert request.reference == f"{ACR_HOST}/hello-world:v1@{digest_of('acr-hello-world')}"


def test_push_without_a_tag_is_scanned_by_digest() -> None:
    [request] = normalise(as_body(load("push_untagged")))
    assert request.tag is None and request.digest == digest_of("acr-hello-world")


@pytest.mark.parametrize("fixture", IGNORED)
def test_other_actions_are_ignored(fixture: str) -> None:
    assert normalise(as_body(load(fixture))) == []


def test_helm_and_referrer_tag_pushes_are_ignored() -> None:
    chart_as_oci = load("push")
    chart_as_oci["target"]["mediaType"] = "application/vnd.cncf.helm.chart.content.v1.tar+gzip"
    assert normalise(as_body(chart_as_oci)) == []
    tag_schema = load("push")
    tag_schema["target"]["tag"] = "sha256-" + "a" * 64
    tag_schema["target"]["mediaType"] = "application/vnd.oci.image.index.v1+json"
    assert normalise(as_body(tag_schema)) == []


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda p: p.pop("action"), "action: Field required"),
        (lambda p: p["target"].pop("digest"), "target.digest: Field required"),
        (lambda p: p.pop("request"), "request: Field required"),
        (lambda p: p["target"].update(digest="sha256:xxxxd5c8"), "digest"),
        (lambda p: p["target"].update(repository="UPPER/case"), "invalid image"),
        (lambda p: p["request"].update(host="evil host/"), "invalid registry host"),
        (lambda p: p.update(action=7), "action: Input should be a valid string"),
    ],
)
def test_malformed_pushes_are_refused_with_a_reason(change: Any, reason: str) -> None:
    payload = load("push")
    change(payload)
    with pytest.raises(WebhookError, match=reason):
        normalise(as_body(payload))


@pytest.mark.parametrize("body", [b"", b"not json", b"[1, 2]", b"\xff\xfe"])
def test_non_object_bodies_are_refused(body: bytes) -> None:
    with pytest.raises(WebhookError, match="acr payload"):
        normalise(body)


def test_secret_must_come_as_a_header_and_match() -> None:
    authenticate({"Authorization": f"Bearer {SECRET}"}, SECRET)
    authenticate({"authorization": SECRET}, SECRET)  # a custom header configured without a scheme
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {SECRET}x"}):
        with pytest.raises(WebhookAuthError) as caught:
            authenticate(headers, SECRET)
        assert SECRET not in str(caught.value)
    with pytest.raises(WebhookAuthError, match="no secret is configured"):
        authenticate({"Authorization": f"Bearer {SECRET}"}, None)
    with pytest.raises(WebhookAuthError):
        authenticate({"Authorization": "Bearer \udcff"}, SECRET)  # undecodable bytes as aiohttp passes them


# ------------------------------------------------------------------ HTTP


@pytest.fixture(scope="module")
def service(registry: LocalRegistry, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningService]:
    env = {
        "GPUBADGE_REGISTRIES": registry.host,
        "GPUBADGE_WEBHOOK_SECRETS": json.dumps({"acr": SECRET}),
        "GPUBADGE_MAX_ATTEMPTS": "2",
        "GPUBADGE_RETRY_BACKOFF": "0.05",
    }
    with run_service_process(tmp_path_factory.mktemp("acr") / "acr.db", env=env) as running:
        yield running


AUTH = {"Authorization": f"Bearer {SECRET}"}


def deliver(service: RunningService, payload: dict[str, Any] | bytes, headers: dict[str, str]) -> Any:
    body = payload if isinstance(payload, bytes) else as_body(payload)
    return call("POST", f"{service.url}/hooks/acr", body, headers)


def acr_event(registry: LocalRegistry, repository: str, digest: str, tag: str | None) -> dict[str, Any]:
    payload = load("push")
    payload["request"]["host"] = registry.host
    payload["target"].update(repository=repository, digest=digest)
    if tag is None:
        del payload["target"]["tag"]
    else:
        payload["target"]["tag"] = tag
    return payload


def test_push_over_http_scans_the_digest(
    service: RunningService, registry: LocalRegistry, push: Pusher
) -> None:
    digest = push(catalog.cuda_ubuntu(), "acr/cuda:12")
    reply = deliver(service, acr_event(registry, "acr/cuda", digest, None), AUTH)
    assert reply.status == 202, reply.text
    assert reply.body["accepted"] == 1
    [job_id] = reply.body["jobs"]
    job = wait_job(service.url, job_id)
    assert (job["state"], job["digest"], job["source"]) == ("done", digest, "acr")
    report = call("GET", f"{service.url}/api/images/by-ref?ref={registry.host}/acr/cuda@{digest}")
    assert report.status == 200 and report.body["platforms"][0]["gpu"]["required"] is True


@pytest.mark.parametrize("fixture", IGNORED)
def test_ignored_actions_over_http_are_acknowledged(service: RunningService, fixture: str) -> None:
    reply = deliver(service, load(fixture), AUTH)
    assert reply.status == 202, reply.text
    assert (reply.body["accepted"], reply.body["jobs"]) == (0, [])


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer not-the-secret"}, {"X-Token": SECRET}],
    ids=["missing", "wrong", "other-header"],
)
def test_missing_or_wrong_secret_is_refused(
    service: RunningService, registry: LocalRegistry, headers: dict[str, str]
) -> None:
    payload = acr_event(registry, "acr/cuda", digest_of("never-queued"), "v1")
    reply = deliver(service, payload, headers)
    assert reply.status == 401, reply.text
    assert SECRET not in reply.text
    by_query = call("POST", f"{service.url}/hooks/acr?token={SECRET}", as_body(payload), headers)
    assert by_query.status == 401, "the secret is accepted as a header only"
    jobs = call("GET", f"{service.url}/api/scans?limit=200").body["jobs"]
    assert digest_of("never-queued") not in json.dumps(jobs)


def test_host_outside_the_allowlist_is_refused_before_any_pull(service: RunningService) -> None:
    reply = deliver(service, load("push"), AUTH)
    assert reply.status == 403, reply.text
    assert reply.body["refused"] == [ACR_HOST]
    jobs = call("GET", f"{service.url}/api/scans?limit=200").body["jobs"]
    assert all(ACR_HOST not in job["reference"] for job in jobs)


@pytest.mark.parametrize(
    "body",
    [b"{", b"[]", as_body({"action": "push", "target": {}}), b'{"action":' + b"[" * 100 + b"]" * 100 + b"}"],
)
def test_malformed_body_over_http_is_a_400(service: RunningService, body: bytes) -> None:
    reply = deliver(service, body, AUTH)
    assert reply.status == 400, reply.text
    assert reply.body["error"].startswith("malformed acr webhook")


def test_metrics_count_acr_deliveries(service: RunningService) -> None:
    deliver(service, load("ping"), AUTH)
    counted = metric_values(call("GET", f"{service.url}/metrics").text, "gpubadge_webhooks_total")
    assert any('source="acr"' in labels and 'status="202"' in labels for labels in counted)
