"""Token realms are outbound requests the registry chooses: who may be contacted, and with what."""

from __future__ import annotations

import pytest
from pydantic import SecretStr

from fixtures.busybox import busybox_image
from fixtures.registry import LocalRegistry
from scanner.registry.auth import RealmRefused, check_realm
from scanner.registry.client import RegistryClient
from scanner.registry.errors import NotFound, RedirectRefused, TokenRealmRefused
from scanner.registry.reference import parse_reference
from scanner.settings import RegistryConfig, ScannerSettings
from tests.conftest import Pusher
from tests.faultproxy import FaultProxy, Rule, TokenServer

# (registry API host, realm URL, allowlist, sends credentials, allowed?)
REALM_CASES: list[tuple[str, str, list[str], bool, bool]] = [
    ("registry-1.docker.io", "https://auth.docker.io/token", [], True, True),
    ("docker.io", "https://auth.docker.io/token", [], False, True),
    ("ghcr.io", "https://ghcr.io/token", [], True, True),
    ("quay.io", "https://quay.io/v2/auth", [], True, True),
    ("us-docker.pkg.dev", "https://us-docker.pkg.dev/v2/token", [], True, True),
    ("eu.gcr.io", "https://gcr.io/v2/token", [], True, True),
    ("registry.gitlab.com", "https://gitlab.com/jwt/auth", [], True, True),
    ("registry.example.com:5000", "https://registry.example.com/token", [], True, True),  # own host
    ("ghcr.io", "https://auth.docker.io/token", [], False, False),  # a pair is not a free pass
    ("ghcr.io", "https://169.254.169.254/latest/meta-data", [], False, False),  # cloud metadata
    ("ghcr.io", "https://evil.example/token", [], True, False),
    ("ghcr.io", "http://127.0.0.1:8080/admin", [], False, False),  # loopback only for loopback registries
    ("ghcr.io", "https://auth.corp.example/token", ["auth.corp.example"], True, True),
    ("ghcr.io", "https://auth.corp.example:8443/token", ["auth.corp.example:8443"], True, True),
    ("ghcr.io", "https://auth.corp.example:8443/token", ["auth.corp.example:9443"], True, False),
    ("127.0.0.1:5000", "http://127.0.0.1:5001/token", [], True, True),
    ("localhost:5000", "http://127.0.0.1:5001/token", [], True, True),
    ("[::1]:5000", "http://localhost:5001/token", [], True, True),
    # Credentials go only over https, or to loopback for a loopback registry.
    ("registry.example.com", "http://registry.example.com/token", [], True, False),
    ("ghcr.io", "http://auth.corp.example/token", ["auth.corp.example"], True, False),
    ("ghcr.io", "ftp://ghcr.io/token", [], False, False),
    ("ghcr.io", "https://user:pw@ghcr.io/token", [], False, False),
    ("ghcr.io", "not a url", [], False, False),
]


@pytest.mark.parametrize(("registry", "realm", "allowlist", "credentials", "allowed"), REALM_CASES)
def test_realm_policy(
    registry: str, realm: str, allowlist: list[str], credentials: bool, allowed: bool
) -> None:
    if allowed:
        check_realm(registry, realm, allowlist=allowlist, sends_credentials=credentials)
    else:
        with pytest.raises(RealmRefused):
            check_realm(registry, realm, allowlist=allowlist, sends_credentials=credentials)


def test_anonymous_plain_http_only_to_loopback_or_insecure() -> None:
    check_realm(
        "lab:5000",
        "http://lab:5000/token",
        allowlist=[],
        sends_credentials=False,
        insecure_hosts=["lab:5000"],
    )
    with pytest.raises(RealmRefused, match="plain HTTP"):
        check_realm("lab:5000", "http://lab:5000/token", allowlist=[], sends_credentials=False)
    with pytest.raises(RealmRefused, match="credentials"):
        check_realm(
            "lab:5000",
            "http://lab:5000/token",
            allowlist=[],
            sends_credentials=True,
            insecure_hosts=["lab:5000"],
        )


