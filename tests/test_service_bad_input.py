"""Bad input against a running `gpubadge serve`: every request is refused with the right
status and a reason, nothing is queued, no outbound connection is made, no secret is
echoed, and the service still answers /healthz afterwards.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import hmac
import json
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from fixtures import catalog
from fixtures.registry import LocalRegistry
from fixtures.service import RunningService, run_service_process
from tests.conftest import Pusher
from tests.test_service_e2e import WEBHOOKS, by_ref, call, wait_job

SECRET = "bad-input-hook-secret-91d2"
TOKEN = "bad-input-api-token-5e77"
MAX_BODY = 64 * 1024
JSON_MAX_STRING = 4096


@dataclass
class ConnectionCounter:
    """A plain TCP listener on another loopback port that counts who connects to it."""

    sock: socket.socket
    connections: int = 0
    stopping: threading.Event = field(default_factory=threading.Event)

    @property
    def host(self) -> str:
        port = self.sock.getsockname()[1]
        return f"127.0.0.1:{port}"

    def serve(self) -> None:
        while not self.stopping.is_set():
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            client.close()


@pytest.fixture(scope="module")
def listener() -> Iterator[ConnectionCounter]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    counter = ConnectionCounter(sock)
    thread = threading.Thread(target=counter.serve, daemon=True)
    thread.start()
    yield counter
    counter.stopping.set()
    sock.close()
    thread.join(timeout=5)


@pytest.fixture(scope="module")
def service(registry: LocalRegistry, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningService]:
    env = {
        "GPUBADGE_REGISTRIES": registry.host,  # the real registry only
        "GPUBADGE_WEBHOOK_SECRET": SECRET,
        "GPUBADGE_API_TOKEN": TOKEN,
        "GPUBADGE_MAX_BODY_BYTES": str(MAX_BODY),
        "GPUBADGE_COALESCE_SECONDS": "60",  # digest-only pushes stay queued: a stable "pending"
        "GPUBADGE_JSON_MAX_STRING": str(JSON_MAX_STRING),  # below MAX_BODY, so a long string fits a body
        "GPUBADGE_JFROG_REGISTRY": registry.host,
    }
    with run_service_process(tmp_path_factory.mktemp("bad") / "bad.db", env=env) as running:
        yield running


@pytest.fixture(autouse=True)
def still_healthy(service: RunningService) -> Iterator[None]:
    """Whatever a test threw at it, the service answers /healthz afterwards."""
    yield
    assert call("GET", f"{service.url}/healthz").status == 200


def queue_total(service: RunningService) -> int:
    depth: dict[str, int] = call("GET", f"{service.url}/healthz").body["queue"]
    return sum(depth.values())


def hook(service: RunningService, source: str, body: bytes | dict[str, Any], headers: dict[str, str]) -> Any:
    return call("POST", f"{service.url}/hooks/{source}", body, headers)


def distribution_push(host: str, repository: str = "bad/app", tag: str | None = "1") -> dict[str, Any]:
    target: dict[str, Any] = {
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "digest": "sha256:" + "1" * 64,
        "repository": repository,
    }
    if tag:
        target["tag"] = tag
    return {"events": [{"action": "push", "target": target, "request": {"host": host}}]}


BEARER = {"Authorization": f"Bearer {SECRET}"}


# ------------------------------------------------------------------ webhook authentication


def test_ghcr_bad_signatures_are_refused(service: RunningService) -> None:
    body = (WEBHOOKS / "ghcr_package_published.json").read_bytes()
    before = queue_total(service)
    good = hmac.new(SECRET.encode(), body, hashlib.sha256).hexdigest()
    wrong_key = hmac.new(b"not-the-secret", body, hashlib.sha256).hexdigest()
    for header in (f"sha256={wrong_key}", f"sha256={good[:-1]}0", f"sha1={good}", good, "sha256="):
        reply = hook(service, "ghcr", body, {"X-GitHub-Event": "package", "X-Hub-Signature-256": header})
        assert reply.status == 401, (header, reply.text)
        assert SECRET not in reply.text
    # A signature over other bytes does not verify this body (tampered payload).
    tampered = body.replace(b"hello-world", b"hello-wOrld")
    reply = hook(
        service, "ghcr", tampered, {"X-GitHub-Event": "package", "X-Hub-Signature-256": f"sha256={good}"}
    )
    assert reply.status == 401
    assert queue_total(service) == before


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {SECRET}x"}],
    ids=["none", "wrong-bearer", "wrong-basic"],
)
def test_webhooks_without_the_secret_are_refused(
    service: RunningService, registry: LocalRegistry, headers: dict[str, str]
) -> None:
    before = queue_total(service)
    reply = hook(service, "distribution", distribution_push(registry.host), headers)
    assert reply.status == 401, reply.text
    assert SECRET not in reply.text
    assert queue_total(service) == before


def test_unknown_source_is_404(service: RunningService) -> None:
    for source in ("gitlab", "..", "DISTRIBUTION"):
        reply = hook(service, source, {"events": []}, BEARER)
        assert reply.status == 404, (source, reply.text)
        assert "distribution" in reply.body["error"]  # the reply names the known sources


# ------------------------------------------------------------------ the SSRF guard


def test_hosts_outside_the_allowlist_are_refused_without_contacting_them(
    service: RunningService, registry: LocalRegistry, listener: ConnectionCounter
) -> None:
    before = queue_total(service)
    reply = hook(service, "distribution", distribution_push(listener.host), BEARER)
    assert reply.status == 403, reply.text
    assert reply.body["refused"] == [listener.host]
    # One foreign event poisons the delivery: nothing of it is queued, not even the allowed part.
    mixed = distribution_push(registry.host)
    mixed["events"] += distribution_push(listener.host)["events"]
    assert hook(service, "distribution", mixed, BEARER).status == 403

    auth = {"Authorization": f"Bearer {TOKEN}"}
    for ref in (f"{listener.host}/x/y:1", "docker.io/library/alpine:3", "169.254.169.254/latest/meta:1"):
        reply = call("POST", f"{service.url}/api/scans", {"ref": ref}, auth)
        assert reply.status == 403, (ref, reply.text)
    quay = {"repository": "x/y", "docker_url": f"{listener.host}/x/y", "updated_tags": ["1"]}
    assert hook(service, "quay", quay, BEARER).status == 403
    assert queue_total(service) == before
    # by-ref never contacts a registry either, even with a long-poll.
    assert by_ref(service.url, f"{listener.host}/x/y:1", wait=0.5).status == 404
    assert listener.connections == 0


# ------------------------------------------------------------------ malformed and oversized bodies


@pytest.mark.parametrize(
    "body",
    [
        b"{not json",
        b"",
        b"[]",
        b'"a string"',
        b'{"events": "nope"}',
        b'{"events": [{"action": "push"}]}',
        b"\xff\xfe",
    ],
    ids=["broken", "empty", "array", "string", "events-not-list", "event-without-target", "not-utf8"],
)
def test_malformed_webhooks_are_400_and_queue_nothing(service: RunningService, body: bytes) -> None:
    before = queue_total(service)
    reply = hook(service, "distribution", body, BEARER)
    assert reply.status == 400, reply.text
    assert reply.body["error"].startswith("malformed distribution webhook")
    assert queue_total(service) == before


def test_invalid_image_names_in_a_payload_are_400(service: RunningService, registry: LocalRegistry) -> None:
    before = queue_total(service)
    for repository in ("UPPER/case", "a//b", "x" * 300 + "/y"):
        reply = hook(service, "distribution", distribution_push(registry.host, repository), BEARER)
        assert reply.status == 400, (repository, reply.text)
    assert queue_total(service) == before


def test_oversized_bodies_are_413(service: RunningService, registry: LocalRegistry) -> None:
    before = queue_total(service)
    padding = "x" * (MAX_BODY + 1)
    big = json.dumps({**distribution_push(registry.host), "padding": padding}).encode()
    reply = hook(service, "distribution", big, BEARER)
    assert reply.status == 413, reply.text
    reply = call("POST", f"{service.url}/api/scans", big, {"Authorization": f"Bearer {TOKEN}"})
    assert reply.status == 413, reply.text
    assert queue_total(service) == before


# ------------------------------------------------------------------ hostile and malformed payloads, per sender


def nested(depth: int) -> Any:
    value: Any = "bottom"
    for _ in range(depth):
        value = {"deeper": [value]}
    return value


def _set(payload: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    changed = copy.deepcopy(payload)
    *parents, last = path.split(".")
    target = changed
    for key in parents:
        target = target[key][0] if isinstance(target[key], list) else target[key]
    target[last] = value
    return changed


def _gar_with(event: Any) -> dict[str, Any]:
    payload = json.loads((WEBHOOKS / "gar_pubsub.json").read_text())
    payload["message"]["data"] = base64.b64encode(json.dumps(event).encode()).decode()
    return payload


# (source, fixture) -> one field of the real payload set to a value of the wrong type or shape.
WRONG_FIELDS: dict[str, tuple[str, str, Any]] = {
    "dockerhub": ("dockerhub_push.json", "push_data.tag", 42),
    "harbor": ("harbor_push_default.json", "event_data.resources", "all of them"),
    "ecr": ("ecr_push.json", "detail.repository-name", ["x"]),
    "jfrog": ("jfrog_pushed.json", "data", "manifest.json"),
    "gar": ("gar_pubsub.json", "message.data", "%%% not base64 %%%"),
}
HOSTILE_SOURCES = sorted(WRONG_FIELDS)


def hostile_bodies(source: str) -> dict[str, bytes]:
    """Each way to break one sender's real payload, keyed by what is wrong with it."""
    fixture, path, wrong = WRONG_FIELDS[source]
    raw = (WEBHOOKS / fixture).read_bytes()
    payload = json.loads(raw)
    bodies = {
        "truncated": raw[: len(raw) // 2],
        "array": b"[" + raw + b"]",
        "wrong-field": json.dumps(_set(payload, path, wrong)).encode(),
        "too-deep": json.dumps({**payload, "extra": nested(40)}).encode(),
        "huge-number": json.dumps(payload).encode()[:-1] + b', "n": 1' + b"0" * 40 + b"}",
        "infinite-number": json.dumps(payload).encode()[:-1] + b', "n": 1e999}',
        "nan": json.dumps(payload).encode()[:-1] + b', "n": NaN}',
        "long-string": json.dumps({**payload, "note": "x" * (JSON_MAX_STRING + 1)}).encode(),
        "long-key": json.dumps({**payload, "k" * (JSON_MAX_STRING + 1): 1}).encode(),
        "deep-recursion": b'{"x": ' + b"[" * 20000 + b"]" * 20000 + b"}",
    }
    if source == "gar":  # the wrapped event is JSON too, and bounded the same way
        event = json.loads(base64.b64decode(payload["message"]["data"]))
        bodies["inner-too-deep"] = json.dumps(_gar_with({**event, "extra": nested(40)})).encode()
        bodies["inner-not-object"] = json.dumps(_gar_with([event])).encode()
        bodies["inner-wrong-field"] = json.dumps(_gar_with({**event, "action": 7})).encode()
    return bodies


EXPECTED_REASON = {
    "too-deep": "nested deeper than",
    "inner-too-deep": "nested deeper than",
    "deep-recursion": "nested deeper than",
    "huge-number": "out of range",
    "infinite-number": "out of range",
    "nan": "not a JSON number",
    "long-string": "longer than",
    "long-key": "longer than",
}


@pytest.mark.parametrize("source", HOSTILE_SOURCES)
def test_hostile_and_malformed_payloads_are_400_and_queue_nothing(
    service: RunningService, source: str
) -> None:
    before = queue_total(service)
    for what, body in hostile_bodies(source).items():
        reply = hook(service, source, body, BEARER)
        assert reply.status == 400, (source, what, reply.text)
        error = reply.body["error"]
        assert error.startswith(f"malformed {source} webhook"), (what, error)
        assert EXPECTED_REASON.get(what, "") in error, (what, error)
        assert "x" * 100 not in error  # the offending value is not echoed back whole
    assert queue_total(service) == before


def test_the_unbroken_payloads_are_accepted(service: RunningService, registry: LocalRegistry) -> None:
    """The control for the test above: the same real payloads, unmodified, are not refused as malformed."""
    for source in HOSTILE_SOURCES:
        fixture = WRONG_FIELDS[source][0]
        reply = hook(service, source, (WEBHOOKS / fixture).read_bytes(), BEARER)
        # 202, or 403 for a payload that names a registry outside this service's allowlist.
        assert reply.status in (202, 403), (source, reply.text)


# ------------------------------------------------------------------ the scan API


@pytest.mark.parametrize(
    "body",
    [
        {"ref": ""},
        {"ref": "UPPER/Case:1"},
        {"ref": "registry:5000/app:tag@sha256:short"},
        {"ref": "app:" + "t" * 200},
        {"ref": "a b"},
        {"reference": "alpine"},
        {"ref": 42},
        {"ref": "x" * 5000},
        {"ref": {"deeper": nested(40)}},
        {"ref": "alpine", "n": 10**40},
    ],
    ids=["empty", "upper", "short-digest", "long-tag", "space", "wrong-key", "number", "long", "deep", "big"],
)
def test_invalid_refs_are_400(service: RunningService, body: dict[str, Any]) -> None:
    before = queue_total(service)
    reply = call("POST", f"{service.url}/api/scans", body, {"Authorization": f"Bearer {TOKEN}"})
    assert reply.status == 400, reply.text
    assert "error" in reply.body
    assert queue_total(service) == before
    for text in (b"{", b"[1]", b""):
        reply = call("POST", f"{service.url}/api/scans", text, {"Authorization": f"Bearer {TOKEN}"})
        assert reply.status == 400, (text, reply.text)


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer not-the-token-0000"},
        {"Authorization": TOKEN},
        {"Authorization": f"Bearer {TOKEN}x"},
    ],
    ids=["missing", "wrong", "no-scheme", "longer"],
)
def test_scan_api_needs_the_token(
    service: RunningService, registry: LocalRegistry, headers: dict[str, str]
) -> None:
    before = queue_total(service)
    reply = call("POST", f"{service.url}/api/scans", {"ref": f"{registry.host}/bad/app:1"}, headers)
    assert reply.status == 401, reply.text
    assert reply.headers.get("WWW-Authenticate", "").startswith("Bearer")
    assert TOKEN not in reply.text and "not-the-token-0000" not in reply.text
    assert queue_total(service) == before


