"""ReportAttacher's protocol decisions, against a scripted stand-in registry.

Debian's registry (the real one in tests/test_referrers.py) has no referrers API and honours
no If-Match, so the paths it cannot take are driven here by a named stand-in for the push
side (`ScriptedPusher`) and for the read side (`StoredSubject`): the referrers API announced
by an OCI-Subject header or by a 200 index, a conditional PUT refused with 412, another
writer replacing the index between our PUT and our re-read, and a tag that is not an index.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

import pytest

from scanner.models import ImageReport
from scanner.publish import ReportAttacher
from scanner.registry.descriptors import Manifest, compute_digest
from scanner.registry.push import Fetched, PushedManifest, PushError
from scanner.registry.referrers import tag_schema_tag
from scanner.settings import ScannerSettings

HOST = "registry.test:5000"
SUBJECT_BYTES = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                            "config": {}, "layers": []}).encode()  # fmt: skip
SUBJECT = compute_digest(SUBJECT_BYTES)
INDEX = "application/vnd.oci.image.index.v1+json"


class StoredSubject:
    """Stand-in for RegistryClient.manifest: the scanned manifest as the registry stores it."""

    async def manifest(self, reference: Any, digest: str | None = None) -> Manifest:
        return Manifest(
            "application/vnd.oci.image.manifest.v1+json", SUBJECT, SUBJECT_BYTES, json.loads(SUBJECT_BYTES)
        )


@dataclass
class ScriptedPusher:
    """Stand-in for RegistryPusher; `tags` is the registry's tag -> bytes, `script` its surprises."""

    host: str = HOST
    oci_subject: bool = False
    referrers_index: bool = False
    refuse_conditional_once: bool = False
    replaced_after_put: int = 0  # times another writer overwrites the index right after our PUT
    tags: dict[str, bytes] = field(default_factory=dict)
    calls: list[str] = field(default_factory=list)

    def upload_blob(self, repository: str, data: bytes, media_type: str) -> str:
        self.calls.append("blob")
        return compute_digest(data)

    def put_manifest(
        self, repository: str, reference: str, raw: bytes, media_type: str, *, if_match: str | None = None
    ) -> PushedManifest:
        self.calls.append(f"put {reference[:7]}" + (" if-match" if if_match else ""))
        if reference.startswith("sha256-"):
            if if_match and self.refuse_conditional_once:
                self.refuse_conditional_once = False
                raise PushError("precondition failed", status=412)
            self.tags[reference] = raw
            if self.replaced_after_put:
                self.replaced_after_put -= 1
                self.tags[reference] = json.dumps({"schemaVersion": 2, "mediaType": INDEX, "manifests": [
                    {"mediaType": "x", "digest": "sha256:" + "9" * 64, "size": 1}]}).encode()  # fmt: skip
        return PushedManifest(compute_digest(raw), SUBJECT if self.oci_subject else None)

    def get_manifest(self, repository: str, reference: str, accept: str) -> Fetched | None:
        self.calls.append(f"get {reference[:7]}")
        raw = self.tags.get(reference)
        return None if raw is None else Fetched(raw, compute_digest(raw), INDEX, f'"{compute_digest(raw)}"')

    def get_referrers(self, repository: str, digest: str) -> bytes | None:
        self.calls.append("referrers")
        return b'{"schemaVersion":2,"manifests":[]}' if self.referrers_index else None

    def close(self) -> None:
        pass


def attach(pusher: ScriptedPusher, attempts: int = 1) -> tuple[Any, ReportAttacher]:
    settings = ScannerSettings(registries=[{"host": HOST, "push_anonymous": True}], attach_reports=True)
    attacher = ReportAttacher(settings, StoredSubject())  # type: ignore[arg-type]
    attacher.writer._pushers[HOST] = pusher  # type: ignore[assignment]
    report = ImageReport(reference=f"{HOST}/r@{SUBJECT}", digest=SUBJECT, registry=HOST, repository="r")
    return asyncio.run(attacher.attach_one(HOST, "r", SUBJECT, report)), attacher


def test_oci_subject_header_means_the_registry_indexes_it() -> None:
    pusher = ScriptedPusher(oci_subject=True)
    done, _ = attach(pusher)
    assert done.via == "referrers-api"
    assert not pusher.tags and "referrers" not in pusher.calls


def test_a_200_referrers_index_means_the_api_and_is_remembered_per_registry() -> None:
    pusher = ScriptedPusher(referrers_index=True)
    done, attacher = attach(pusher)
    assert done.via == "referrers-api" and not pusher.tags
    assert attacher.writer._referrers_api == {HOST: True}


def test_conditional_put_refused_reads_again_and_retries() -> None:
    tag = tag_schema_tag(SUBJECT)
    existing = json.dumps({"schemaVersion": 2, "mediaType": INDEX, "manifests": []}).encode()
    pusher = ScriptedPusher(refuse_conditional_once=True, tags={tag: existing})
    done, _ = attach(pusher)
    assert done.via == "tag-schema"
    assert [c for c in pusher.calls if c.startswith("put sha256-")] == ["put sha256- if-match"] * 2
    assert [e["digest"] for e in json.loads(pusher.tags[tag])["manifests"]] == [done.artifact]


def test_an_update_lost_to_another_writer_is_redone_keeping_theirs() -> None:
    pusher = ScriptedPusher(replaced_after_put=1)
    done, _ = attach(pusher)
    listed = [e["digest"] for e in json.loads(pusher.tags[tag_schema_tag(SUBJECT)])["manifests"]]
    assert listed == ["sha256:" + "9" * 64, done.artifact]


def test_gives_up_after_losing_every_time() -> None:
    with pytest.raises(PushError, match="lost the update"):
        attach(ScriptedPusher(replaced_after_put=99))


def test_a_tag_that_is_not_an_index_is_left_alone() -> None:
    tag = tag_schema_tag(SUBJECT)
    manifest = json.dumps(
        {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json"}
    ).encode()
    pusher = ScriptedPusher(tags={tag: manifest})
    with pytest.raises(PushError, match="not an index; leaving it alone"):
        attach(pusher)
    assert pusher.tags[tag] == manifest
