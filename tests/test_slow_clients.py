"""Slow clients are closed, not served forever (web/connections.py), against a running service.

Each test opens raw TCP connections to the service's real listener (the `GuardedRunner` that
`serve` runs) and behaves as a slow or greedy client does: request heads sent a line at a time,
bodies a few bytes at a time, more connections than the cap. Timeouts are shortened through the
settings so the suite stays quick; the defaults' figures are in bench/.

Without the guard, aiohttp's only clock is the keep-alive timeout (3630 s for an `AppRunner`,
75 s under `web.run_app`), which trickled header lines never reach: every one of these
connections would stay open.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from fixtures.admission import pod_admission_review
from fixtures.service import RunningService, run_service_inprocess
from placement.inventory import Gpu, Server
from web.fleet.long_polls import idle_poll_end
from web.guards.connections import default_max_connections
from web.settings import ServiceSettings

HEAD_TIMEOUT = 2.0
MARGIN = 3.0  # a loaded CI runner's scheduling, on top of the timeout


def settings_for(tmp_path: Path, **overrides: Any) -> ServiceSettings:
    values: dict[str, Any] = {
        "db": tmp_path / "gpubadge.db",
        "workers": 0,
        "request_head_timeout": HEAD_TIMEOUT,
        "allow_agents_without_token": True,  # the agents here present no token
    }
    return ServiceSettings(**(values | overrides))


@pytest.fixture
async def service(tmp_path: Path) -> AsyncIterator[RunningService]:
    async with run_service_inprocess(settings_for(tmp_path, min_body_rate=1024)) as running:
        yield running


def _port(service: RunningService) -> int:
    return int(service.url.rsplit(":", 1)[1])


async def _trickle_head(port: int, interval: float, limit: float) -> tuple[float, bytes]:
    """Send a request line, then a header line every `interval` s; (seconds until the server
    closed the connection, what it sent before closing). `limit` bounds the wait."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    opened = time.monotonic()
    writer.write(b"POST /hooks/distribution HTTP/1.1\r\nHost: gpubadge\r\n")
    received = b""
    line = 0
    try:
        while time.monotonic() - opened < limit:
            try:
                chunk = await asyncio.wait_for(reader.read(4096), interval)
            except TimeoutError:
                line += 1
                writer.write(b"X-Trickle-%d: x\r\n" % line)
                try:
                    await writer.drain()
                except ConnectionError:
                    return time.monotonic() - opened, received
                continue
            if not chunk:
                return time.monotonic() - opened, received
            received += chunk
        return float("inf"), received
    except ConnectionError:
        return time.monotonic() - opened, received
    finally:
        writer.close()


async def test_connections_that_trickle_header_lines_are_closed_while_a_normal_request_answers(
    service: RunningService,
) -> None:
    port = _port(service)
    trickling = [
        asyncio.create_task(_trickle_head(port, 0.25, HEAD_TIMEOUT + MARGIN + 5)) for _ in range(200)
    ]
    await asyncio.sleep(HEAD_TIMEOUT / 2)  # every trickler connected and sending lines
    async with aiohttp.ClientSession() as session:
        started = time.monotonic()
        async with session.get(f"{service.url}/healthz") as reply:
            assert reply.status == 200
        assert time.monotonic() - started < 2.0
    outcomes = await asyncio.gather(*trickling)
    seconds = [took for took, _ in outcomes]
    assert max(seconds) <= HEAD_TIMEOUT + MARGIN, sorted(seconds)[-5:]
    assert min(seconds) >= HEAD_TIMEOUT - 0.1  # the named timeout, not an earlier cut
    assert all(sent.startswith(b"HTTP/1.1 408 ") for _, sent in outcomes)


async def test_a_keep_alive_connections_next_head_gets_the_same_clock(service: RunningService) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(service))
    try:
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: gpubadge\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 200 ")
        length = int(
            next(line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))[15:]
        )
        await asyncio.wait_for(reader.readexactly(length), 5)
        # idle on keep-alive for longer than the head timeout: idle is the keep-alive's business
        await asyncio.sleep(HEAD_TIMEOUT + 0.5)
        writer.write(b"GET /healthz HTTP/1.1\r\n")  # a next head that never completes
        started = time.monotonic()
        rest = await asyncio.wait_for(reader.read(), HEAD_TIMEOUT + MARGIN)
        assert rest.startswith(b"HTTP/1.1 408 ")
        assert HEAD_TIMEOUT - 0.1 <= time.monotonic() - started <= HEAD_TIMEOUT + MARGIN
    finally:
        writer.close()


