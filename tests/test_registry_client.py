"""The registry client against the real registry: resolve, manifests, indexes, blobs, budgets, auth."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest
from aiohttp import web
from pydantic import SecretStr

from fixtures.oci import ImageSpec, LayerSpec, fake_elf, file
from fixtures.registry import LocalRegistry, htpasswd, run_registry
from scanner.registry.auth import Challenge, TokenCache, parse_challenges, parse_token_response
from scanner.registry.client import RegistryClient
from scanner.registry.descriptors import OCI_INDEX, OCI_MANIFEST
from scanner.registry.errors import NotFound, TooLarge, Unauthorized
from scanner.registry.reference import parse_reference
from scanner.settings import RegistryConfig, ScannerSettings
from tests.conftest import Pusher
from tests.faultproxy import FaultProxy, TokenServer


def settings(**overrides: object) -> ScannerSettings:
    values: dict[str, object] = {
        "docker_config": None,
        "backoff_base": 0.001,
        "backoff_max": 0.01,
        "request_timeout": 5.0,
        "retries": 3,
    }
    values.update(overrides)
    return ScannerSettings(**values)  # type: ignore[arg-type]


def incompressible(size: int) -> bytes:
    blocks = (hashlib.sha256(i.to_bytes(4, "big")).digest() for i in range(size // 32 + 1))
    return b"".join(blocks)[:size]


def image(env: dict[str, str], arch: str = "amd64", noise: int = 0) -> ImageSpec:
    entries = [file("bin/sh", fake_elf("/lib64/ld-linux-x86-64.so.2", arch))]
    if noise:
        entries.append(file("opt/noise", incompressible(noise)))
    layer = LayerSpec(entries)
    return ImageSpec([layer, LayerSpec([file("etc/os-release", "ID=test\n")])], env=env, architecture=arch)


@pytest.fixture(scope="module")
def pushed(push: Pusher) -> dict[str, str]:
    return {
        "single": push(image({"CUDA_VERSION": "12.4.1"}, noise=300_000), "client/single:v1"),
        "multi": push([image({}, "amd64"), image({}, "arm64")], "client/multi:v1"),
    }


async def test_resolve_by_tag_uses_head(registry: LocalRegistry, pushed: dict[str, str]) -> None:
    async with RegistryClient(settings()) as client:
        with client.track() as stats:
            descriptor = await client.resolve(parse_reference(f"{registry.host}/client/single:v1"))
    assert descriptor.digest == pushed["single"]
    assert descriptor.media_type == OCI_MANIFEST
    assert descriptor.size > 0
    assert stats.requests == 1
    assert stats.bytes_received == 0


async def test_manifest_by_tag_and_digest_is_verified(
    registry: LocalRegistry, pushed: dict[str, str]
) -> None:
    ref = parse_reference(f"{registry.host}/client/single:v1")
    async with RegistryClient(settings()) as client:
        by_tag = await client.manifest(ref)
        by_digest = await client.manifest(ref, pushed["single"])
    assert by_tag.digest == by_digest.digest == pushed["single"]
    assert not by_tag.is_index
    assert by_tag.config.media_type == "application/vnd.oci.image.config.v1+json"
    assert [layer.media_type for layer in by_tag.layers] == [
        "application/vnd.oci.image.layer.v1.tar+gzip"
    ] * 2
    assert by_tag.raw == by_digest.raw


async def test_index_lists_platforms_and_attestation(registry: LocalRegistry, pushed: dict[str, str]) -> None:
    ref = parse_reference(f"{registry.host}/client/multi:v1")
    async with RegistryClient(settings()) as client:
        resolved = await client.resolve(ref)
        index = await client.manifest(ref, resolved.digest)
        children = index.manifests
        child = await client.manifest(ref, children[1].digest)
    assert resolved.media_type == OCI_INDEX and index.is_index
    assert [str(d.platform) for d in children] == ["linux/amd64", "linux/arm64", "unknown/unknown"]
    assert children[2].annotations["vnd.docker.reference.type"] == "attestation-manifest"
    assert child.digest == children[1].digest and not child.is_index


async def test_single_image_by_tag_costs_three_requests(
    registry: LocalRegistry, pushed: dict[str, str]
) -> None:
    """HEAD + manifest GET + config GET, counted per scan even when scans run concurrently."""

    async def scan(client: RegistryClient, name: str) -> tuple[int, dict[str, object]]:
        ref = parse_reference(f"{registry.host}/{name}")
        with client.track() as stats:
            descriptor = await client.resolve(ref)
            manifest = await client.manifest(ref, descriptor.digest)
            if manifest.is_index:
                manifest = await client.manifest(ref, manifest.manifests[0].digest)
            config = json.loads(await client.blob(ref, manifest.config.digest, 1 << 20))
        return stats.requests, config

    async with RegistryClient(settings()) as client, asyncio.TaskGroup() as group:
        with client.track() as outer:
            single = group.create_task(scan(client, "client/single:v1"))
            multi = group.create_task(scan(client, "client/multi:v1"))
            again = group.create_task(scan(client, "client/single:v1"))
    assert single.result()[0] == 3
    assert again.result()[0] == 3
    assert multi.result()[0] == 4  # the index adds one GET
    assert single.result()[1]["config"] == {"Env": ["CUDA_VERSION=12.4.1"]}
    assert outer.requests == 10  # nested tracking sees the tasks started inside it
    assert client.totals.requests == 10


async def test_blob_stream_verifies_at_eof_and_closes_early(
    registry: LocalRegistry, pushed: dict[str, str]
) -> None:
    ref = parse_reference(f"{registry.host}/client/single:v1")
    async with RegistryClient(settings()) as client:
        layer = (await client.manifest(ref)).layers[0]
        async with client.stream_blob(ref, layer.digest, chunk_size=4096) as stream:
            data = b"".join([chunk async for chunk in stream])
        assert stream.verified and len(data) == layer.size == stream.bytes_read
        with client.track() as stats:
            async with client.stream_blob(ref, layer.digest, chunk_size=1024) as early:
                first = await early.__anext__()
        assert len(first) <= 1024 and not early.verified
        assert stats.requests == 1
        # Consumed: one chunk. Received: also what already sat in the buffers at the early close
        # (on loopback that can be the whole small blob): counted, never hidden.
        assert early.bytes_read == len(first) < layer.size
        assert len(first) <= stats.bytes_received == early.bytes_received <= layer.size


async def test_missing_things_raise_not_found(registry: LocalRegistry, pushed: dict[str, str]) -> None:
    async with RegistryClient(settings()) as client:
        with pytest.raises(NotFound, match="client/single/manifests/nope") as missing_tag:
            await client.resolve(parse_reference(f"{registry.host}/client/single:nope"))
        with pytest.raises(NotFound, match=r"MANIFEST_UNKNOWN|NAME_UNKNOWN"):
            await client.manifest(parse_reference(f"{registry.host}/client/absent:v1"))
        with pytest.raises(NotFound, match="BLOB_UNKNOWN"):
            await client.blob(parse_reference(f"{registry.host}/client/single:v1"), "sha256:" + "0" * 64, 100)
    assert not missing_tag.value.retryable
    assert client.totals.retries == 0


async def test_size_caps_refuse_by_content_length(registry: LocalRegistry, pushed: dict[str, str]) -> None:
    ref = parse_reference(f"{registry.host}/client/single:v1")
    async with RegistryClient(settings(max_manifest_bytes=100)) as client:
        with pytest.raises(TooLarge, match="over the 100-byte limit"):
            await client.manifest(ref)
    async with RegistryClient(settings()) as client:
        manifest = await client.manifest(ref)
        with pytest.raises(TooLarge):
            await client.blob(ref, manifest.config.digest, 10)


# --- Basic auth: a second real registry with htpasswd over the same storage -----------------------


@pytest.fixture(scope="module")
def basic_registry(registry: LocalRegistry, pushed: dict[str, str]) -> Iterator[LocalRegistry]:
    root = Path(tempfile.mkdtemp(prefix="gpubadge-basic-"))
    (root / "data").symlink_to(registry.root / "data")
    accounts = root / "htpasswd"
    accounts.write_text(htpasswd({"scanner": "hunter2-secret"}))
    auth = {"auth": {"htpasswd": {"realm": "gpubadge-test", "path": str(accounts)}}}
    try:
        with run_registry(extra_config=auth, root=root) as running:
            yield running
    finally:
        shutil.rmtree(root, ignore_errors=True)  # unlinks the data symlink; never follows it


async def test_basic_auth_with_configured_credentials(
    basic_registry: LocalRegistry, pushed: dict[str, str]
) -> None:
    ref = parse_reference(f"{basic_registry.host}/client/single:v1")
    good = RegistryConfig(host=basic_registry.host, username="scanner", password=SecretStr("hunter2-secret"))
    async with RegistryClient(settings(registries=[good])) as client:
        with client.track() as first:
            descriptor = await client.resolve(ref)
        with client.track() as second:
            manifest = await client.manifest(ref, descriptor.digest)
            await client.blob(ref, manifest.config.digest, 1 << 20)
    assert descriptor.digest == pushed["single"]
    assert first.requests == 2  # 401 with the Basic challenge, then the answer
    assert second.requests == 2  # Basic is now sent up front
    assert first.token_requests == 0


async def test_basic_auth_failures_are_clear_and_secret_free(
    basic_registry: LocalRegistry, pushed: dict[str, str]
) -> None:
    ref = parse_reference(f"{basic_registry.host}/client/single:v1")
    bad = RegistryConfig(host=basic_registry.host, username="scanner", password=SecretStr("wrong-pass-xyz"))
    async with RegistryClient(settings(registries=[bad])) as client:
        with pytest.raises(Unauthorized) as denied:
            await client.resolve(ref)
    assert "access denied (401) with credentials from settings" in str(denied.value)
    assert "wrong-pass-xyz" not in str(denied.value) + repr(denied.value) + repr(bad)
    async with RegistryClient(settings()) as client:
        with pytest.raises(Unauthorized, match="anonymously"):
            await client.resolve(ref)


# --- Bearer tokens: a real token server and the proxy as a token-checking registry -----------------


async def test_bearer_token_fetched_once_and_reused(registry: LocalRegistry, pushed: dict[str, str]) -> None:
    async with TokenServer() as tokens, FaultProxy(registry.url) as proxy:
        proxy.require_bearer(tokens.realm, tokens.issued)
        ref = parse_reference(f"{proxy.host}/client/single:v1")
        async with RegistryClient(settings()) as client:
            with client.track() as stats:
                descriptor = await client.resolve(ref)
                manifest = await client.manifest(ref, descriptor.digest)
                await client.blob(ref, manifest.config.digest, 1 << 20)
            with client.track() as other_repo:
                await client.resolve(parse_reference(f"{proxy.host}/client/multi:v1"))
    assert stats.requests == 4  # one 401 (cold host), then HEAD, GET manifest, GET config
    assert stats.token_requests == 1 and len(tokens.calls) == 2
    assert tokens.calls[0]["scope"] == "repository:client/single:pull"
    assert tokens.calls[0]["service"] == "test-registry"
    assert tokens.calls[0]["authorization"] == ""  # anonymous
    # The host's challenge is remembered: a new repository gets its token before its first request.
    assert other_repo.requests == 1 and other_repo.token_requests == 1
    assert proxy.count(status=401) == 1


async def test_identity_token_uses_oauth_refresh_post(
    registry: LocalRegistry, pushed: dict[str, str], tmp_path: Path
) -> None:
    async with TokenServer(refresh_tokens={"refresh-abc"}) as tokens, FaultProxy(registry.url) as proxy:
        proxy.require_bearer(tokens.realm, tokens.issued)
        config = tmp_path / "config.json"
        config.write_text(json.dumps({"auths": {proxy.host: {"identitytoken": "refresh-abc"}}}))
        async with RegistryClient(settings(docker_config=config)) as client:
            descriptor = await client.resolve(parse_reference(f"{proxy.host}/client/single:v1"))
    assert descriptor.digest == pushed["single"]
    assert [(c["method"], c["grant_type"]) for c in tokens.calls] == [("POST", "refresh_token")]


# --- pure auth pieces ------------------------------------------------------------------------------


def test_challenge_parsing_handles_quotes_commas_and_several_schemes() -> None:
    header = (
        'Bearer realm="https://auth.example.com/token",service="registry.example.com",'
        'scope="repository:a/b:pull,push", Basic realm="x \\"quoted\\""'
    )
    bearer, basic = parse_challenges([header])
    assert bearer.scheme == "bearer" and bearer.realm == "https://auth.example.com/token"
    assert bearer.service == "registry.example.com"
    assert bearer.params["scope"] == "repository:a/b:pull,push"
    assert basic.scheme == "basic" and basic.realm == 'x "quoted"'
    assert parse_challenges(['Basic realm="Registry Realm"']) == [
        Challenge("basic", {"realm": "Registry Realm"})
    ]


def test_token_responses_and_cache_expiry() -> None:
    assert parse_token_response(b'{"token": "t"}') == ("t", 60.0)  # expires_in defaults to 60 s
    assert parse_token_response(b'{"access_token": "a", "expires_in": 300}') == ("a", 300.0)
    with pytest.raises(ValueError, match="no token"):
        parse_token_response(b'{"expires_in": 5}')
    now = [1000.0]
    cache = TokenCache(clock=lambda: now[0])
    cache.put(("h", "s", "repository:a:pull"), "secret-token-value", 60)
    now[0] += 54
    assert cache.get(("h", "s", "repository:a:pull")) == "secret-token-value"
    assert "secret-token-value" not in repr(cache)
    now[0] += 2  # within the 5 s safety margin: treated as expired
    assert cache.get(("h", "s", "repository:a:pull")) is None


async def _blob_server(data: bytes, honour_ranges: bool) -> tuple[web.AppRunner, str, list[str]]:
    """A stand-in registry for one blob (loopback, anonymous): honours Range, or ignores it."""
    ranges: list[str] = []

    async def blob(request: web.Request) -> web.StreamResponse:
        asked = request.headers.get("Range", "")
        ranges.append(asked)
        if honour_ranges and asked.startswith("bytes="):
            first, _, last = asked.removeprefix("bytes=").partition("-")
            start, end = int(first), min(int(last) if last else len(data) - 1, len(data) - 1)
            return web.Response(
                status=206,
                body=data[start : end + 1],
                headers={"Content-Range": f"bytes {start}-{end}/{len(data)}"},
            )
        return web.Response(body=data)

    runner, port = await _serve_blobs(blob)
    return runner, f"127.0.0.1:{port}", ranges


async def _serve_blobs(
    blob: Callable[[web.Request], Awaitable[web.StreamResponse]],
) -> tuple[web.AppRunner, int]:
    """A stand-in registry answering `/v2/r/blobs/{digest}` with `blob`, on a free loopback port."""
    app = web.Application()
    app.router.add_get("/v2/r/blobs/{digest}", blob)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]


@pytest.mark.parametrize("honour_ranges", [True, False], ids=["ranges", "no-ranges"])
async def test_a_ranged_read_grows_its_ranges_and_counts_what_an_early_stop_was_sent(
    honour_ranges: bool,
) -> None:
    data = os.urandom(24 << 20)
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    runner, host, ranges = await _blob_server(data, honour_ranges)
    try:
        ref = parse_reference(f"{host}/r:1")
        async with RegistryClient(settings()) as client:
            async with client.stream_blob(ref, digest, size=len(data), ranged=True) as whole:
                assert b"".join([chunk async for chunk in whole]) == data
            assert whole.verified and whole.bytes_received == len(data)
            if honour_ranges:  # 1, 4, 16 MiB, then the last 3: each byte sent once
                assert ranges == [
                    "bytes=0-1048575",
                    "bytes=1048576-5242879",
                    "bytes=5242880-22020095",
                    "bytes=22020096-25165823",
                ]
            else:
                assert len(ranges) == 1
            ranges.clear()
            async with client.stream_blob(ref, digest, size=len(data), ranged=True) as early:
                await early.__anext__()
            assert not early.verified and early.bytes_read <= 65536
            if honour_ranges:  # the registry sent at most the first range: counted, all of it
                assert ranges == ["bytes=0-1048575"] and early.bytes_received == 1 << 20
            else:  # what reached this host before the close counts
                assert early.bytes_read <= early.bytes_received <= len(data)
    finally:
        await runner.cleanup()


async def test_cookies_a_registry_sets_are_never_sent_back() -> None:
    """As containerd's resolver and skopeo: the registry API authenticates by header, so a
    `Set-Cookie` (a load balancer's session, a hostile registry's tracker) is not kept."""
    data = b'{"architecture": "amd64", "os": "linux"}'
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    sent: list[str | None] = []

    async def blob(request: web.Request) -> web.Response:
        sent.append(request.headers.get("Cookie"))
        response = web.Response(body=data)
        response.set_cookie("session", "tracked", path="/")
        return response

    runner, port = await _serve_blobs(blob)
    try:
        # by name: aiohttp's default jar keeps no cookie of a bare IP address anyway
        ref = parse_reference(f"localhost:{port}/r:1")
        async with RegistryClient(settings()) as client:
            for _ in range(3):
                assert await client.blob(ref, digest, 1 << 20) == data
        assert sent == [None, None, None]
    finally:
        await runner.cleanup()


@pytest.mark.parametrize(
    ("media_type", "urls", "reason"),
    [
        # each rule alone: a mutation dropping any one of them fails its own case
        ("application/vnd.oci.image.layer.nondistributable.v1.tar+gzip", None, "non-distributable layer"),
        ("application/vnd.docker.image.rootfs.foreign.diff.tar.gzip", None, "foreign layer"),
        ("application/vnd.oci.image.layer.v1.tar+gzip", ["https://example.com/base.tgz"], "external URLs"),
        ("application/vnd.oci.image.layer.v1.tar+gzip", None, None),
        ("application/vnd.oci.image.layer.v1.tar+gzip", [], None),
    ],
)
def test_layers_never_fetched_each_rule_alone(
    media_type: str, urls: list[str] | None, reason: str | None
) -> None:
    from scanner.registry.descriptors import Descriptor, not_distributable

    data: dict[str, object] = {"mediaType": media_type, "digest": "sha256:" + "a" * 64, "size": 10}
    if urls is not None:
        data["urls"] = urls
    why = not_distributable(Descriptor.from_json(data, "layer 0"))
    if reason is None:
        assert why is None
    else:
        assert why is not None and reason in why, why
