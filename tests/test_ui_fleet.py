"""The placement pages: `/servers` and the eligibility explorer `/eligibility`.

Part one drives the aiohttp app in-process (empty fleet, form errors, escaping). Part two
(`-m browser`) runs `gpubadge serve` as a real process with an inventory file, scans an image
pushed by skopeo to the real test registry through the form, and reads the pages with
headless Chromium.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp.test_utils import TestClient, TestServer

from fixtures import catalog
from fixtures.registry import LocalRegistry
from fixtures.service import RunningService, run_service_process
from placement.inventory import Gpu, Server
from tests.conftest import Pusher
from tests.test_fleet_api import FLEET
from web.app import create_app
from web.settings import ServiceSettings
from web.views.fleet_views import EligibilityForm, FormError, gpu_groups, server_row_view

XSS = "<script>window.__xss=1</script>"

# ------------------------------------------------------------------ pure views


def test_gpus_are_grouped_by_model_and_in_use_ones_named() -> None:
    gpus = [
        Gpu(index=1, uuid="GPU-b", name="NVIDIA H100 80GB HBM3", memory_mib=81559, compute_capability="9.0"),
        Gpu(index=0, uuid="GPU-a", name="NVIDIA H100 80GB HBM3", memory_mib=81559, compute_capability="9.0"),
        Gpu(
            index=2,
            uuid="GPU-c",
            name="NVIDIA A100-SXM4-40GB",
            memory_mib=40960,
            compute_capability="8.0",
            mig=True,
        ),
    ]
    groups = gpu_groups(gpus)
    assert [(g.count, g.model, g.memory, g.compute_capability, g.mig) for g in groups] == [
        (2, "NVIDIA H100 80GB HBM3", "79.64 GiB", "9.0", False),  # placement.sizes' one way
        (1, "NVIDIA A100-SXM4-40GB", "40 GiB", "8.0", True),
    ]
    now = datetime(2026, 1, 1, 12, tzinfo=UTC)
    agent = Server(
        name="n1",
        memory="512Gi",
        gpus=gpus,
        gpus_in_use=["GPU-c", "GPU-a"],
        source="agent",
        last_heartbeat=now - timedelta(minutes=3),
    )
    row = server_row_view(agent, now)
    assert (row.memory, row.heartbeat, row.gpu_count) == ("512 GiB", "3 min ago", 3)
    assert [(gpu.index, gpu.uuid) for gpu in row.in_use] == [(0, "GPU-a"), (2, "GPU-c")]
    assert server_row_view(Server(name="f"), now).heartbeat == "none: from the inventory file"


def test_form_splits_models_and_names_the_bad_field() -> None:
    form = EligibilityForm.from_query(
        {
            "image": " r/x:1 ",
            "gpus": "2",
            "gpu_models": "h100, a100-80gb,",
            "min_gpu_memory": "40Gi",
            "cpus": "",
        }
    )
    assert form.image == "r/x:1"
    request = form.deploy_request()
    assert (request.gpus, request.gpu_models, request.min_gpu_memory, request.cpus) == (
        2,
        ["h100", "a100-80gb"],
        40 * 1024**3,
        None,
    )
    with pytest.raises(FormError, match=r"^Min GPU memory: invalid quantity 'lots'"):
        EligibilityForm.from_query({"image": "r/x:1", "min_gpu_memory": "lots"}).deploy_request()
    with pytest.raises(FormError, match=r"^GPU count: expected an integer, got 'two'$"):  # no pydantic words
        EligibilityForm.from_query({"image": "r/x:1", "gpus": "two"}).deploy_request()
    with pytest.raises(FormError, match=r"^Min compute capability: 'eight' is not a version"):
        EligibilityForm.from_query({"image": "r/x:1", "min_compute_capability": "eight"}).deploy_request()


# ------------------------------------------------------------------ in-process


@pytest.fixture
async def client(tmp_path: Path) -> AsyncIterator[TestClient[Any, Any]]:
    inventory = tmp_path / "fleet.yaml"
    hostile = {"name": XSS, "labels": {"zone": XSS}, "cpus": 4, "memory": "8Gi"}
    inventory.write_text(yaml.safe_dump({"servers": [*FLEET["servers"], hostile]}))
    settings = ServiceSettings(db=tmp_path / "ui.db", inventory_file=inventory, docker_config=None)
    async with TestClient(TestServer(create_app(settings, start_workers=False))) as test_client:
        yield test_client


async def test_empty_fleet_says_how_to_add_servers(tmp_path: Path) -> None:
    settings = ServiceSettings(db=tmp_path / "empty.db", docker_config=None)
    async with TestClient(TestServer(create_app(settings, start_workers=False))) as test_client:
        response = await test_client.get("/servers")
        html = await response.text()
    assert response.status == 200
    assert "No servers yet" in html
    assert "gpubadge agent --service http://127.0.0.1" in html
    assert "GPUBADGE_INVENTORY_FILE" in html


async def test_servers_page_escapes_server_values(client: TestClient[Any, Any]) -> None:
    response = await client.get("/servers")
    html = await response.text()
    assert response.status == 200
    assert XSS not in html
    assert "&lt;script&gt;window.__xss=1&lt;/script&gt;" in html
    assert "Tesla T4" in html and "h100-new" in html


@pytest.mark.parametrize(
    ("query", "status", "message"),
    [
        ("image=UPPER/Case::x", 400, "invalid"),
        ("image=127.0.0.1:1/a:1&min_gpu_memory=lots", 400, "Min GPU memory: invalid quantity"),
        ("gpus=1", 400, "Enter an image reference"),
        ("image=ghcr.io/acme/never-scanned:1", 422, "registry not on the allowlist: ghcr.io"),
    ],
)
async def test_bad_input_is_a_clear_message_not_a_trace(
    client: TestClient[Any, Any], query: str, status: int, message: str
) -> None:
    response = await client.get("/eligibility?" + query)
    html = await response.text()
    assert response.status == status, html
    assert response.content_type == "text/html"
    assert "Cannot check this request." in html
    assert message.replace("'", "&#39;") in html or message in html, html
    assert "Traceback" not in html


async def test_blank_form_is_a_plain_page(client: TestClient[Any, Any]) -> None:
    response = await client.get("/eligibility")
    html = await response.text()
    assert response.status == 200
    assert 'name="min_gpu_memory"' in html and "Cannot check" not in html
    assert 'aria-current="page"' in html


# ===================================================================== browser


def screenshot_path(name: str, tmp_path: Path) -> Path:
    """Where a test keeps its shot (docs/*.png come from `make run`: python -m fixtures.screenshots)."""
    return tmp_path / name


@pytest.fixture(scope="module")
def fleet_service(
    tmp_path_factory: pytest.TempPathFactory, registry: LocalRegistry, push: Pusher
) -> Iterator[tuple[RunningService, str]]:
    """`gpubadge serve` with the FLEET inventory file; the CUDA image is pushed but not yet scanned."""
    push(catalog.cuda_ubuntu(), "uifleet/cuda:12.2")
    root = tmp_path_factory.mktemp("ui-fleet")
    inventory = root / "fleet.yaml"
    inventory.write_text(yaml.safe_dump(FLEET))
    with run_service_process(
        root / "gpubadge.db", env={"GPUBADGE_INVENTORY_FILE": str(inventory)}
    ) as service:
        yield service, f"{registry.host}/uifleet/cuda:12.2"


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    """A page with JavaScript off: both pages must work as plain HTML forms."""
    context = browser.new_context(viewport={"width": 1280, "height": 900}, java_script_enabled=False)
    context.set_default_timeout(10_000)
    try:
        yield context.new_page()
    finally:
        context.close()


@pytest.mark.browser
def test_servers_page_lists_the_fleet(
    fleet_service: tuple[RunningService, str], page: Any, tmp_path: Path
) -> None:
    service, _ = fleet_service
    page.goto(service.url + "/servers")
    rows = page.locator("table.servers tbody tr")
    assert rows.count() == 3
    h100 = page.locator("tr[data-server='h100-new']")
    assert "1 × NVIDIA H100 80GB HBM3" in h100.locator(".gpus").inner_text()
    assert "CC 9.0" in h100.inner_text()
    assert "512 GiB" in h100.inner_text()  # placement.sizes, as the explorer's reasons write sizes
    assert "550.54.15" in h100.inner_text()
    t4 = page.locator("tr[data-server='t4-old']")
    assert "Tesla T4" in t4.locator(".gpus").inner_text()
    assert "0 of 1" in t4.locator(".in-use").inner_text()
    # an inventory server sends no heartbeat: the page says so, and where it comes from
    assert "none: from the inventory file" in t4.locator("td").last.inner_text() and "file" in t4.inner_text()
    assert "CPU only" in page.locator("tr[data-server='arm-cpu']").inner_text()
    page.screenshot(path=str(screenshot_path("servers.png", tmp_path)), full_page=True)


@pytest.mark.browser
def test_eligibility_form_scans_and_explains(
    fleet_service: tuple[RunningService, str], page: Any, record_property: Any, tmp_path: Path
) -> None:
    service, reference = fleet_service
    page.goto(service.url + "/eligibility")
    page.fill("input[name=image]", reference)
    page.fill("input[name=gpus]", "1")
    started = time.perf_counter()
    page.get_by_role("button", name="Check").click()
    page.wait_for_url("**/eligibility?image=**")
    record_property("scan_and_decide_seconds", round(time.perf_counter() - started, 3))

    assert page.locator(".eligibility-error").count() == 0
    eligible = page.locator("table.eligible tbody tr")
    assert eligible.locator(".server-name").all_inner_texts() == ["h100-new"]
    assert "GPU-h100-new-0" in eligible.first.inner_text()
    summary = page.locator("table.rejected-summary tbody tr")
    t4_rows = [row for row in summary.all() if "t4-old" in row.locator(".examples").inner_text()]
    assert any("12.2" in row.locator(".reason").inner_text() for row in t4_rows)
    assert page.locator("table.rejected").count() == 0  # the summary only, until asked
    assert "exact fit" in page.locator(".score-legend").inner_text()  # the score is explained
    assert "spare GPUs" in (page.locator("abbr.score-help").get_attribute("title") or "")
    assert page.locator("input[name=gpus]").input_value() == "1"  # the form keeps what was typed
    page.screenshot(path=str(screenshot_path("eligibility.png", tmp_path)), full_page=True)
    page.locator("a.explain-all").click()
    page.wait_for_url("**explain=all**")
    rejected = page.locator("table.rejected tr[data-server='t4-old'] .reasons li").all_inner_texts()
    assert any("12.2" in reason for reason in rejected), rejected
    arm = page.locator("table.rejected tr[data-server='arm-cpu'] .reasons li").all_inner_texts()
    assert arm, "every rejected server carries its reasons"
    assert page.locator("input[name=gpus]").input_value() == "1"


@pytest.mark.browser
def test_invalid_reference_shows_a_clear_error(fleet_service: tuple[RunningService, str], page: Any) -> None:
    service, _ = fleet_service
    page.goto(service.url + "/eligibility")
    page.fill("input[name=image]", "Not A Reference!")
    page.get_by_role("button", name="Check").click()
    page.wait_for_url("**/eligibility?image=**")
    error = page.get_by_role("alert")
    assert "Cannot check this request." in error.inner_text()
    assert "Not A Reference!" in error.inner_text() or "invalid" in error.inner_text().lower()
    assert page.locator("table.eligible").count() == 0
    assert page.locator("input[name=image]").input_value() == "Not A Reference!"
