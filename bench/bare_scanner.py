"""The push-burst bench's second peer: the least a durable scanning service can do, in Python.

`bench.null_receiver` is the floor for a webhook answered and dropped. This is the floor for a
webhook turned into a scan, with none of gpubadge in it: what any Python service that badges a
push must spend, so that gpubadge's CPU per image can be set against both. Per delivery it
parses the envelope, commits one row per pushed manifest to a SQLite file (WAL, synchronous
NORMAL, gpubadge's default) on a thread, and only then answers 202. Per job, one of eight
coroutines GETs the manifest, the config and each layer it has not read before (a process-local
set of digests stands in for a shared layer cache), walks each new layer's tar headers in
process, reads the config's environment, and commits the job's end with its result. Nothing
else: no leases, no retries, no reports, no notices, no bounds on input, no API.
`GET /healthz` answers `{"queue": {...}}` counts from memory, as the bench polls gpubadge's.

With `--apart`, the scans run in a child process of their own (jobs sent down a pipe once
committed, states sent back), so the intake's interpreter does nothing else: the floor for an
intake that never waits behind scans, as point 1 of issue 44 asks of gpubadge's. With
`--commit-on-loop` as well, the intake commits on its event loop instead of on a thread: the
experiment that shows where an intake's answer waits (the thread's wake-up and the loop's), and
what gpubadge does not do (no SQL runs on its event loops). With `--apart --intake-thread`, a
thread of its own takes the deliveries on a blocking listener and commits each before it answers
(and answers /healthz); the event loop only passes the jobs to the child.

python3 -m bench.bare_scanner --port PORT --db FILE [--apart [--commit-on-loop | --intake-thread]]
"""

from __future__ import annotations

import argparse
import asyncio
import http.server
import io
import json
import signal
import sqlite3
import sys
import tarfile
import threading
import zlib
from collections.abc import Callable
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
    """One process's half: the intake (`receive`), the scans (`scanner`), or both."""

    def __init__(self, db: str, *, commit_on_loop: bool = False) -> None:
        self.commit_on_loop = commit_on_loop
        self.sql = ThreadPoolExecutor(1)  # one connection, used by one thread
        self.db = db
        self.connection: sqlite3.Connection | None = None
        self.jobs: asyncio.Queue[tuple[int, str]] = asyncio.Queue()
        self.counts = {"queued": 0, "running": 0, "done": 0, "failed": 0}
        self.seen_layers: dict[str, bool] = {}  # layer digest -> it holds a glibc loader
        self.session: aiohttp.ClientSession | None = None
        self.dispatch: Callable[[int, str], None] = lambda job, url: self.jobs.put_nowait((job, url))
        self.on_state: Callable[[int, str], None] = self.count

    def count(self, job: int, state: str) -> None:
        self.counts["queued" if state == "running" else "running"] -= 1
        self.counts[state] += 1

    def _connect(self) -> None:
        self.connection = sqlite3.connect(self.db, isolation_level=None, timeout=30, check_same_thread=False)
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
        urls = manifest_urls(await request.read())
        if urls is None:
            return web.Response(status=400)
        if urls:
            jobs = self._insert(urls) if self.commit_on_loop else await self._sql(self._insert, urls)
            for job, url in zip(jobs, urls, strict=True):
                self.received(job, url)
        return web.Response(status=202)

    def received(self, job: int, url: str) -> None:
        self.counts["queued"] += 1
        self.dispatch(job, url)

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
            self.on_state(job, "running")
            try:
                result, state = await self._scan(url), "done"
            except Exception as exc:  # a bench peer: the error is the result
                result, state = {"error": str(exc)}, "failed"
            await self._sql(self._finish, job, state, json.dumps(result))
            self.on_state(job, state)


def _has_glibc(blob: bytes) -> bool:
    data = zlib.decompress(blob, wbits=47)  # gzip or zlib
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as archive:
        return any("ld-linux" in member.name for member in archive)


