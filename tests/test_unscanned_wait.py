"""An image never scanned, asked about with the API token, is scanned for the answer, but for at most
GPUBADGE_UNSCANNED_SCAN_WAIT: a registry that does not answer holds a deploy pipeline's request that long
and no longer (it held it for the whole scan's bound, GPUBADGE_MAX_SCAN_SECONDS: 30 minutes). Then the
scan is queued for the workers, the 404 names its job, and the answer comes once the registry does."""

from __future__ import annotations

import asyncio
import base64
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from fixtures import catalog
from fixtures.registry import LocalRegistry, free_port
from gpubadge.eligible import EXIT_NONE, ask_service
from tests.conftest import Pusher
from tests.faultproxy import FaultProxy, Rule
from tests.test_analysis_version import API_TOKEN as TOKEN
from tests.test_analysis_version import service_on  # noqa: F401 (the service fixture, shared)
from web.settings import ServiceSettings


@pytest.fixture
def service(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    """Start the service (SQLite, no fleet, the API token set) with settings given; its URL, awaited."""
    start = request.getfixturevalue("service_on")
    return lambda **overrides: start(tmp_path / "service.db", **overrides)


async def test_a_registry_that_does_not_answer_holds_a_never_scanned_answer_only_for_the_wait(
    registry: LocalRegistry, push: Pusher, service: Any
) -> None:
    push(catalog.cuda_ubuntu(), "unscanned/hanging:1")
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with FaultProxy(registry.url) as proxy, aiohttp.ClientSession(headers=headers) as session:
        reference = f"{proxy.host}/unscanned/hanging:1"
        url = await service(unscanned_scan_wait=1.0)
        proxy.add(Rule("hang", path="/manifests/", times=None))

        started = time.monotonic()
        async with session.post(f"{url}/api/eligibility", json={"image": reference}) as reply:
            body = await reply.json()
            assert reply.status == 404, body
        assert time.monotonic() - started < 6  # the 1 s wait and a margin
        found = re.search(r"queued as scan (\S+); ask again when it is done", body["error"])
        assert found and "took longer than 1 s (GPUBADGE_UNSCANNED_SCAN_WAIT)" in body["error"], body
        job_id = found.group(1)
        assert body["scan"] == job_id  # for clients to wait on (`gpubadge eligible` does)
        async with session.get(f"{url}/api/scans/{job_id}") as reply:
            job = await reply.json()
            assert job["reference"] == reference and job["state"] in ("queued", "running"), job
        await proxy.wait_for_in_flight(1, timeout=30)  # the queued scan waits on the registry now

        proxy.release.set()
        async with session.get(f"{url}/api/scans/{job_id}", params={"wait": "30"}) as reply:
            assert (await reply.json())["state"] == "done"
        async with session.post(f"{url}/api/eligibility", json={"image": reference}) as reply:
            answered = await reply.json()
            assert reply.status == 200 and answered["image"]["reference"] == reference, answered


async def test_the_eligibility_page_says_the_scan_is_queued_and_where_to_find_it(
    registry: LocalRegistry, push: Pusher, service: Any
) -> None:
    """The browser's form, with the token (HTTP Basic), past the wait: the page says the scan is queued, names
    it and says to reload, instead of the API's words."""
    push(catalog.cuda_ubuntu(), "unscanned/page:1")
    basic = {"Authorization": "Basic " + base64.b64encode(f"anyone:{TOKEN}".encode()).decode()}
    async with FaultProxy(registry.url) as proxy, aiohttp.ClientSession(headers=basic) as session:
        reference = f"{proxy.host}/unscanned/page:1"
        url = await service(unscanned_scan_wait=1.0)
        proxy.add(Rule("hang", path="/manifests/", times=None))
        async with session.get(f"{url}/eligibility", params={"image": reference}) as reply:
            html = await reply.text()
            assert reply.status == 404, html[:2000]
        found = re.search(
            r"its scan took longer than this page waits, so it is queued \(scan (\S+), on the Scans"
            r" page\); reload this page once it is done",
            html,
        )
        assert found, html[:4000]
        async with session.get(f"{url}/api/scans/{found.group(1)}") as reply:
            assert (await reply.json())["reference"] == reference
        proxy.release.set()


async def test_an_image_scanned_within_the_wait_is_answered_at_once(
    registry: LocalRegistry, push: Pusher, service: Any
) -> None:
    push(catalog.cuda_ubuntu(), "unscanned/quick:1")
    url = await service()
    reference = f"{registry.host}/unscanned/quick:1"
    async with (
        aiohttp.ClientSession(headers={"Authorization": f"Bearer {TOKEN}"}) as session,
        session.post(f"{url}/api/eligibility", json={"image": reference}) as reply,
    ):
        assert reply.status == 200, await reply.text()


def test_the_wait_is_bounded_and_named() -> None:
    assert ServiceSettings.model_fields["unscanned_scan_wait"].default == 60.0
    with pytest.raises(ValueError, match="unscanned_scan_wait"):
        ServiceSettings(unscanned_scan_wait=0)


async def test_gpubadge_eligible_waits_for_the_scan_the_service_queued_and_asks_again(
    registry: LocalRegistry, push: Pusher, service: Any
) -> None:
    """The CLI, told the image's scan is queued, says so on stderr, waits for that scan and answers, exit
    status and all, as if the service had scanned it at once."""
    push(catalog.cuda_ubuntu(), "unscanned/cli:1")
    async with FaultProxy(registry.url) as proxy:
        reference = f"{proxy.host}/unscanned/cli:1"
        url = await service(unscanned_scan_wait=1.0)
        proxy.add(Rule("hang", path="/manifests/", times=None))
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPUBADGE")}
        cli = await asyncio.create_subprocess_exec(
            *(
                sys.executable,
                "-m",
                "gpubadge.cli",
                "eligible",
                reference,
                "--service",
                url,
                "--token",
                TOKEN,
            ),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
        )
        assert cli.stderr is not None
        line = (await asyncio.wait_for(cli.stderr.readline(), timeout=30)).decode()
        assert re.match(rf"scanning +{re.escape(reference)} \(scan \S+\); waiting for it$", line.strip()), (
            line
        )
        await proxy.wait_for_in_flight(1, timeout=30)  # the queued scan waits on the registry now
        proxy.release.set()
        out, err = await asyncio.wait_for(cli.communicate(), timeout=60)
        assert cli.returncode == EXIT_NONE, (out, err)  # no fleet here: no server can run it
        assert b"no server can run this image with this request" in out and not err.strip(), (out, err)


async def test_the_cli_asks_about_the_scan_at_most_once_a_second_whatever_the_service_does_with_wait() -> (
    None
):
    """A service that answers `?wait=` at once (an older or a foreign one) is not asked in a busy loop."""
    asked: list[float] = []
    posts: list[int] = []

    async def eligibility(request: web.Request) -> web.Response:
        posts.append(1)
        if len(posts) == 1:
            return web.json_response({"error": "not scanned yet: queued", "scan": "s/1"}, status=404)
        return web.json_response({"eligible": [], "eligible_count": 0})

    async def scan(request: web.Request) -> web.Response:
        assert request.match_info["id"] == "s%2F1" or request.match_info["id"] == "s/1"
        asked.append(time.monotonic())
        return web.json_response({"state": "done" if len(asked) >= 3 else "queued"})

    app = web.Application()
    app.router.add_post("/api/eligibility", eligibility)
    app.router.add_get("/api/scans/{id}", scan)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        answer = await ask_service("registry.example/x:1", f"http://127.0.0.1:{port}", {}, None)
    finally:
        await runner.cleanup()
    assert answer["eligible_count"] == 0 and len(posts) == 2 and len(asked) == 3
    assert asked[2] - asked[0] >= 1.9, asked  # two pauses of a second between three questions