# ------------------------------------------------------------------ unscanned images


def test_by_ref_for_unscanned_image_is_404(service: RunningService, registry: LocalRegistry) -> None:
    reply = by_ref(service.url, f"{registry.host}/never/pushed:1", wait=0.2)
    assert reply.status == 404
    assert reply.body["pending"] is False and reply.body["job"] is None

    # A digest-only push waits out the coalescing delay (60 s here): it is pending meanwhile.
    event = distribution_push(registry.host, "bad/pending", tag=None)
    accepted = hook(service, "distribution", event, BEARER)
    assert accepted.status == 202, accepted.text
    digest = event["events"][0]["target"]["digest"]
    reply = by_ref(service.url, f"{registry.host}/bad/pending@{digest}", wait=0)
    assert reply.status == 404
    assert reply.body["pending"] is True
    assert reply.body["job"]["id"] == accepted.body["jobs"][0]
    assert reply.body["job"]["state"] == "queued"

    for bad in ("", "UPPER:1"):
        assert by_ref(service.url, bad, wait=0).status == 400


def test_a_digest_only_push_is_held_back_while_a_later_tagged_one_runs(
    service: RunningService, registry: LocalRegistry, push: Pusher
) -> None:
    """The coalescing delay, observed by order rather than by clock: a tagged push delivered after
    a digest-only one is claimed and scanned to the end while the digest-only job (older, so
    first in line were it ready) has not been tried once. Without the delay it would be claimed
    first (claims go by readiness, then age), and its try would count."""
    held = hook(service, "distribution", distribution_push(registry.host, "bad/held", tag=None), BEARER)
    assert held.status == 202, held.text
    tagged = distribution_push(registry.host, "bad/later", tag="1")
    tagged["events"][0]["target"]["digest"] = push(catalog.plain_glibc(), "bad/later:1")
    later = hook(service, "distribution", tagged, BEARER)
    assert later.status == 202, later.text
    assert wait_job(service.url, later.body["jobs"][0])["state"] == "done", service.log()[-3000:]
    job = wait_job(service.url, held.body["jobs"][0], wait=0)
    assert (job["state"], job["attempts"]) == ("queued", 0), job


def test_health_after_everything(service: RunningService) -> None:
    reply = call("GET", f"{service.url}/healthz")
    assert reply.status == 200 and reply.body["status"] == "ok"
    assert service.process is not None and service.process.poll() is None
    assert "Traceback" not in service.log()
