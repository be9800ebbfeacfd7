"""What a supervised worker process tells `serve` (jobs/worker_reports.py), and when."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from jobs.worker_reports import FLUSH_SECONDS, WorkerReporter


class RecordingPipe(asyncio.WriteTransport):
    """The worker's stdout pipe as `serve` would read it: every write, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []

    def write(self, data: Any) -> None:
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return False


def lines(pipe: RecordingPipe) -> list[dict[str, Any]]:
    return [json.loads(line) for line in b"".join(pipe.writes).splitlines()]


async def test_an_artifact_about_to_be_pushed_is_told_at_once() -> None:
    """The registry's push event for our own artifact may reach `serve` a few milliseconds after the
    PUT; a report gathered for FLUSH_SECONDS would come after it, and the artifact would be queued
    for a scan (seen in test_referrers_service). So `own` is written before the push starts."""
    pipe = RecordingPipe()
    reporter = WorkerReporter(pipe)
    reporter.metric("gpubadge_scans_total", "inc", ("done",), 1.0)  # gathered, as every report
    assert pipe.writes == []
    reporter.own("sha256:" + "a" * 64)
    assert [line["k"] for line in lines(pipe)] == [
        "m",
        "own",
    ]  # written now, in order, with what was gathered
    await asyncio.sleep(FLUSH_SECONDS * 2)  # the gathering timer finds nothing more to write
    assert [line["k"] for line in lines(pipe)] == ["m", "own"]
