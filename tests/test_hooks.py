"""Webhook normalisers and authentication (the web/hooks package).

Payload fixtures in fixtures/webhooks/ follow each sender's documented format
(shared/reference/webhooks.md); where a format names a host, it points at a loopback
registry. One test also drives a real CNCF Distribution registry: skopeo pushes, the
registry notifies a local listener, and what it sent is normalised.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import queue
import threading
import urllib.request
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from fixtures.oci import OCI_INDEX, OCI_MANIFEST, ImageSpec, LayerSpec, file, push_image
from fixtures.registry import LocalRegistry, run_registry
from scanner.registry.reference import parse_reference
from web.hooks import (
    SOURCES,
    ScanRequest,
    UnknownSource,
    WebhookAuthError,
    WebhookError,
    authenticate,
    normalise,
)

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "webhooks"
LOOPBACK = "127.0.0.1:5000"
V1_ENVELOPE = {"Content-Type": "application/vnd.docker.distribution.events.v1+json"}
V2_ENVELOPE = {"Content-Type": "application/vnd.docker.distribution.events.v2+json"}
CLOUDEVENTS = {"Content-Type": "application/cloudevents+json"}
SECRET = "It's a Secret to Everybody"


def digest_of(name: str) -> str:
    """The fixtures' digests are sha256 of a readable name, so expectations stay legible."""
    return "sha256:" + hashlib.sha256(name.encode()).hexdigest()


def load(name: str) -> bytes:
    return (FIXTURES / f"{name}.json").read_bytes()


Row = tuple[str, str, str | None, str | None, str]  # registry, repository, tag, digest, action


def rows(requests: list[ScanRequest]) -> list[Row]:
    return [(r.registry, r.repository, r.tag, r.digest, r.action) for r in requests]


JFROG_HOST = "artifactory.example.com"
GAR_IMAGE = ("us-west1-docker.pkg.dev", "my-project/my-repo/hello-world")
ECR_HOST = "123456789012.dkr.ecr.us-west-2.amazonaws.com"
HUB_DIGEST = "sha256:fea8895f450959fa676bcc1df0611ea93823a735a01205fd8622846041d0c7cf"
BUSYBOX = "sha256:2278daae78b8899e6c7192a8a6f49763b9e0cde6fcf94de34f115df4401b955f"

