"""Where layer content is parsed: in analysis processes, off the scanning process's event loop.

Decompressing a layer, parsing its tar entries and analysing them are CPU work on untrusted
bytes. In the service they must not run on the event loop that answers /healthz and the API,
so they run in a small pool of analysis processes (`analysis_processes`, default 2). The
scanning process keeps the I/O: it streams each layer's compressed bytes from the registry
(async, with its connection pool, auth and retries) and ships them to an analysis process as
they arrive, like `curl | gzip -dc | tar -t` in a pipe. Nothing big crosses back: a reply as
soon as the layer's walk wants no more (the early stop), the layer's cache entry as JSON
(never parsed in the scanning process), and the image's verdicts.

A session is one platform image's `scanner.layers.image.ImageAnalysis`: the libc analysis
and, for a deep scan, the inferred-CUDA collector, fed by one walk of each layer. Why not
`concurrent.futures.ProcessPoolExecutor`: a layer is a stream, and the analysis is stateful
across the layers of an image (an upper layer's whiteouts decide what a lower one may show).
An executor runs one call per task with all its input up front, so either a whole layer would
be buffered in memory (multi-GB CUDA layers) or the merged view re-sent with every layer.
Here each analysis process is a long-lived child speaking a small framed protocol over its
stdin/stdout pipes (`asyncio` subprocess pipes: no threads, no blocking writes, backpressure
by `drain()`), and holds one `ImageAnalysis` per open session, so any number of scans
multiplex over a bounded number of processes.

Bounds: a session carries the scan's `AnalysisLimits` and deadline; the walk checks them as
it goes and the process answers `LimitExceeded` like any other error. Each process runs under an
address-space limit (`RLIMIT_AS`, `analysis_memory_bytes`): an allocation past it raises
`MemoryError` in the session that asked, which answers `LimitExceeded` naming that setting (the same
bytes fail the same way, so the scan is not retried), and the process serves its other sessions on.
A process that dies all the same (killed by a signal) fails its sessions with `AnalysisCrashed`
(retryable: the sessions sharing it did nothing wrong) and is replaced on the next session; one that
does not answer an abandoned request within `kill_grace` is killed. `analysis_processes = 0` runs the same `ImageAnalysis` in the
scanning process (`LocalSession`): for tests, and for one-shot CLI runs where no one else
waits.

Inline sessions. The hand-over costs about 1.5 ms of CPU per image, where the walk of the small
top layer most pushes add costs a tenth of that. So `scanner.layer_reader` opens a `LocalSession`
with an `InlineBudget` for an image whose cache entries and layers still to read are small
(`inline_analysis_bytes`, `inline_analysis_ms`): it runs on the scanning process's event loop, and
a session that reaches its budget raises `InlineBudgetSpent`, after which the image's analysis
starts over in an analysis process. Its cost on the loop is bounded by that budget, not by the
image's `AnalysisLimits`.

Frames: `<length:u32><kind:u8><session:u32>` then `length` payload bytes (JSON, raw layer
bytes for CHUNK, a byte count for ACK). The scanning process stays at most `WINDOW_BYTES` ahead
of what the analysis process has ACKed as parsed: an early stop then reads little more than the
verdict needed, even while a process is starting or busy. The process ACKs each time it has
parsed another half window (`ACK_EVERY`), not every chunk: the sender can still never be held
with its window full of parsed bytes, and a layer smaller than that costs no ACK at all.

The reply that feeds a session's last layer (or leaves it done) carries the image's verdict, so
`Session.verdict` costs no further round trip; a verdict that failed to compute there is asked
for again with VERDICT, whose reply carries the error.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import itertools
import json
import logging
import os
import resource
import struct
import sys
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Protocol

from scanner.layers.errors import AnalysisCrashed, CorruptLayer, LayerError
from scanner.layers.image import ImageAnalysis, ImageVerdict
from scanner.layers.limits import DEFAULT_ANALYSIS_MEMORY_BYTES, AnalysisLimits, InlineBudget, LimitExceeded
from scanner.layers.walk import LayerWalk

log = logging.getLogger(__name__)

HEADER = struct.Struct("<IBI")
OPEN, CACHED, LAYER, CHUNK, END, VERDICT, CLOSE, REPLY, ACK, SKIP = range(1, 11)
ACK_BODY = struct.Struct("<Q")
WINDOW_BYTES = 256 << 10  # layer bytes sent but not yet parsed: bounds what is read past an early stop
ACK_EVERY = WINDOW_BYTES // 2  # parsed bytes between two ACKs of one layer
PIPE_BYTES = 256 << 10
ANALYSIS_NICENESS = 10
MAX_CONTROL_FRAME = 64 << 20  # cache entries are bounded by max_layer_records; this is a sanity cap


@dataclass
class LayerOutcome:
    """What reading one layer gave: its new cache entry (JSON), whether it was read to its end,
    and the compressed bytes handed to the walk."""

    evidence_json: str | None
    complete: bool
    compressed_bytes: int


class Session(Protocol):
    """The layer analysis of one platform image, wherever it runs (see `ImageAnalysis`)."""

    @property
    def done(self) -> bool: ...

    async def use_cached(self, evidence_json: str) -> bool: ...

    async def read_layer(self, chunks: AsyncIterator[bytes], media_type: str) -> LayerOutcome: ...

    async def skip_layer(self) -> None: ...

    async def verdict(self, bytes_read: int, bytes_total: int) -> ImageVerdict: ...

    def close(self) -> None: ...


def _raise_reply_error(error: dict[str, Any]) -> None:
    kind, message = error.get("kind"), str(error.get("message"))
    if kind == "limit":
        exc = LimitExceeded.__new__(LimitExceeded)
        Exception.__init__(exc, message)
        exc.limit, exc.setting = error.get("limit", 0), str(error.get("setting"))
        raise exc
    if kind == "corrupt":
        raise CorruptLayer(message)
    raise AnalysisCrashed(message)


def out_of_memory(limit: int) -> LimitExceeded:
    """The error of a layer whose analysis needed more than the process's address space."""
    return LimitExceeded("the layer's analysis ran out of memory", limit, "analysis_memory_bytes")


