"""Starvation run: how long a normal registry's scan takes while a slow registry holds its cap.

    python3 -m bench.starvation_bench [--quick]

Setup (unmeasured): a real registry (Debian's docker-registry) with sixteen images for the
slow registry and a few for the normal one, pushed with skopeo. The slow registry is a small
stand-in proxy in front of the same registry on another port (another registry name): it
either drips every manifest one byte a second (a throttled proxy) or answers every manifest
429 with `Retry-After: 60` (a rate limit). `gpubadge serve` runs in-process with its workers.

Measured, for each slow registry and each configuration: sixteen scans of the slow registry
are requested; once it holds the workers it may have, scans of the normal registry are
requested together, each timed from its request until it is `done` (or the deadline
passes). Ours is the service with its defaults (no per-registry cap: the slow registry takes
every idle worker, and the normal registry gets one back by pre-emption after
GPUBADGE_PREEMPT_AFTER); the peer is the same service with main's behaviour before issue 20
(per-registry scans = workers = 8, no transfer-rate floor, no pre-emption, a Retry-After slept on
up to 60 s in the worker), run in the same bench run; claims are then the fair ones, which
cannot help when one registry may take every worker and none of its scans ends.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from bench.common import Figure, Results, percentile, run_section
from fixtures import catalog
from fixtures.loopback_http import serve_on_free_port
from fixtures.oci import push_many
from fixtures.registry import LocalRegistry, run_registry
from fixtures.service import run_service_inprocess
from jobs import runtime as job_runtime
from scanner.registry.client import RegistryClient
from web.settings import ServiceSettings

SECTION = "starvation"
SLOW_SCANS = 16


class SlowRegistry:
    """A proxy to `upstream` whose manifest GETs drip one byte a second, or answer 429."""

    def __init__(self, upstream: str, mode: str) -> None:
        self.upstream, self.mode = upstream, mode
        self.port = 0
        self.closing = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> SlowRegistry:
        self._session = aiohttp.ClientSession(auto_decompress=False)
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner, self.port = await serve_on_free_port(app)
        return self

    async def close(self) -> None:
        self.closing.set()
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        manifest = "/manifests/" in request.path
        if manifest and self.mode == "429":
            return web.Response(status=429, headers={"Retry-After": "60"})
        assert self._session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in {"host", "connection"}}
        async with self._session.request(
            request.method, self.upstream + request.path_qs, headers=headers, allow_redirects=False
        ) as upstream:
            body = await upstream.read()
            out = {
                k: v
                for k, v in upstream.headers.items()
                if k.lower() not in {"content-length", "transfer-encoding", "connection", "content-encoding"}
            }
        if request.method == "HEAD" or not (manifest and self.mode == "drip"):
            response = web.Response(
                status=upstream.status, headers=out, body=None if request.method == "HEAD" else body
            )
            if request.method == "HEAD" and upstream.content_length is not None:
                response.headers["Content-Length"] = str(upstream.content_length)
            return response
        stream = web.StreamResponse(status=upstream.status, headers=out)
        stream.content_length = len(body)
        await stream.prepare(request)
        for index in range(len(body)):
            try:
                await stream.write(body[index : index + 1])
                await asyncio.wait_for(self.closing.wait(), 1.0)
                return stream
            except TimeoutError:
                continue
            except (ConnectionError, RuntimeError):
                return stream
        return stream


class SleepingClient(RegistryClient):
    """The registry client as main's workers had it: a Retry-After is slept on, not deferred."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["defer_retry_after"] = False
        super().__init__(*args, **kwargs)


@dataclass
class Outcome:
    seconds: list[float]  # per normal scan: request -> done (the deadline where it did not finish)
    unfinished: int


