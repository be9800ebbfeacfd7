"""What a worker process `serve` supervises tells it, one JSON object per line on the worker's stdout.

The worker process scans for the service, so what users see of scans must reach the service's
process: every metric the worker counts (`/metrics` counts every scan, whichever process ran
it), the layer reads it has in flight (the image page's progress), the artifacts its attacher
pushed (their push events must queue no scan) and how its report attachments stand (the image
page). `WorkerReporter` writes them in the worker; `WorkerView.apply` reads them in `serve` into
its own metrics, progress and attacher.

Each message is an object whose `k` says what it is:
- `ready`: the workers run; `owner` is their lease owner (host/pid/nonce).
- `alive`: sent every ALIVE_SECONDS, so `serve` knows a silent worker is stuck, not idle.
- `m`: one metric change: `n` the name, `c` the change (`inc`, `set`, `observe`), `l` the labels,
  `v` the value (`jobs.metrics.JobMetrics.forward_to`).
- `counts`: counts the worker keeps outside its metrics (bytes from registries, transfers cut
  off), whole, by metric name: `s` {name: [[labels, value], ...]} (`JobMetrics.process_counts`).
- `progress`: the layer reads in flight, whole: `s` {reference: text} (`Scanner.layer_progress`).
- `own`: `d`, the digest of an artifact the worker's attacher is about to push (sent at once).
- `status`: a report attachment's status (`scanner.publish.AttachStatus`; a companion's parsed
  document never travels: the page reads that back from the registry).
- `synced`: `n`, the answer to `serve`'s `sync <n>` line on the worker's stdin, sent after the
  worker's counts as they are now: every report before it is read once this is (`/metrics` asks
  each worker so before it answers, and so counts whatever a worker did before it was asked).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

from jobs.metrics import JobMetrics, LabelValues
from scanner.publish import AttachStatus, ReportAttacher

log = logging.getLogger(__name__)

# A worker says it is alive this often, and sends its counts and progress when they changed.
ALIVE_SECONDS = 2.0
FLUSH_SECONDS = 0.05  # reports gather this long before they are written: `serve` wakes for a batch, not each
LINE_LIMIT = 1 << 20  # bytes: a longer line from a worker is a fault, not a report


class WorkerReporter:
    """In a worker process: writes its reports to `serve` over `transport` (the worker's stdout pipe),
    gathered for FLUSH_SECONDS (a `sync` answer at once) and written without ever blocking the loop.
    What `/metrics` shows waits for no timer: it asks each worker to `sync` first."""

    def __init__(self, transport: asyncio.WriteTransport) -> None:
        self._transport = transport
        self._buffer: list[bytes] = []
        self._flush_scheduled = False
        self._last_counts: dict[str, Any] | None = None
        self._last_progress: dict[str, str] | None = None

    def send(self, message: dict[str, Any]) -> None:
        self._buffer.append(json.dumps(message, separators=(",", ":")).encode() + b"\n")
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_later(FLUSH_SECONDS, self.flush)

    def flush(self) -> None:
        self._flush_scheduled = False
        if self._buffer and not self._transport.is_closing():
            self._transport.write(b"".join(self._buffer))
        self._buffer.clear()

    def own(self, digest: str) -> None:
        """An artifact the attacher is about to push: written at once, not gathered, so that `serve`
        knows it before the registry's push event reaches it (the push itself takes less than
        FLUSH_SECONDS on a near registry, and a scan queued for our own artifact is a wrong one)."""
        self.send({"k": "own", "d": digest})
        self.flush()

    def metric(self, name: str, change: str, labels: LabelValues, value: float) -> None:
        self.send({"k": "m", "n": name, "c": change, "l": list(labels), "v": value})

    async def report(
        self,
        owner: str,
        metrics: JobMetrics,
        attacher: ReportAttacher | None,
        progress: Callable[[], dict[str, str]],
    ) -> None:
        """Say ready, then report until cancelled: every metric change and attachment as it happens,
        the counts and the layer progress whenever they changed (checked every ALIVE_SECONDS), and
        that the worker is alive. Cancelled, it sends the last counts, so nothing counted is lost."""
        metrics.forward_to(self.metric)
        if attacher is not None:
            attacher.on_own = self.own
            attacher.on_status = lambda status: self.send({"k": "status", **status_fields(status)})
        self.send({"k": "ready", "owner": owner})
        try:
            while True:
                self._report_changes(metrics, progress)
                self.send({"k": "alive"})
                await asyncio.sleep(ALIVE_SECONDS)
        finally:
            self._report_changes(metrics, progress)
            self.flush()

    def synced(self, number: int, metrics: JobMetrics, progress: Callable[[], dict[str, str]]) -> None:
        """`serve` asked (`sync <number>`): the counts and progress as they are now, then `synced`."""
        self._report_changes(metrics, progress)
        self.send({"k": "synced", "n": number})
        self.flush()

    def _report_changes(self, metrics: JobMetrics, progress: Callable[[], dict[str, str]]) -> None:
        counts = {
            name: [[list(labels), value] for labels, value in sorted(values.items())]
            for name, values in metrics.process_counts().items()
        }
        if counts != self._last_counts:
            self._last_counts = counts
            self.send({"k": "counts", "s": counts})
        reads = progress()
        if reads != self._last_progress:
            self._last_progress = reads
            self.send({"k": "progress", "s": reads})


def status_fields(status: AttachStatus) -> dict[str, Any]:
    """A report attachment's status as JSON (its document, a companion's, stays behind)."""
    fields = asdict(status)
    fields.pop("document", None)
    fields["updated_at"] = status.updated_at.isoformat()
    return fields


@dataclass
class WorkerView:
    """In `serve`: what one worker process has reported, applied to the service's own state."""

    metrics: JobMetrics
    attacher: ReportAttacher | None
    owner: str | None = None
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    heard_at: float = field(default_factory=time.monotonic)
    progress: dict[str, str] = field(default_factory=dict)
    counts: dict[str, dict[LabelValues, float]] = field(default_factory=dict)
    syncs: dict[int, asyncio.Future[None]] = field(default_factory=dict)  # asked, not yet answered

    def apply(self, line: bytes) -> None:
        """One line of the worker's reports; a line that does not parse is logged and skipped."""
        self.heard_at = time.monotonic()
        try:
            message = json.loads(line)
            kind = message["k"]
            if kind == "m":
                self.metrics.apply(
                    message["n"], message["c"], [str(label) for label in message["l"]], float(message["v"])
                )
            elif kind == "counts":
                self.counts = {
                    name: {tuple(labels): float(value) for labels, value in values}
                    for name, values in message["s"].items()
                }
            elif kind == "progress":
                self.progress = {str(reference): str(text) for reference, text in message["s"].items()}
            elif kind == "own" and self.attacher is not None:
                self.attacher.note_own(str(message["d"]))
            elif kind == "status" and self.attacher is not None:
                fields = {key: value for key, value in message.items() if key != "k"}
                fields["updated_at"] = datetime.fromisoformat(fields["updated_at"])
                self.attacher.note_status(AttachStatus(**fields))
            elif kind == "synced":
                for number in [number for number in self.syncs if number <= int(message["n"])]:
                    waiter = self.syncs.pop(number)
                    if not waiter.done():
                        waiter.set_result(None)
            elif kind == "ready":
                self.owner = str(message["owner"])
                self.ready.set()
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("a worker process sent a report that does not read (%s): %.200r", exc, line)