# fixture, source, headers, default_registry, expected rows in order
CASES: list[tuple[str, str, dict[str, str], str | None, list[Row]]] = [
    (
        "distribution_push_v1",
        "distribution",
        V1_ENVELOPE,
        None,
        [(LOOPBACK, "library/test", "latest", digest_of("test-manifest"), "push")],
    ),
    (
        "distribution_push_v2",
        "distribution",
        V2_ENVELOPE,
        None,
        [(LOOPBACK, "team/cuda-app", "1.0", digest_of("cuda-app-amd64"), "push")],
    ),
    (
        "distribution_multiarch",
        "distribution",
        V1_ENVELOPE,
        None,
        [
            (LOOPBACK, "team/multi", None, digest_of("multi-amd64"), "push"),
            (LOOPBACK, "team/multi", None, digest_of("multi-arm64"), "push"),
            (LOOPBACK, "team/multi", "v2", digest_of("multi-index"), "push"),
        ],
    ),
    ("distribution_pull_with_tag", "distribution", V1_ENVELOPE, None, []),
    ("distribution_blob_events", "distribution", V2_ENVELOPE, None, []),
    (
        "distribution_delete",
        "distribution",
        V1_ENVELOPE,
        None,
        [
            (LOOPBACK, "team/gone", None, digest_of("gone-manifest"), "delete"),
            (LOOPBACK, "team/gone", "old", None, "delete"),
        ],
    ),
    (
        "dockerhub_push",
        "dockerhub",
        {},
        None,
        [("docker.io", "svendowideit/testhook", "latest", None, "push")],
    ),
    (
        "dockerhub_push_observed",
        "dockerhub",
        {},
        None,
        [("docker.io", "gpubadge/cuda-app", "12.4-runtime", None, "push")],
    ),
    (
        "harbor_push_default",
        "harbor",
        {"Content-Type": "application/json"},
        None,
        [(LOOPBACK, "harbor/alpine", None, digest_of("harbor-alpine"), "push")],
    ),
    (
        "harbor_push_default_tagged",
        "harbor",
        {},
        None,
        [(LOOPBACK, "test-webhook/debian", "latest", digest_of("harbor-debian"), "push")],
    ),
    (
        "harbor_push_cloudevents",
        "harbor",
        CLOUDEVENTS,
        None,
        [(LOOPBACK, "harbor/alpine", "3.18", digest_of("harbor-alpine"), "push")],
    ),
    (
        "harbor_delete_default",
        "harbor",
        {},
        None,
        [(LOOPBACK, "test-webhook/debian", "latest", digest_of("harbor-debian"), "delete")],
    ),
    ("harbor_pull_cloudevents", "harbor", CLOUDEVENTS, None, []),
    ("harbor_scan_completed", "harbor", {}, None, []),
    (
        "ghcr_package_published",
        "ghcr",
        {"X-GitHub-Event": "package"},
        None,
        [("ghcr.io", "codertocat/hello-world", "latest", digest_of("ghcr-hello-world"), "push")],
    ),
    (
        "ghcr_registry_package_published",
        "ghcr",
        {"X-GitHub-Event": "registry_package"},
        None,
        [("ghcr.io", "codertocat/hello-world", "v1.2.0", digest_of("ghcr-hello-world"), "push")],
    ),
    (
        "ghcr_package_untagged",
        "ghcr",
        {"x-github-event": "package"},
        None,
        [("ghcr.io", "codertocat/hello-world", None, digest_of("ghcr-child-arm64"), "push")],
    ),
    ("ghcr_package_npm", "ghcr", {"X-GitHub-Event": "package"}, None, []),
    ("ghcr_ping", "ghcr", {"X-GitHub-Event": "ping"}, None, []),
    ("quay_push", "quay", {}, None, [(LOOPBACK, "dgangaia/test", "latest", None, "push")]),
    (
        "quay_test_notification",
        "quay",
        {},
        None,
        [
            (LOOPBACK, "gpubadge/cuda-app", "latest", None, "push"),
            (LOOPBACK, "gpubadge/cuda-app", "foo", None, "push"),
        ],
    ),
    ("gar_pubsub", "gar", {}, None, [(*GAR_IMAGE, "1.1", digest_of("gar-hello-world"), "push")]),
    ("gar_pubsub_untagged", "gar", {}, None, [(*GAR_IMAGE, None, digest_of("gar-child"), "push")]),
    ("gar_pubsub_delete", "gar", {}, None, [(*GAR_IMAGE, "1.1", None, "delete")]),
    ("gar_unwrapped", "gar", {}, None, [(*GAR_IMAGE, "1.1", digest_of("gar-hello-world"), "push")]),
    (
        "ecr_push",
        "ecr",
        {},
        None,
        [(ECR_HOST, "my-repository-name", "latest", digest_of("ecr-my-repository"), "push")],
    ),
    (
        "ecr_delete",
        "ecr",
        {},
        None,
        [(ECR_HOST, "my-repository-name", "latest", digest_of("ecr-my-repository"), "delete")],
    ),
    ("ecr_push_failed", "ecr", {}, None, []),
    ("ecr_image_scan", "ecr", {}, None, []),
    (
        "jfrog_pushed",
        "jfrog",
        {},
        JFROG_HOST,
        [(JFROG_HOST, "test-repo/foo/bar/busybox", "latest", BUSYBOX, "push")],
    ),
    (
        "jfrog_pushed_list",
        "jfrog",
        {},
        JFROG_HOST,
        [(JFROG_HOST, "test-repo/cuda-app", "1.0", "sha256:" + digest_of("jfrog-list")[7:], "push")],
    ),
    (
        "jfrog_deleted",
        "jfrog",
        {},
        JFROG_HOST,
        [(JFROG_HOST, "test-repo/foo/bar/busybox", "latest", BUSYBOX, "delete")],
    ),
    ("jfrog_promoted", "jfrog", {}, JFROG_HOST, []),
    (
        "acr_push_index",
        "acr",
        {"Content-Type": "application/json"},
        None,
        [("contoso.azurecr.io", "team-a/cuda-app", "12.4", digest_of("acr-cuda-index"), "push")],
    ),
]


