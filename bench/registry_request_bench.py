"""CPU per registry GET: gpubadge's registry client next to aiohttp alone and bare asyncio streams.

A scan of a pushed image makes three GETs (its manifest, its config, each layer not cached), so
what one GET costs the scanning process is a floor under every scan's CPU (issue 44, point 3).
Three ways to GET the same manifest and config from a local `docker-registry`, on one keep-alive
connection, uvloop's loop, one request at a time, alternating in rounds so the host's drift falls
on each alike:

- `RegistryClient.manifest` and `.blob`: what a scan calls (the mirror and retry policies, the
  redirect guard, the host's slot, the rate-limit headers, the capped read, the digest check);
- aiohttp's `ClientSession.get` and `read`, with nothing around it (the client's HTTP layer alone);
- bare asyncio streams: the request's bytes written, the head read to its end, the body by its
  Content-Length. Not a client (no chunked bodies, TLS, redirects, timeouts or bounds): the floor
  of any HTTP/1.1 exchange from Python on this loop.

CPU is this process's (`time.process_time`: every thread, user and system), per request; the
registry's is its own and not counted.

Run alone: python3 -m bench.registry_request_bench [--quick]
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from bench.common import Figure, Results, run_section
from bench.registry_burst import put_manifests, stage_images
from fixtures.registry import run_registry
from jobs.event_loop import new_event_loop
from scanner.registry.client import RegistryClient
from scanner.registry.descriptors import MANIFEST_ACCEPT
from scanner.registry.reference import parse_reference
from scanner.settings import ScannerSettings

REPOSITORY = "bench/requests"


@dataclass
class RequestFigures:
    rounds: int = 10
    per_round: int = 500  # requests per way per round (half manifests, half configs)

    @classmethod
    def quick(cls) -> RequestFigures:
        return cls(rounds=3, per_round=200)


@dataclass
class Target:
    host: str
    manifest_digest: str
    config_digest: str


Way = Callable[[], Awaitable[None]]


async def _ways(target: Target) -> tuple[dict[str, Way], Callable[[], Awaitable[None]]]:
    """Each way's one request pair (the manifest, then the config), and what closes them all."""
    ref = parse_reference(f"{target.host}/{REPOSITORY}@{target.manifest_digest}")
    client = RegistryClient(ScannerSettings())

    async def ours() -> None:
        await client.manifest(ref)
        await client.blob(ref, target.config_digest, 1 << 20)

    session = aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar())
    base = f"http://{target.host}/v2/{REPOSITORY}"

    async def aiohttp_alone() -> None:
        async with session.get(
            f"{base}/manifests/{target.manifest_digest}", headers={"Accept": MANIFEST_ACCEPT}
        ) as r:
            await r.read()
        async with session.get(f"{base}/blobs/{target.config_digest}") as r:
            await r.read()

    host, port = target.host.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    requests = [
        (
            f"GET /v2/{REPOSITORY}/manifests/{target.manifest_digest} HTTP/1.1\r\nHost: {target.host}\r\n"
            f"Accept: {MANIFEST_ACCEPT}\r\n\r\n"
        ).encode(),
        f"GET /v2/{REPOSITORY}/blobs/{target.config_digest} HTTP/1.1\r\nHost: {target.host}\r\n\r\n".encode(),
    ]

    async def bare_streams() -> None:
        for request in requests:
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            if not head.startswith(b"HTTP/1.1 200"):
                raise RuntimeError(f"registry answered {head[:40]!r}")
            length = next(
                int(line.split(b":", 1)[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            )
            await reader.readexactly(length)

    async def close() -> None:
        await client.close()
        await session.close()
        writer.close()

    return {
        "gpubadge's RegistryClient": ours,
        "aiohttp alone": aiohttp_alone,
        "bare asyncio streams": bare_streams,
    }, close


async def _measure(target: Target, figures: RequestFigures) -> dict[str, list[float]]:
    """Microseconds of CPU per request, per way, one figure per round."""
    ways, close = await _ways(target)
    per_request: dict[str, list[float]] = {name: [] for name in ways}
    try:
        for way in ways.values():  # connections open, code paths warm
            for _ in range(50):
                await way()
        pairs = figures.per_round // 2
        for _ in range(figures.rounds):
            for name, way in ways.items():
                started = time.process_time()
                for _ in range(pairs):
                    await way()
                per_request[name].append((time.process_time() - started) / (2 * pairs) * 1e6)
    finally:
        await close()
    return per_request


def _staged(workdir: Path, registry_url: str) -> Target:
    (image,) = stage_images(workdir / "layout", registry_url, REPOSITORY, 1)
    put_manifests(registry_url, REPOSITORY, [image], 1)
    return Target(
        registry_url.split("//", 1)[-1],
        "sha256:" + hashlib.sha256(image.manifest).hexdigest(),
        json.loads(image.manifest)["config"]["digest"],
    )


def run_all(results: Results, quick: bool, figures: RequestFigures | None = None) -> None:
    figures = figures or (RequestFigures.quick() if quick else RequestFigures())
    with tempfile.TemporaryDirectory(prefix="gpubadge-requests-") as workdir, run_registry() as registry:
        target = _staged(Path(workdir), registry.url)
        loop = new_event_loop()
        try:
            per_request = loop.run_until_complete(_measure(target, figures))
        finally:
            loop.close()
    medians = {name: sorted(values)[len(values) // 2] for name, values in per_request.items()}
    ours = medians["gpubadge's RegistryClient"]
    for name, values in per_request.items():
        results.detail(f"registry GET, {name}: " + ", ".join(f"{value:.0f}" for value in values) + " µs CPU")
    for peer in ("aiohttp alone", "bare asyncio streams"):
        results.add(
            Figure(
                "registry",
                f"CPU per registry GET (manifest, config), median of {figures.rounds} rounds",
                f"{ours:.0f} µs",
                peer=f"{medians[peer]:.0f} µs, {peer}",
                ratio=medians[peer] / ours,
                note="three GETs a scan of a pushed image; the registry's own CPU not counted",
            )
        )


if __name__ == "__main__":
    run_section(run_all, __doc__)