def manifest_urls(body: bytes) -> list[str] | None:
    """The pushed manifests' URLs of one notification envelope; None when it is not one."""
    try:
        events = json.loads(body)["events"]
        return [
            event["target"]["url"]
            for event in events
            if event.get("action") == "push" and event.get("target", {}).get("mediaType") in MANIFEST_TYPES
        ]
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def intake_thread(scanner: BareScanner, port: int) -> http.server.HTTPServer:
    """A listener served by one thread of its own: read a delivery, commit its jobs, answer, then hand
    the jobs to the event loop (`scanner.dispatch`, through `call_soon_threadsafe`)."""
    loop = asyncio.get_running_loop()

    class Intake(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _answer(self, status: int, body: bytes = b"") -> None:
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:
            urls = manifest_urls(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
            if urls is None:
                self._answer(400)
                return
            jobs = scanner._insert(urls) if urls else []
            self._answer(202)
            for job, url in zip(jobs, urls, strict=True):
                loop.call_soon_threadsafe(scanner.received, job, url)

        def do_GET(self) -> None:
            self._answer(200, json.dumps({"queue": dict(scanner.counts)}).encode())

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", port), Intake)
    threading.Thread(target=server.serve_forever, name="intake", daemon=True).start()
    return server


async def _until_stopped() -> None:
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(signum, stop.set)
    await stop.wait()


async def serve(port: int, db: str, apart: bool, commit_on_loop: bool, own_thread: bool) -> None:
    """The intake on `port`; the scans in this process, or (`apart`) in a child process of their own.
    `commit_on_loop`: the intake's commit runs on the event loop (the experiment), else on a thread;
    `own_thread`: the intake is `intake_thread`'s listener, not the event loop's."""
    scanner = BareScanner(db, commit_on_loop=commit_on_loop)
    await scanner._sql(scanner._connect)
    tasks: list[asyncio.Task[None]] = []
    child: asyncio.subprocess.Process | None = None
    if apart:
        child = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "bench.bare_scanner",
            "--scans",
            "--db",
            db,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        assert child.stdin is not None and child.stdout is not None
        to_child, from_child = child.stdin, child.stdout
        scanner.dispatch = lambda job, url: to_child.write(f"{job} {url}\n".encode())

        async def hear() -> None:
            async for line in from_child:
                job, state = line.decode().split()
                scanner.count(int(job), state)

        tasks.append(asyncio.create_task(hear()))
    else:
        scanner.session = aiohttp.ClientSession()
        tasks.extend(asyncio.create_task(scanner.scanner()) for _ in range(SCANNERS))
    runner: web.AppRunner | None = None
    listener: http.server.HTTPServer | None = None
    if own_thread:
        listener = intake_thread(scanner, port)
    else:
        app = web.Application()
        app.router.add_post("/hooks/distribution", scanner.receive)
        app.router.add_get("/healthz", scanner.healthz)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
    print("ready", flush=True)
    await _until_stopped()
    for task in tasks:
        task.cancel()
    if runner is not None:
        await runner.cleanup()
    if listener is not None:
        listener.shutdown()
    if scanner.session is not None:
        await scanner.session.close()
    if child is not None:
        child.kill()
        await child.wait()


async def scan_apart(db: str) -> None:
    """The child of `serve(apart=True)`: jobs as `<id> <url>` lines on stdin, states back on stdout."""
    scanner = BareScanner(db)
    await scanner._sql(scanner._connect)
    scanner.session = aiohttp.ClientSession()
    loop = asyncio.get_running_loop()
    incoming = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(incoming), sys.stdin)

    def tell(job: int, state: str) -> None:
        sys.stdout.write(f"{job} {state}\n")
        sys.stdout.flush()

    scanner.on_state = tell
    tasks = [asyncio.create_task(scanner.scanner()) for _ in range(SCANNERS)]
    async for line in incoming:
        job, url = line.decode().split()
        scanner.jobs.put_nowait((int(job), url))
    for task in tasks:
        task.cancel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int)
    parser.add_argument("--db", required=True)
    parser.add_argument("--apart", action="store_true", help="scans in a child process of their own")
    parser.add_argument("--commit-on-loop", action="store_true", help="the intake's commit on its event loop")
    parser.add_argument("--intake-thread", action="store_true", help="the intake on a thread's own listener")
    parser.add_argument("--scans", action="store_true", help="be that child (jobs on stdin)")
    arguments = parser.parse_args()
    if arguments.scans:
        asyncio.run(scan_apart(arguments.db))
    elif arguments.port is None:
        parser.error("--port is required")
    elif (arguments.commit_on_loop or arguments.intake_thread) and not arguments.apart:
        parser.error(
            "--commit-on-loop and --intake-thread need --apart (the scans' writes use the connection too)"
        )
    else:
        asyncio.run(
            serve(
                arguments.port,
                arguments.db,
                arguments.apart,
                arguments.commit_on_loop,
                arguments.intake_thread,
            )
        )


if __name__ == "__main__":
    main()
