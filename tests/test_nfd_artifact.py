"""NFD image-compatibility artifacts attached beside the report, on the real Debian docker-registry 2.8.

That registry has no referrers API, so everything goes through the referrers tag schema. Images
are pushed with skopeo. What gpubadge attached is read back here the way NFD's client
(`pkg/client-nfd/compat/artifact-client`) reads it, with plain HTTP and none of gpubadge's
registry code: resolve the tag (to the index unless a platform is asked for), list the subject's
referrers filtered by artifactType, take the newest by `org.opencontainers.image.created`, read
`layers[0]`, decode the YAML.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import subprocess
import urllib.error
import urllib.request
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from fixtures import catalog
from fixtures.registry import LocalRegistry
from jobs.companions import companions
from placement.nfd.schema import ARTIFACT_TYPE as NFD_TYPE
from placement.nfd.schema import SPEC_MEDIA_TYPE
from scanner.models import ImageReport
from scanner.publish import ReportAttacher
from scanner.registry.client import RegistryClient
from scanner.registry.referrers import ARTIFACT_TYPE as REPORT_TYPE
from scanner.registry.referrers import EMPTY_DIGEST, tag_schema_tag
from scanner.settings import ScannerSettings
from tests.conftest import Pusher
from tests.test_nfd_schema import check_against_nfd_schema
from tests.test_referrers import scan, settings_for

INDEX_TYPES = (
    "application/vnd.oci.image.index.v1+json, application/vnd.docker.distribution.manifest.list.v2+json"
)
MANIFEST_TYPES = (
    "application/vnd.oci.image.manifest.v1+json, application/vnd.docker.distribution.manifest.v2+json"
)


# --------------------------------------------------------------- NFD's client, step by step


def get(registry: LocalRegistry, path: str, accept: str = "") -> tuple[int, bytes, dict[str, str]]:
    request = urllib.request.Request(
        f"{registry.url}/v2/{path}", headers={"Accept": accept} if accept else {}
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read(), dict(response.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), dict(exc.headers)


def resolve(registry: LocalRegistry, repository: str, tag: str, platform: str | None = None) -> str:
    """oras.Resolve: the tag's digest; with a platform, the matching manifest of its index."""
    status, body, _ = get(registry, f"{repository}/manifests/{tag}", f"{INDEX_TYPES}, {MANIFEST_TYPES}")
    assert status == 200
    if platform is None:
        return "sha256:" + hashlib.sha256(body).hexdigest()
    os_name, architecture = platform.split("/")[:2]
    [entry] = [
        m
        for m in json.loads(body)["manifests"]
        if m.get("platform", {}).get("os") == os_name and m["platform"].get("architecture") == architecture
    ]
    digest: str = entry["digest"]
    return digest


def referrers(
    registry: LocalRegistry, repository: str, digest: str, artifact_type: str
) -> list[dict[str, Any]]:
    """oras-go's Referrers: the API (404 here), else the `sha256-<hex>` tag; filtered by artifactType."""
    status, body, _ = get(registry, f"{repository}/referrers/{digest}?artifactType={artifact_type}")
    if status != 200:
        status, body, _ = get(registry, f"{repository}/manifests/{digest.replace(':', '-')}", INDEX_TYPES)
        if status == 404:
            return []
    return [m for m in json.loads(body)["manifests"] if m.get("artifactType") == artifact_type]


def created(entry: dict[str, Any]) -> datetime:
    text = entry.get("annotations", {}).get("org.opencontainers.image.created", "")
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return datetime.fromisoformat("0001-01-01T00:00:00+00:00")


def nfd_reads(
    registry: LocalRegistry, repository: str, tag: str, platform: str | None = None
) -> dict[str, Any]:
    """FetchCompatibilitySpec: the newest artifact's layers[0], decoded; plus what was read on the way."""
    subject = resolve(registry, repository, tag, platform)
    found = sorted(referrers(registry, repository, subject, NFD_TYPE), key=created)
    assert found, f"compatibility artifact not found for {subject}"
    status, raw_manifest, _ = get(registry, f"{repository}/manifests/{found[-1]['digest']}", MANIFEST_TYPES)
    assert status == 200
    manifest = json.loads(raw_manifest)
    status, layer, _ = get(registry, f"{repository}/blobs/{manifest['layers'][0]['digest']}")
    assert status == 200 and "sha256:" + hashlib.sha256(layer).hexdigest() == manifest["layers"][0]["digest"]
    return {"subject": subject, "entries": found, "manifest": manifest, "spec": yaml.safe_load(layer)}


