"""Reports as OCI referrers (scanner/publish.py over scanner/registry/referrers.py) against the real Debian docker-registry 2.8.

That registry has no referrers API, so every attach goes through the referrers tag schema.
Images and the foreign tag-schema index are pushed with skopeo; what we pushed is checked
independently with `skopeo inspect --raw`, and read back with `gpubadge referrers`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fixtures import catalog
from fixtures.oci import ImageSpec, LayoutWriter
from fixtures.registry import LocalRegistry, htpasswd, run_registry
from scanner.models import ImageReport
from scanner.publish import ReportAttacher
from scanner.registry.client import RegistryClient
from scanner.registry.push import PushError
from scanner.registry.referrers import (
    ARTIFACT_TYPE,
    EMPTY_DIGEST,
    EMPTY_MEDIA_TYPE,
    Subject,
    build_artifact,
    tag_schema_tag,
    with_entry,
)
from scanner.scan import Scanner
from scanner.settings import ScannerSettings
from tests.conftest import Pusher


def raw(registry: LocalRegistry, name: str) -> bytes:
    """`skopeo inspect --raw`: the bytes the registry serves, read by an independent client."""
    result = subprocess.run(
        ["skopeo", "inspect", "--raw", "--tls-verify=false", f"docker://{registry.host}/{name}"],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return result.stdout


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def settings_for(registry: LocalRegistry, **extra: Any) -> ScannerSettings:
    values: dict[str, Any] = {
        "registries": [{"host": registry.host, "push_anonymous": True}],  # the test registry has no accounts
        "attach_reports": True,
        "docker_config": None,
    }
    return ScannerSettings(**{**values, **extra})


async def scan(settings: ScannerSettings, reference: str) -> ImageReport:
    async with RegistryClient(settings) as client:
        report = await Scanner(client, None, settings).scan(reference)
    assert report.error is None, report.error
    return report


async def attach(settings: ScannerSettings, report: ImageReport) -> list[Any]:
    async with RegistryClient(settings) as client:
        attacher = ReportAttacher(settings, client)
        try:
            return await attacher.attach(report)
        finally:
            await attacher.stop()


# ------------------------------------------------------------------ pure


def test_artifact_shape_and_digest_come_from_the_bytes_pushed() -> None:
    report = ImageReport(reference="r/x:1", digest="sha256:" + "a" * 64, registry="r", repository="x")
    subject = Subject("application/vnd.docker.distribution.manifest.v2+json", "sha256:" + "a" * 64, 1234)
    artifact = build_artifact(report, subject)
    manifest = json.loads(artifact.manifest)
    assert artifact.digest == sha256(artifact.manifest)
    assert manifest["artifactType"] == ARTIFACT_TYPE
    assert manifest["config"] == {"mediaType": EMPTY_MEDIA_TYPE, "digest": EMPTY_DIGEST, "size": 2}
    assert manifest["subject"] == {"mediaType": subject.media_type, "digest": subject.digest, "size": 1234}
    assert manifest["layers"][0]["digest"] == sha256(artifact.report)
    assert "tag" not in manifest
    assert all(isinstance(v, str) and "." in k for k, v in manifest["annotations"].items())


def test_tag_schema_tag_and_merge_keep_every_entry() -> None:
    assert tag_schema_tag("sha256:" + "ab" * 32) == "sha256-" + "ab" * 32
    theirs: dict[str, Any] = {"mediaType": "x", "digest": "sha256:" + "1" * 64, "size": 1, "extra": [1]}
    foreign: dict[str, Any] = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [theirs],
        "annotations": {"kept": "yes"},
    }
    ours = {"mediaType": "m", "digest": "sha256:" + "2" * 64, "size": 3, "artifactType": ARTIFACT_TYPE}
    merged = with_entry(json.dumps(foreign).encode(), ours)
    assert merged is not None
    assert json.loads(merged) == {**foreign, "manifests": [theirs, ours]}
    assert with_entry(merged, ours) is None  # already listed: no write


# ------------------------------------------------------------------ real registry


def test_attach_with_the_tag_schema_keeps_foreign_entries(registry: LocalRegistry, push: Pusher) -> None:
    settings = settings_for(registry)
    subject_digest = push(catalog.cuda_ubuntu(), "refs/cuda:12")
    tag = tag_schema_tag(subject_digest)
    # Another tool's referrer already listed in the tag-schema index (pushed by skopeo).
    push([ImageSpec([catalog.app_layer("sbom")], architecture="amd64")], f"refs/cuda:{tag}")
    foreign_index = json.loads(raw(registry, f"refs/cuda:{tag}"))
    foreign_entries = foreign_index["manifests"]
    assert foreign_entries

    report = asyncio.run(scan(settings, f"{registry.host}/refs/cuda:12"))
    [attached] = asyncio.run(attach(settings, report))
    assert attached.via == "tag-schema"

    index = json.loads(raw(registry, f"refs/cuda:{tag}"))
    assert index["mediaType"] == "application/vnd.oci.image.index.v1+json"
    assert index["manifests"][:-1] == foreign_entries  # verbatim, in order
    ours = index["manifests"][-1]
    assert ours["digest"] == attached.artifact and ours["artifactType"] == ARTIFACT_TYPE
    assert ours["annotations"]["io.gpubadge.report.gpu"] == "true"
    assert ours["annotations"]["io.gpubadge.report.cuda"] == "12.2"
    assert ours["annotations"]["io.gpubadge.report.libc"] == "glibc"

    artifact_bytes = raw(registry, f"refs/cuda@{attached.artifact}")
    assert sha256(artifact_bytes) == attached.artifact == ours["digest"]
    assert ours["size"] == len(artifact_bytes)
    manifest = json.loads(artifact_bytes)
    subject_bytes = raw(registry, f"refs/cuda@{subject_digest}")
    assert manifest["subject"] == {
        "mediaType": json.loads(subject_bytes)["mediaType"],
        "digest": sha256(subject_bytes),
        "size": len(subject_bytes),
    }
    assert manifest["artifactType"] == ARTIFACT_TYPE
    assert manifest["config"]["digest"] == EMPTY_DIGEST
    tags = subprocess.run(
        ["skopeo", "list-tags", "--tls-verify=false", f"docker://{registry.host}/refs/cuda"],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    assert sorted(json.loads(tags.stdout)["Tags"]) == sorted(["12", tag])  # no tag for the artifact

    # Attaching the same report again writes nothing new; a new report is appended after ours.
    asyncio.run(attach(settings, report))
    assert len(json.loads(raw(registry, f"refs/cuda:{tag}"))["manifests"]) == len(foreign_entries) + 1


def test_multi_arch_report_is_attached_to_the_index_and_each_platform(
    registry: LocalRegistry, push: Pusher
) -> None:
    settings = settings_for(registry)
    index_digest = push(catalog.multi_arch(), "refs/multi:1")
    report = asyncio.run(scan(settings, f"{registry.host}/refs/multi:1"))
    attached = asyncio.run(attach(settings, report))
    subjects = [index_digest, *(p.digest for p in report.platforms)]
    assert len(attached) == len(subjects) == 3
    for subject, done in zip(subjects, attached, strict=True):
        [entry] = json.loads(raw(registry, f"refs/multi:{tag_schema_tag(subject)}"))["manifests"]
        assert entry["digest"] == done.artifact
        layer = json.loads(raw(registry, f"refs/multi@{done.artifact}"))["layers"][0]
        assert layer["mediaType"] == ARTIFACT_TYPE
    platform_report = json.loads(raw(registry, f"refs/multi@{attached[1].artifact}"))
    assert platform_report["subject"]["digest"] == report.platforms[0].digest


def test_concurrent_attaches_to_one_subject_are_serialised(registry: LocalRegistry, push: Pusher) -> None:
    settings = settings_for(registry)
    push(catalog.alpine_gpu(), "refs/burst:1")
    report = asyncio.run(scan(settings, f"{registry.host}/refs/burst:1"))
    variants = [report.model_copy(update={"requests": n}) for n in range(5)]

    async def all_at_once() -> list[Any]:
        async with RegistryClient(settings) as client:
            attacher = ReportAttacher(settings, client)
            try:
                return list(await asyncio.gather(*(attacher.attach(v) for v in variants)))
            finally:
                await attacher.stop()

    artifacts = {done.artifact for [done] in asyncio.run(all_at_once())}
    assert len(artifacts) == 5
    listed = json.loads(raw(registry, f"refs/burst:{tag_schema_tag(report.digest or '')}"))["manifests"]
    assert {entry["digest"] for entry in listed} == artifacts


def test_never_attaches_to_its_own_artifact(registry: LocalRegistry, push: Pusher) -> None:
    settings = settings_for(registry)
    push(catalog.plain_glibc(), "refs/own:1")
    report = asyncio.run(scan(settings, f"{registry.host}/refs/own:1"))
    [done] = asyncio.run(attach(settings, report))
    own = report.model_copy(update={"digest": done.artifact, "platforms": []})
    with pytest.raises(PushError, match="is a gpubadge report itself"):
        asyncio.run(attach(settings, own))
    # The scanner refuses it as well, so a push event for it can never start the loop.
    scanned = asyncio.run(_scan_any(settings, f"{registry.host}/refs/own@{done.artifact}"))
    assert scanned.not_an_image


async def _scan_any(settings: ScannerSettings, reference: str) -> ImageReport:
    async with RegistryClient(settings) as client:
        return await Scanner(client, None, settings).scan(reference)


def test_cli_reads_the_reports_back(registry: LocalRegistry, push: Pusher, tmp_path: Any) -> None:
    settings = settings_for(registry)
    push(catalog.legacy_cuda(), "refs/cli:10")
    report = asyncio.run(scan(settings, f"{registry.host}/refs/cli:10"))
    [done] = asyncio.run(attach(settings, report))
    env_registries = {
        "GPUBADGE_REGISTRIES": registry.host,
        "GPUBADGE_DOCKER_CONFIG": str(tmp_path / "none.json"),
    }
    result = _cli(["referrers", f"{registry.host}/refs/cli:10", "--json"], env_registries)
    assert result.returncode == 0, result.stderr
    [line] = [json.loads(text) for text in result.stdout.splitlines()]
    assert line["digest"] == done.artifact and line["subject"] == report.digest
    assert line["report"]["platforms"][0]["gpu"]["cuda_version"] == report.platforms[0].gpu.cuda_version
    push(catalog.static_scratch(), "refs/cli:bare")
    none = _cli(["referrers", f"{registry.host}/refs/cli:bare"], env_registries)
    assert none.returncode == 3 and "no gpubadge report" in none.stderr


def _cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    import os

    return subprocess.run(
        [sys.executable, "-m", "gpubadge.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **env},
    )


def test_background_failures_are_retried_counted_and_never_raise(registry: LocalRegistry) -> None:
    """A subject that does not exist: every attempt fails, the status says so, nothing raises."""
    settings = settings_for(registry, attach_attempts=2, attach_backoff=0.01)
    missing = "sha256:" + "0" * 64
    report = ImageReport(reference="x", digest=missing, registry=registry.host, repository="refs/missing")
    results: list[str] = []

    async def run() -> Any:
        async with RegistryClient(settings) as client:
            attacher = ReportAttacher(settings, client, on_result=results.append)
            assert attacher.submit(report)
            assert attacher.status(missing).state == "pending"  # type: ignore[union-attr]
            assert await attacher.wait_idle(30)
            await attacher.stop()
            return attacher.status(missing)

    status = asyncio.run(run())
    assert (status.state, status.attempts) == ("failed", 2)
    assert "not found" in status.error
    assert results == ["retry", "failed"]


def test_submit_skips_cached_failed_and_disabled(registry: LocalRegistry) -> None:
    digest = "sha256:" + "1" * 64
    base = ImageReport(reference="x", digest=digest, registry=registry.host, repository="r")

    async def run(settings: ScannerSettings, report: ImageReport) -> bool:
        async with RegistryClient(settings) as client:
            attacher = ReportAttacher(settings, client)
            try:
                return attacher.submit(report)
            finally:
                await attacher.stop()

    assert not asyncio.run(run(settings_for(registry, attach_reports=False), base))
    assert not asyncio.run(
        run(settings_for(registry, registries=[registry.host]), base)
    )  # no push credentials
    assert not asyncio.run(run(settings_for(registry), base.model_copy(update={"cached": True})))
    assert not asyncio.run(run(settings_for(registry), base.model_copy(update={"error": "boom"})))


def test_no_push_credentials_means_no_write_and_says_so(registry: LocalRegistry, push: Pusher) -> None:
    settings = settings_for(registry, registries=[registry.host])
    digest = push(catalog.plain_glibc(), "refs/nocreds:1")
    report = asyncio.run(scan(settings, f"{registry.host}/refs/nocreds:1"))
    with pytest.raises(PushError, match="no push credentials"):
        asyncio.run(attach(settings, report))

    async def submitted() -> Any:
        async with RegistryClient(settings) as client:
            attacher = ReportAttacher(settings, client)
            assert not attacher.submit(report)
            return attacher.status(digest)

    status = asyncio.run(submitted())
    assert status.state == "skipped" and "push_username" in (status.error or "")
    missing = subprocess.run(
        ["skopeo", "inspect", "--raw", "--tls-verify=false", f"docker://{registry.host}/refs/nocreds:{tag_schema_tag(digest)}"],
        capture_output=True, timeout=60,
    )  # fmt: skip
    assert missing.returncode != 0  # nothing was written


def test_own_events_are_recognised() -> None:
    attacher = ReportAttacher(ScannerSettings(docker_config=None), RegistryClient(ScannerSettings()))
    assert attacher.is_own(None, "sha256-" + "a" * 64)
    assert not attacher.is_own("sha256:" + "b" * 64, "latest")
    attacher._remember("sha256:" + "b" * 64)
    assert attacher.is_own("sha256:" + "b" * 64, None)


@pytest.fixture(scope="module")
def locked_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRegistry]:
    """A registry with htpasswd accounts: `reader` (gpubadge's pull account) and `pusher` (its push account)."""
    root = tmp_path_factory.mktemp("locked-registry")
    (root / "htpasswd").write_text(htpasswd(ACCOUNTS))
    auth = {"htpasswd": {"realm": "gpubadge-test", "path": str(root / "htpasswd")}}
    with run_registry(root=root, extra_config={"auth": auth}) as running:
        yield running


ACCOUNTS = {"reader": "reader-pw-51c3", "pusher": "pusher-pw-7a0e"}


def test_pushes_use_gpubadge_push_account(locked_registry: LocalRegistry, tmp_path: Path) -> None:
    """Pulls go with the pull account, pushes with the push account: a wrong push password fails the attach."""
    layout = LayoutWriter(tmp_path / "layout")
    descriptor = layout.image(catalog.alpine_gpu())
    layout.tag(descriptor, "t")
    subprocess.run(
        ["skopeo", "copy", "--quiet", "--dest-tls-verify=false", "--dest-creds", f"pusher:{ACCOUNTS['pusher']}",
         f"oci:{tmp_path / 'layout'}:t", f"docker://{locked_registry.host}/locked/gpu:1"],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip

    def settings(push_password: str) -> ScannerSettings:
        entry = {
            "host": locked_registry.host,
            "username": "reader",
            "password": ACCOUNTS["reader"],
            "push_username": "pusher",
            "push_password": push_password,
        }
        return settings_for(locked_registry, registries=[entry])

    report = asyncio.run(scan(settings(ACCOUNTS["pusher"]), f"{locked_registry.host}/locked/gpu:1"))
    with pytest.raises(PushError) as refused:
        asyncio.run(attach(settings("wrong-password"), report))
    assert "wrong-password" not in str(refused.value) and ACCOUNTS["reader"] not in str(refused.value)
    [done] = asyncio.run(attach(settings(ACCOUNTS["pusher"]), report))
    assert done.via == "tag-schema"
    listed = subprocess.run(
        ["skopeo", "inspect", "--raw", "--tls-verify=false", "--creds", f"reader:{ACCOUNTS['reader']}",
         f"docker://{locked_registry.host}/locked/gpu:{tag_schema_tag(descriptor['digest'])}"],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    assert [entry["digest"] for entry in json.loads(listed.stdout)["manifests"]] == [done.artifact]