_ADDRESS_SPACE = 0  # this analysis process's RLIMIT_AS (0: none), named in its out-of-memory errors


def _error_of(exc: BaseException) -> dict[str, Any]:
    if isinstance(exc, MemoryError):
        exc = out_of_memory(_ADDRESS_SPACE)
    if isinstance(exc, LimitExceeded):
        return {"kind": "limit", "message": str(exc), "limit": exc.limit, "setting": exc.setting}
    if isinstance(exc, LayerError):
        return {"kind": "corrupt", "message": str(exc)}
    return {"kind": "internal", "message": f"analysis failed: {type(exc).__name__}: {exc}"}


# -- in the scanning process


class LocalSession:
    """The analysis on this process's event loop: with `analysis_processes = 0`, or inline, for an
    image whose layers still to read are small (`ImageAnalysis` built with an `InlineBudget`: each
    step below runs in `ScanBudget.running_inline`, and `InlineBudgetSpent` ends the session)."""

    def __init__(self, analysis: ImageAnalysis) -> None:
        self.analysis = analysis
        self._step = analysis.budget.running_inline  # a no-op unless inline; reused for every step

    @property
    def done(self) -> bool:
        return self.analysis.done

    async def use_cached(self, evidence_json: str) -> bool:
        with self._step:
            return self.analysis.use_cached(evidence_json)

    async def read_layer(self, chunks: AsyncIterator[bytes], media_type: str) -> LayerOutcome:
        walk = self.analysis.begin_layer(media_type)
        try:
            async for chunk in chunks:
                with self._step:
                    wanted = walk.feed(chunk)
                if not wanted:
                    break
            else:
                with self._step:
                    walk.close()
        except BaseException:
            self.analysis.fail_layer()
            raise
        with self._step:
            reply = self.analysis.finish_layer()
        return LayerOutcome(reply.evidence_json, reply.complete, walk.stats.compressed_bytes)

    async def skip_layer(self) -> None:
        self.analysis.skip_layer()

    async def verdict(self, bytes_read: int, bytes_total: int) -> ImageVerdict:
        with self._step:
            return self.analysis.verdict(bytes_read=bytes_read, bytes_total=bytes_total)

    def close(self) -> None:
        pass


def _widen_pipe(pipe: Any) -> None:
    """A 256 KiB pipe: 4x fewer wake-ups than 64 KiB, and still little read past an early stop."""
    setter = getattr(fcntl, "F_SETPIPE_SZ", None)
    if pipe is None or setter is None:
        return
    with contextlib.suppress(OSError):
        fcntl.fcntl(pipe.fileno(), setter, PIPE_BYTES)


