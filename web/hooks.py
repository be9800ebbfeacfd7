"""Registry webhooks: turn each sender's payload into scan requests, and check who sent it.

Eight senders announce pushes in eight shapes (see docs in shared/reference/webhooks.md).
This module is pure: the aiohttp handler hands it the raw body, the headers and the
query, and gets back either a list of `ScanRequest` or an exception it maps to a status:
`UnknownSource` -> 404, `WebhookError` -> 400, `WebhookAuthError` -> 401.

Ignored events (pulls, blob uploads, scan results, other packages) give an empty list,
not an error: senders retry on non-2xx, and an event we do not care about must not be
retried forever.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from scanner.reference import DOCKER_HUB, ReferenceError, parse_reference
from web.bounded_json import JsonLimitExceeded, JsonLimits, loads_bounded

SOURCES: tuple[str, ...] = ("distribution", "dockerhub", "harbor", "ghcr", "quay", "gar", "ecr", "jfrog")

# Manifest media types worth scanning. Blobs (layers, configs) and schema1 are left out:
# registry:3 dropped schema1 and the scanner cannot read it.
MANIFEST_MEDIA_TYPES = frozenset(
    {
        "application/vnd.oci.image.manifest.v1+json",
        "application/vnd.oci.image.index.v1+json",
        "application/vnd.docker.distribution.manifest.v2+json",
        "application/vnd.docker.distribution.manifest.list.v2+json",
    }
)
DISTRIBUTION_MEDIA_TYPES = (
    "application/vnd.docker.distribution.events.v1+json",  # registry:2 (and GitLab's fork)
    "application/vnd.docker.distribution.events.v2+json",  # registry:3
)
CLOUDEVENTS_MEDIA_TYPE = "application/cloudevents+json"
GHCR_HOST = "ghcr.io"
_DOCKER_HUB_ALIASES = frozenset(
    {"docker.io", "index.docker.io", "registry-1.docker.io", "registry.hub.docker.com"}
)
_MAX_ERRORS_SHOWN = 3
_HOST_LABEL = r"(?:[a-z0-9]|[a-z0-9][a-z0-9-]*[a-z0-9])"
_HOST_RE = re.compile(rf"^(?:{_HOST_LABEL}(?:\.{_HOST_LABEL})*|\[[a-f0-9:]+\])(?::[0-9]{{1,5}})?$")


class WebhookError(ValueError):
    """The payload cannot be understood; the message says why (for a 400)."""


class UnknownSource(WebhookError):
    """No normaliser for this source name (for a 404)."""

    def __init__(self, source: str) -> None:
        super().__init__(f"unknown webhook source {_short(source)}; known sources: {', '.join(SOURCES)}")


class WebhookAuthError(Exception):
    """The sender did not prove it knows the secret (for a 401). Never carries the secret."""


class ScanRequest(BaseModel):
    """One manifest to (re)scan, or to mark gone.

    For `push`, scan `digest` if set, else resolve `tag` first (Docker Hub and Quay send
    no digest). For `delete`, a set `tag` means that tag is gone; a digest alone means
    the manifest itself is gone.
    """

    model_config = ConfigDict(frozen=True, strict=True)

    registry: str
    repository: str
    tag: str | None
    digest: str | None
    action: Literal["push", "delete"]
    source: str

    @model_validator(mode="after")
    def _canonical_and_parseable(self) -> ScanRequest:
        if self.tag is None and self.digest is None:
            raise ValueError(f"{self.registry}/{self.repository}: neither a tag nor a digest")
        host = self.registry.lower()
        if host in _DOCKER_HUB_ALIASES:
            host = DOCKER_HUB
        if not _HOST_RE.match(host):
            raise ValueError(f"invalid registry host {_short(self.registry)}")
        try:
            parsed = parse_reference(_reference_text(host, self.repository, self.tag, self.digest))
        except ReferenceError as exc:
            raise ValueError(str(exc)) from None
        if parsed.registry != host:
            raise ValueError(
                f"registry host {_short(host)} would read as a Docker Hub namespace in an image "
                "reference; use a dotted name, 'localhost' or host:port"
            )
        # Frozen model: set the canonical spelling (docker.io/library/x, lowercase host) directly.
        object.__setattr__(self, "registry", parsed.registry)
        object.__setattr__(self, "repository", parsed.repository)
        return self

    @property
    def reference(self) -> str:
        """`registry/repository[:tag][@digest]`, accepted by `scanner.reference.parse_reference`."""
        return _reference_text(self.registry, self.repository, self.tag, self.digest)


def _reference_text(registry: str, repository: str, tag: str | None, digest: str | None) -> str:
    text = f"{registry}/{repository}"
    if tag:
        text += f":{tag}"
    if digest:
        text += f"@{digest}"
    return text


# --- payload models: only the fields we read; everything else is ignored -------------------


class _Payload(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, frozen=True, populate_by_name=True)


class _DistributionTarget(_Payload):
    media_type: str | None = Field(default=None, alias="mediaType")
    digest: str | None = None
    repository: str | None = None
    url: str | None = None
    tag: str | None = None


class _DistributionRequest(_Payload):
    host: str | None = None


class _DistributionEvent(_Payload):
    action: str
    target: _DistributionTarget
    request: _DistributionRequest | None = None


class _DistributionEnvelope(_Payload):
    events: list[_DistributionEvent]


class _DockerHubPushData(_Payload):
    tag: str


class _DockerHubRepository(_Payload):
    repo_name: str


class _DockerHubPayload(_Payload):
    push_data: _DockerHubPushData
    repository: _DockerHubRepository


class _HarborResource(_Payload):
    digest: str | None = None
    tag: str | None = None
    resource_url: str | None = None


class _HarborRepository(_Payload):
    repo_full_name: str


class _HarborEventData(_Payload):
    resources: list[_HarborResource]
    repository: _HarborRepository


class _HarborHeader(_Payload):
    type: str


class _GhcrTag(_Payload):
    name: str | None = None
    digest: str | None = None


class _GhcrContainerMetadata(_Payload):
    tag: _GhcrTag | None = None


class _GhcrPackageVersion(_Payload):
    version: str | None = None
    name: str | None = None
    package_url: str | None = None
    container_metadata: _GhcrContainerMetadata | None = None


class _GhcrOwner(_Payload):
    login: str


class _GhcrPackageHeader(_Payload):
    package_type: str | None = None
    ecosystem: str | None = None


class _GhcrPackage(_Payload):
    name: str
    owner: _GhcrOwner
    package_version: _GhcrPackageVersion


class _GhcrEvent(_Payload):
    action: str


class _QuayPush(_Payload):
    repository: str
    docker_url: str | None = None
    updated_tags: list[str] | None = None


class _PubSubMessage(_Payload):
    data: str


class _PubSubEnvelope(_Payload):
    message: _PubSubMessage


class _GarEvent(_Payload):
    action: str
    digest: str | None = None
    tag: str | None = None


class _EcrHeader(_Payload):
    source: str
    detail_type: str = Field(alias="detail-type")


class _EcrDetail(_Payload):
    result: str
    action_type: str = Field(alias="action-type")
    repository_name: str = Field(alias="repository-name")
    image_digest: str | None = Field(default=None, alias="image-digest")
    image_tag: str | None = Field(default=None, alias="image-tag")


class _EcrImageAction(_Payload):
    account: str = Field(pattern=r"^[0-9]{12}$")
    region: str = Field(pattern=r"^[a-z]{2}(?:-[a-z]+)+-[0-9]+$")
    detail: _EcrDetail


class _JfrogHeader(_Payload):
    domain: str
    event_type: str


class _JfrogData(_Payload):
    repo_key: str
    tag: str
    sha256: str | None = None
    path: str | None = None
    name: str | None = None
    image_name: str | None = None

    @field_validator("sha256")
    @classmethod
    def _bare_hex(cls, value: str | None) -> str | None:
        if value is not None and (len(value) != 64 or value.strip("0123456789abcdef")):
            raise ValueError("expected 64 lowercase hex characters (the manifest's sha256)")
        return value


class _JfrogEvent(_Payload):
    data: _JfrogData


# --- normalisers ---------------------------------------------------------------------------

Headers = Mapping[str, str]
Normaliser = Callable[[dict[str, Any], Headers, str | None], Iterable[ScanRequest]]


def _distribution(
    payload: dict[str, Any], headers: Headers, default_registry: str | None
) -> Iterable[ScanRequest]:
    """CNCF Distribution (registry:2 v1 envelope, registry:3 v2 envelope; same JSON either way)."""
    envelope = _DistributionEnvelope.model_validate(payload)
    for event in envelope.events:
        target = event.target
        if event.action == "push":
            if target.media_type not in MANIFEST_MEDIA_TYPES:
                continue  # layers, configs (application/octet-stream), schema1
            action: Literal["push", "delete"] = "push"
        elif event.action == "delete":
            # Manifest and blob deletes look alike (digest only); a stray blob digest marks nothing.
            if target.media_type is not None and target.media_type not in MANIFEST_MEDIA_TYPES:
                continue
            action = "delete"
        else:
            continue  # pull, mount, and whatever future actions appear
        tag, digest = _blank(target.tag), _blank(target.digest)
        if tag is None and digest is None:
            continue  # a repository delete: nothing scannable is named
        if not target.repository:
            raise WebhookError(f"distribution event {event.action}: target.repository is missing")
        host = _url_host(target.url) or _blank(event.request.host if event.request else None)
        yield _request(
            "distribution",
            host or _require_default(default_registry, "distribution event carries no request.host"),
            target.repository,
            tag,
            digest,
            action,
        )


def _dockerhub(
    payload: dict[str, Any], headers: Headers, default_registry: str | None
) -> Iterable[ScanRequest]:
    """Docker Hub: pushes only, by tag, never a digest."""
    hub = _DockerHubPayload.model_validate(payload)
    yield _request("dockerhub", DOCKER_HUB, hub.repository.repo_name, hub.push_data.tag, None, "push")


_HARBOR_ACTIONS: dict[str, Literal["push", "delete"]] = {
    "PUSH_ARTIFACT": "push",
    "DELETE_ARTIFACT": "delete",
    "harbor.artifact.pushed": "push",
    "harbor.artifact.deleted": "delete",
}


def _harbor(payload: dict[str, Any], headers: Headers, default_registry: str | None) -> Iterable[ScanRequest]:
    """Harbor, Default (`event_data`) or CloudEvents (`data`, `specversion`) format."""
    cloudevents = _media_type(headers) == CLOUDEVENTS_MEDIA_TYPE or ("specversion" in payload)
    action = _HARBOR_ACTIONS.get(_HarborHeader.model_validate(payload).type)
    if action is None:
        return  # pulls, scans, quotas, replication, retention
    data_key = "data" if cloudevents else "event_data"
    if data_key not in payload:
        raise WebhookError(f"harbor payload: {data_key}: Field required")
    data = _HarborEventData.model_validate(payload[data_key])
    for resource in data.resources:
        digest = _blank(resource.digest)
        tag = _blank(resource.tag)
        if tag is not None and (tag == digest or tag.startswith("sha256:")):
            tag = None  # Harbor repeats the digest as "tag" for pushes by digest
        host = _harbor_host(resource.resource_url)
        yield _request(
            "harbor",
            host or _require_default(default_registry, "harbor resource carries no resource_url"),
            data.repository.repo_full_name,
            tag,
            digest,
            action,
        )


def _harbor_host(resource_url: str | None) -> str | None:
    url = _blank(resource_url)
    if url is None:
        return None
    if "://" in url:
        return _url_host(url)
    return url.split("/", 1)[0] or None


_GHCR_ACTIONS = frozenset({"published", "updated"})
_CONTAINER_PACKAGE_TYPES = frozenset({"container", "docker"})


def _ghcr(payload: dict[str, Any], headers: Headers, default_registry: str | None) -> Iterable[ScanRequest]:
    """GitHub `package` / `registry_package` events for container packages."""
    event_name = headers.get("x-github-event")
    if event_name == "ping":
        return
    if event_name not in (None, "package", "registry_package"):
        return  # some other GitHub event routed here
    if event_name is None:
        event_name = "package" if "package" in payload else "registry_package"
    if _GhcrEvent.model_validate(payload).action not in _GHCR_ACTIONS:
        return
    if event_name not in payload:
        raise WebhookError(f"ghcr payload: {event_name}: Field required")
    header = _GhcrPackageHeader.model_validate(payload[event_name])
    kinds = {(header.package_type or "").lower(), (header.ecosystem or "").lower()}
    if not kinds & _CONTAINER_PACKAGE_TYPES:
        return  # npm, maven, ... packages
    package = _GhcrPackage.model_validate(payload[event_name])
    version = package.package_version
    tag_info = version.container_metadata.tag if version.container_metadata else None
    tag = _blank(tag_info.name if tag_info else None)
    # The package version *is* the manifest, named by its digest; the tag block repeats it.
    digest = next(
        (d for d in (version.version, version.name) if d and d.startswith("sha256:")),
        _blank(tag_info.digest if tag_info else None),
    )
    host = _ghcr_host(version.package_url) or GHCR_HOST
    repository = f"{package.owner.login}/{package.name}".lower()
    yield _request("ghcr", host, repository, tag, digest, "push")


def _ghcr_host(package_url: str | None) -> str | None:
    """`ghcr.io/Owner/name:tag` -> `ghcr.io` (GitHub Enterprise uses its own containers host)."""
    first = (package_url or "").split("/", 1)[0].lower()
    return first if "." in first and _HOST_RE.match(first) else None


def _quay(payload: dict[str, Any], headers: Headers, default_registry: str | None) -> Iterable[ScanRequest]:
    """Quay `repo_push`: one request per updated tag, no digests."""
    push = _QuayPush.model_validate(payload)
    if push.updated_tags is None:
        return  # another repository notification (build, vulnerability) sent to this hook
    host = _blank((push.docker_url or "").split("/", 1)[0])
    host = host or _require_default(default_registry, "quay payload carries no docker_url")
    for tag in push.updated_tags:
        yield _request("quay", host, push.repository, tag, None, "push")


_GAR_ACTIONS: dict[str, Literal["push", "delete"]] = {"INSERT": "push", "DELETE": "delete"}


def _gar(payload: dict[str, Any], headers: Headers, default_registry: str | None) -> Iterable[ScanRequest]:
    """Artifact Registry via a Pub/Sub push subscription (unwrapped by `_unwrap_pubsub` first)."""
    event = _GarEvent.model_validate(payload)
    action = _GAR_ACTIONS.get(event.action)
    if action is None:
        return
    by_tag = _split_reference(event.tag, ":", "tag") if _blank(event.tag) else None
    by_digest = _split_reference(event.digest, "@", "digest") if _blank(event.digest) else None
    if by_tag and by_digest and by_tag[0] != by_digest[0]:
        raise WebhookError(
            f"gar payload: tag and digest name different images ({by_tag[0]} vs {by_digest[0]})"
        )
    name = (by_tag or by_digest or ("", ""))[0]
    if not name:
        raise WebhookError("gar payload: neither tag nor digest is set")
    host, _, repository = name.partition("/")
    yield _request(
        "gar",
        host,
        repository,
        by_tag[1] if by_tag else None,
        by_digest[1] if by_digest else None,
        action,
    )


def _unwrap_pubsub(payload: dict[str, Any], limits: JsonLimits) -> dict[str, Any]:
    """A Pub/Sub push wraps the event as base64 JSON in `message.data`; unwrapped pushes are the event."""
    if "message" not in payload:
        return payload
    try:
        encoded = _PubSubEnvelope.model_validate(payload).message.data
    except ValidationError as exc:
        raise WebhookError(f"gar payload: {_describe(exc)}") from None
    try:
        message = loads_bounded(base64.b64decode(encoded, validate=True), limits)
    except JsonLimitExceeded as exc:
        raise WebhookError(f"gar payload refused: message.data: {exc}") from None
    except (binascii.Error, ValueError) as exc:
        raise WebhookError(f"gar payload: message.data is not base64-encoded JSON ({exc})") from None
    if not isinstance(message, dict):
        raise WebhookError(f"gar payload: message.data must hold a JSON object, got {type(message).__name__}")
    return message


def _split_reference(text: str | None, separator: str, field: str) -> tuple[str, str]:
    """`host/path<sep>value` -> (`host/path`, value); GAR sends full references, not parts."""
    name, sep, value = (text or "").rpartition(separator)
    if not sep or "/" not in name or not value or (separator == ":" and "/" in value):
        raise WebhookError(f"gar payload: {field} {_short(text)} is not a full image reference")
    return name, value


_ECR_ACTIONS: dict[str, Literal["push", "delete"]] = {"PUSH": "push", "DELETE": "delete"}


def _ecr(payload: dict[str, Any], headers: Headers, default_registry: str | None) -> Iterable[ScanRequest]:
    """ECR `ECR Image Action` events from EventBridge; the host is built from account and region."""
    header = _EcrHeader.model_validate(payload)
    if header.source != "aws.ecr" or header.detail_type != "ECR Image Action":
        return  # scans, replication, pull-through cache ... on the same bus
    event = _EcrImageAction.model_validate(payload)
    detail = event.detail
    action = _ECR_ACTIONS.get(detail.action_type)
    if detail.result != "SUCCESS" or action is None:
        return
    suffix = "amazonaws.com.cn" if event.region.startswith("cn-") else "amazonaws.com"
    host = f"{event.account}.dkr.ecr.{event.region}.{suffix}"
    yield _request(
        "ecr", host, detail.repository_name, _blank(detail.image_tag), _blank(detail.image_digest), action
    )


_JFROG_ACTIONS: dict[str, Literal["push", "delete"]] = {"pushed": "push", "deleted": "delete"}
_JFROG_MANIFEST_FILES = frozenset({"manifest.json", "list.manifest.json"})


def _jfrog(payload: dict[str, Any], headers: Headers, default_registry: str | None) -> Iterable[ScanRequest]:
    """Artifactory `docker` domain events; repository-path access (`host/<repo_key>/<image>`)."""
    header = _JfrogHeader.model_validate(payload)
    action = _JFROG_ACTIONS.get(header.event_type)
    if header.domain != "docker" or action is None:
        return  # artifact/build domains, promotions
    if not default_registry:
        raise WebhookError(
            "jfrog payloads do not reliably name the registry host (jpd_origin is often missing); "
            "configure the Artifactory Docker host as the default registry for this hook"
        )
    data = _JfrogEvent.model_validate(payload).data
    image = _jfrog_image_path(data)
    digest = f"sha256:{data.sha256}" if data.sha256 else None
    yield _request("jfrog", default_registry, f"{data.repo_key}/{image}", data.tag, digest, action)


def _jfrog_image_path(data: _JfrogData) -> str:
    """`foo/bar/busybox/latest/manifest.json` -> `foo/bar/busybox`; image_name drops `foo/bar`."""
    if data.path:
        parts = data.path.strip("/").split("/")
        if len(parts) >= 3 and parts[-1] in _JFROG_MANIFEST_FILES and parts[-2] == data.tag:
            return "/".join(parts[:-2])
        raise WebhookError(
            f"jfrog payload: data.path {_short(data.path)} is not <image>/<tag>/<manifest file>"
        )
    if data.image_name:
        return data.image_name
    raise WebhookError("jfrog payload: neither data.path nor data.image_name names the image")


_NORMALISERS: dict[str, Normaliser] = {
    "distribution": _distribution,
    "dockerhub": _dockerhub,
    "harbor": _harbor,
    "ghcr": _ghcr,
    "quay": _quay,
    "gar": _gar,
    "ecr": _ecr,
    "jfrog": _jfrog,
}
assert tuple(_NORMALISERS) == SOURCES


def normalise(
    source: str,
    body: bytes,
    headers: Mapping[str, str],
    *,
    default_registry: str | None = None,
    limits: JsonLimits | None = None,
) -> list[ScanRequest]:
    """Parse one webhook delivery into scan requests, in payload order, without duplicates.

    `default_registry` (host[:port]) is used where the payload names no host; JFrog needs it.
    `limits` bound the JSON's nesting, numbers and strings (GAR's wrapped message too).
    Raises UnknownSource, or WebhookError with the reason the payload was refused.
    """
    normaliser = _NORMALISERS.get(source)
    if normaliser is None:
        raise UnknownSource(source)
    limits = limits or JsonLimits()
    payload = _parse_json(source, body, limits)
    if source == "gar":
        payload = _unwrap_pubsub(payload, limits)
    try:
        requests = list(normaliser(payload, _lower_keys(headers), default_registry))
    except ValidationError as exc:
        raise WebhookError(f"{source} payload: {_describe(exc)}") from None
    return list(dict.fromkeys(requests))  # frozen models hash by value; keeps first-seen order


def _parse_json(source: str, body: bytes, limits: JsonLimits) -> dict[str, Any]:
    try:
        payload = loads_bounded(body, limits)
    except JsonLimitExceeded as exc:
        raise WebhookError(f"{source} payload refused: {exc}") from None
    except UnicodeDecodeError:
        raise WebhookError(f"{source} payload is not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise WebhookError(f"{source} payload is not JSON: {exc.msg} at line {exc.lineno}") from None
    if not isinstance(payload, dict):
        raise WebhookError(f"{source} payload must be a JSON object, got {type(payload).__name__}")
    return payload


def _request(
    source: str,
    registry: str,
    repository: str,
    tag: str | None,
    digest: str | None,
    action: Literal["push", "delete"],
) -> ScanRequest:
    try:
        return ScanRequest(
            registry=registry, repository=repository, tag=tag, digest=digest, action=action, source=source
        )
    except ValidationError as exc:
        raise WebhookError(f"{source} payload names an invalid image: {_describe(exc)}") from None


def _describe(exc: ValidationError) -> str:
    """Pydantic's errors as `field.path: reason`, without echoing the offending values."""
    errors = exc.errors(include_url=False, include_input=False)
    parts = []
    for error in errors[:_MAX_ERRORS_SHOWN]:
        location = ".".join(str(part) for part in error["loc"])
        message = str(error["msg"]).removeprefix("Value error, ")
        parts.append(f"{location}: {message}" if location else message)
    if len(errors) > _MAX_ERRORS_SHOWN:
        parts.append(f"and {len(errors) - _MAX_ERRORS_SHOWN} more")
    return "; ".join(parts)


