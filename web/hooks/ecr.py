"""Amazon ECR image actions, delivered through EventBridge."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

from pydantic import Field

from web.hooks.common import Headers, ScanRequest, Sender, _blank, _Payload, _request, json_parser
from web.hooks.signatures import shared_secret


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


_ECR_ACTIONS: dict[str, Literal["push", "delete"]] = {"PUSH": "push", "DELETE": "delete"}


def normalise(
    payload: dict[str, Any], headers: Headers, default_registry: str | None
) -> Iterable[ScanRequest]:
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


SENDER = Sender("ecr", parse=json_parser("ecr", normalise), authenticate=shared_secret("ecr"))