@pytest.mark.parametrize(
    ("fixture", "source", "headers", "default_registry", "expected"),
    CASES,
    ids=[case[0] for case in CASES],
)
def test_fixture_normalises_to_expected_requests(
    fixture: str, source: str, headers: dict[str, str], default_registry: str | None, expected: list[Row]
) -> None:
    requests = normalise(source, load(fixture), headers, default_registry=default_registry)
    assert rows(requests) == expected
    assert all(request.source == source for request in requests)


def test_every_fixture_is_exercised_and_every_source_has_one() -> None:
    on_disk = {path.stem for path in FIXTURES.glob("*.json")}
    assert on_disk == {case[0] for case in CASES}
    assert {case[1] for case in CASES} == set(SOURCES)


@pytest.mark.parametrize("case", [c for c in CASES if c[4]], ids=[c[0] for c in CASES if c[4]])
def test_reference_round_trips_through_the_scanner_parser(
    case: tuple[str, str, dict[str, str], str | None, list[Row]],
) -> None:
    fixture, source, headers, default_registry, _ = case
    for request in normalise(source, load(fixture), headers, default_registry=default_registry):
        parsed = parse_reference(request.reference)
        assert (parsed.registry, parsed.repository, parsed.digest) == (
            request.registry,
            request.repository,
            request.digest,
        )
        assert parsed.tag == (request.tag or (None if request.digest else "latest"))


def test_reference_text() -> None:
    request = ScanRequest(
        registry=LOOPBACK, repository="a/b", tag="v1", digest=digest_of("x"), action="push", source="t"
    )
    assert request.reference == f"{LOOPBACK}/a/b:v1@{digest_of('x')}"
    untagged = request.model_copy(update={"tag": None})
    assert untagged.reference == f"{LOOPBACK}/a/b@{digest_of('x')}"


def test_docker_hub_names_are_canonical() -> None:
    body = json.dumps({"push_data": {"tag": "1.27"}, "repository": {"repo_name": "nginx"}}).encode()
    [request] = normalise("dockerhub", body, {})
    assert (request.registry, request.repository) == ("docker.io", "library/nginx")
    aliased = ScanRequest(
        registry="Index.Docker.IO", repository="nginx", tag="1", digest=None, action="push", source="t"
    )
    assert (aliased.registry, aliased.repository) == ("docker.io", "library/nginx")


def test_harbor_cloudevents_recognised_by_content_type_alone() -> None:
    payload = json.loads(load("harbor_push_cloudevents"))
    del payload["specversion"]
    body = json.dumps(payload).encode()
    assert len(normalise("harbor", body, CLOUDEVENTS)) == 1
    with pytest.raises(WebhookError, match="event_data"):
        normalise("harbor", body, {"Content-Type": "application/json"})


def test_distribution_host_falls_back_to_request_host_then_default() -> None:
    event = {
        "action": "push",
        "target": {
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": digest_of("x"),
            "repository": "a/b",
        },
        "request": {"host": "localhost:5001"},
    }
    body = json.dumps({"events": [event]}).encode()
    assert normalise("distribution", body, {})[0].registry == "localhost:5001"
    del event["request"]
    body = json.dumps({"events": [event]}).encode()
    assert normalise("distribution", body, {}, default_registry="reg.example.com")[0].registry == (
        "reg.example.com"
    )
    with pytest.raises(WebhookError, match="no default registry"):
        normalise("distribution", body, {})


def test_target_url_wins_over_client_host_and_drops_credentials() -> None:
    event = {
        "action": "push",
        "target": {
            "mediaType": "application/vnd.docker.distribution.manifest.list.v2+json",
            "digest": digest_of("x"),
            "repository": "a/b",
            "url": f"https://user:pw@registry.example.com:8443/v2/a/b/manifests/{digest_of('x')}",
        },
        "request": {"host": "10.0.0.7:5000"},
    }
    [request] = normalise("distribution", json.dumps({"events": [event]}).encode(), {})
    assert request.registry == "registry.example.com:8443"


def test_jfrog_without_configured_host_is_refused_with_the_reason() -> None:
    with pytest.raises(WebhookError, match="configure the Artifactory Docker host"):
        normalise("jfrog", load("jfrog_pushed"), {})


def test_jfrog_falls_back_to_image_name_without_path() -> None:
    payload = json.loads(load("jfrog_pushed"))
    del payload["data"]["path"]
    [request] = normalise("jfrog", json.dumps(payload).encode(), {}, default_registry=JFROG_HOST)
    assert request.repository == "test-repo/busybox"


