"""Answers before the layers are read, through a running `gpubadge serve`.

A proxy in front of the real registry holds the layer blobs (not the config): the config facts
are published at once (`pending: true`); the API, the SVG badge, eligibility and the admission
webhook say what is still being read; `?wait=&until=facts` returns the facts, and a plain `?wait=`
the full report once the layers are released. /metrics counts the bytes each registry sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import pytest

from fixtures import catalog
from fixtures.registry import LocalRegistry
from fixtures.service import RunningService, run_service_process
from tests.conftest import Pusher
from tests.faultproxy import FaultProxy, Rule
from tests.test_service_e2e import Reply, call

TOKEN = "api-token-pending"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
FLEET = Path(__file__).resolve().parent.parent / "fixtures" / "fleet.yaml"


async def ask(method: str, url: str, body: dict[str, object] | None = None, timeout: float = 40) -> Reply:
    """An HTTP call off the loop: the proxy answers on this loop meanwhile."""
    return await asyncio.to_thread(call, method, url, body, AUTH, timeout)


def layer_digests(registry: LocalRegistry, repository: str, tag: str) -> list[str]:
    request = urllib.request.Request(
        f"{registry.url}/v2/{repository}/manifests/{tag}",
        headers={"Accept": "application/vnd.oci.image.manifest.v1+json"},
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return [layer["digest"] for layer in json.loads(response.read())["layers"]]


@dataclass
class Held:
    proxy: FaultProxy
    service: RunningService
    reference: str


@pytest.fixture
async def held(registry: LocalRegistry, push: Pusher, tmp_path: Path) -> AsyncIterator[Held]:
    """A GPU image behind a proxy that holds its layer blobs until `proxy.release` is set."""
    push(catalog.cuda_ubuntu(), "pending/cuda:1")
    layers = "|".join(re.escape(digest) for digest in layer_digests(registry, "pending/cuda", "1"))
    async with FaultProxy(registry.url) as proxy:
        proxy.add(Rule("hang", method="GET", path=rf"/blobs/({layers})$", times=None))
        env = {
            "GPUBADGE_REGISTRIES": f"{registry.host},{proxy.host}",
            "GPUBADGE_API_TOKEN": TOKEN,
            "GPUBADGE_INVENTORY_FILE": str(FLEET),
        }
        with contextlib.ExitStack() as stack:
            service = await asyncio.to_thread(
                stack.enter_context, run_service_process(tmp_path / "svc.db", env=env)
            )
            try:
                yield Held(proxy, service, f"{proxy.host}/pending/cuda:1")
            finally:
                proxy.release.set()
                await asyncio.to_thread(stack.close)


async def test_config_facts_come_first_and_the_layers_follow(held: Held) -> None:
    url, reference, proxy = held.service.url, held.reference, held.proxy
    reply = await ask("POST", f"{url}/api/scans", {"ref": reference})
    assert reply.status == 202, reply.text
    by_ref = f"{url}/api/images/by-ref?ref={quote(reference)}"

    facts = await ask("GET", f"{by_ref}&wait=30&until=facts")
    assert facts.status == 200, facts.text
    assert facts.body["pending"] is True
    (platform,) = facts.body["platforms"]
    assert platform["gpu"]["required"] is True and platform["libc"]["state"] == "pending"

    host, _, rest = reference.partition("/")
    svg = await ask("GET", f"{url}/badge/{host}/{rest.replace(':', '/')}.svg")
    assert "nvidia gpu" in svg.text and "layers are still being read" in svg.text

    still = await ask("GET", f"{by_ref}&wait=0.5")  # the full report is not there yet: the facts are
    assert still.status == 200 and still.body["pending"] is True

    eligibility = await ask("POST", f"{url}/api/eligibility", {"image": reference})
    assert eligibility.status == 200, eligibility.text
    (pending,) = eligibility.body["pending"]
    assert pending.startswith("linux/amd64: layers still being read") and "musl" in pending

    proxy.release.set()
    done = await ask("GET", f"{by_ref}&wait=30")
    assert done.status == 200 and done.body["pending"] is False, done.text
    assert done.body["platforms"][0]["libc"]["flavour"] == "glibc"
    again = await ask("POST", f"{url}/api/eligibility", {"image": reference})
    assert again.body["pending"] == []

    metrics = await ask("GET", f"{url}/metrics")
    counted = re.search(
        rf'gpubadge_registry_received_bytes_total{{registry="{re.escape(proxy.host)}"}} (\d+)', metrics.text
    )
    assert counted is not None and int(counted.group(1)) >= done.body["bytes_fetched"] > 0


async def test_a_bad_until_is_refused(held: Held) -> None:
    reply = await ask("GET", f"{held.service.url}/api/images/by-ref?ref={quote(held.reference)}&until=soon")
    assert reply.status == 400 and "until" in reply.text
