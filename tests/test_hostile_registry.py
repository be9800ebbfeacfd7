"""The client behind a fault-injecting proxy: retries, Retry-After, resets, tampering, timeouts,
redirects across hosts, schema 1, missing digests, mirrors, and secrets that never leak."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from pathlib import Path

import pytest
from pydantic import SecretStr

from fixtures.oci import ImageSpec, LayerSpec, file
from fixtures.registry import LocalRegistry
from scanner.registry.auth import Challenge
from scanner.registry.client import RegistryClient
from scanner.registry.credentials import CredentialStore
from scanner.registry.errors import (
    DigestMismatch,
    InsecureTransport,
    RateLimited,
    ServerError,
    TokenRealmRefused,
    TooLarge,
    TransportError,
    Unauthorized,
    UnsupportedManifest,
)
from scanner.registry.reference import is_loopback, parse_reference
from scanner.registry.retry import parse_rate_limit, parse_retry_after
from scanner.settings import RegistryConfig, ScannerSettings
from tests.conftest import Pusher
from tests.faultproxy import FaultProxy, Rule, TokenServer

REPO = "hostile/app"


def settings(**overrides: object) -> ScannerSettings:
    values: dict[str, object] = {
        "docker_config": None,
        "backoff_base": 0.001,
        "backoff_max": 0.01,
        "request_timeout": 5.0,
        "retries": 4,
    }
    values.update(overrides)
    return ScannerSettings(**values)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def digest(push: Pusher) -> str:
    noise = b"".join(hashlib.sha256(i.to_bytes(4, "big")).digest() for i in range(8000))  # incompressible
    spec = ImageSpec([LayerSpec([file("bin/tool", noise), file("etc/os-release", "ID=x\n")])], env={"A": "1"})
    return push(spec, f"{REPO}:v1")


@pytest.fixture
async def proxy(registry: LocalRegistry, digest: str) -> AsyncIterator[FaultProxy]:
    async with FaultProxy(registry.url) as running:
        yield running


async def test_5xx_is_retried_until_success(proxy: FaultProxy, digest: str) -> None:
    proxy.add(Rule("status", method="HEAD", status=503, times=2))
    proxy.add(Rule("status", method="GET", path="/manifests/", status=500, times=1))
    ref = parse_reference(f"{proxy.host}/{REPO}:v1")
    async with RegistryClient(settings()) as client:
        with client.track() as stats:
            descriptor = await client.resolve(ref)
            manifest = await client.manifest(ref, descriptor.digest)
    assert descriptor.digest == manifest.digest == digest
    assert proxy.count("HEAD") == 3 and proxy.count("GET") == 2
    assert stats.retries == 3 and stats.requests == 5


async def test_persistent_5xx_gives_up_after_bounded_attempts(proxy: FaultProxy) -> None:
    proxy.add(Rule("status", status=502, times=None))
    async with RegistryClient(settings(retries=3)) as client:
        with pytest.raises(ServerError, match="server error 502") as failed:
            await client.resolve(parse_reference(f"{proxy.host}/{REPO}:v1"))
    assert failed.value.retryable
    assert proxy.count() == 3


async def test_429_honours_retry_after_and_records_rate_limits(proxy: FaultProxy, digest: str) -> None:
    proxy.add(Rule("status", status=429, times=1, headers={"Retry-After": "0"}))
    proxy.add(
        Rule("add_headers", headers={"RateLimit-Remaining": "42;w=21600", "RateLimit-Limit": "100;w=21600"})
    )
    async with RegistryClient(settings()) as client:
        descriptor = await client.resolve(parse_reference(f"{proxy.host}/{REPO}:v1"))
    assert descriptor.digest == digest
    assert client.rate_limits == {proxy.host: 42}
    assert client.rate_limit_limits == {proxy.host: 100}


async def test_429_with_long_retry_after_fails_fast(proxy: FaultProxy) -> None:
    proxy.add(Rule("status", status=429, times=None, headers={"Retry-After": "3600"}))
    async with RegistryClient(settings(retry_after_max=5)) as client:
        with client.track() as stats, pytest.raises(RateLimited) as limited:
            await client.resolve(parse_reference(f"{proxy.host}/{REPO}:v1"))
    assert limited.value.retry_after == 3600 and limited.value.retryable
    assert proxy.count() == 1 and stats.retries == 0  # no hour-long wait, no second try


def test_retry_after_and_rate_limit_parsing() -> None:
    now = datetime(2026, 1, 1, tzinfo=UTC)
    assert parse_retry_after("7") == 7
    assert parse_retry_after(format_datetime(now + timedelta(seconds=30), usegmt=True), now.timestamp()) == 30
    assert parse_retry_after("soon") is None
    assert parse_rate_limit("100;w=21600") == 100 and parse_rate_limit("x") is None


async def test_connection_reset_midway_is_retried(proxy: FaultProxy, digest: str) -> None:
    ref = parse_reference(f"{proxy.host}/{REPO}:v1")
    async with RegistryClient(settings()) as client:
        manifest = await client.manifest(ref, digest)
        layer = manifest.layers[0]
        proxy.add(Rule("reset", path="/blobs/", times=1))
        with client.track() as stats:
            config = await client.blob(ref, manifest.config.digest, 1 << 20)
        assert json.loads(config)["config"]["Env"] == ["A=1"]
        assert stats.retries == 1
        proxy.add(Rule("reset", path="/blobs/", times=None))
        with pytest.raises(TransportError):
            await client.blob(ref, layer.digest, 1 << 20)


async def test_reset_while_streaming_is_a_transport_error(proxy: FaultProxy, digest: str) -> None:
    ref = parse_reference(f"{proxy.host}/{REPO}:v1")
    async with RegistryClient(settings()) as client:
        layer = (await client.manifest(ref, digest)).layers[0]
        proxy.add(Rule("reset", path="/blobs/", times=1))
        with pytest.raises(TransportError) as failed:
            async with client.stream_blob(ref, layer.digest, chunk_size=1024) as stream:
                async for _ in stream:
                    pass
    assert failed.value.retryable


async def test_tampered_bytes_are_digest_mismatches(proxy: FaultProxy, digest: str) -> None:
    ref = parse_reference(f"{proxy.host}/{REPO}:v1")
    async with RegistryClient(settings()) as client:
        manifest = await client.manifest(ref, digest)
        proxy.add(Rule("tamper", path="/manifests/", times=2))
        with pytest.raises(DigestMismatch, match="content digest is"):
            await client.manifest(ref, digest)
        with pytest.raises(DigestMismatch, match="registry claims digest"):
            await client.manifest(ref)  # by tag: checked against Docker-Content-Digest
        proxy.add(Rule("tamper", path="/blobs/", times=2))
        with pytest.raises(DigestMismatch):
            await client.blob(ref, manifest.config.digest, 1 << 20)
        layer = manifest.layers[0]
        chunks: list[bytes] = []
        with pytest.raises(DigestMismatch):
            async with client.stream_blob(ref, layer.digest) as stream:
                async for chunk in stream:
                    chunks.append(chunk)
        assert sum(map(len, chunks)) == layer.size  # every byte was delivered; EOF raised
    assert client.totals.retries == 0  # a lie is not retried


async def test_slow_registry_times_out_within_bound(proxy: FaultProxy) -> None:
    proxy.add(Rule("hang", times=None))
    async with RegistryClient(settings(request_timeout=0.3, retries=2)) as client:
        with client.track() as stats, pytest.raises(TransportError, match=r"timed out after 0\.3s"):
            await client.resolve(parse_reference(f"{proxy.host}/{REPO}:v1"))
    assert proxy.count() == 2 and (stats.requests, stats.retries) == (2, 1)  # each attempt timed out once


async def test_head_without_digest_falls_back_to_get(proxy: FaultProxy, digest: str) -> None:
    proxy.add(Rule("strip_headers", method="HEAD", remove=("Docker-Content-Digest",)))
    async with RegistryClient(settings()) as client:
        with client.track() as stats:
            descriptor = await client.resolve(parse_reference(f"{proxy.host}/{REPO}:v1"))
    assert descriptor.digest == digest
    assert stats.requests == 2 and proxy.count("GET") == 1


async def test_schema1_manifests_are_unsupported(proxy: FaultProxy) -> None:
    schema1 = json.dumps({"schemaVersion": 1, "name": REPO, "tag": "old", "fsLayers": []}).encode()
    signed = "application/vnd.docker.distribution.manifest.v1+prettyjws"
    proxy.add(Rule("status", method="HEAD", status=200, headers={"Content-Type": signed}))
    proxy.add(Rule("status", method="GET", status=200, body=schema1, headers={"Content-Type": "text/plain"}))
    ref = parse_reference(f"{proxy.host}/{REPO}:old")
    async with RegistryClient(settings()) as client:
        with pytest.raises(UnsupportedManifest, match="schema 1"):
            await client.resolve(ref)
        with pytest.raises(UnsupportedManifest, match="schema 1"):
            await client.manifest(ref)


async def test_authorization_is_not_forwarded_across_hosts(
    registry: LocalRegistry, proxy: FaultProxy, digest: str
) -> None:
    """Blob GETs redirect to a CDN; the token must stay with the registry."""
    async with TokenServer() as tokens, FaultProxy(registry.url, bind="127.0.0.1") as cdn:
        proxy.require_bearer(tokens.realm, tokens.issued)
        cdn_base = f"http://localhost:{cdn.port}"
        proxy.add(Rule("redirect", method="GET", path="/blobs/", location=cdn_base, times=None))
        ref = parse_reference(f"{proxy.host}/{REPO}:v1")
        async with RegistryClient(settings()) as client:
            manifest = await client.manifest(ref, digest)
            with client.track() as stats:
                config = await client.blob(ref, manifest.config.digest, 1 << 20)
            async with client.stream_blob(ref, manifest.layers[0].digest) as stream:
                layer = b"".join([chunk async for chunk in stream])
    assert json.loads(config)["config"]["Env"] == ["A=1"]
    assert len(layer) == manifest.layers[0].size and stream.verified
    assert stats.requests == 2  # the registry's 307, then the CDN
    assert cdn.count("GET") == 2
    assert all("Authorization" not in seen.headers for seen in cdn.seen)
    redirected = [s for s in proxy.seen if s.status == 307]
    assert redirected and all(s.headers["Authorization"].startswith("Bearer ") for s in redirected)


async def test_redirect_to_plain_http_elsewhere_is_refused(proxy: FaultProxy, digest: str) -> None:
    proxy.add(Rule("redirect", path="/blobs/", location="http://cdn.example.com", times=None))
    ref = parse_reference(f"{proxy.host}/{REPO}:v1")
    async with RegistryClient(settings()) as client:
        manifest = await client.manifest(ref, digest)
        with pytest.raises(InsecureTransport, match=r"refusing plain HTTP to cdn\.example\.com"):
            await client.blob(ref, manifest.config.digest, 1 << 20)


def test_plain_http_only_for_loopback_or_insecure() -> None:
    assert is_loopback("127.0.0.1:5000") and is_loopback("localhost") and is_loopback("[::1]:80")
    assert is_loopback("127.8.9.10") and not is_loopback("10.0.0.1:5000") and not is_loopback("ghcr.io")
    client = RegistryClient(settings(registries=[RegistryConfig(host="lab.internal:5000", insecure=True)]))
    assert client._scheme("lab.internal:5000") == "http"
    assert client._scheme("ghcr.io") == "https"
    assert client._scheme("127.0.0.1:5000") == "http"


async def test_secrets_never_leak(
    registry: LocalRegistry, proxy: FaultProxy, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    async with TokenServer(users={"robot": "right-password"}, allow_anonymous=False) as tokens:
        proxy.require_bearer(tokens.realm, tokens.issued)
        creds = RegistryConfig(host=proxy.host, username="robot", password=SecretStr("s3cr3t-PASSWORD"))
        config = settings(registries=[creds])
        async with RegistryClient(config) as client:
            with pytest.raises(Unauthorized) as denied:
                await client.resolve(parse_reference(f"{proxy.host}/{REPO}:v1"))
    message = str(denied.value)
    assert "refused (401)" in message and "credentials from settings" in message
    for text in (
        message,
        repr(denied.value),
        repr(config),
        str(config.model_dump()),
        caplog.text,
        repr(client),
    ):
        assert "s3cr3t-PASSWORD" not in text
    assert tokens.calls[0]["authorization"].startswith("Basic ")


async def test_concurrency_is_limited_per_registry(proxy: FaultProxy, digest: str) -> None:
    proxy.add(Rule("hang", method="HEAD", times=None))
    ref = parse_reference(f"{proxy.host}/{REPO}:v1")
    async with RegistryClient(settings(concurrency_per_registry=2)) as client:
        tasks = [asyncio.create_task(client.resolve(ref)) for _ in range(5)]
        await proxy.wait_for_in_flight(2)
        for _ in range(20):
            await asyncio.sleep(0)  # let any request the semaphore failed to hold reach the proxy
        assert proxy.in_flight == 2
        proxy.release.set()
        results = await asyncio.gather(*tasks)
    assert {d.digest for d in results} == {digest}
    assert proxy.max_in_flight == 2 and proxy.count("HEAD") == 5


async def test_mirror_first_then_fallback(registry: LocalRegistry, digest: str) -> None:
    async with FaultProxy(registry.url) as upstream, FaultProxy(registry.url) as mirror:
        mirror.add(Rule("status", status=404, times=None))
        config = settings(registries=[RegistryConfig(host=upstream.host, mirror=mirror.host)])
        async with RegistryClient(config) as client:
            descriptor = await client.resolve(parse_reference(f"{upstream.host}/{REPO}:v1"))
        assert descriptor.digest == digest
        assert mirror.count("HEAD") == 1 and upstream.count("HEAD") == 1
        healthy = settings(docker_mirror=mirror.host)
        mirror.rules.clear()
        async with RegistryClient(healthy) as client:
            hub_descriptor = await client.resolve(parse_reference(f"docker.io/{REPO}:v1"))
        assert hub_descriptor.digest == digest  # docker.io served entirely by the mirror
        assert mirror.seen[-1].path == f"/v2/{REPO}/manifests/v1"


async def test_mirror_password_never_reaches_a_warning_or_an_error(
    registry: LocalRegistry, digest: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 30 (10): a mirror given as user:password@host is asked by its host alone (its user info
    is a credential for it) and named without its password, in warnings and in errors."""
    caplog.set_level(logging.DEBUG)
    async with FaultProxy(registry.url) as upstream, FaultProxy(registry.url) as mirror:
        mirror.add(Rule("status", status=404, times=None))
        secret_mirror = f"robot:mirror-pw-9f1@{mirror.host}"
        config = settings(registries=[RegistryConfig(host=upstream.host, mirror=secret_mirror)])
        async with RegistryClient(config) as client:
            descriptor = await client.resolve(parse_reference(f"{upstream.host}/{REPO}:v1"))
        assert descriptor.digest == digest and mirror.count("HEAD") == 1
        assert f"mirror {mirror.host} failed" in caplog.text
        found = await CredentialStore(config).get(mirror.host)
        assert found is not None and found.username == "robot" and found.password is not None
        assert found.password.get_secret_value() == "mirror-pw-9f1"
        # an error that does not fall back (a digest the mirror lies about) stands, without the password
        mirror.rules.clear()
        mirror.add(Rule("tamper", method="GET", path="/manifests/", times=None))
        async with RegistryClient(config) as client:
            with pytest.raises(DigestMismatch) as lied:
                await client.manifest(parse_reference(f"{upstream.host}/{REPO}@{digest}"))
    assert "mirror-pw-9f1" not in caplog.text and "mirror-pw-9f1" not in str(lied.value)