def test_ecr_china_regions_use_the_cn_domain() -> None:
    payload = json.loads(load("ecr_push"))
    payload["region"] = "cn-north-1"
    [request] = normalise("ecr", json.dumps(payload).encode(), {})
    assert request.registry == "123456789012.dkr.ecr.cn-north-1.amazonaws.com.cn"


def _gar_envelope(data: bytes) -> bytes:
    return json.dumps({"message": {"data": base64.b64encode(data).decode()}, "subscription": "s"}).encode()


def _mutated(fixture: str, change: Callable[[dict[str, Any]], object]) -> bytes:
    payload = json.loads(load(fixture))
    change(payload)
    return json.dumps(payload).encode()


def _set(path: list[str | int], value: object) -> Callable[[dict[str, Any]], object]:
    def change(payload: dict[str, Any]) -> None:
        node: Any = payload
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value

    return change


# source, body, default_registry, fragment the message must contain
MALFORMED: list[tuple[str, str, bytes, str | None, str]] = [
    ("not-json", "distribution", b"{events: nope", None, "not JSON"),
    ("not-utf8", "quay", b"\xff\xfe{", None, "not"),
    ("json-array", "harbor", b"[1, 2]", None, "must be a JSON object"),
    ("events-missing", "distribution", b"{}", None, "events: Field required"),
    ("events-not-list", "distribution", b'{"events": {"action": "push"}}', None, "events: Input should be"),
    (
        "action-wrong-type",
        "distribution",
        _mutated("distribution_push_v2", _set(["events", 0, "action"], 7)),
        None,
        "events.0.action",
    ),
    (
        "invalid-digest",
        "distribution",
        _mutated("distribution_push_v2", _set(["events", 0, "target", "digest"], "sha256:abc")),
        None,
        "needs 64 hex characters",
    ),
    (
        "repository-uppercase",
        "distribution",
        _mutated("distribution_push_v2", _set(["events", 0, "target", "repository"], "Team/App")),
        None,
        "must be lowercase",
    ),
    (
        "repository-missing",
        "distribution",
        _mutated("distribution_push_v2", _set(["events", 0, "target", "repository"], None)),
        None,
        "target.repository is missing",
    ),
    (
        "tag-absurd",
        "dockerhub",
        _mutated("dockerhub_push", _set(["push_data", "tag"], "-" + "x" * 200)),
        None,
        "invalid tag",
    ),
    (
        "hub-tag-missing",
        "dockerhub",
        _mutated("dockerhub_push", _set(["push_data"], {})),
        None,
        "push_data.tag",
    ),
    (
        "hub-repo-name-number",
        "dockerhub",
        _mutated("dockerhub_push", _set(["repository", "repo_name"], 42)),
        None,
        "repository.repo_name",
    ),
    (
        "harbor-resources-not-list",
        "harbor",
        _mutated("harbor_push_default", _set(["event_data", "resources"], "x")),
        None,
        "resources",
    ),
    (
        "harbor-host-not-a-host",
        "harbor",
        _mutated(
            "harbor_push_default_tagged", _set(["event_data", "resources", 0, "resource_url"], "h_x/a:b")
        ),
        None,
        "invalid registry host",
    ),
    ("harbor-type-missing", "harbor", b'{"event_data": {}}', None, "type: Field required"),
    (
        "ghcr-octokit-fake-digest",
        "ghcr",
        _mutated(
            "ghcr_package_untagged",
            lambda p: p["package"]["package_version"].update(
                version="1.0",
                name="1.0",
                container_metadata={"tag": {"name": "", "digest": "sha256:" + "6c" * 20}},
            ),
        ),
        None,
        "needs 64 hex characters",
    ),
    (
        "ghcr-owner-missing",
        "ghcr",
        _mutated("ghcr_package_published", lambda p: p["package"].pop("owner")),
        None,
        "owner: Field required",
    ),
    (
        "quay-tags-not-list",
        "quay",
        _mutated("quay_push", _set(["updated_tags"], "latest")),
        None,
        "updated_tags",
    ),
    ("gar-not-base64", "gar", b'{"message": {"data": "%%%"}}', None, "not base64"),
    ("gar-base64-not-json", "gar", _gar_envelope(b"plain text"), None, "not base64-encoded JSON"),
    (
        "gar-short-reference",
        "gar",
        _gar_envelope(json.dumps({"action": "INSERT", "digest": "hello@" + digest_of("x")}).encode()),
        None,
        "not a full image reference",
    ),
    (
        "gar-tag-and-digest-disagree",
        "gar",
        _gar_envelope(
            json.dumps(
                {"action": "INSERT", "digest": f"h.dev/p/a@{digest_of('x')}", "tag": "h.dev/p/b:1"}
            ).encode()
        ),
        None,
        "different images",
    ),
    (
        "ecr-verbatim-elided-digest",
        "ecr",
        _mutated(
            "ecr_push",
            _set(
                ["detail", "image-digest"],
                "sha256:7f5b2640fe6fb4f46592dfd3410c4a79dac4f89e4782432e0378abcd1234",
            ),
        ),
        None,
        "got 60",
    ),
    ("ecr-account-not-digits", "ecr", _mutated("ecr_push", _set(["account"], "12345")), None, "account"),
    (
        "ecr-repository-missing",
        "ecr",
        _mutated("ecr_push", lambda p: p["detail"].pop("repository-name")),
        None,
        "detail.repository-name",
    ),
    (
        "jfrog-sha256-not-hex",
        "jfrog",
        _mutated("jfrog_pushed", _set(["data", "sha256"], "zz")),
        JFROG_HOST,
        "64 lowercase hex",
    ),
    (
        "jfrog-path-inconsistent",
        "jfrog",
        _mutated("jfrog_pushed", _set(["data", "path"], "busybox/other/manifest.json")),
        JFROG_HOST,
        "data.path",
    ),
]


