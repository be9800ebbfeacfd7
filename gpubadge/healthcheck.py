"""`gpubadge healthcheck`: the container image's HEALTHCHECK, true for whichever role the container runs.

One image runs every role, so a fixed probe (say :8080/healthz) is wrong for most of them. This
command finds the container's gpubadge process in /proc, reads its role and flags, resolves the
port the way that role does (flag, else the settings: GPUBADGE_PORT, GPUBADGE_HOST, --config
or GPUBADGE_CONFIG), and probes it:

- `serve`: GET /healthz on --port, else GPUBADGE_PORT (it fails when the store cannot be written);
  the worker processes it starts (`worker --supervised worker-N`) are its own, never the probe's target;
- `worker --metrics-port N`: GET /healthz on N (it fails when the store cannot be written or no
  worker makes progress on a waiting queue);
- every other role (`agent`, `worker` without --metrics-port, `db`, `scan`, `config`, ...) serves no
  port: there is nothing to probe, so it reports healthy while its process runs (and Docker's
  restart policy sees the process exit).

Exit status 0 healthy, 1 unhealthy (one line saying why), as Docker's HEALTHCHECK expects.
"""

from __future__ import annotations

import argparse
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

PROBE_TIMEOUT = 3.0  # seconds; the Dockerfile's HEALTHCHECK --timeout is 5
WILDCARDS = {"", "0.0.0.0", "::", "*"}


@dataclass(frozen=True)
class Probe:
    """What to probe for one role: `url`, or None with the reason there is nothing to probe."""

    url: str | None
    reason: str


def gpubadge_command(argv: Sequence[str]) -> list[str] | None:
    """The gpubadge command line (role first) inside a process's argv, or None for another program.

    Matches the console script (`/opt/gpubadge/bin/gpubadge serve`, behind its interpreter or not)
    and `python -m gpubadge.cli serve`."""
    for index, arg in enumerate(argv):
        if Path(arg).name == "gpubadge" or (arg == "gpubadge.cli" and index and argv[index - 1] == "-m"):
            return list(argv[index + 1 :])
    return None


def main_command(processes: Iterable[tuple[int, Sequence[str]]], own_pid: int) -> list[str] | None:
    """The container's main gpubadge command: the lowest pid running gpubadge, this probe and the
    worker processes `serve` starts (`worker --supervised`, which serve no port) excluded.

    The lowest, because PID 1 is the container's command (or its init, with `docker run --init`,
    whose child then has the next pid)."""
    for pid, argv in sorted(processes, key=lambda item: item[0]):
        command = gpubadge_command(argv)
        if pid == own_pid or not command or command[0] == "healthcheck" or "--supervised" in command:
            continue
        return command
    return None


def _url(host: str, port: int) -> str:
    if host in WILDCARDS:
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}/healthz"


def probe_for(command: Sequence[str]) -> Probe:
    """The probe for a role's command line, its port resolved as the role itself resolves it."""
    from gpubadge.worker import worker_parser
    from web.commands import load_settings, serve_parser

    role, rest = command[0], list(command[1:])
    if role == "serve":
        args, _ = serve_parser().parse_known_args(rest)
        settings = load_settings(args.config, host=args.host, port=args.port)
        return Probe(_url(settings.host, settings.port), "serve")
    if role == "worker":
        args, _ = worker_parser().parse_known_args(rest)
        if not args.metrics_port:
            return Probe(None, "worker without --metrics-port serves no port: nothing to probe")
        settings = load_settings(args.config)
        return Probe(_url(settings.host, args.metrics_port), "worker")
    return Probe(None, f"{role} serves no port: nothing to probe")


def _processes(proc: Path) -> Iterable[tuple[int, list[str]]]:
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            raw = (entry / "cmdline").read_bytes()
        except OSError:  # gone, or not ours to read
            continue
        yield int(entry.name), [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def check(url: str) -> str | None:
    """GET `url`: None when it answers 200, else why not."""
    try:
        with urllib.request.urlopen(url, timeout=PROBE_TIMEOUT) as response:
            return None if response.status == 200 else f"{url} answered {response.status}"
    except urllib.error.HTTPError as exc:
        return f"{url} answered {exc.code}"
    except (OSError, ValueError) as exc:
        return f"{url}: {exc}"


def main(argv: Sequence[str], proc: Path = Path("/proc")) -> int:
    parser = argparse.ArgumentParser(
        prog="gpubadge healthcheck",
        description="Probe this container's gpubadge role on the port its flags and settings name"
        " (the image's HEALTHCHECK). Exit 0 healthy, 1 unhealthy.",
    )
    parser.add_argument(
        "command",
        nargs=argparse.REMAINDER,
        help="the role's command line to probe (default: the container's gpubadge process, from /proc)",
    )
    args = parser.parse_args(argv)
    command = args.command or main_command(_processes(proc), os.getpid())
    if not command:
        print("gpubadge healthcheck: no gpubadge process runs here", file=sys.stderr)
        return 1
    try:
        probe = probe_for(command)
    except (ValueError, OSError, SystemExit) as exc:
        print(f"gpubadge healthcheck: {' '.join(command)}: cannot read its settings: {exc}", file=sys.stderr)
        return 1
    if probe.url is None:
        print(f"healthy: {probe.reason}")
        return 0
    problem = check(probe.url)
    if problem:
        print(f"gpubadge healthcheck: {probe.reason}: {problem}", file=sys.stderr)
        return 1
    print(f"healthy: {probe.reason} {probe.url}")
    return 0