async def test_token_over_plain_http_to_remote_realm_is_refused(proxy: FaultProxy) -> None:
    proxy.require_bearer("http://auth.example.com/token", set())
    ref = parse_reference(f"{proxy.host}/{REPO}:v1")
    async with RegistryClient(settings()) as client:
        with pytest.raises(TokenRealmRefused, match=r"auth\.example\.com.*GPUBADGE_REGISTRIES"):
            await client.resolve(ref)
    allowed_host = settings(registries=[RegistryConfig(host="auth.example.com")])
    async with RegistryClient(allowed_host) as client:
        with pytest.raises(TokenRealmRefused, match=r"plain HTTP from auth\.example\.com"):
            await client.resolve(ref)


async def test_size_caps_hold_without_content_length(proxy: FaultProxy, digest: str) -> None:
    proxy.add(Rule("chunked", times=None))
    ref = parse_reference(f"{proxy.host}/{REPO}:v1")
    async with RegistryClient(settings(max_manifest_bytes=200)) as client:
        with pytest.raises(TooLarge, match="exceeds the 200-byte limit"):
            await client.manifest(ref, digest)
    async with RegistryClient(settings()) as client:
        manifest = await client.manifest(ref, digest)
        layer = manifest.layers[0]
        with client.track() as stats, pytest.raises(TooLarge, match="exceeds the 100000-byte limit"):
            await client.blob(ref, layer.digest, 100_000)
        assert layer.size > 200_000
        assert stats.bytes_received < 100_000 + 65536 < layer.size  # stopped one chunk past the cap