class _Worker:
    """One analysis process and the replies it owes, by session."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process
        assert process.stdin is not None and process.stdout is not None
        self.stdin = process.stdin
        self.stdout = process.stdout
        _widen_pipe(self.stdin.transport.get_extra_info("pipe"))
        self.waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.parsed: dict[int, int] = {}  # layer bytes the process has parsed, by session (ACK frames)
        self.progress: dict[int, asyncio.Event] = {}  # set on every ACK or reply of a session
        self.watchdogs: set[asyncio.Task[None]] = set()
        self.sessions = 0
        self.alive = True
        self.reader = asyncio.create_task(self._read_replies())

    def send(self, kind: int, session: int, payload: bytes = b"") -> None:
        if not self.alive:
            raise AnalysisCrashed("the analysis process exited")
        self.stdin.write(HEADER.pack(len(payload), kind, session) + payload)

    async def drain(self) -> None:
        try:
            await self.stdin.drain()
        except (ConnectionError, BrokenPipeError) as exc:
            self._die(f"the analysis process exited ({exc})")
            raise AnalysisCrashed("the analysis process exited") from None

    def expect(self, session: int) -> asyncio.Future[dict[str, Any]]:
        if not self.alive:
            raise AnalysisCrashed("the analysis process exited")
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.waiting[session] = future
        return future

    async def _read_replies(self) -> None:
        try:
            while True:
                header = await self.stdout.readexactly(HEADER.size)
                length, kind, session = HEADER.unpack(header)
                payload = await self.stdout.readexactly(length)
                if kind == ACK:
                    (self.parsed[session],) = ACK_BODY.unpack(payload)
                else:
                    future = self.waiting.pop(session, None)
                    if future is not None and not future.done():
                        future.set_result(json.loads(payload))
                self._wake(session)
        except (asyncio.IncompleteReadError, ConnectionError):
            self._die("the analysis process exited")
        except Exception as exc:  # a garbled reply: the process cannot be trusted any more
            log.exception("analysis process sent a bad reply")
            self._die(f"the analysis process failed: {exc}")

    def _wake(self, session: int) -> None:
        event = self.progress.get(session)
        if event is not None:
            event.set()

    def _die(self, why: str) -> None:
        if self.alive:
            log.warning(
                "analysis process %s: %s (exit status %s)", self.process.pid, why, self.process.returncode
            )
        self.alive = False
        for event in self.progress.values():
            event.set()
        for future in self.waiting.values():
            if not future.done():
                future.set_exception(AnalysisCrashed(why))
                future.add_done_callback(_retrieved)  # an abandoned request's reply is nobody's error
        self.waiting.clear()
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()


def _retrieved(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


async def _kill_if_silent(worker: _Worker, owed: asyncio.Future[dict[str, Any]], grace: float) -> None:
    """Kill `worker` when the reply `owed` has not come within `grace` seconds."""
    with contextlib.suppress(Exception):
        await asyncio.wait_for(asyncio.shield(owed), grace)
    if not owed.done() and worker.alive:
        worker._die(f"no answer within {grace:g} s of an abandoned request; killed")


class RemoteSession:
    """A session held by an analysis process."""

    def __init__(self, worker: _Worker, session: int, kill_grace: float) -> None:
        self._worker = worker
        self._id = session
        self._done = False
        self._closed = False
        self._kill_grace = kill_grace
        self._awaiting: asyncio.Future[dict[str, Any]] | None = None  # a reply owed by the process
        self._verdict: str | None = None  # the verdict that came with the last layer's reply (JSON)

    @property
    def done(self) -> bool:
        return self._done

    async def _ask(self, kind: int, payload: bytes) -> dict[str, Any]:
        future = self._awaiting = self._worker.expect(self._id)
        self._worker.send(kind, self._id, payload)
        await self._worker.drain()
        reply = await asyncio.shield(future)  # a cancelled scan leaves the reply owed (see close)
        self._took(reply)
        return reply

    def _took(self, reply: dict[str, Any]) -> None:
        self._done = bool(reply.get("done", self._done))
        if reply.get("error"):
            _raise_reply_error(reply["error"])
        if isinstance(reply.get("verdict"), str):
            self._verdict = reply["verdict"]

    async def use_cached(self, evidence_json: str) -> bool:
        return bool((await self._ask(CACHED, evidence_json.encode()))["covered"])

    async def skip_layer(self) -> None:
        await self._ask(SKIP, b"")

    async def read_layer(self, chunks: AsyncIterator[bytes], media_type: str) -> LayerOutcome:
        worker = self._worker
        future = self._awaiting = worker.expect(self._id)
        progress = worker.progress.setdefault(self._id, asyncio.Event())
        worker.parsed[self._id] = 0
        worker.send(LAYER, self._id, json.dumps({"media_type": media_type}).encode())
        sent = 0
        try:
            async for chunk in chunks:
                worker.send(CHUNK, self._id, chunk)
                sent += len(chunk)
                await worker.drain()
                # Credit flow: stay at most WINDOW_BYTES ahead of the parser, so an early stop
                # (the verdict is known) costs little more than the bytes the verdict needed.
                while not future.done() and sent - worker.parsed.get(self._id, 0) > WINDOW_BYTES:
                    progress.clear()
                    if not future.done() and sent - worker.parsed.get(self._id, 0) > WINDOW_BYTES:
                        await progress.wait()
                if future.done():  # decided (or failed): stop pulling bytes from the registry
                    break
        finally:
            if worker.alive:
                worker.send(END, self._id)
        await worker.drain()
        reply = await asyncio.shield(future)  # a cancelled scan leaves the reply owed (see close)
        self._took(reply)
        return LayerOutcome(reply.get("evidence"), bool(reply.get("complete")), sent)

    async def verdict(self, bytes_read: int, bytes_total: int) -> ImageVerdict:
        if self._verdict is not None:  # it came with the last layer's reply; the byte counts are ours
            verdict = ImageVerdict.model_validate_json(self._verdict)
            verdict.libc.bytes_read, verdict.libc.bytes_total = bytes_read, bytes_total
            return verdict
        reply = await self._ask(
            VERDICT, json.dumps({"bytes_read": bytes_read, "bytes_total": bytes_total}).encode()
        )
        return ImageVerdict.model_validate_json(reply["verdict"])

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._awaiting is not None and not self._awaiting.done() and self._worker.alive:
            # Abandoned mid-request (the scan's deadline, a cancelled scan): the process should
            # answer within moments; one that does not is stuck, and is killed and replaced.
            task = asyncio.get_running_loop().create_task(
                _kill_if_silent(self._worker, self._awaiting, self._kill_grace)
            )
            self._worker.watchdogs.add(task)
            task.add_done_callback(self._worker.watchdogs.discard)
        self._worker.sessions -= 1
        self._worker.progress.pop(self._id, None)
        self._worker.parsed.pop(self._id, None)
        if self._worker.alive:
            with contextlib.suppress(Exception):
                self._worker.send(CLOSE, self._id)


@dataclass
class AnalysisPool:
    """Hands out sessions: in `processes` analysis processes, or in this process when 0."""

    processes: int
    kill_grace: float = 10.0  # seconds an abandoned request may stay unanswered before the process is killed
    memory_bytes: int = DEFAULT_ANALYSIS_MEMORY_BYTES  # each process's address space (RLIMIT_AS); 0: none
    _workers: list[_Worker] = field(default_factory=list)
    _ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    _starting: asyncio.Lock | None = None

    async def _worker(self) -> _Worker:
        if self._starting is None:
            self._starting = asyncio.Lock()
        async with self._starting:
            self._workers = [worker for worker in self._workers if worker.alive]
            while len(self._workers) < self.processes:  # all at once: they start in parallel
                process = await asyncio.create_subprocess_exec(
                    sys.executable,
                    "-m",
                    "scanner.layers.analysis",
                    str(self.memory_bytes),
                    stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE,
                    start_new_session=True,  # a terminal's Ctrl-C is for the service, which stops us
                )
                self._workers.append(_Worker(process))
            return min(self._workers, key=lambda worker: worker.sessions)

    async def start(self) -> None:
        """Start the analysis processes (they otherwise start at the first session)."""
        if self.processes > 0:
            await self._worker()

    async def open(
        self,
        arch: str,
        layers_total: int,
        limits: AnalysisLimits,
        deadline: float,
        *,
        cuda: bool,
        inline: InlineBudget | None = None,
        overrides: Mapping[str, str] | None = None,
    ) -> Session:
        """A session for one platform image; `cuda`: look for inferred CUDA too (reads layers whole).
        `inline`: in this process within that budget, though there are analysis processes.
        `overrides`: the builds the image's config makes packages load (`GpuFacts.build_overrides`)."""
        if self.processes <= 0 or inline is not None:
            return LocalSession(
                ImageAnalysis(
                    arch, layers_total, limits, deadline, cuda=cuda, inline=inline, overrides=overrides
                )
            )
        worker = await self._worker()
        session = next(self._ids)
        payload = {
            "arch": arch,
            "layers_total": layers_total,
            "limits": limits.model_dump(),
            "deadline": deadline,
            "cuda": cuda,
            "overrides": dict(overrides or {}),
        }
        worker.send(OPEN, session, json.dumps(payload).encode())
        worker.sessions += 1
        return RemoteSession(worker, session, self.kill_grace)

    async def close(self) -> None:
        """Stop the analysis processes (closing stdin ends them; kill after a grace period)."""
        workers, self._workers = self._workers, []
        for worker in workers:
            for watchdog in list(worker.watchdogs):
                watchdog.cancel()
            worker.alive = False  # an orderly exit, not a death worth a warning
            with contextlib.suppress(Exception):
                worker.stdin.close()
        for worker in workers:
            try:
                await asyncio.wait_for(worker.process.wait(), timeout=5)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    worker.process.kill()
                await worker.process.wait()
            worker.reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await worker.reader


