"""Slow request heads: how long 2,000 header-trickling connections stay open, and what still answers.

    python3 -m bench.slow_clients_bench [--quick]

Each connection sends `POST /hooks/distribution HTTP/1.1` and then one header line every
INTERVAL seconds, never finishing its head (the client a slowloris attack is made of). Ours is
`gpubadge serve` with its defaults (a child process, as deployed); the peer is a bare aiohttp
`web.run_app` serving one route in a child process, i.e. aiohttp's own defaults, which close such
a connection only at the keep-alive timeout (75 s). Measured while the connections are held: an
agent's long poll (`wait=1`), the admission webhook (`POST /k8s/admit`) and `/healthz`, over HTTP;
then when each trickling connection was closed, seen from the client.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import aiohttp

from bench.common import Figure, Results, ms, percentile
from fixtures.admission import pod_admission_review
from fixtures.registry import free_port
from fixtures.service import run_service_process, wait_healthy

INTERVAL = 10.0  # seconds between header lines, as in issue 31
PEER_WAIT = 20.0  # how long the peer is watched (it would close them at 75 s)

_PEER_APP = textwrap.dedent(
    """
    import sys
    from aiohttp import web
    app = web.Application()
    app.router.add_get("/healthz", lambda request: web.Response(text="ok"))
    web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), access_log=None, print=None)
    """
)


async def trickle(port: int, opened: list[float], closed: list[float], limit: float) -> None:
    """One slow head; appends when the server closed it (seconds since the first connection)."""
    start = time.monotonic()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    opened.append(time.monotonic())
    writer.write(b"POST /hooks/distribution HTTP/1.1\r\nHost: gpubadge\r\n")
    line = 0
    try:
        while time.monotonic() - start < limit:
            try:
                if not await asyncio.wait_for(reader.read(4096), INTERVAL):
                    closed.append(time.monotonic())
                    return
            except TimeoutError:
                line += 1
                writer.write(b"X-Trickle-%d: x\r\n" % line)
                await writer.drain()
    except ConnectionError:
        closed.append(time.monotonic())
    finally:
        writer.close()


async def hold(
    url: str, count: int, limit: float, probe: bool
) -> tuple[list[float], int, dict[str, list[float]]]:
    """(seconds each closed connection lived, how many were still open at `limit`, probe latencies)."""
    port = int(url.rsplit(":", 1)[1])
    opened: list[float] = []
    closed: list[float] = []
    tasks = [asyncio.create_task(trickle(port, opened, closed, limit)) for _ in range(count)]
    latencies: dict[str, list[float]] = {"long poll (wait=1)": [], "admission": [], "healthz": []}
    async with aiohttp.ClientSession() as session:
        await asyncio.sleep(1.0)  # every connection open and trickling
        started = time.monotonic()
        while probe and time.monotonic() - started < 8.0:
            for name, method, path, body in (
                ("long poll (wait=1)", "GET", "/api/agents/bench-gpu/deployments?wait=1", None),
                ("admission", "POST", "/k8s/admit", pod_admission_review(["registry.example/app:1"])),
                ("healthz", "GET", "/healthz", None),
            ):
                began = time.monotonic()
                async with session.request(method, url + path, json=body) as reply:
                    await reply.read()
                    assert reply.status == 200, (path, reply.status)
                latencies[name].append(time.monotonic() - began)
    await asyncio.gather(*tasks)
    first = min(opened)
    return [moment - first for moment in closed], count - len(closed), latencies


async def register(url: str) -> None:
    server = {
        "name": "bench-gpu",
        "cpus": 2,
        "memory": "8Gi",
        "driver_version": "550.54.15",
        "cuda_driver_version": "12.4",
        "runtime_modes": ["runtime"],
        "gpus": [
            {
                "index": 0,
                "uuid": "GPU-b",
                "name": "NVIDIA H100",
                "memory_mib": 81559,
                "compute_capability": "9.0",
            }
        ],
        "source": "agent",
    }
    async with aiohttp.ClientSession() as session, session.post(f"{url}/api/servers", json=server) as reply:
        assert reply.status in (200, 201), await reply.text()


def run_all(results: Results, quick: bool) -> None:
    count = 500 if quick else 2000
    print(f"slow clients: {count} connections trickling a header line every {INTERVAL:g} s", flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="gpubadge-bench-slow-"))
    try:
        with run_service_process(
            workdir / "slow.db", env={"GPUBADGE_WORKERS": "0", "GPUBADGE_ALLOW_AGENTS_WITHOUT_TOKEN": "true"}
        ) as service:
            asyncio.run(register(service.url))
            lived, still_open, latencies = asyncio.run(hold(service.url, count, 30.0, probe=True))
        port = free_port()
        peer = subprocess.Popen([sys.executable, "-c", _PEER_APP, str(port)])
        try:
            wait_healthy(f"http://127.0.0.1:{port}", peer)
            peer_lived, peer_open, _ = asyncio.run(
                hold(f"http://127.0.0.1:{port}", count, PEER_WAIT, probe=False)
            )
        finally:
            peer.terminate()
            peer.wait(10)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    last = max(lived) if lived else float("inf")
    results.add(
        Figure(
            "slowclients",
            f"{count} connections trickling header lines: all closed by",
            f"{last:.1f} s ({still_open} open at 30 s)",
            peer=f"bare aiohttp run_app: {peer_open} of {count} still open at {PEER_WAIT:g} s"
            + (f", first closed at {min(peer_lived):.1f} s" if peer_lived else ""),
            target="closed within the head timeout (10 s) plus a margin",
            met=still_open == 0 and last <= 15.0,
        )
    )
    for name, seconds in latencies.items():
        results.add(
            Figure(
                "slowclients",
                f"{name} while {count} slow heads are held",
                f"p50 {ms(percentile(seconds, 0.5))}, max {ms(max(seconds))} ({len(seconds)} calls)",
                target="answers as usual",
                met=True,
            )
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer connections")
    run_all(Results(), parser.parse_args().quick)  # each figure is printed as it is added


if __name__ == "__main__":
    main()
