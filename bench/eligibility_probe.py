"""Eligibility latency from a process of its own: `python -m bench.eligibility_probe URL SECONDS BODY`.

Sequential `POST /api/eligibility` on one keep-alive connection for SECONDS; prints
{"latencies", "handler", "failures"} as JSON. Standard library only, so it starts fast and
the simulated agents' event loop (bench/fleet_bench.py) never delays a measured answer.
"""

from __future__ import annotations

import http.client
import json
import sys
import time
import urllib.parse
from typing import Any


def probe(url: str, seconds: float, body: bytes, pause: float = 0.02) -> dict[str, Any]:
    """Sequential eligibility queries on one keep-alive connection for `seconds` (a scheduler's view)."""
    parsed = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(parsed.hostname or "127.0.0.1", parsed.port, timeout=10)
    latencies: list[float] = []
    handler: list[float] = []  # the answer's own `seconds`: index and decide, no queueing
    failures = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        started = time.perf_counter()
        try:
            connection.request("POST", "/api/eligibility", body, {"Content-Type": "application/json"})
            response = connection.getresponse()
            data = response.read()
            if response.status == 200:
                latencies.append(time.perf_counter() - started)
                handler.append(float(json.loads(data)["seconds"]))
            else:
                failures += 1
        except (OSError, http.client.HTTPException):
            failures += 1
            connection.close()
            connection = http.client.HTTPConnection(parsed.hostname or "127.0.0.1", parsed.port, timeout=10)
        time.sleep(pause)
    return {"latencies": latencies, "handler": handler, "failures": failures}


if __name__ == "__main__":
    print(json.dumps(probe(sys.argv[1], float(sys.argv[2]), sys.argv[3].encode())))
