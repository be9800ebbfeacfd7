"""Bearer auth against the real registry (Debian docker-registry 2.8) configured with `auth: token`.

The registry verifies every JWT itself (RS256 signature against the issuer's certificate, issuer,
audience, expiry, and the `access` claim), so these tests show that what the client sends is what a
production registry accepts, not only what our own token server hands out.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from pydantic import SecretStr

from fixtures.busybox import busybox_image
from fixtures.registry import LocalRegistry, run_registry
from fixtures.token_issuer import SERVICE, SigningKey, TokenIssuer
from scanner.registry.client import RegistryClient
from scanner.registry.errors import Unauthorized
from scanner.registry.reference import parse_reference
from scanner.settings import RegistryConfig, ScannerSettings
from tests.conftest import Pusher

OPEN = "tokenauth/open:v1"
PRIVATE = "tokenauth/private:v1"
PASSWORD = "issuer-PW-51c2"


@pytest.fixture(scope="module")
def pushed(push: Pusher) -> dict[str, str]:
    return {OPEN: push(busybox_image(), OPEN), PRIVATE: push(busybox_image(), PRIVATE)}


@contextmanager
def token_registry(registry: LocalRegistry, issuer: TokenIssuer) -> Iterator[LocalRegistry]:
    """A second registry process over the shared registry's storage, with `auth: token`."""
    root = Path(tempfile.mkdtemp(prefix="gpubadge-tokenauth-"))
    (root / "data").symlink_to(registry.root / "data")
    try:
        with run_registry(extra_config=issuer.registry_auth(root), root=root) as running:
            yield running
    finally:
        shutil.rmtree(root, ignore_errors=True)  # unlinks the data symlink; never follows it


def only_open_for_anonymous(user: str | None, repository: str, actions: list[str]) -> list[str]:
    if repository == PRIVATE.split(":")[0] and user != "robot":
        return []
    return [action for action in actions if action == "pull"]


@dataclass
class Setup:
    issuer: TokenIssuer
    registry: LocalRegistry


@pytest.fixture
async def setup(registry: LocalRegistry, pushed: dict[str, str]) -> AsyncIterator[Setup]:
    issuer = TokenIssuer(users={"robot": PASSWORD}, allow_anonymous=True, policy=only_open_for_anonymous)
    async with issuer:
        with token_registry(registry, issuer) as running:
            yield Setup(issuer, running)


def settings(host: str, password: str | None = None) -> ScannerSettings:
    registries = []
    if password is not None:
        registries = [RegistryConfig(host=host, username="robot", password=SecretStr(password))]
    return ScannerSettings(registries=registries, docker_config=None, retries=2, backoff_base=0.001)


async def test_anonymous_pull_with_a_jwt_the_registry_verifies(setup: Setup, pushed: dict[str, str]) -> None:
    ref = parse_reference(f"{setup.registry.host}/{OPEN}")
    async with RegistryClient(settings(setup.registry.host)) as client:
        with client.track() as stats:
            descriptor = await client.resolve(ref)
            manifest = await client.manifest(ref, descriptor.digest)
            config = await client.blob(ref, manifest.config.digest, 1 << 20)
    assert descriptor.digest == pushed[OPEN] and config
    assert stats.token_requests == 1  # one token for the repository, reused for every request
    assert stats.requests == 4  # the 401 that names the realm, then HEAD, GET manifest, GET config
    assert setup.issuer.calls == [
        {"user": None, "scopes": ["repository:tokenauth/open:pull"], "service": SERVICE}
    ]


async def test_basic_credentials_buy_a_token_for_a_private_repository(
    setup: Setup, pushed: dict[str, str]
) -> None:
    ref = parse_reference(f"{setup.registry.host}/{PRIVATE}")
    async with RegistryClient(settings(setup.registry.host)) as client:
        with pytest.raises(Unauthorized, match=r"access denied \(401\) anonymously"):
            await client.resolve(ref)
    async with RegistryClient(settings(setup.registry.host, PASSWORD)) as client:
        with client.track() as stats:
            descriptor = await client.resolve(ref)
    assert descriptor.digest == pushed[PRIVATE]
    assert stats.token_requests == 1
    assert setup.issuer.calls[-1]["user"] == "robot"


async def test_wrong_password_is_refused_by_the_issuer_without_retries(setup: Setup) -> None:
    ref = parse_reference(f"{setup.registry.host}/{PRIVATE}")
    async with RegistryClient(settings(setup.registry.host, "not-the-password")) as client:
        with client.track() as stats, pytest.raises(Unauthorized, match="refused \\(401\\)") as refused:
            await client.resolve(ref)
    assert "not-the-password" not in str(refused.value)
    assert stats.token_requests == 1 and stats.retries == 0


async def test_a_token_the_registry_cannot_verify_is_not_retried_forever(
    registry: LocalRegistry, pushed: dict[str, str]
) -> None:
    """A JWT signed by a key the registry does not trust: the registry refuses it; we stop."""
    async with TokenIssuer(allow_anonymous=True, forged_by=SigningKey.generate("forger")) as issuer:
        with token_registry(registry, issuer) as running:
            ref = parse_reference(f"{running.host}/{OPEN}")
            async with RegistryClient(settings(running.host)) as client:
                with client.track() as stats, pytest.raises(Unauthorized, match="access denied"):
                    await client.resolve(ref)
    assert len(issuer.calls) <= 2 and stats.requests <= 3  # one fresh token after a refusal, no loop


async def test_a_token_answer_that_arrives_in_parts_is_read_to_its_end(
    registry: LocalRegistry, pushed: dict[str, str]
) -> None:
    """The token server's body comes in two writes: the client reads it whole, not its first part."""
    issuer = TokenIssuer(allow_anonymous=True, policy=only_open_for_anonymous, split_answer=True)
    async with issuer:
        with token_registry(registry, issuer) as running:
            ref = parse_reference(f"{running.host}/{OPEN}")
            async with RegistryClient(settings(running.host)) as client:
                descriptor = await client.resolve(ref)
    assert descriptor.digest == pushed[OPEN] and len(issuer.calls) == 1