async def test_a_body_slower_than_the_named_rate_is_closed(service: RunningService) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(service))
    try:
        writer.write(
            b"POST /hooks/distribution HTTP/1.1\r\nHost: gpubadge\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100000\r\n\r\n{"
        )
        opened = time.monotonic()
        received = b""
        while time.monotonic() - opened < 2 * HEAD_TIMEOUT + MARGIN:  # 40 bytes/s against 1024
            try:
                chunk = await asyncio.wait_for(reader.read(4096), 0.25)
            except TimeoutError:
                writer.write(b"          ")
                continue
            if not chunk:
                break
            received += chunk
        took = time.monotonic() - opened
        assert received.startswith(b"HTTP/1.1 408 "), received
        assert HEAD_TIMEOUT - 0.1 <= took <= HEAD_TIMEOUT + MARGIN
    finally:
        writer.close()


async def test_a_body_at_a_fair_rate_is_served(tmp_path: Path) -> None:
    # 2 KiB/s over 3 s against a floor of 1 KiB/s: slow, but within the rate, so it is answered
    settings = settings_for(tmp_path, min_body_rate=1024)
    async with run_service_inprocess(settings) as service:
        body = b'{"events": []}' + b" " * 6000
        reader, writer = await asyncio.open_connection("127.0.0.1", _port(service))
        try:
            writer.write(
                b"POST /hooks/distribution HTTP/1.1\r\nHost: gpubadge\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n" % len(body)
            )
            for start in range(0, len(body), 512):
                writer.write(body[start : start + 512])
                await writer.drain()
                await asyncio.sleep(0.25)
            head = await asyncio.wait_for(reader.readuntil(b"\r\n"), 5)
            assert not head.startswith(b"HTTP/1.1 408"), head
        finally:
            writer.close()


async def test_beyond_the_connection_cap_new_connections_get_a_quick_503(tmp_path: Path) -> None:
    cap = 50
    async with run_service_inprocess(settings_for(tmp_path, max_connections=cap)) as service:
        port = _port(service)
        held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(cap)]
        try:
            await asyncio.sleep(0.2)  # every one accepted
            started = time.monotonic()
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            answer = await asyncio.wait_for(reader.read(), 2)
            writer.close()
            assert answer.startswith(b"HTTP/1.1 503 ") and b"Retry-After: 1" in answer
            assert time.monotonic() - started < 1.0
        finally:
            for _, held_writer in held:
                held_writer.close()
        async with aiohttp.ClientSession() as session:  # the held ones gone, the service answers again

            async def healthy() -> int:
                while True:  # bounded by wait_for
                    async with session.get(f"{service.url}/healthz") as reply:
                        if reply.status == 200:
                            return reply.status
                    await asyncio.sleep(0.05)

            assert await asyncio.wait_for(healthy(), 5) == 200


def test_the_default_cap_is_sized_from_the_open_file_limit() -> None:
    assert default_max_connections(20_000) == 18_000  # a tenth kept back
    assert default_max_connections(1024) == 768  # at least 256 kept back
    assert default_max_connections(100) == 64
    assert ServiceSettings().max_connections is None and ServiceSettings().request_head_timeout == 10.0


async def test_long_polls_and_admission_answer_while_2000_slow_heads_are_held(tmp_path: Path) -> None:
    settings = settings_for(tmp_path, request_head_timeout=30.0)  # they stay held for the whole test
    async with run_service_inprocess(settings) as service, aiohttp.ClientSession() as session:
        port = _port(service)
        held: list[asyncio.StreamWriter] = []
        try:
            for _ in range(2000):
                _, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(b"POST /hooks/distribution HTTP/1.1\r\nX-Slow: 1\r\n")
                held.append(writer)
            server = Server(
                name="gpu-1",
                cpus=2,
                memory="8Gi",
                driver_version="550.54.15",
                cuda_driver_version="12.4",
                runtime_modes=["runtime"],
                gpus=[
                    Gpu(index=0, uuid="GPU-1", name="NVIDIA H100", memory_mib=81559, compute_capability="9.0")
                ],
                source="agent",
            )
            async with session.post(
                f"{service.url}/api/servers", json=server.model_dump(mode="json")
            ) as reply:
                assert reply.status in (200, 201), await reply.text()
            opened = time.time()
            async with session.get(f"{service.url}/api/agents/gpu-1/deployments?wait=1") as reply:
                assert reply.status == 200, await reply.text()
                assert (await reply.json())["deployments"] == []
            waited = time.time() - opened  # the poll held to its server's point of the cycle, and no longer
            assert idle_poll_end("gpu-1", 1.0, opened) - opened - 0.05 <= waited < 3.0
            review = pod_admission_review(["registry.example/app:1"])
            started = time.monotonic()
            async with session.post(f"{service.url}/k8s/admit", json=review) as reply:
                assert reply.status == 200, await reply.text()
                assert (await reply.json())["response"]["uid"] == review["request"]["uid"]
            assert time.monotonic() - started < 2.0
        finally:
            for writer in held:
                writer.close()