# --------------------------------------------------------------- helpers


def nfd_settings(registry: LocalRegistry, **extra: Any) -> ScannerSettings:
    return settings_for(registry, **extra)


async def attach_all(settings: ScannerSettings, report: ImageReport) -> list[Any]:
    async with RegistryClient(settings) as client:
        attacher = ReportAttacher(settings, client, companions=companions(settings))
        try:
            await attacher.attach(report)
            return await attacher.attach_companions(report)
        finally:
            await attacher.stop()


def rules_by_set(spec: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    return {item["tag"]: item["rules"] for item in spec["compatibilities"]}


# --------------------------------------------------------------- tests


def test_gpu_image_gets_an_artifact_nfd_reads(registry: LocalRegistry, push: Pusher) -> None:
    """Through the background path (submit), as the service does; NFD finds it with its own steps."""
    settings = nfd_settings(registry)
    digest = push(catalog.cuda_ubuntu(require="cuda>=12.2 brand=tesla,driver>=470,driver<471"), "nfd/cuda:12")
    report = asyncio.run(scan(settings, f"{registry.host}/nfd/cuda:12"))
    counted: list[tuple[str, str]] = []

    async def submitted() -> Any:
        async with RegistryClient(settings) as client:
            attacher = ReportAttacher(
                settings,
                client,
                companions=companions(settings),
                on_companion=lambda k, r: counted.append((k, r)),
            )
            assert not attacher.submit(
                report.model_copy(update={"pending": True})
            )  # config facts only: never
            assert attacher.submit(report)
            assert await attacher.wait_idle(60)
            await attacher.stop()
            return attacher.companion_status(digest, "nfd"), attacher.status(digest)

    nfd_status, report_status = asyncio.run(submitted())
    assert report_status.state == "attached"
    assert nfd_status.state == "attached" and counted == [("nfd", "attached")], nfd_status

    read = nfd_reads(registry, "nfd/cuda", "12")
    assert read["subject"] == digest and [e["digest"] for e in read["entries"]] == [nfd_status.artifact]
    manifest = read["manifest"]
    assert (
        manifest["artifactType"] == NFD_TYPE
        and manifest["mediaType"] == "application/vnd.oci.image.manifest.v1+json"
    )
    assert manifest["config"] == {
        "mediaType": "application/vnd.oci.empty.v1+json",
        "digest": EMPTY_DIGEST,
        "size": 2,
    }
    assert [layer["mediaType"] for layer in manifest["layers"]] == [SPEC_MEDIA_TYPE]
    assert manifest["subject"]["digest"] == digest
    assert manifest["annotations"]["io.gpubadge.generator"] == "gpubadge"
    assert created(read["entries"][0]) == report.scanned_at  # to the microsecond, RFC 3339

    spec = read["spec"]
    check_against_nfd_schema(spec)
    rules = rules_by_set(spec)
    assert rules["nvidia-gpu"][0]["matchFeatures"][0] == {
        "feature": "pci.device",
        "matchExpressions": {
            "vendor": {"op": "In", "value": ["10de"]},
            "class": {"op": "In", "value": ["0300", "0302"]},
        },
    }
    assert rules["nvidia-gpu"][1]["matchFeatures"][0]["matchExpressions"] == {"nvidia": {"op": "Exists"}}
    [cuda_rule] = rules["nvidia-gfd"]
    assert cuda_rule["matchFeatures"] == [
        {
            "feature": "local.label",
            "matchExpressions": {
                "nvidia.com/cuda.runtime-version.full": {"op": "Ge", "value": ["12.2"], "type": "version"}
            },
        }
    ]
    gfd_description = spec["compatibilities"][1]["description"]
    assert "cannot evaluate this set yet" in gfd_description
    assert (
        "brand=tesla,driver>=470,driver<471" in gfd_description and "no GPU brand feature" in gfd_description
    )

    tags = subprocess.run(
        ["skopeo", "list-tags", "--tls-verify=false", f"docker://{registry.host}/nfd/cuda"],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    assert sorted(json.loads(tags.stdout)["Tags"]) == sorted(
        ["12", tag_schema_tag(digest)]
    )  # no tag for artifacts
    listed = {e["artifactType"] for e in referrers(registry, "nfd/cuda", digest, NFD_TYPE)} | {
        e["artifactType"] for e in referrers(registry, "nfd/cuda", digest, REPORT_TYPE)
    }
    assert listed == {NFD_TYPE, REPORT_TYPE}  # beside the report, in the same index


def test_multi_platform_index_and_each_gpu_platform(registry: LocalRegistry, push: Pusher) -> None:
    settings = nfd_settings(registry)
    index_digest = push(catalog.multi_arch(), "nfd/multi:1")
    report = asyncio.run(scan(settings, f"{registry.host}/nfd/multi:1"))
    attached = asyncio.run(attach_all(settings, report))
    assert [a.subject for a in attached] == [index_digest, *(p.digest for p in report.platforms)]
    assert {a.outcome for a in attached} == {"attached"}

    whole = nfd_reads(registry, "nfd/multi", "1")  # no --platform: the index's artifact
    assert whole["subject"] == index_digest
    assert (
        "Platforms that need one: linux/amd64, linux/arm64/v8."
        in whole["spec"]["compatibilities"][0]["description"]
    )
    arm = nfd_reads(registry, "nfd/multi", "1", platform="linux/arm64")
    assert arm["subject"] == report.platforms[1].digest and arm["subject"] != index_digest
    for read in (whole, arm):
        check_against_nfd_schema(read["spec"])
        assert len(read["entries"]) == 1
        [rule] = rules_by_set(read["spec"])["nvidia-gfd"]
        expression = rule["matchFeatures"][0]["matchExpressions"]["nvidia.com/cuda.runtime-version.full"]
        assert expression == {"op": "Ge", "value": ["12.4"], "type": "version"}


def test_cpu_image_gets_none(registry: LocalRegistry, push: Pusher) -> None:
    settings = nfd_settings(registry)
    digest = push(catalog.plain_glibc(), "nfd/cpu:1")
    report = asyncio.run(scan(settings, f"{registry.host}/nfd/cpu:1"))
    assert asyncio.run(attach_all(settings, report)) == []
    assert referrers(registry, "nfd/cpu", digest, NFD_TYPE) == []
    assert len(referrers(registry, "nfd/cpu", digest, REPORT_TYPE)) == 1  # the report itself still is


def test_rescan_reuses_a_changed_verdict_wins_and_another_tools_artifact_is_kept(
    registry: LocalRegistry, push: Pusher
) -> None:
    settings = nfd_settings(registry)
    digest = push(catalog.alpine_gpu(), "nfd/again:1")
    first = asyncio.run(scan(settings, f"{registry.host}/nfd/again:1"))
    [done] = asyncio.run(attach_all(settings, first))
    assert done.outcome == "attached"

    rescan = asyncio.run(scan(settings, f"{registry.host}/nfd/again:1"))  # same verdict, a later scan
    assert rescan.scanned_at > first.scanned_at
    [again] = asyncio.run(attach_all(settings, rescan))
    assert (again.outcome, again.artifact) == ("reused", done.artifact)
    assert len(referrers(registry, "nfd/again", digest, NFD_TYPE)) == 1  # no duplicate
    assert len(referrers(registry, "nfd/again", digest, REPORT_TYPE)) == 2  # reports are per scan

    # A new verdict (here: a newer gpubadge that reads a requirement into the same image) wins.
    platform = rescan.platforms[0]
    changed_gpu = platform.gpu.model_copy(
        update={
            "requirements": ["cuda>=12.6"],
            "env": {**platform.gpu.env, "NVIDIA_REQUIRE_CUDA": "cuda>=12.6"},
        }
    )
    changed = asyncio.run(scan(settings, f"{registry.host}/nfd/again:1"))
    changed = changed.model_copy(update={"platforms": [platform.model_copy(update={"gpu": changed_gpu})]})
    [newer] = asyncio.run(attach_all(settings, changed))
    assert newer.outcome == "attached" and newer.artifact != done.artifact
    read = nfd_reads(registry, "nfd/again", "1")
    assert (
        read["manifest"]["layers"][0]["digest"]
        != json.loads(raw_manifest(registry, "nfd/again", done.artifact))["layers"][0]["digest"]
    )
    assert "nvidia-gfd" in rules_by_set(read["spec"])
    assert [e["digest"] for e in read["entries"]][-1] == newer.artifact

    # Someone attaches their own document with `oras attach` (written here with plain HTTP): it is
    # the newest, so gpubadge's next attach leaves it as the one NFD reads.
    theirs = attach_by_hand(registry, "nfd/again", digest, b"version: v1alpha1\ncompatibilities: []\n")
    [kept] = asyncio.run(
        attach_all(
            settings, changed.model_copy(update={"scanned_at": datetime.now(changed.scanned_at.tzinfo)})
        )
    )
    assert (kept.outcome, kept.artifact) == ("deferred", theirs)
    assert nfd_reads(registry, "nfd/again", "1")["entries"][-1]["digest"] == theirs
    assert len(referrers(registry, "nfd/again", digest, NFD_TYPE)) == 3


def raw_manifest(registry: LocalRegistry, repository: str, digest: str) -> bytes:
    status, body, _ = get(registry, f"{repository}/manifests/{digest}", MANIFEST_TYPES)
    assert status == 200
    return body


def _send(registry: LocalRegistry, method: str, url: str, data: bytes, content_type: str) -> dict[str, str]:
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": content_type})
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.status in (201, 202)
        return dict(response.headers)


def _upload(registry: LocalRegistry, repository: str, data: bytes) -> str:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    headers = _send(
        registry, "POST", f"{registry.url}/v2/{repository}/blobs/uploads/", b"", "application/octet-stream"
    )
    location = headers["Location"]
    location = location if location.startswith("http") else registry.url + location
    _send(
        registry,
        "PUT",
        f"{location}{'&' if '?' in location else '?'}digest={digest}",
        data,
        "application/octet-stream",
    )
    return digest


def attach_by_hand(registry: LocalRegistry, repository: str, subject: str, document: bytes) -> str:
    """What `oras attach --artifact-type ... spec.yaml:<media type>` writes, by the tag schema."""
    subject_raw = raw_manifest(registry, repository, subject)
    _upload(registry, repository, b"{}")
    layer = _upload(registry, repository, document)
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "artifactType": NFD_TYPE,
        "config": {"mediaType": "application/vnd.oci.empty.v1+json", "digest": EMPTY_DIGEST, "size": 2},
        "layers": [{"mediaType": SPEC_MEDIA_TYPE, "digest": layer, "size": len(document)}],
        "subject": {
            "mediaType": json.loads(subject_raw)["mediaType"],
            "digest": subject,
            "size": len(subject_raw),
        },
        "annotations": {"org.opencontainers.image.created": "2099-01-01T00:00:00Z"},
    }
    raw = json.dumps(manifest).encode()
    digest = "sha256:" + hashlib.sha256(raw).hexdigest()
    _send(registry, "PUT", f"{registry.url}/v2/{repository}/manifests/{digest}", raw, manifest["mediaType"])
    status, index_raw, _ = get(registry, f"{repository}/manifests/{tag_schema_tag(subject)}", INDEX_TYPES)
    index = (
        json.loads(index_raw)
        if status == 200
        else {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json", "manifests": []}
    )
    index["manifests"].append(
        {
            "mediaType": manifest["mediaType"],
            "digest": digest,
            "size": len(raw),
            "artifactType": NFD_TYPE,
            "annotations": manifest["annotations"],
        }
    )
    _send(
        registry,
        "PUT",
        f"{registry.url}/v2/{repository}/manifests/{tag_schema_tag(subject)}",
        json.dumps(index).encode(),
        index["mediaType"],
    )
    return digest


def test_cli_lists_the_artifact_beside_the_report_and_checks_nodes_against_it(
    registry: LocalRegistry, push: Pusher, tmp_path: Path
) -> None:
    from tests.test_nfd_match import GPU_NODE, OLD_DRIVER_NODE
    from tests.test_referrers import _cli

    settings = nfd_settings(registry)
    push(catalog.multi_arch(), "nfd/cli:1")
    report = asyncio.run(scan(settings, f"{registry.host}/nfd/cli:1"))
    attached = asyncio.run(attach_all(settings, report))
    env = {"GPUBADGE_REGISTRIES": registry.host, "GPUBADGE_DOCKER_CONFIG": str(tmp_path / "none.json")}

    listed = _cli(["referrers", f"{registry.host}/nfd/cli:1", "--json"], env)
    assert listed.returncode == 0, listed.stderr
    lines = [json.loads(text) for text in listed.stdout.splitlines()]
    assert [line["kind"] for line in lines] == ["report", "nfd"]
    nfd = lines[1]
    assert nfd["digest"] == attached[0].artifact and nfd["current"] is True and nfd["warnings"] == []
    check_against_nfd_schema(nfd["spec"])
    arm = _cli(["referrers", f"{registry.host}/nfd/cli:1", "--platform", "linux/arm64"], env)
    assert arm.returncode == 0 and attached[2].artifact in arm.stdout and "(the one NFD reads)" in arm.stdout

    (tmp_path / "gpu-node.yaml").write_text(GPU_NODE)
    (tmp_path / "old-node.yaml").write_text(OLD_DRIVER_NODE)
    both = ["--node", str(tmp_path / "gpu-node.yaml"), "--node", str(tmp_path / "old-node.yaml")]
    checked = _cli(["compat", f"{registry.host}/nfd/cli:1", *both], env)
    assert checked.returncode == 3, checked.stderr
    assert "worker-1: compatible" in checked.stdout and "worker-1: not compatible" in checked.stdout
    assert "nvidia.com/cuda.runtime-version.full is '11.4'; needs Ge 12.4 (version)" in checked.stdout
    today = _cli(["compat", f"{registry.host}/nfd/cli:1", *both, "--tags", "nvidia-gpu", "--json"], env)
    assert today.returncode == 0, today.stdout + today.stderr
    assert {json.loads(line)["verdict"] for line in today.stdout.splitlines()} == {"match"}

    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(nfd["spec"]))
    fleet = _cli(
        ["compat", "--spec", str(tmp_path / "spec.yaml"), "--servers", "fixtures/fleet.yaml", "--json"], env
    )
    verdicts = {json.loads(line)["node"]: json.loads(line)["verdict"] for line in fleet.stdout.splitlines()}
    assert verdicts["h100-a"] == "match" and "no-match" in verdicts.values() and fleet.returncode == 3

    push(catalog.plain_glibc(), "nfd/cli:cpu")
    missing = _cli(["compat", f"{registry.host}/nfd/cli:cpu", *both], env)
    assert missing.returncode == 1 and "compatibility artifact not found" in missing.stderr


def test_image_page_reads_back_what_another_process_attached(registry: LocalRegistry, push: Pusher) -> None:
    """An API replica (or a restarted service) did not attach it: the page reads it as NFD does."""
    from web.views.nfd_view import nfd_views

    settings = nfd_settings(registry)
    push(catalog.multi_arch(), "nfd/page:1")
    report = asyncio.run(scan(settings, f"{registry.host}/nfd/page:1"))
    push(catalog.alpine_gpu(), "nfd/page:none")
    unattached = asyncio.run(scan(settings, f"{registry.host}/nfd/page:none"))
    attached = asyncio.run(attach_all(settings, report))

    async def views(target: ImageReport) -> list[Any]:
        async with RegistryClient(settings) as client:
            fresh = ReportAttacher(settings, client, companions=companions(settings))
            try:
                return await nfd_views(fresh, target)
            finally:
                await fresh.stop()

    found = asyncio.run(views(report))
    assert [(v.label, v.state, v.artifact) for v in found] == [
        ("index", "found", attached[0].artifact),
        ("linux/amd64", "found", attached[1].artifact),
        ("linux/arm64/v8", "found", attached[2].artifact),
    ]
    assert [s["tag"] for s in found[0].sets] == ["nvidia-gpu", "nvidia-gfd"] and found[0].warnings == []
    [absent] = asyncio.run(views(unattached))
    assert (absent.state, absent.sets) == ("absent", [])
    off = settings.model_copy(update={"attach_nfd": False})
    assert companions(off) == []
