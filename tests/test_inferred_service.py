"""Inferred CUDA seen through a running `gpubadge serve`: API filter, image page, SVG badge."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest

from fixtures import catalog
from fixtures.registry import LocalRegistry
from fixtures.service import RunningService, run_service_process
from tests.conftest import Pusher
from tests.test_deep_scan import SITE, wheel_layer
from tests.test_service_e2e import call, wait_job

TOKEN = "api-token-inferred"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def service(registry: LocalRegistry, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningService]:
    env = {
        "GPUBADGE_REGISTRIES": registry.host,
        "GPUBADGE_API_TOKEN": TOKEN,
        "GPUBADGE_INVENTORY_FILE": str(Path(__file__).resolve().parent.parent / "fixtures" / "fleet.yaml"),
    }
    with run_service_process(tmp_path_factory.mktemp("inferred") / "svc.db", env=env) as running:
        yield running


@pytest.fixture(scope="module")
def scanned(service: RunningService, registry: LocalRegistry, push: Pusher) -> dict[str, str]:
    plain = catalog.plain_glibc()
    torch = catalog.plain_glibc()
    torch.layers.append(wheel_layer())
    images = {"inf/torch:1": torch, "inf/plain:1": plain}
    for name, spec in images.items():
        push(spec, name)
    for name in images:
        reply = call("POST", f"{service.url}/api/scans", {"ref": f"{registry.host}/{name}"}, AUTH)
        assert reply.status == 202, reply.text
        job = wait_job(service.url, str(reply.body["id"]), wait=60)
        assert job["state"] == "done", job
    return {name: f"{registry.host}/{name}" for name in images}


def repositories(service: RunningService, query: str) -> list[str]:
    reply = call("GET", f"{service.url}/api/images?{query}")
    assert reply.status == 200, reply.text
    return sorted(image["repository"] for image in reply.body["images"])


def test_api_filter(service: RunningService, scanned: dict[str, str]) -> None:
    assert repositories(service, "inferred=true") == ["inf/torch"]
    assert repositories(service, "inferred=false") == ["inf/plain"]
    assert call("GET", f"{service.url}/api/images?inferred=maybe").status == 400


def test_image_page_badge_and_images_page(service: RunningService, scanned: dict[str, str]) -> None:
    page = call("GET", f"{service.url}/images/{scanned['inf/torch:1']}")
    assert page.status == 200
    assert "GPU optional" in page.text and "CUDA 12.1 inside" in page.text  # placement.image_needs' words
    assert f"{SITE}/torch/version.py: torch 2.1.2+cu121, cuda = &#39;12.1&#39;" in page.text
    assert "sm_90" in page.text and f"{SITE}/nvidia/nvjpeg/lib/libnvjpeg.so.12" in page.text
    registry, _, rest = scanned["inf/torch:1"].partition("/")
    svg = call("GET", f"{service.url}/badge/{registry}/{rest.replace(':', '/')}.svg")
    assert svg.status == 200 and "gpu optional" in svg.text and "cuda 12.1 inside" in svg.text
    listing = call("GET", f"{service.url}/?gpu=inferred")
    assert listing.status == 200 and "inf/torch" in listing.text and "inf/plain" not in listing.text


def test_eligibility_hint_without_gpus_and_driver_floor_with_gpus(
    service: RunningService, scanned: dict[str, str]
) -> None:
    reference = scanned["inf/torch:1"]
    cpu = call("POST", f"{service.url}/api/eligibility", {"image": reference}, AUTH)
    assert cpu.status == 200, cpu.text
    assert cpu.body["hints"] == ["carries CUDA 12.1 (torch): ask for gpus to run it on a GPU"]
    assert "cpu-1" in [entry["server"] for entry in cpu.body["eligible"]]
    gpu = call(
        "POST", f"{service.url}/api/eligibility", {"image": reference, "gpus": 1, "explain": "all"}, AUTH
    )
    assert gpu.status == 200 and gpu.body["hints"] == []
    eligible = [entry["server"] for entry in gpu.body["eligible"]]
    assert "h100-a" in eligible and "cpu-1" not in eligible
    legacy = next(entry["reasons"] for entry in gpu.body["ineligible"] if entry["server"] == "t4-legacy")
    assert any("driver 470.57.02: CUDA 12.x needs driver >= 525.60.13" in line for line in legacy), legacy
    page = call("GET", f"{service.url}/eligibility?image={quote(reference)}")
    assert page.status == 200 and "carries CUDA 12.1" in page.text