def _blank(value: str | None) -> str | None:
    return value if value else None


def _url_host(url: str | None) -> str | None:
    """host[:port] of an absolute URL, without credentials."""
    if not url:
        return None
    try:
        parts = urlsplit(url)
    except ValueError:
        return None
    return parts.netloc.rpartition("@")[2] or None


def _require_default(default_registry: str | None, why: str) -> str:
    if not default_registry:
        raise WebhookError(f"{why}, and no default registry is configured")
    return default_registry


def _media_type(headers: Headers) -> str:
    return headers.get("content-type", "").split(";", 1)[0].strip().lower()


def _lower_keys(headers: Mapping[str, str]) -> dict[str, str]:
    return {key.lower(): value for key, value in headers.items()}


def _short(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --- authentication ------------------------------------------------------------------------

GITHUB_SIGNATURE_HEADER = "x-hub-signature-256"
JFROG_AUTH_HEADER = "x-jfrog-event-auth"


def authenticate(
    source: str,
    body: bytes,
    headers: Mapping[str, str],
    query: Mapping[str, str],
    secret: str | None,
) -> None:
    """Accept the delivery if it proves knowledge of `secret`; raise WebhookAuthError if not.

    Proofs: `Authorization: Bearer <secret>` (or the bare secret, as Harbor and GitLab send
    their configured header verbatim), `?token=<secret>`, GitHub's `X-Hub-Signature-256`,
    and JFrog's `X-JFrog-Event-Auth`. A signature header that is present must verify;
    it is not silently skipped in favour of a token. No secret configured: accept.
    """
    if source not in _NORMALISERS:
        raise UnknownSource(source)
    if not secret:
        return
    key = secret.encode()
    lowered = _lower_keys(headers)
    if source == "ghcr" and GITHUB_SIGNATURE_HEADER in lowered:
        _check_github_signature(key, body, lowered[GITHUB_SIGNATURE_HEADER])
        return
    if source == "jfrog" and JFROG_AUTH_HEADER in lowered:
        _check_jfrog_auth(key, body, lowered[JFROG_AUTH_HEADER])
        return
    authorization = lowered.get("authorization")
    token = query.get("token")
    if authorization is None and token is None:
        raise WebhookAuthError(_missing_credentials(source))
    if authorization is not None and _equal(_bearer_credential(authorization), key):
        return
    if token is not None and _equal(token.encode(), key):
        return
    raise WebhookAuthError(f"{source} webhook: the token does not match the configured secret")


def _missing_credentials(source: str) -> str:
    accepted = ["Authorization: Bearer <secret>", "?token=<secret>"]
    if source == "ghcr":
        accepted.append("X-Hub-Signature-256")
    if source == "jfrog":
        accepted.append("X-JFrog-Event-Auth")
    return f"{source} webhook: no credentials; send one of {', '.join(accepted)}"


def _bearer_credential(authorization: str) -> bytes:
    scheme, _, credential = authorization.strip().partition(" ")
    if scheme.lower() == "bearer" and credential:
        return credential.strip().encode()
    return authorization.strip().encode()


def _check_github_signature(key: bytes, body: bytes, header: str) -> None:
    algorithm, sep, signature = header.strip().partition("=")
    if not sep or algorithm != "sha256":
        raise WebhookAuthError("ghcr webhook: X-Hub-Signature-256 must read 'sha256=<hex HMAC-SHA256>'")
    expected = hmac.new(key, body, hashlib.sha256).hexdigest().encode()
    if not _equal(signature.lower().encode(), expected):
        raise WebhookAuthError("ghcr webhook: X-Hub-Signature-256 does not match the body and secret")


def _check_jfrog_auth(key: bytes, body: bytes, header: str) -> None:
    """X-JFrog-Event-Auth holds the secret itself, or (when signing) an HMAC of the body.

    JFrog does not document the signing algorithm. Live captures (akuity/kargo) verify
    plain hex HMAC-SHA256; telegraf expects `sha1=<hex HMAC-SHA1>`. Accept those, and
    `sha256=<hex>`, and nothing else.
    """
    value = header.strip()
    algorithm, sep, signature = value.partition("=")
    if sep and algorithm in ("sha1", "sha256"):
        digestmod = hashlib.sha1 if algorithm == "sha1" else hashlib.sha256
        expected = hmac.new(key, body, digestmod).hexdigest().encode()
        if _equal(signature.lower().encode(), expected):
            return
    else:
        if _equal(value.encode(), key):
            return
        if _equal(value.lower().encode(), hmac.new(key, body, hashlib.sha256).hexdigest().encode()):
            return
    raise WebhookAuthError("jfrog webhook: X-JFrog-Event-Auth is neither the secret nor a valid signature")


def _equal(given: bytes, expected: bytes) -> bool:
    """Constant-time comparison, so response timing does not leak the secret byte by byte."""
    return hmac.compare_digest(given, expected)