async def test_static_registry_token_and_request_hook(
    registry: LocalRegistry, proxy: FaultProxy, digest: str
) -> None:
    proxy.require_bearer("http://127.0.0.1:9/unused", {"pre-issued-token"})
    observed: list[tuple[str, int | None, str | None]] = []
    config = settings(registries=[RegistryConfig(host=proxy.host, token=SecretStr("pre-issued-token"))])
    async with RegistryClient(config, on_request=lambda *event: observed.append(event)) as client:
        with client.track() as stats:
            descriptor = await client.resolve(parse_reference(f"{proxy.host}/{REPO}:v1"))
    assert descriptor.digest == digest
    assert (stats.requests, stats.token_requests) == (1, 0)
    assert observed == [(proxy.host, 200, None)]


async def test_cancelled_stream_open_gives_its_registry_slot_back(proxy: FaultProxy, digest: str) -> None:
    """A scan cancelled while a layer request is still unanswered must not keep the host's slot."""
    ref = parse_reference(f"{proxy.host}/{REPO}:v1")
    async with RegistryClient(settings(concurrency_per_registry=1)) as client:
        layer = (await client.manifest(ref, digest)).layers[0]
        proxy.add(Rule("hang", method="GET", path="/blobs/", times=1))

        async def read_layer() -> int:
            async with client.stream_blob(ref, layer.digest) as stream:
                return sum([len(chunk) async for chunk in stream])

        stuck = asyncio.create_task(read_layer())
        await proxy.wait_for_in_flight(1)
        stuck.cancel()
        with pytest.raises(asyncio.CancelledError):
            await stuck
        assert await asyncio.wait_for(read_layer(), timeout=5) == layer.size


