"""Docker Hub repository webhooks (tag pushes; no digest, so the tag is resolved)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from scanner.registry.reference import DOCKER_HUB
from web.hooks.common import Headers, ScanRequest, Sender, _Payload, _request, json_parser
from web.hooks.signatures import shared_secret


class _DockerHubPushData(_Payload):
    tag: str


class _DockerHubRepository(_Payload):
    repo_name: str


class _DockerHubPayload(_Payload):
    push_data: _DockerHubPushData
    repository: _DockerHubRepository


def normalise(
    payload: dict[str, Any], headers: Headers, default_registry: str | None
) -> Iterable[ScanRequest]:
    """Docker Hub: pushes only, by tag, never a digest."""
    hub = _DockerHubPayload.model_validate(payload)
    yield _request("dockerhub", DOCKER_HUB, hub.repository.repo_name, hub.push_data.tag, None, "push")


SENDER = Sender(
    "dockerhub", parse=json_parser("dockerhub", normalise), authenticate=shared_secret("dockerhub")
)