@pytest.mark.parametrize(
    ("source", "body", "default_registry", "fragment"),
    [case[1:] for case in MALFORMED],
    ids=[case[0] for case in MALFORMED],
)
def test_malformed_payloads_are_refused_with_a_reason(
    source: str, body: bytes, default_registry: str | None, fragment: str
) -> None:
    with pytest.raises(WebhookError) as caught:
        normalise(source, body, {}, default_registry=default_registry)
    assert fragment in str(caught.value)
    assert str(caught.value).startswith(source)


def test_unknown_source_is_its_own_error() -> None:
    with pytest.raises(UnknownSource, match="known sources: distribution"):
        normalise("gitlab", b"{}", {})
    with pytest.raises(UnknownSource):
        authenticate("gitlab", b"{}", {}, {}, SECRET)
    assert issubclass(UnknownSource, WebhookError)


# --- authentication ------------------------------------------------------------------------


def github_signature(body: bytes, secret: str = SECRET, algorithm: str = "sha256") -> str:
    return f"{algorithm}=" + hmac.new(secret.encode(), body, algorithm).hexdigest()


def test_github_documented_test_vector() -> None:
    body = b"Hello, World!"
    expected = "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17"
    assert github_signature(body) == expected
    authenticate("ghcr", body, {"X-Hub-Signature-256": expected}, {}, SECRET)


BODY = load("ghcr_package_published")

ACCEPTED: list[tuple[str, str, dict[str, str], dict[str, str]]] = [
    ("bearer", "dockerhub", {"Authorization": f"Bearer {SECRET}"}, {}),
    ("bearer-lowercase-scheme", "harbor", {"authorization": f"bearer {SECRET}"}, {}),
    ("verbatim-header", "harbor", {"Authorization": SECRET}, {}),
    ("query-token", "quay", {}, {"token": SECRET}),
    ("wrong-bearer-but-good-token", "harbor", {"Authorization": "Bearer unrelated"}, {"token": SECRET}),
    ("github-signature", "ghcr", {"X-Hub-Signature-256": github_signature(BODY)}, {}),
    ("github-bearer-instead", "ghcr", {"Authorization": f"Bearer {SECRET}"}, {}),
    ("jfrog-plain-secret", "jfrog", {"X-JFrog-Event-Auth": SECRET}, {}),
    ("jfrog-hex-hmac-sha256", "jfrog", {"X-JFrog-Event-Auth": github_signature(BODY)[7:]}, {}),
    ("jfrog-sha256-prefixed", "jfrog", {"x-jfrog-event-auth": github_signature(BODY)}, {}),
    ("jfrog-sha1-telegraf", "jfrog", {"X-JFrog-Event-Auth": github_signature(BODY, algorithm="sha1")}, {}),
    ("jfrog-token-instead", "jfrog", {}, {"token": SECRET}),
]