async def test_unresolvable_host_fails_at_once_with_words() -> None:
    """An offline machine (or a typo) gets one attempt and a sentence, not retries and a class name."""
    observed: list[tuple[str, int | None, str | None]] = []
    ref = parse_reference("registry.invalid/some/app:v1")  # RFC 6761: .invalid never resolves
    async with RegistryClient(
        settings(retries=4), on_request=lambda *event: observed.append(event)
    ) as client:
        with client.track() as stats, pytest.raises(TransportError) as failed:
            await client.resolve(ref)
    assert str(failed.value) == "cannot reach registry.invalid:443: name resolution failed"
    assert not failed.value.retryable
    assert (stats.requests, stats.retries) == (1, 0)
    assert observed == [
        ("registry.invalid", None, "cannot reach registry.invalid:443: name resolution failed")
    ]


async def test_unresolvable_token_realm_is_not_retried() -> None:
    ref = parse_reference("registry.invalid/some/app:v1")
    async with RegistryClient(settings(retries=4)) as client:
        client._auth._challenges["registry.invalid"] = Challenge(
            "bearer", {"realm": "https://registry.invalid/token", "service": "x"}
        )
        with client.track() as stats, pytest.raises(TransportError, match="name resolution failed") as failed:
            await client.resolve(ref)
    assert "registry.invalid:443" in str(failed.value) and "Error" not in str(failed.value)
    assert (stats.token_requests, stats.requests, stats.retries) == (1, 0, 0)


async def test_refused_connection_names_host_and_port_and_is_retried() -> None:
    ref = parse_reference("127.0.0.1:1/some/app:v1")  # port 1: nothing listens there
    async with RegistryClient(settings(retries=3)) as client:
        with client.track() as stats, pytest.raises(TransportError) as failed:
            await client.resolve(ref)
    assert str(failed.value) == "cannot reach 127.0.0.1:1: connection refused"
    assert (stats.requests, stats.retries) == (3, 2)


def test_cli_scan_of_an_unresolvable_registry_fails_in_words(tmp_path: Path) -> None:
    """What a user without network sees: one line naming host, port and cause; exit status 1."""
    env = {
        **os.environ,
        "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
        "DOCKER_CONFIG": str(tmp_path),
    }
    result = subprocess.run(
        [sys.executable, "-m", "gpubadge.cli", "scan", "registry.invalid/some/app:v1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1, result.stderr
    assert "cannot reach registry.invalid:443: name resolution failed" in result.stderr
    assert "Error" not in result.stderr + result.stdout  # no exception class names
