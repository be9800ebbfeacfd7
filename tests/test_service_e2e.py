"""End to end: a real registry notifies the running service; badges appear through the API.

The service runs as a real `gpubadge serve` subprocess. A real `docker-registry` is
configured with `notifications: endpoints:` pointing at it (with the Bearer secret in
the endpoint's static headers, as operators configure it). Images are pushed with
skopeo. Every other source is exercised with its documented payload, rewritten to name
the loopback registry, after pushing the image the payload names. Nothing is inserted
into the store behind the service's back; every wait is a bounded long-poll.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import re
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from fixtures import catalog
from fixtures.oci import ImageSpec, push_image
from fixtures.registry import LocalRegistry, free_port, notification_endpoint, run_registry
from fixtures.service import RunningService, run_service_process

WEBHOOKS = Path(__file__).resolve().parent.parent / "fixtures" / "webhooks"
SECRET = "e2e-hook-secret-7f3a"
ECR_HOST = "123456789012.dkr.ecr.us-west-2.amazonaws.com"
FIXTURE_HOST = "127.0.0.1:5000"


# ------------------------------------------------------------------ helpers (shared by the service tests)


@dataclass
class Reply:
    status: int
    body: Any
    headers: dict[str, str]
    text: str


def call(
    method: str,
    url: str,
    body: bytes | dict[str, Any] | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = 20.0,
) -> Reply:
    """One HTTP request; JSON bodies are decoded, errors are replies (not exceptions)."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    all_headers = {"Content-Type": "application/json", **(headers or {})}
    request = urllib.request.Request(url, data=data, method=method, headers=all_headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            raw, status, got = response.read(), response.status, dict(response.headers)
    except urllib.error.HTTPError as exc:
        raw, status, got = exc.read(), exc.code, dict(exc.headers)
    text = raw.decode(errors="replace")
    try:
        decoded: Any = json.loads(text)
    except ValueError:
        decoded = None
    return Reply(status, decoded, got, text)


def by_ref(service: str, ref: str, wait: float = 10.0) -> Reply:
    """GET /api/images/by-ref with a bounded long-poll (the service answers as the scan lands)."""
    query = urllib.parse.urlencode({"ref": ref, "wait": str(wait)})
    return call("GET", f"{service}/api/images/by-ref?{query}", timeout=wait + 10)


def wait_job(service: str, job_id: str, wait: float = 15.0) -> dict[str, Any]:
    reply = call("GET", f"{service}/api/scans/{job_id}?wait={wait}", timeout=wait + 10)
    assert reply.status == 200, reply.text
    job: dict[str, Any] = reply.body
    return job


def metric_values(text: str, name: str) -> dict[str, float]:
    """`name{labels} value` lines of a Prometheus exposition, keyed by the label text."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        match = re.fullmatch(rf"{re.escape(name)}(\{{[^}}]*\}})? (\S+)", line)
        if match:
            values[match.group(1) or ""] = float(match.group(2))
    return values


def bearer(secret: str = SECRET) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


# ------------------------------------------------------------------ the running pair


@dataclass
class Stack:
    service: RunningService
    registry: LocalRegistry  # notifies the service on every push
    quiet: LocalRegistry  # notifies nobody: the senders' images live here
    workdir: Path

    @property
    def url(self) -> str:
        return self.service.url

    def push(self, spec: ImageSpec | list[ImageSpec], name: str, *, quiet: bool = False) -> str:
        target = self.workdir / f"layout-{len(list(self.workdir.iterdir()))}"
        host = self.quiet.host if quiet else self.registry.host
        return push_image(spec, f"{host}/{name}", target)

    def hook(self, source: str, payload: dict[str, Any], headers: dict[str, str] | None = None) -> Reply:
        return call("POST", f"{self.url}/hooks/{source}", payload, {**bearer(), **(headers or {})})


def notifications(notify_url: str) -> dict[str, Any]:
    """The registry's own notification config, authenticated the way operators do it."""
    return {"endpoints": [notification_endpoint(notify_url, SECRET)]}


@pytest.fixture(scope="module")
def stack(registry: LocalRegistry, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The service, a registry that notifies it, and a quiet registry (the session's) for the
    other senders' payloads, so that a badge there can only come from the payload under test."""
    root = tmp_path_factory.mktemp("e2e")
    port = free_port()
    notify_url = f"http://127.0.0.1:{port}/hooks/distribution"
    log_config = {"level": "info", "accesslog": {"disabled": False}}
    with run_registry(
        extra_config={"notifications": notifications(notify_url), "log": log_config}
    ) as notifying:
        allowlist = [
            {"host": notifying.host},
            {"host": registry.host},
            {"host": "docker.io"},
            {"host": ECR_HOST, "mirror": registry.host},
        ]
        env = {
            "GPUBADGE_REGISTRIES": json.dumps(allowlist),
            "GPUBADGE_DOCKER_MIRROR": registry.host,
            "GPUBADGE_JFROG_REGISTRY": registry.host,
            "GPUBADGE_WEBHOOK_SECRET": SECRET,
            "GPUBADGE_COALESCE_SECONDS": "1.0",
            "DOCKER_CONFIG": str(root / "docker"),
        }
        with run_service_process(root / "service.db", env=env, port=port) as service:
            workdir = root / "layouts"
            workdir.mkdir()
            yield Stack(service, notifying, registry, workdir)


# ------------------------------------------------------------------ registry notifications


def test_registry_notification_produces_a_badge(stack: Stack) -> None:
    digest = stack.push(catalog.cuda_ubuntu(), "e2e/cuda:12")
    reply = by_ref(stack.url, f"{stack.registry.host}/e2e/cuda:12")
    assert reply.status == 200, (reply.text, stack.service.log()[-2000:])
    report = reply.body
    assert report["digest"] == digest
    (platform,) = report["platforms"]
    assert platform["gpu"]["required"] is True
    assert platform["libc"]["flavour"] == "glibc"
    listing = call("GET", f"{stack.url}/api/images?gpu=true&q=e2e/cuda").body
    assert [image["digest"] for image in listing["images"]] == [digest]
    assert listing["images"][0]["tags"] == ["12"]


def layer_gets(registry: LocalRegistry, digest: str, since: int = 0) -> int:
    """Blob GETs for `digest` in the registry's own access log, from character `since` on (where the
    log ended before the test's push): what the scanner really read, of any repository holding it."""
    return len(re.findall(rf'"GET /v2/[^"]*/blobs/{re.escape(digest)} ', registry.log()[since:]))


def test_multi_arch_push_coalesces_into_one_index_report(stack: Stack) -> None:
    # The counts start here: the previous test's image shares the amd64 base layer, and its read of it
    # is not this push's.
    log_mark = len(stack.registry.log())
    index_digest = stack.push(catalog.multi_arch(), "e2e/multi:1")  # with a buildkit attestation
    reply = by_ref(stack.url, f"{stack.registry.host}/e2e/multi:1")
    assert reply.status == 200, reply.text
    report = reply.body
    assert report["digest"] == index_digest
    assert sorted(p["platform"] for p in report["platforms"]) == ["linux/amd64", "linux/arm64/v8"]
    children = {p["digest"] for p in report["platforms"]}

    # The child-manifest events (two platforms, one attestation) queued digest-only jobs; all end
    # done (the attestation as "not an image"), and none of them adds a report or re-reads a layer.
    jobs = call("GET", f"{stack.url}/api/scans?limit=200").body["jobs"]
    mine = [job for job in jobs if "/e2e/multi" in job["reference"]]
    for job in mine:
        assert wait_job(stack.url, job["id"])["state"] == "done"
    references = sorted(job["reference"] for job in mine)
    by_digest = {ref.rpartition("@")[2] for ref in references if "@" in ref}
    assert children <= by_digest | {index_digest}, references
    assert len(mine) == len(set(references)), "one job per manifest, not one per event"

    listing = call("GET", f"{stack.url}/api/images?q=e2e/multi").body
    assert [image["digest"] for image in listing["images"]] == [index_digest], listing
    # each layer read once, an inline analysis handed over to an analysis process on a busy host too
    # (that process is given the bytes the inline read took)
    for platform in report["platforms"]:
        for layer in platform["layers"]:
            assert layer_gets(stack.registry, layer["digest"], log_mark) <= 1, layer["digest"]
    for child in children:
        child_view = by_ref(stack.url, f"{stack.registry.host}/e2e/multi@{child}", wait=0)
        assert child_view.status == 200
        assert [p["digest"] for p in child_view.body["platforms"]] == [child]


def manifest_event(host: str, repository: str, digest: str, tag: str | None = None) -> dict[str, Any]:
    """One registry push event, as CNCF Distribution sends it (the tag absent for a child)."""
    target = {"mediaType": "application/vnd.oci.image.manifest.v1+json", "repository": repository}
    target |= {"digest": digest, **({"tag": tag} if tag else {})}
    return {"action": "push", "target": target, "request": {"host": host}}


def index_children(host: str, repository: str, tag: str) -> list[str]:
    """The manifests an index lists (platforms and attestations), read from the registry itself."""
    request = urllib.request.Request(
        f"http://{host}/v2/{repository}/manifests/{tag}",
        headers={"Accept": "application/vnd.oci.image.index.v1+json"},
    )
    with urllib.request.urlopen(request, timeout=20) as response:
        return [child["digest"] for child in json.loads(response.read())["manifests"]]


@pytest.mark.parametrize("child_event", ["before", "with", "after"])
def test_a_multi_arch_child_never_becomes_an_image_whenever_its_event_arrives(
    stack: Stack, child_event: str
) -> None:
    """The index's and its children's push events in each order a registry may send them, each
    delivery's jobs run to the end before the next: one image, the index; each child is known as
    one of its platforms (README, Durability: child events wait so the index covers them)."""
    repository = f"e2e/order-{child_event}"
    specs = catalog.multi_arch()
    for spec in specs:  # content of its own, so no other test's report of the same digest answers
        spec.labels["case"] = repository
    index_digest = stack.push(specs, f"{repository}:1", quiet=True)
    host = stack.quiet.host
    children = [manifest_event(host, repository, d) for d in index_children(host, repository, "1")]
    index = [manifest_event(host, repository, index_digest, tag="1")]
    deliveries = {
        "before": [children, index],
        "with": [children + index],
        "after": [index, children],
    }[child_event]
    for events in deliveries:
        reply = stack.hook("distribution", {"events": events})
        assert reply.status == 202, reply.text
        for job_id in reply.body["jobs"]:
            assert wait_job(stack.url, job_id)["state"] == "done", stack.service.log()[-2000:]
    listing = call("GET", f"{stack.url}/api/images?limit=200").body["images"]
    mine = [image["digest"] for image in listing if image["repository"] == repository]
    assert mine == [index_digest], listing
    report = by_ref(stack.url, f"{host}/{repository}:1", wait=0).body
    for platform in report["platforms"]:
        child_view = by_ref(stack.url, f"{host}/{repository}@{platform['digest']}", wait=0)
        assert child_view.status == 200, child_view.text
        assert [p["digest"] for p in child_view.body["platforms"]] == [platform["digest"]]


# ------------------------------------------------------------------ every other documented sender


@dataclass(frozen=True)
class SenderCase:
    source: str
    fixture: str
    pushed_as: str  # repository:tag on the loopback registry, as the payload names it
    expected: str  # the reference (with `{host}`) the badge must appear under; `{digest}` if by digest
    headers: tuple[tuple[str, str], ...] = ()


SENDERS = [
    SenderCase(
        "dockerhub",
        "dockerhub_push.json",
        "svendowideit/testhook:latest",
        "docker.io/svendowideit/testhook:latest",
    ),
    SenderCase(
        "harbor", "harbor_push_default.json", "harbor/alpine:default", "{host}/harbor/alpine@{digest}"
    ),
    SenderCase(
        "harbor",
        "harbor_push_cloudevents.json",
        "harbor/alpine:3.18",
        "{host}/harbor/alpine:3.18",
        (("Content-Type", "application/cloudevents+json"),),
    ),
    SenderCase(
        "ghcr",
        "ghcr_package_published.json",
        "codertocat/hello-world:latest",
        "{host}/codertocat/hello-world:latest",
        (("X-GitHub-Event", "package"),),
    ),
    SenderCase("quay", "quay_push.json", "dgangaia/test:latest", "{host}/dgangaia/test:latest"),
    SenderCase(
        "gar",
        "gar_pubsub.json",
        "my-project/my-repo/hello-world:1.1",
        "{host}/my-project/my-repo/hello-world:1.1",
    ),
    SenderCase("ecr", "ecr_push.json", "my-repository-name:latest", f"{ECR_HOST}/my-repository-name:latest"),
    SenderCase(
        "jfrog",
        "jfrog_pushed.json",
        "test-repo/foo/bar/busybox:latest",
        "{host}/test-repo/foo/bar/busybox:latest",
    ),
]
FOREIGN_HOSTS = (FIXTURE_HOST, "ghcr.io", "us-west1-docker.pkg.dev")


def rewrite(text: str, host: str, digest: str) -> str:
    """Point a documented payload at the loopback registry and at the image really pushed."""
    first = re.search(r"[0-9a-f]{64}", text)
    if first:
        text = text.replace(first.group(0), digest.removeprefix("sha256:"))
    for foreign in FOREIGN_HOSTS:
        text = text.replace(foreign, host)
    return text


def sender_payload(case: SenderCase, host: str, digest: str) -> bytes:
    payload = json.loads((WEBHOOKS / case.fixture).read_text())
    if case.source == "gar":  # Pub/Sub wraps the event as base64 JSON
        inner = base64.b64decode(payload["message"]["data"]).decode()
        payload["message"]["data"] = base64.b64encode(rewrite(inner, host, digest).encode()).decode()
        return json.dumps(payload).encode()
    return rewrite(json.dumps(payload), host, digest).encode()


def sender_image(case: SenderCase) -> ImageSpec:
    marker = f"{case.source}-{case.fixture}"
    return ImageSpec(
        [catalog.alpine_base(), catalog.app_layer(case.source)],
        env={"NVIDIA_VISIBLE_DEVICES": "all", "NVIDIA_GPU": "1", "MARKER": marker},
    )


@pytest.mark.parametrize(
    "case", SENDERS, ids=[f"{c.source}-{c.fixture.removesuffix('.json')}" for c in SENDERS]
)
def test_documented_sender_payload_produces_a_badge(stack: Stack, case: SenderCase) -> None:
    digest = stack.push(sender_image(case), case.pushed_as, quiet=True)
    body = sender_payload(case, stack.quiet.host, digest)
    headers = dict(case.headers)
    if case.source == "ghcr":  # GitHub signs; the signature is the proof, not a token
        signature = hmac.new(SECRET.encode(), body, hashlib.sha256).hexdigest()
        reply = call(
            "POST", f"{stack.url}/hooks/ghcr", body, {**headers, "X-Hub-Signature-256": f"sha256={signature}"}
        )
    else:
        reply = call("POST", f"{stack.url}/hooks/{case.source}", body, {**bearer(), **headers})
    assert reply.status == 202, reply.text
    assert reply.body["accepted"] == 1 and len(reply.body["jobs"]) == 1

    expected = case.expected.format(host=stack.quiet.host, digest=digest)
    view = by_ref(stack.url, expected)
    assert view.status == 200, (view.text, wait_job(stack.url, reply.body["jobs"][0], wait=0))
    assert view.body["digest"] == digest
    assert view.body["platforms"][0]["gpu"]["required"] is True
    assert view.body["platforms"][0]["libc"]["flavour"] == "musl"
    job = wait_job(stack.url, reply.body["jobs"][0])
    assert (job["state"], job["source"], job["digest"]) == ("done", case.source, digest)


def test_foreign_ecr_account_is_refused(stack: Stack) -> None:
    """Only the ECR account configured (with its mirror) is allowed; another is a 403."""
    case = next(c for c in SENDERS if c.source == "ecr")
    body = sender_payload(case, stack.quiet.host, "sha256:" + "a" * 64).replace(
        b"123456789012", b"999999999999"
    )
    reply = call("POST", f"{stack.url}/hooks/ecr", body, bearer())
    assert reply.status == 403, reply.text
    assert reply.body["refused"] == ["999999999999.dkr.ecr.us-west-2.amazonaws.com"]