@pytest.mark.parametrize(
    ("source", "headers", "query"), [c[1:] for c in ACCEPTED], ids=[c[0] for c in ACCEPTED]
)
def test_valid_credentials_are_accepted(source: str, headers: dict[str, str], query: dict[str, str]) -> None:
    authenticate(source, BODY, headers, query, SECRET)


REFUSED: list[tuple[str, str, dict[str, str], dict[str, str], str]] = [
    ("nothing", "dockerhub", {}, {}, "no credentials"),
    ("wrong-bearer", "distribution", {"Authorization": "Bearer not-it"}, {}, "does not match"),
    ("wrong-token", "quay", {}, {"token": "not-it"}, "does not match"),
    ("secret-as-prefix", "quay", {}, {"token": SECRET + "x"}, "does not match"),
    (
        "basic-scheme",
        "ecr",
        {"Authorization": "Basic " + base64.b64encode(SECRET.encode()).decode()},
        {},
        "match",
    ),
    ("github-missing", "ghcr", {}, {}, "X-Hub-Signature-256"),
    ("github-bad", "ghcr", {"X-Hub-Signature-256": github_signature(b"other body")}, {}, "does not match"),
    (
        "github-wrong-secret",
        "ghcr",
        {"X-Hub-Signature-256": github_signature(BODY, "nope")},
        {},
        "does not match",
    ),
    (
        "github-sha1-prefix",
        "ghcr",
        {"X-Hub-Signature-256": github_signature(BODY, algorithm="sha1")},
        {},
        "sha256=",
    ),
    ("github-no-prefix", "ghcr", {"X-Hub-Signature-256": github_signature(BODY)[7:]}, {}, "sha256="),
    (
        "github-bad-signature-not-rescued-by-token",
        "ghcr",
        {"X-Hub-Signature-256": github_signature(b"tampered")},
        {"token": SECRET},
        "does not match",
    ),
    ("jfrog-wrong", "jfrog", {"X-JFrog-Event-Auth": "nope"}, {}, "neither the secret"),
    ("jfrog-md5-prefix", "jfrog", {"X-JFrog-Event-Auth": "md5=" + "0" * 32}, {}, "neither the secret"),
    ("jfrog-hmac-other-body", "jfrog", {"X-JFrog-Event-Auth": github_signature(b"x")[7:]}, {}, "neither"),
]


@pytest.mark.parametrize(
    ("source", "headers", "query", "fragment"), [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED]
)
def test_invalid_credentials_are_refused_without_leaking_the_secret(
    source: str, headers: dict[str, str], query: dict[str, str], fragment: str
) -> None:
    with pytest.raises(WebhookAuthError) as caught:
        authenticate(source, BODY, headers, query, SECRET)
    message = str(caught.value)
    assert fragment in message
    assert SECRET not in message
    assert "Secret" not in message
    for value in [*headers.values(), *query.values()]:
        assert value not in message


def test_no_secret_configured_accepts_anything() -> None:
    authenticate("ghcr", BODY, {"X-Hub-Signature-256": "sha256=garbage"}, {}, None)
    authenticate("dockerhub", BODY, {}, {}, None)


def test_comparisons_are_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    real = hmac.compare_digest
    calls: list[tuple[bytes, bytes]] = []

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    scenarios: list[tuple[str, dict[str, str], dict[str, str], bytes]] = [
        ("dockerhub", {"Authorization": f"Bearer {SECRET}"}, {}, SECRET.encode()),
        ("quay", {}, {"token": SECRET}, SECRET.encode()),
        ("ghcr", {"X-Hub-Signature-256": github_signature(BODY)}, {}, github_signature(BODY)[7:].encode()),
        ("jfrog", {"X-JFrog-Event-Auth": SECRET}, {}, SECRET.encode()),
    ]
    for source, headers, query, compared in scenarios:
        calls.clear()
        authenticate(source, BODY, headers, query, SECRET)
        assert (compared, compared) in calls, source
    calls.clear()
    with pytest.raises(WebhookAuthError):
        authenticate("quay", BODY, {}, {"token": "wrong"}, SECRET)
    assert calls == [(b"wrong", SECRET.encode())]


