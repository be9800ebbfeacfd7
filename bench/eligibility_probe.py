"""Eligibility latency from a process of its own: `python -m bench.eligibility_probe URL SECONDS BODY [PID]`.

Sequential `POST /api/eligibility` on one keep-alive connection for SECONDS; prints
{"latencies", "handler", "waited", "failures"} as JSON. Standard library only, so it starts fast
and the simulated agents' event loop (bench/fleet_bench.py) never delays a measured answer.

`waited`, per answer: the seconds that the service's event-loop thread (process PID, given) and
this probe's own thread spent ready to run but waiting in a run queue for a core, while the answer
was on its way (the kernel's schedstat). On a host whose cores the load shares with the service,
that is the part of a latency the service's code does not decide.
"""

from __future__ import annotations

import http.client
import json
import sys
import time
import urllib.parse
from typing import Any


def run_queue_wait(schedstat: str) -> float:
    """Seconds the thread of this /proc schedstat file has spent waiting for a core (0 if unreadable)."""
    try:
        with open(schedstat) as file:
            return int(file.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def probe(
    url: str, seconds: float, body: bytes, pause: float = 0.02, pid: int | None = None
) -> dict[str, Any]:
    """Sequential eligibility queries on one keep-alive connection for `seconds` (a scheduler's view)."""
    stats = ["/proc/thread-self/schedstat"] + ([f"/proc/{pid}/task/{pid}/schedstat"] if pid else [])

    def waiting() -> float:
        return sum(run_queue_wait(path) for path in stats)

    parsed = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(parsed.hostname or "127.0.0.1", parsed.port, timeout=10)
    latencies: list[float] = []
    handler: list[float] = []  # the answer's own `seconds`: index and decide, no queueing
    waited: list[float] = []  # the loop's and the probe's threads in a run queue, per answer
    failures = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        waited_before = waiting()
        started = time.perf_counter()
        try:
            connection.request("POST", "/api/eligibility", body, {"Content-Type": "application/json"})
            response = connection.getresponse()
            data = response.read()
            if response.status == 200:
                latencies.append(time.perf_counter() - started)
                waited.append(waiting() - waited_before)
                handler.append(float(json.loads(data)["seconds"]))
            else:
                failures += 1
        except (OSError, http.client.HTTPException):
            failures += 1
            connection.close()
            connection = http.client.HTTPConnection(parsed.hostname or "127.0.0.1", parsed.port, timeout=10)
        time.sleep(pause)
    return {"latencies": latencies, "handler": handler, "waited": waited, "failures": failures}


if __name__ == "__main__":
    server_pid = int(sys.argv[4]) if len(sys.argv) > 4 else None
    print(json.dumps(probe(sys.argv[1], float(sys.argv[2]), sys.argv[3].encode(), pid=server_pid)))
