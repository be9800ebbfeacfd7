"""The push-burst bench's second peer: the least a durable scanning service can do, in Python.

`bench.null_receiver` is the floor for a webhook answered and dropped. This is the floor for a
webhook turned into a scan, with none of gpubadge in it: what any Python service that badges a
push must spend, so that gpubadge's CPU per image can be set against both. Per delivery it
parses the envelope, commits one row per pushed manifest to a SQLite file (WAL, synchronous
NORMAL, gpubadge's default) on a thread, and only then answers 202. Per job, one of eight
coroutines GETs the manifest, the config and each layer it has not read before (a process-local
set of digests stands in for a shared layer cache), walks each new layer's tar headers in
process, reads the config's environment, and commits the job's end with its result. Nothing
else: no leases, no retries, no reports, no notices, no second process, no bounds on input.
`GET /healthz` answers `{"queue": {...}}` counts from memory, as the bench polls gpubadge's.

python3 -m bench.bare_scanner --port PORT --db FILE
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import signal
import sqlite3
import tarfile
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import aiohttp
from aiohttp import web

MANIFEST_TYPES = (
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
)
SCANNERS = 8


class BareScanner:
    def __init__(self, db: str) -> None:
        self.sql = ThreadPoolExecutor(1)  # one connection, used by one thread
        self.db = db
        self.connection: sqlite3.Connection | None = None
        self.jobs: asyncio.Queue[tuple[int, str]] = asyncio.Queue()
        self.counts = {"queued": 0, "running": 0, "done": 0, "failed": 0}
        self.seen_layers: dict[str, bool] = {}  # layer digest -> it holds a glibc loader
        self.session: aiohttp.ClientSession | None = None

    def _connect(self) -> None:
        self.connection = sqlite3.connect(self.db, isolation_level=None)
        self.connection.execute("PRAGMA journal_mode=WAL")
        self.connection.execute("PRAGMA synchronous=NORMAL")
        self.connection.execute(
            "CREATE TABLE IF NOT EXISTS jobs (id INTEGER PRIMARY KEY, url TEXT, state TEXT, result TEXT)"
        )

    def _insert(self, urls: list[str]) -> list[int]:
        assert self.connection is not None
        with self.connection:  # one transaction, committed before the answer
            self.connection.execute("BEGIN")
            return [
                int(
                    self.connection.execute(
                        "INSERT INTO jobs (url, state) VALUES (?, 'queued')", (url,)
                    ).lastrowid
                    or 0
                )
                for url in urls
            ]

    def _finish(self, job: int, state: str, result: str) -> None:
        assert self.connection is not None
        with self.connection:
            self.connection.execute("BEGIN")
            self.connection.execute(
                "UPDATE jobs SET state = ?, result = ? WHERE id = ?", (state, result, job)
            )

    async def _sql(self, function: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.sql, function, *args)

    async def receive(self, request: web.Request) -> web.Response:
        try:
            events = json.loads(await request.read())["events"]
        except (ValueError, KeyError, TypeError):
            return web.Response(status=400)
        urls = [
            event["target"]["url"]
            for event in events
            if event.get("action") == "push" and event.get("target", {}).get("mediaType") in MANIFEST_TYPES
        ]
        if urls:
            for job, url in zip(await self._sql(self._insert, urls), urls, strict=True):
                self.counts["queued"] += 1
                self.jobs.put_nowait((job, url))
        return web.Response(status=202)

    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"queue": self.counts})

    async def _get(self, url: str, accept: str | None = None) -> bytes:
        assert self.session is not None
        headers = {"Accept": accept} if accept else {}
        async with self.session.get(url, headers=headers) as response:
            response.raise_for_status()
            return await response.read()

    async def _scan(self, url: str) -> dict[str, Any]:
        manifest = json.loads(await self._get(url, ", ".join(MANIFEST_TYPES)))
        blobs = url.rsplit("/manifests/", 1)[0] + "/blobs/"
        if "manifests" in manifest:  # an index: its first platform image
            url = url.rsplit("/", 1)[0] + "/" + manifest["manifests"][0]["digest"]
            manifest = json.loads(await self._get(url, ", ".join(MANIFEST_TYPES)))
        config = json.loads(await self._get(blobs + manifest["config"]["digest"]))
        env = [
            line
            for line in config.get("config", {}).get("Env") or []
            if line.startswith(("NVIDIA_", "CUDA_"))
        ]
        glibc = False
        for layer in reversed(manifest["layers"]):
            digest = layer["digest"]
            if digest not in self.seen_layers:
                self.seen_layers[digest] = _has_glibc(await self._get(blobs + digest))
            glibc = glibc or self.seen_layers[digest]
        return {"gpu_env": env, "glibc": glibc}

    async def scanner(self) -> None:
        while True:
            job, url = await self.jobs.get()
            self.counts["queued"] -= 1
            self.counts["running"] += 1
            try:
                result, state = await self._scan(url), "done"
            except Exception as exc:  # a bench peer: the error is the result
                result, state = {"error": str(exc)}, "failed"
            await self._sql(self._finish, job, state, json.dumps(result))
            self.counts["running"] -= 1
            self.counts[state] += 1


def _has_glibc(blob: bytes) -> bool:
    data = zlib.decompress(blob, wbits=47)  # gzip or zlib
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as archive:
        return any("ld-linux" in member.name for member in archive)


async def serve(port: int, db: str) -> None:
    scanner = BareScanner(db)
    await scanner._sql(scanner._connect)
    scanner.session = aiohttp.ClientSession()
    tasks = [asyncio.create_task(scanner.scanner()) for _ in range(SCANNERS)]
    app = web.Application()
    app.router.add_post("/hooks/distribution", scanner.receive)
    app.router.add_get("/healthz", scanner.healthz)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    print("ready", flush=True)
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(signum, stop.set)
    await stop.wait()
    for task in tasks:
        task.cancel()
    await runner.cleanup()
    await scanner.session.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--db", required=True)
    arguments = parser.parse_args()
    asyncio.run(serve(arguments.port, arguments.db))


if __name__ == "__main__":
    main()
