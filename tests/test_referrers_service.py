"""`gpubadge serve` with GPUBADGE_ATTACH_REPORTS=true against real Debian registries.

A notifying registry drives the whole path: skopeo pushes, the registry notifies, the
service scans and attaches its report, and the registry's notifications about what we
pushed (the artifact, the `sha256-…` index) come back and are ignored. A read-only registry
makes every attach fail for real: the scan still succeeds, and the failure is retried,
counted in /metrics and shown on the image page.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fixtures import catalog
from fixtures.oci import push_image
from fixtures.registry import LocalRegistry, free_port, notification_endpoint, run_registry
from fixtures.service import RunningService, run_service_process
from placement.nfd.schema import ARTIFACT_TYPE as NFD_TYPE
from scanner.registry.referrers import ARTIFACT_TYPE, tag_schema_tag
from tests.test_service_e2e import by_ref, call, metric_values, wait_job

SECRET = "referrers-hook-secret-4c1e"
TOKEN = "referrers-api-token-8d2f"


def skopeo_raw(host: str, name: str) -> dict[str, Any]:
    result = subprocess.run(
        ["skopeo", "inspect", "--raw", "--tls-verify=false", f"docker://{host}/{name}"],
        check=True,
        capture_output=True,
        timeout=60,
    )
    data: dict[str, Any] = json.loads(result.stdout)
    return data


def wait_metric(url: str, name: str, labels: str, at_least: float, timeout: float = 30.0) -> float:
    """Poll /metrics (bounded) until the sample reaches `at_least`; returns the last value seen."""
    deadline = time.monotonic() + timeout
    value = 0.0
    while time.monotonic() < deadline:
        value = metric_values(call("GET", f"{url}/metrics").text, name).get(labels, 0.0)
        if value >= at_least:
            return value
        time.sleep(0.05)
    return value


@pytest.fixture(scope="module")
def readonly(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalRegistry, str]]:
    """A registry that serves an image but refuses every write (maintenance read-only mode)."""
    root = tmp_path_factory.mktemp("readonly-registry")
    with run_registry(root=root) as writable:
        # Not an image the other test pushes: a digest already scanned is reused, not re-attached.
        digest = push_image(catalog.legacy_cuda(), f"{writable.host}/ro/cuda:12", root / "layout")
    storage = {
        "filesystem": {"rootdirectory": str(root / "data")},
        "maintenance": {"readonly": {"enabled": True}},
    }
    with run_registry(root=root, extra_config={"storage": storage}) as frozen:
        yield frozen, digest


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, readonly: tuple[LocalRegistry, str]
) -> Iterator[tuple[RunningService, LocalRegistry]]:
    root = tmp_path_factory.mktemp("referrers-service")
    port = free_port()
    notify = {"endpoints": [notification_endpoint(f"http://127.0.0.1:{port}/hooks/distribution", SECRET)]}
    with run_registry(extra_config={"notifications": notify}) as notifying:
        env = {
            "GPUBADGE_REGISTRIES": json.dumps(
                [
                    {"host": notifying.host, "push_anonymous": True},
                    {"host": readonly[0].host, "push_anonymous": True},
                ]
            ),
            "GPUBADGE_WEBHOOK_SECRET": SECRET,
            "GPUBADGE_API_TOKEN": TOKEN,
            "GPUBADGE_ALLOW_AGENTS_WITHOUT_TOKEN": "true",  # the server below registers without one
            "GPUBADGE_ATTACH_REPORTS": "true",
            "GPUBADGE_ATTACH_ATTEMPTS": "2",
            "GPUBADGE_ATTACH_BACKOFF": "0.05",
            "DOCKER_CONFIG": str(root / "docker"),
        }
        with run_service_process(root / "service.db", env=env, port=port) as service:
            yield service, notifying


def test_pushed_image_gets_its_report_attached_and_our_pushes_are_not_scanned(
    stack: tuple[RunningService, LocalRegistry], tmp_path: Path
) -> None:
    service, registry = stack
    digest = push_image(catalog.cuda_ubuntu(), f"{registry.host}/svc/cuda:12", tmp_path / "a")
    assert by_ref(service.url, f"{registry.host}/svc/cuda:12", wait=20).status == 200
    attached = wait_metric(service.url, "gpubadge_referrer_attach_total", '{result="attached"}', 1)
    assert attached == 1, service.log()[-3000:]

    nfd = wait_metric(service.url, "gpubadge_nfd_attach_total", '{result="attached"}', 1)
    assert nfd == 1, service.log()[-3000:]

    index = skopeo_raw(registry.host, f"svc/cuda:{tag_schema_tag(digest)}")
    [entry, nfd_entry] = index["manifests"]  # the report, then NFD's artifact beside it
    assert entry["artifactType"] == ARTIFACT_TYPE and nfd_entry["artifactType"] == NFD_TYPE
    artifact = skopeo_raw(registry.host, f"svc/cuda@{entry['digest']}")
    assert artifact["subject"]["digest"] == digest
    assert skopeo_raw(registry.host, f"svc/cuda@{nfd_entry['digest']}")["subject"]["digest"] == digest

    # Notifications are delivered in order: once a later push is scanned, the registry has
    # already told us about our artifact and the sha256-… index, and they queued nothing.
    sentinel = push_image(catalog.plain_glibc(), f"{registry.host}/svc/sentinel:1", tmp_path / "b")
    assert by_ref(service.url, f"{registry.host}/svc/sentinel:1", wait=20).status == 200
    jobs = call("GET", f"{service.url}/api/scans?limit=200").body["jobs"]
    references = [job["reference"] for job in jobs]
    assert sorted(references) == sorted(
        [f"{registry.host}/svc/cuda:12@{digest}", f"{registry.host}/svc/sentinel:1@{sentinel}"]
    ), references
    webhooks = metric_values(call("GET", f"{service.url}/metrics").text, "gpubadge_webhooks_total")
    assert webhooks.get('{source="distribution",status="202"}', 0) >= 4  # ours were delivered, and ignored

    page = call("GET", f"{service.url}/images/{registry.host}/svc/cuda:12")
    assert "Report in the registry" in page.text and "attached" in page.text, service.log()[-2500:]
    assert entry["digest"][:19] in page.text
    # NFD's artifact: attached, and its rules as NFD reads them.
    assert "Node Feature Discovery image-compatibility artifact" in page.text
    assert "attached by gpubadge" in page.text and nfd_entry["digest"][:19] in page.text
    assert "nvidia-gpu" in page.text and "nvidia-gfd" in page.text
    assert (
        "vendor In 10de" in page.text
        and "nvidia.com/cuda.runtime-version.full Ge 12.2 (version)" in page.text
    )

    # `gpubadge compat --service`: the fleet comes from the service; an agent's server is checked.
    from tests.test_referrers import _cli

    h100 = {
        "name": "gpu-node-1", "driver_version": "550.107.02", "cuda_driver_version": "12.4",
        "gpus": [{"index": 0, "uuid": "GPU-nfd-0", "name": "NVIDIA H100 80GB HBM3", "brand": "NVIDIA", "memory_mib": 81559}],
    }  # fmt: skip
    assert call("POST", f"{service.url}/api/servers", h100).status == 200
    env = {"GPUBADGE_REGISTRIES": registry.host, "GPUBADGE_DOCKER_CONFIG": str(tmp_path / "none.json")}
    checked = _cli(["compat", f"{registry.host}/svc/cuda:12", "--service", service.url, "--json"], env)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    [line] = [json.loads(text) for text in checked.stdout.splitlines()]
    assert (line["node"], line["verdict"], line["artifact"].rsplit("@", 1)[1]) == (
        "gpu-node-1",
        "match",
        nfd_entry["digest"],
    )


def test_failed_attach_never_fails_the_scan(
    stack: tuple[RunningService, LocalRegistry], readonly: tuple[LocalRegistry, str]
) -> None:
    service, _ = stack
    frozen, digest = readonly
    reply = call(
        "POST",
        f"{service.url}/api/scans",
        {"ref": f"{frozen.host}/ro/cuda:12"},
        {"Authorization": f"Bearer {TOKEN}"},
    )
    assert reply.status == 202, reply.text
    job = wait_job(service.url, reply.body["id"])
    assert (job["state"], job["digest"], job["error"]) == ("done", digest, None)
    failed = wait_metric(service.url, "gpubadge_referrer_attach_total", '{result="failed"}', 1)
    assert failed == 1, service.log()[-3000:]
    counted = metric_values(call("GET", f"{service.url}/metrics").text, "gpubadge_referrer_attach_total")
    assert counted.get('{result="retry"}', 0) >= 1
    page = call("GET", f"{service.url}/images/{frozen.host}/ro/cuda:12")
    assert page.status == 200
    assert "referrer-failed" in page.text and "refused to open an upload session" in page.text, page.text[
        -3000:
    ]
