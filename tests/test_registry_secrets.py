"""Registry credentials (Basic passwords, refresh tokens, issued Bearer tokens) never show up in logs,
scan reports, API answers or /metrics, whether the scan succeeds or is refused."""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from pydantic import SecretStr

from fixtures.busybox import busybox_image
from fixtures.registry import LocalRegistry, free_port, htpasswd, run_registry
from fixtures.service import run_service_inprocess
from scanner.registry.client import RegistryClient
from scanner.scan import Scanner
from scanner.settings import RegistryConfig, ScannerSettings
from store import open_store
from tests.conftest import Pusher
from tests.faultproxy import FaultProxy, TokenServer
from web.settings import ServiceSettings

BASIC_PASSWORD = "basic-PW-7f3a9c"
BEARER_PASSWORD = "bearer-PW-2b8e41"
WRONG_PASSWORD = "wrong-PW-99d0e2"
REPOSITORY = "secrets/app:v1"


@pytest.fixture(scope="module")
def pushed(push: Pusher) -> str:
    return push(busybox_image(), REPOSITORY)


@pytest.fixture(scope="module")
def basic_registry(registry: LocalRegistry, pushed: str) -> Iterator[LocalRegistry]:
    root = Path(tempfile.mkdtemp(prefix="gpubadge-secrets-"))
    (root / "data").symlink_to(registry.root / "data")
    accounts = root / "htpasswd"
    accounts.write_text(htpasswd({"scanner": BASIC_PASSWORD}))
    auth = {"auth": {"htpasswd": {"realm": "gpubadge-secrets", "path": str(accounts)}}}
    try:
        with run_registry(extra_config=auth, root=root) as running:
            yield running
    finally:
        shutil.rmtree(root, ignore_errors=True)


def assert_free_of(texts: dict[str, str], secrets: list[str]) -> None:
    for where, text in texts.items():
        for secret in secrets:
            assert secret not in text, f"{secret!r} leaked into {where}"


async def test_scans_with_basic_and_bearer_credentials_leak_nothing(
    registry: LocalRegistry, basic_registry: LocalRegistry, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)  # every logger, aiohttp's included
    tokens = TokenServer(users={"robot": BEARER_PASSWORD}, allow_anonymous=False)
    async with tokens, FaultProxy(registry.url) as bearer_registry:
        bearer_registry.require_bearer(tokens.realm, tokens.issued)
        good = [
            RegistryConfig(host=basic_registry.host, username="scanner", password=SecretStr(BASIC_PASSWORD)),
            RegistryConfig(host=bearer_registry.host, username="robot", password=SecretStr(BEARER_PASSWORD)),
        ]
        settings = ScannerSettings(registries=good, docker_config=None)
        async with RegistryClient(settings) as client:
            store = open_store(tmp_path / "good.db")
            scanner = Scanner(client, store.scan_cache, settings)
            reports = [
                await scanner.scan(f"{basic_registry.host}/{REPOSITORY}"),
                await scanner.scan(f"{bearer_registry.host}/{REPOSITORY}"),
            ]
            await scanner.close()
            await store.close()
            client_repr = repr(client) + repr(client.totals)
        assert [report.error for report in reports] == [None, None]
        bad = [
            RegistryConfig(host=basic_registry.host, username="scanner", password=SecretStr(WRONG_PASSWORD)),
            RegistryConfig(host=bearer_registry.host, username="robot", password=SecretStr(WRONG_PASSWORD)),
        ]
        bad_settings = ScannerSettings(registries=bad, docker_config=None)
        async with RegistryClient(bad_settings) as client:
            store = open_store(tmp_path / "bad.db")
            scanner = Scanner(client, store.scan_cache, bad_settings)
            refused = [
                await scanner.scan(f"{basic_registry.host}/{REPOSITORY}"),
                await scanner.scan(f"{bearer_registry.host}/{REPOSITORY}"),
            ]
            await scanner.close()
            await store.close()
    assert all(report.error and "credentials from settings" in report.error for report in refused)
    assert tokens.issued and any(call["authorization"].startswith("Basic ") for call in tokens.calls)
    texts = {
        "logs": caplog.text,
        "reports": json.dumps([r.model_dump(mode="json") for r in reports + refused]),
        "client": client_repr,
        "settings": repr(settings) + repr(bad_settings) + str(settings.model_dump()),
    }
    assert_free_of(texts, [BASIC_PASSWORD, BEARER_PASSWORD, WRONG_PASSWORD, *tokens.issued])


async def test_service_with_registry_credentials_leaks_nothing(
    registry: LocalRegistry, basic_registry: LocalRegistry, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    tokens = TokenServer(users={"robot": BEARER_PASSWORD}, allow_anonymous=False)
    async with tokens, FaultProxy(registry.url) as bearer_registry:
        bearer_registry.require_bearer(tokens.realm, tokens.issued)
        settings = ServiceSettings(
            db=tmp_path / "service.db",
            port=0,
            docker_config=None,
            registries=[
                RegistryConfig(
                    host=basic_registry.host, username="scanner", password=SecretStr(BASIC_PASSWORD)
                ),
                RegistryConfig(
                    host=bearer_registry.host, username="robot", password=SecretStr(BEARER_PASSWORD)
                ),
            ],
        )
        answers: list[str] = []
        async with (
            run_service_inprocess(settings, port=free_port()) as service,
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session,
        ):
            for host in (basic_registry.host, bearer_registry.host):
                reference = f"{host}/{REPOSITORY}"
                async with session.post(f"{service.url}/api/scans", json={"ref": reference}) as response:
                    assert response.status == 202, await response.text()
                    job = await response.json()
                scan_url = f"{service.url}/api/scans/{job['id']}"
                async with session.get(scan_url, params={"wait": "30"}) as response:
                    answers.append(await response.text())
                    assert json.loads(answers[-1])["state"] == "done", answers[-1]
                params = {"ref": reference}
                async with session.get(f"{service.url}/api/images/by-ref", params=params) as response:
                    body = await response.text()
                    assert response.status == 200 and json.loads(body)["error"] is None, body
                    answers.append(body)
            for path in ("/metrics", "/api/images", "/api/scans", "/healthz"):
                async with session.get(f"{service.url}{path}") as response:
                    answers.append(await response.text())
    assert tokens.issued
    texts = {"logs": caplog.text, "answers": "\n".join(answers)}
    assert_free_of(texts, [BASIC_PASSWORD, BEARER_PASSWORD, *tokens.issued])