async def measure(
    registry: LocalRegistry, slow_repos: list[str], normal: list[str], mode: str, peer: bool, deadline: float
) -> Outcome:
    workdir = Path(tempfile.mkdtemp(prefix="gpubadge-bench-starve-"))
    slow = await SlowRegistry(f"http://{registry.host}", mode).start()
    overrides: dict[str, Any] = {}
    if peer:  # main's settings: one registry may take every worker; no rate floor
        overrides = {"per_registry_scans": 8, "min_transfer_rate": 0, "preempt_after": 0}
    settings = ServiceSettings(
        db=workdir / "gpubadge.db",
        registries=[registry.host, slow.host],  # type: ignore[list-item]
        workers=8,
        drain_seconds=0.5,
        analysis_processes=0,
        worker_processes=0,  # scans in this process, where the peer's client stands in for the runtime's
        **overrides,
    )
    seconds: list[float] = []
    unfinished = 0
    built = job_runtime.RegistryClient
    if peer:  # main's workers slept on a Retry-After (up to retry_after_max, 60 s) inside the worker
        job_runtime.RegistryClient = SleepingClient  # type: ignore[misc]
    try:
        async with run_service_inprocess(settings) as service, aiohttp.ClientSession() as session:
            for repo in slow_repos:
                async with session.post(
                    f"{service.url}/api/scans", json={"ref": f"{slow.host}/{repo}"}
                ) as reply:
                    assert reply.status == 202, await reply.text()
            await asyncio.sleep(2.0)  # as in the issue: the normal image is asked for 2 s later

            async def timed(ref: str) -> float | None:
                requested = time.monotonic()
                async with session.post(f"{service.url}/api/scans", json={"ref": ref}) as reply:
                    job = await reply.json()
                state = job["state"]
                while state != "done" and time.monotonic() - requested < deadline:
                    left = max(0.5, deadline - (time.monotonic() - requested))
                    async with session.get(f"{service.url}/api/scans/{job['id']}?wait={left:.1f}") as reply:
                        state = (await reply.json())["state"]
                return time.monotonic() - requested if state == "done" else None

            for took in await asyncio.gather(*(timed(ref) for ref in normal)):
                seconds.append(deadline if took is None else took)
                unfinished += took is None
    finally:
        job_runtime.RegistryClient = built  # type: ignore[misc]
        await slow.close()
        shutil.rmtree(workdir, ignore_errors=True)
    return Outcome(seconds, unfinished)


def _describe(outcome: Outcome, deadline: float) -> str:
    if outcome.unfinished == len(outcome.seconds):
        return f"none done in {deadline:.0f} s"
    text = f"p50 {percentile(outcome.seconds, 0.5):.2f} s, max {max(outcome.seconds):.2f} s"
    return text + (f" ({outcome.unfinished} not done in {deadline:.0f} s)" if outcome.unfinished else "")


def run_all(results: Results, quick: bool) -> None:
    deadline = 30.0 if quick else 60.0
    normal_count = 2 if quick else 3
    workdir = Path(tempfile.mkdtemp(prefix="gpubadge-bench-starvation-"))
    try:
        with run_registry() as registry:
            print(
                f"starvation: pushing {SLOW_SCANS} + {normal_count * 4} images (setup, unmeasured)",
                flush=True,
            )
            repos = {f"starve/app{n:02d}": catalog.plain_glibc() for n in range(SLOW_SCANS)}
            push_many(repos, registry.host, workdir / "slow")
            slow_repos = [f"{name}:latest" for name in sorted(repos)]
            normals: dict[tuple[str, bool], list[str]] = {
                (mode, peer): [f"normal/{mode}-{'peer' if peer else 'ours'}-{n}" for n in range(normal_count)]
                for mode in ("drip", "429")
                for peer in (False, True)
            }
            push_many(
                {name: catalog.alpine_gpu() for names in normals.values() for name in names},
                registry.host,
                workdir / "normal",
            )
            normals = {
                key: [f"{registry.host}/{name}:latest" for name in names] for key, names in normals.items()
            }
            for mode, label in (("drip", "1 byte/s manifests"), ("429", "429 Retry-After: 60")):
                print(f"starvation: {label}: ours, then main's settings", flush=True)
                ours = asyncio.run(
                    measure(registry, slow_repos, normals[(mode, False)], mode, False, deadline)
                )
                peer = asyncio.run(measure(registry, slow_repos, normals[(mode, True)], mode, True, deadline))
                ours_p50, peer_p50 = percentile(ours.seconds, 0.5), percentile(peer.seconds, 0.5)
                bound = peer.unfinished > 0  # the peer's time is the deadline: its ratio is a lower bound
                ratio = None if bound or ours_p50 <= 0 else peer_p50 / ours_p50
                results.add(
                    Figure(
                        SECTION,
                        f"normal registry's scan while a {label} registry has {SLOW_SCANS} scans",
                        _describe(ours, deadline),
                        peer=_describe(peer, deadline),
                        ratio=ratio,
                        target="done < 15 s",
                        met=ours.unfinished == 0 and max(ours.seconds) < 15.0,
                        note="peer = main's behaviour (per-registry 8 = workers, no rate floor, Retry-After"
                        " slept on)"
                        + (f"; ratio at least {peer_p50 / ours_p50:.0f}x" if bound and ours_p50 > 0 else ""),
                    )
                )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    run_section(run_all, __doc__)