def test_case_insensitive_multidict_headers_as_aiohttp_passes_them() -> None:
    from multidict import CIMultiDict, MultiDict

    headers = CIMultiDict({"X-GITHUB-EVENT": "package", "x-hub-signature-256": github_signature(BODY)})
    authenticate("ghcr", BODY, headers, MultiDict(), SECRET)
    assert len(normalise("ghcr", BODY, headers)) == 1
    authenticate("quay", BODY, CIMultiDict(), MultiDict({"token": SECRET}), SECRET)


def test_non_ascii_credentials_are_refused_not_crashing() -> None:
    with pytest.raises(WebhookAuthError):
        authenticate("quay", BODY, {}, {"token": "sécret"}, SECRET)
    authenticate("quay", BODY, {}, {"token": "sécret"}, "sécret")


# --- a real registry:2 sending real notifications ------------------------------------------


class _Listener(ThreadingHTTPServer):
    deliveries: queue.Queue[tuple[dict[str, str], bytes]]


class _RecordDelivery(BaseHTTPRequestHandler):
    server: _Listener

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        self.server.deliveries.put((dict(self.headers.items()), body))
        self.send_response(200)
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def listener() -> Iterator[_Listener]:
    server = _Listener(("127.0.0.1", 0), _RecordDelivery)
    server.deliveries = queue.Queue()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def notifying_registry(listener: _Listener) -> Iterator[LocalRegistry]:
    url = f"http://127.0.0.1:{listener.server_address[1]}/hooks/distribution"
    endpoint = {
        "name": "gpubadge",
        "url": url,
        "headers": {"Authorization": [f"Bearer {SECRET}"]},
        "timeout": "2s",
        "threshold": 5,
        "backoff": "100ms",
    }
    with run_registry(extra_config={"notifications": {"endpoints": [endpoint]}}) as registry:
        yield registry


def collect(
    listener: _Listener, until: Callable[[list[ScanRequest]], bool], timeout: float = 20.0
) -> list[ScanRequest]:
    """Authenticate and normalise deliveries until `until` holds; every wait is bounded."""
    seen: list[ScanRequest] = []
    while not until(seen):
        try:
            headers, body = listener.deliveries.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"registry did not notify in {timeout}s; got {seen}") from None
        authenticate("distribution", body, headers, {}, SECRET)
        assert headers["Content-Type"] == "application/vnd.docker.distribution.events.v1+json"
        seen.extend(normalise("distribution", body, headers))
    return seen


def _image(marker: str, arch: str = "amd64") -> ImageSpec:
    return ImageSpec([LayerSpec([file("etc/marker", marker)])], architecture=arch)


def test_real_registry_notifications(
    notifying_registry: LocalRegistry, listener: _Listener, tmp_path: Path
) -> None:
    host = notifying_registry.host
    single = push_image(_image("single"), f"{host}/hooks/single:v1", tmp_path / "single")
    pushes = collect(listener, lambda seen: any(r.digest == single for r in seen))
    # Blob uploads (layer, config) were notified too, and dropped: only the manifest remains.
    assert rows(pushes) == [(host, "hooks/single", "v1", single, "push")]

    index = push_image([_image("a"), _image("b", "arm64")], f"{host}/hooks/multi:v2", tmp_path / "multi")
    multi = collect(listener, lambda seen: any(r.digest == index for r in seen))
    request = urllib.request.Request(
        f"{notifying_registry.url}/v2/hooks/multi/manifests/{index}", headers={"Accept": OCI_INDEX}
    )
    with urllib.request.urlopen(request, timeout=5) as response:
        children = [m["digest"] for m in json.load(response)["manifests"]]
    assert {r.digest for r in multi} == {*children, index}
    assert [r.tag for r in multi if r.digest == index] == ["v2"]
    assert all(r.tag is None and r.action == "push" for r in multi if r.digest != index)

    # A pull is notified but ignored; a delete comes through as a delete of that digest.
    pull = urllib.request.Request(
        f"{notifying_registry.url}/v2/hooks/single/manifests/v1", headers={"Accept": OCI_MANIFEST}
    )
    with urllib.request.urlopen(pull, timeout=5):
        pass
    delete = urllib.request.Request(
        f"{notifying_registry.url}/v2/hooks/single/manifests/{single}", method="DELETE"
    )
    with urllib.request.urlopen(delete, timeout=5) as response:
        assert response.status == 202
    after = collect(listener, lambda seen: any(r.action == "delete" for r in seen))
    assert rows(after) == [(host, "hooks/single", None, single, "delete")]