# -- in the analysis process


@dataclass
class _ServerSession:
    analysis: ImageAnalysis
    walk: LayerWalk | None = None
    answered: bool = True  # the current layer's reply was sent (early stop or error)
    acked: int = 0  # the current layer's parsed bytes as last ACKed


class _Server:
    """The analysis process: reads frames from stdin, answers on stdout, one session per image."""

    def __init__(self, incoming: BinaryIO, outgoing: BinaryIO) -> None:
        self._in = incoming
        self._out = outgoing
        self._sessions: dict[int, _ServerSession] = {}

    def _ack(self, session: int, parsed: int) -> None:
        self._out.write(HEADER.pack(ACK_BODY.size, ACK, session) + ACK_BODY.pack(parsed))
        self._out.flush()

    def _reply(self, session: int, body: dict[str, Any]) -> None:
        payload = json.dumps(body).encode()
        self._out.write(HEADER.pack(len(payload), REPLY, session) + payload)
        self._out.flush()

    def _read(self, count: int) -> bytes | None:
        data = self._in.read(count)
        if len(data) < count:
            return None
        return data

    def serve(self) -> None:
        while True:
            header = self._read(HEADER.size)
            if header is None:
                return  # the scanning process closed the pipe: time to go
            length, kind, session = HEADER.unpack(header)
            if kind != CHUNK and length > MAX_CONTROL_FRAME:
                raise SystemExit(f"analysis: control frame of {length} bytes")
            payload = self._read(length) if length else b""
            if payload is None:
                return
            self._handle(kind, session, payload)

    def _handle(self, kind: int, session: int, payload: bytes) -> None:
        if kind == OPEN:
            body = json.loads(payload)
            analysis = ImageAnalysis(
                str(body["arch"]),
                int(body["layers_total"]),
                AnalysisLimits.model_validate(body["limits"]),
                float(body["deadline"]),
                cuda=bool(body.get("cuda")),
                overrides={str(k): str(v) for k, v in dict(body.get("overrides") or {}).items()},
            )
            self._sessions[session] = _ServerSession(analysis)
            return
        if kind == CLOSE:
            self._sessions.pop(session, None)
            return
        state = self._sessions.get(session)
        if state is None:
            if kind in (CACHED, LAYER, VERDICT, SKIP):
                self._reply(session, {"error": {"kind": "internal", "message": "no such analysis session"}})
            return
        if kind == CHUNK:
            self._chunk(session, state, payload)
        elif kind == LAYER:
            try:
                state.walk, state.answered, state.acked = (
                    state.analysis.begin_layer(json.loads(payload)["media_type"]),
                    False,
                    0,
                )
            except Exception as exc:  # a bound crossed deciding what to attach: the layer's answer
                state.walk = None
                self._fail_layer(session, state, exc)
        elif kind == END:
            self._end_layer(session, state)
        else:
            self._answer(session, state, kind, payload)

    def _answer(self, session: int, state: _ServerSession, kind: int, payload: bytes) -> None:
        """CACHED, SKIP and VERDICT: one request, one reply (an error reply names the bound)."""
        analysis = state.analysis
        try:
            if kind == CACHED:
                body: dict[str, Any] = {"covered": analysis.use_cached(payload.decode())}
            elif kind == SKIP:
                analysis.skip_layer()
                body = {}
            else:
                counts = json.loads(payload)
                verdict = analysis.verdict(bytes_read=counts["bytes_read"], bytes_total=counts["bytes_total"])
                body = {"verdict": verdict.model_dump_json()}
            body["done"] = analysis.done  # may cross a bound (path components)
        except Exception as exc:
            body = {"error": _error_of(exc)}
        else:
            if kind != VERDICT:
                self._attach_verdict(state, body)
        self._reply(session, body)

    @staticmethod
    def _attach_verdict(state: _ServerSession, body: dict[str, Any]) -> None:
        """The image's verdict, in the reply after which nothing more will be fed (its byte counts are
        the scanning process's to fill in). One that fails here is left out: VERDICT asks again and
        gets the error in its own reply."""
        if not state.analysis.finished:
            return
        try:
            body["verdict"] = state.analysis.verdict(bytes_read=0, bytes_total=0).model_dump_json()
        except Exception:
            return

    def _chunk(self, session: int, state: _ServerSession, payload: bytes) -> None:
        if state.answered or state.walk is None:
            return  # the layer was already answered (early stop); the rest is in flight
        try:
            wanted = state.walk.feed(payload)
        except Exception as exc:
            self._fail_layer(session, state, exc)
            return
        if not wanted:
            self._finish_layer(session, state)
            return
        parsed = state.walk.stats.compressed_bytes
        if parsed - state.acked >= ACK_EVERY:
            state.acked = parsed
            self._ack(session, parsed)

    def _end_layer(self, session: int, state: _ServerSession) -> None:
        if not state.answered and state.walk is not None:
            try:
                state.walk.close()
            except Exception as exc:
                self._fail_layer(session, state, exc)
            else:
                self._finish_layer(session, state)
        state.walk = None

    def _finish_layer(self, session: int, state: _ServerSession) -> None:
        try:
            reply = state.analysis.finish_layer()
        except Exception as exc:
            self._fail_layer(session, state, exc)
            return
        state.answered = True
        body: dict[str, Any] = {
            "evidence": reply.evidence_json,
            "complete": reply.complete,
            "done": reply.done,
        }
        self._attach_verdict(state, body)
        self._reply(session, body)

    def _fail_layer(self, session: int, state: _ServerSession, exc: BaseException) -> None:
        state.analysis.fail_layer()
        state.answered = True
        if isinstance(exc, MemoryError):
            log.warning("a layer's analysis ran out of its %d bytes of address space", _ADDRESS_SPACE)
        elif not isinstance(exc, LayerError | LimitExceeded):
            log.error("analysis failed", exc_info=exc)
        self._reply(session, {"error": _error_of(exc)})


def limit_address_space(limit: int) -> None:
    """Hold this process to `limit` bytes of address space (RLIMIT_AS); 0 leaves it as it is."""
    global _ADDRESS_SPACE
    if limit > 0:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        _ADDRESS_SPACE = limit


def main() -> None:
    """Entry point of an analysis process: frames on fd 0 and 1; anything printed goes to stderr.
    Its one argument is its address-space limit in bytes (0: none)."""
    limit_address_space(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
    incoming = os.fdopen(os.dup(0), "rb", buffering=PIPE_BYTES)  # little read-ahead past an early stop
    outgoing = os.fdopen(os.dup(1), "wb", buffering=1 << 16)
    os.dup2(2, 1)  # a stray print() must not corrupt the protocol
    sys.stdout = sys.stderr
    with contextlib.suppress(OSError):
        os.nice(ANALYSIS_NICENESS)  # background work: the service's own process gets the CPU first
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s analysis: %(message)s")
    with contextlib.suppress(BrokenPipeError, KeyboardInterrupt):
        _Server(incoming, outgoing).serve()


if __name__ == "__main__":
    main()