def test_refusal_names_the_host_and_the_setting() -> None:
    with pytest.raises(RealmRefused) as refused:
        check_realm("ghcr.io", "https://evil.example:8443/t?x=1", allowlist=[], sends_credentials=False)
    message = str(refused.value)
    assert "evil.example:8443" in message and "GPUBADGE_REGISTRIES" in message and "ghcr.io" in message


def settings(**overrides: object) -> ScannerSettings:
    values: dict[str, object] = {
        "docker_config": None,
        "backoff_base": 0.001,
        "backoff_max": 0.01,
        "retries": 3,
    }
    values.update(overrides)
    return ScannerSettings(**values)  # type: ignore[arg-type]


async def test_foreign_realm_is_never_contacted_and_fails_the_request(registry: LocalRegistry) -> None:
    """A registry we may scan cannot point us (and the user's password) at another host."""
    observed: list[str] = []
    async with FaultProxy(registry.url) as proxy:
        proxy.require_bearer("https://evil.example/token", set())
        creds = RegistryConfig(host=proxy.host, username="robot", password=SecretStr("leak-me-not"))
        async with RegistryClient(
            settings(registries=[creds]), on_request=lambda h, *_: observed.append(h)
        ) as client:
            with client.track() as stats, pytest.raises(TokenRealmRefused) as refused:
                await client.resolve(parse_reference(f"{proxy.host}/realm/app:v1"))
    assert "evil.example" in str(refused.value) and "GPUBADGE_REGISTRIES" in str(refused.value)
    assert "leak-me-not" not in str(refused.value)
    assert stats.token_requests == 0 and stats.retries == 0
    assert observed == [proxy.host]  # only the 401; the realm was never asked


async def test_loopback_realm_of_a_loopback_registry_gets_credentials(registry: LocalRegistry) -> None:
    tokens_server = TokenServer(users={"robot": "pw-123"}, allow_anonymous=False)
    async with tokens_server as tokens, FaultProxy(registry.url) as proxy:
        proxy.require_bearer(tokens.realm.replace("127.0.0.1", "localhost"), tokens.issued)
        creds = RegistryConfig(host=proxy.host, username="robot", password=SecretStr("pw-123"))
        async with RegistryClient(settings(registries=[creds])) as client:
            with pytest.raises(NotFound):  # the repository does not exist: auth itself succeeded
                await client.resolve(parse_reference(f"{proxy.host}/realm/absent:v1"))
    assert tokens.calls and tokens.calls[0]["authorization"].startswith("Basic ")


async def test_blob_redirects_to_storage_stay_allowed_and_carry_no_credentials(
    registry: LocalRegistry, push: Pusher
) -> None:
    """A configured registry token goes to the registry only, never to the storage host it redirects to."""
    digest = push(busybox_image(), "realm/redirected:v1")
    async with FaultProxy(registry.url) as proxy, FaultProxy(registry.url) as storage:
        proxy.require_bearer("https://unused.example/token", {"configured-token-123"})
        proxy.add(
            Rule(
                "redirect",
                method="GET",
                path="/blobs/",
                location=f"http://localhost:{storage.port}",
                times=None,
            )
        )
        registries = [RegistryConfig(host=proxy.host, token=SecretStr("configured-token-123"))]
        ref = parse_reference(f"{proxy.host}/realm/redirected:v1")
        async with RegistryClient(settings(registries=registries)) as client:
            manifest = await client.manifest(ref, digest)
            with pytest.raises(RedirectRefused, match=f"localhost:{storage.port}.*GPUBADGE_REDIRECT_HOSTS"):
                await client.blob(ref, manifest.config.digest, 1 << 20)  # a storage host nobody listed
            assert storage.count() == 0
        config = settings(registries=registries, redirect_hosts=[f"localhost:{storage.port}"])
        async with RegistryClient(config) as client:
            assert await client.blob(ref, manifest.config.digest, 1 << 20)
    assert storage.count("GET") == 1
    assert all("Authorization" not in seen.headers for seen in storage.seen)
    assert all(seen.headers.get("Authorization") == "Bearer configured-token-123" for seen in proxy.seen)
